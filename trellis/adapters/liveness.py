"""The health checks that ask a server now (/healthz's "nats" and "store"): a ping of the NATS
server and a query of PostgreSQL, each answered within `HEALTH_CHECK_S`.

A check never waits longer than that, and never piles up: a store query that has not
returned is left to finish on its own (cancelling it would wait on a cancel request the
stalled server does not answer either: /healthz took 4 s with Postgres frozen), and the next
check waits for that one again instead of sending another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS

from trellis.adapters.http.metrics import Verdict

HEALTH_CHECK_S = 2.0


async def nats_answers(nc: NATS) -> Verdict:
    """Whether the NATS server answers a ping now. Connected is only a local flag: a hung
    server (stopped, partitioned, stuck on its disk) keeps the socket open for minutes."""
    if not nc.is_connected:
        return Verdict(False, ("nats: not connected to the server (reconnecting)",))
    try:
        await nc.flush(timeout=round(HEALTH_CHECK_S))  # a PING, answered by the server's PONG
    except Exception as exc:
        said = str(exc) or type(exc).__name__
        return Verdict(False, (f"nats: no answer to a ping within {HEALTH_CHECK_S:g} s ({said})",))
    return Verdict(True)


class StoreCheck:
    """Whether the event store answers `query()` now, one query in flight at a time."""

    def __init__(self, query: Callable[[], Awaitable[object]]) -> None:
        self._query = query
        self._running: asyncio.Task[object] | None = None
        self._since = 0.0

    async def __call__(self) -> Verdict:
        if self._running is None:
            self._running = asyncio.ensure_future(self._query())
            self._since = time.monotonic()
        running = self._running
        await asyncio.wait({running}, timeout=HEALTH_CHECK_S)
        if not running.done():
            waited = time.monotonic() - self._since
            return Verdict(False, (f"store: a query has had no answer for {waited:.1f} s",))
        self._running = None
        if running.cancelled():
            return Verdict(False, ("store: the query was cancelled",))
        failure = running.exception()
        if failure is not None:
            said = str(failure) or type(failure).__name__
            return Verdict(False, (f"store: a query failed: {said}",))
        return Verdict(True)
