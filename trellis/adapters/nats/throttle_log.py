"""Who is throttled, said in the engine's log: once a minute at most, each tenant throttled since
the last line with how many of its intents and views were answered `throttled`.

`/metrics` counts throttled answers by family and verb, never by tenant (a label per tenant
would let a client grow the series without bound), so an operator could see a flood but not
whose it was (the hostile-tenant probe: 4,709 intents throttled, no line in the log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from trellis.adapters.nats.replies import LOG_EVERY_S  # as the dropped requests' lines

log = logging.getLogger(__name__)

#: Tenants told on one line, the busiest first; the rest are summed.
_NAMED = 5
#: Tenants counted between two lines at most (made-up tenant tokens are free in plain mode).
_COUNTED = 1000


class ThrottleLog:
    """`later(seconds, callback)` schedules the line that tells what came after the last one
    (the event loop's call_later by default): a flood that ends within the minute is told a
    minute after its first line, not at the next flood."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        later: Callable[[float, Callable[[], None]], object] | None = None,
    ) -> None:
        self._clock = clock
        self._later = later
        self._counts: Counter[tuple[str, str]] = Counter()  # (tenant, family): answers
        self._others = 0  # throttled answers of tenants past _COUNTED
        self._last = -LOG_EVERY_S
        self._told_later = False  # a line is scheduled

    def throttled(self, family: str, tenant: str) -> None:
        """One `throttled` answer to `tenant`'s request of `family` (intent or view)."""
        key = (tenant, family)
        if key in self._counts or len(self._counts) < _COUNTED:
            self._counts[key] += 1
        else:
            self._others += 1
        wait = self._last + LOG_EVERY_S - self._clock()
        if wait <= 0:
            self.tell()
        elif not self._told_later:
            self._told_later = True
            later = self._later or asyncio.get_running_loop().call_later
            later(wait, self.tell)

    def tell(self) -> None:
        """The line: every tenant throttled since the last one, if any."""
        self._told_later = False
        if not self._counts and not self._others:
            return
        self._last = self._clock()
        named = self._counts.most_common(_NAMED)
        told = [
            f"tenant {tenant!r} {count} {family}{'' if count == 1 else 's'}"
            for (tenant, family), count in named
        ]
        rest = sum(self._counts.values()) - sum(count for _, count in named) + self._others
        if rest:
            told.append(f"{rest} more of other tenants")
        log.warning(
            "throttled since the last line (at most one a minute): %s; nothing was written for "
            "them (trellis_intents_total / trellis_queries_total, code throttled)",
            ", ".join(told),
        )
        self._counts.clear()
        self._others = 0
