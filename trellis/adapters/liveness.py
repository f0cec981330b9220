"""The health checks that ask a server now (/healthz's "nats" and "store"): a ping through the
NATS server and a query of PostgreSQL, each answered within `HEALTH_CHECK_S`.

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
from trellis.adapters.nats.roundtrip import RoundTrip

HEALTH_CHECK_S = 2.0


class NatsCheck:
    """Whether the NATS server answers now: a message to this connection's own inbox must come
    back through the server within `HEALTH_CHECK_S` (adapters/nats/roundtrip.py says why not
    nats-py's flush). Connected is only a local flag: a hung server (stopped, partitioned,
    stuck on its disk) keeps the socket open for minutes."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._echo = RoundTrip(nc)

    async def __call__(self) -> Verdict:
        if not self._nc.is_connected:
            return Verdict(False, ("nats: not connected to the server (reconnecting)",))
        try:
            answered = await self._echo(HEALTH_CHECK_S)
        except Exception as exc:  # a publish refused while the connection goes
            said = str(exc) or type(exc).__name__
            return Verdict(False, (f"nats: a ping could not be sent ({said})",))
        if not answered:
            return Verdict(False, (f"nats: no answer to a ping within {HEALTH_CHECK_S:g} s",))
        return Verdict(True)


class StoreCheck:
    """Whether the event store answers `query()` now, one query in flight at a time."""

    def __init__(self, query: Callable[[], Awaitable[object]]) -> None:
        self._query = query
        self._running: asyncio.Task[object] | None = None
        self._since = 0.0

    async def __call__(self) -> Verdict:
        if self._running is not None and self._running.done():
            # Finished since the last answer, which reported it still waiting: what it found
            # may be long past (a store that recovered an hour ago). Ask again, the old
            # failure read (asyncio logs one never read as an error).
            if not self._running.cancelled():
                self._running.exception()
            self._running = None
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
