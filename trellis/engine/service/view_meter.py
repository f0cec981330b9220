"""Each tenant's views, metered by the engine time they take (engine/core/throttle.py's view
budget): a view past its tenant's time, or beyond its views in flight, is answered
`throttled` with `retry_after_ms` before it is decoded or answered."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Coroutine, Generator
from typing import Any, cast

from trellis.engine.core import replies
from trellis.engine.core.throttle import Bucket, ViewBudget, charge, kept, may_view

IN_FLIGHT_RETRY_MS = 50  # a view in flight is answered within a few tens of milliseconds


class ViewMeter:
    """The view buckets of every tenant; `budget` None (or a share of 0): no limit."""

    def __init__(
        self,
        budget: ViewBudget | None,
        clock: Callable[[], float] = time.monotonic,
        cost: Callable[[], float] = time.thread_time,
    ) -> None:
        self._budget = budget if budget is not None and budget.share > 0 else None
        self._clock = clock  # refills the buckets
        self._cost = cost  # what a view takes: the engine thread's CPU while it runs
        self._buckets: dict[str, Bucket] = {}
        self._in_flight: Counter[str] = Counter()

    def refusal(self, tenant: str) -> bytes | None:
        """The `throttled` answer for a view of `tenant` that may not start now, else None: it
        then holds one of the tenant's places in flight until `release`."""
        budget = self._budget
        if budget is None:
            return None
        if self._in_flight[tenant] >= budget.in_flight:
            return replies.error(
                "throttled",
                f"tenant {tenant!r} has {budget.in_flight} views in flight, as many as it may; "
                f"resend once one is answered",
                {"retry_after_ms": IN_FLIGHT_RETRY_MS},
            )
        now = self._clock()
        self._buckets = kept(self._buckets, now, budget.share, budget.burst_s)
        self._buckets[tenant], wait_ms = may_view(self._buckets.get(tenant), now, budget)
        if wait_ms:
            return replies.error(
                "throttled",
                f"tenant {tenant!r} has spent its views' share of this engine's time "
                f"({budget.share:g} of it, {budget.burst_s:g} s at once); resend in {wait_ms} ms",
                {"retry_after_ms": wait_ms},
            )
        self._in_flight[tenant] += 1
        return None

    def release(self, tenant: str) -> None:
        """A view let in by `refusal` is over (answered, or refused for another reason)."""
        if self._budget is None or not self._in_flight[tenant]:
            return
        self._in_flight[tenant] -= 1
        if not self._in_flight[tenant]:
            del self._in_flight[tenant]

    async def metered(self, tenant: str, answer: Callable[[], Coroutine[Any, Any, bytes]]) -> bytes:
        """`answer()`, its time taken from `tenant`'s bucket when it ends: the CPU the engine's
        thread spent in the view's own steps. Not its waits (for PostgreSQL, or a busy
        machine), which would throttle a cheap view for the machine's load, nor other
        requests' work while it waited, which charged one tenant for another's views."""
        budget = self._budget
        if budget is None:
            return await answer()
        view = OwnCpu(answer(), self._cost)
        try:
            return await view
        finally:
            now = self._clock()
            self._buckets[tenant] = charge(self._buckets.get(tenant), now, budget, view.spent)


class OwnCpu:
    """Awaits a coroutine and adds up `cost` (a CPU clock) over its own steps only: from each
    time its task resumes it to the next time it awaits. Other tasks' work in between is not
    its own."""

    def __init__(self, coro: Coroutine[Any, Any, bytes], cost: Callable[[], float]) -> None:
        self._coro = coro
        self._cost = cost
        self.spent = 0.0

    def __await__(self) -> Generator[Any, Any, bytes]:
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            started = self._cost()
            try:
                awaited = self._coro.send(sent) if thrown is None else self._coro.throw(thrown)
            except StopIteration as done:
                return cast(bytes, done.value)
            finally:
                self.spent += self._cost() - started
            try:
                sent, thrown = (yield awaited), None
            except BaseException as exc:  # a cancel, passed on into the view
                sent, thrown = None, exc
