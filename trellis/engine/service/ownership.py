"""Which engine writes which domain: writer leases, spread over the engines that are up.

Every engine serves every subject, but a domain is written by one engine at a time: the one
holding the domain's lease (engine.service.ports.LeaseStore). Each acquisition after a lease lapsed
draws a new epoch; the writer's appends and fabric calls carry it, and the log and the fabric
refuse a stale one, so an engine that lost its lease (killed, or paused past it) can neither
commit nor program the hardware once another has taken over.

Spreading: every tick, each engine places the log's domains on the engines whose heartbeat is
fresh (engine/core/spread.py: rendezvous hashing with balanced loads, so every engine holds
within one domain of every other, and at most `cap` when one is set), and all compute the same
placement. An engine claims the unheld domains placed on it, forwards requests for a domain to
its holder (or, unheld, to the engine it is placed on), and hands over a domain placed on
another engine that has been up for a while. A survivor takes a dead writer's domains within
a lease time plus a tick; for that, a writer's open transaction must not outlive its lease
(adapters/bootstrap.py bounds it by a tick).

An engine trusts its own clock only to stop early: a lease counts as held until the moment
the renewal was sent plus the lease time, less a margin; the store, which fences appends by
its own clock, keeps it at least that long.

Every call to the lease store is given a lease time: one that has not answered by then is as
good as lost, and must not hold up the ownership loop, nor a load or a drop waiting on it
(waiting for a pool connection, say, which no statement timeout bounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import msgspec

from trellis.engine.core.errors import StoreUnavailable
from trellis.engine.core.spread import score, spread
from trellis.engine.service.ports import Holder, LeaseStore

_T = TypeVar("_T")

MARGIN = 0.5  # seconds before the store's expiry an engine stops counting on its lease
# How late a timer may fire before the event loop counts as not having run meanwhile.
LATE_S = 1.0


class Lease(msgspec.Struct, kw_only=True):
    """This engine's lease on one domain, as it counts it."""

    domain: str
    epoch: int
    until: float  # time.monotonic() after which this engine no longer writes the domain

    def holds(self) -> bool:
        return time.monotonic() < self.until


class Overran(StoreUnavailable):
    """A call the ownership loop waits on had not ended in the time it was given."""


async def wait_running(task: asyncio.Future[Any], seconds: float) -> None:
    """Wait for `task` at most `seconds` of time the event loop ran. A timer that fires more
    than LATE_S late means the loop did not run meanwhile (a paused process): that time was
    not the task's, which gets its `seconds` again."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait({task}, timeout=seconds)
    if not task.done() and loop.time() - started > seconds + LATE_S:
        await asyncio.wait({task}, timeout=seconds)


async def within(seconds: float, call: Awaitable[_T], what: str) -> _T:
    """`call`, given `seconds` (wait_running): what the ownership loop waits on must not
    hold it up.

    Raises:
        Overran: `what`, within `seconds`, when it had not ended by then.
    """
    task = asyncio.ensure_future(call)
    try:
        await wait_running(task, seconds)
    finally:
        if not task.done():  # overran, or this wait was cancelled: the call ends here too
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise Overran(f"{what} within {seconds:g} s")
    return task.result()


def tick_of(ttl: float) -> float:
    """How often an engine renews its leases and looks at the others: three times a lease."""
    return ttl / 3


def preferred(domain: str, engines: list[str]) -> str | None:
    """The engine a domain prefers among `engines` (rendezvous hashing), None if there are none."""
    return max(engines, key=lambda e: score(e, domain), default=None)


class Ownership:
    """One engine's view of the leases: what it holds, who else is up, who holds what.

    Args:
        leases: the lease store.
        identity: this engine's id (also a NATS subject token).
        name: how people recognise it (host and pid).
        ttl: seconds a lease and a heartbeat last; renewals run three times as often.
        cap: the most domains placed on one engine (0: no limit but the balanced share).
    """

    def __init__(
        self,
        leases: LeaseStore,
        identity: str,
        name: str,
        ttl: float,
        *,
        serves_all: bool = True,
        cap: int = 0,
    ):
        self.identity = identity
        self.serves_all = serves_all
        self.name = name
        self.ttl = ttl
        self.tick = tick_of(ttl)
        self._leases = leases
        self.alive: list[str] = [identity]
        self.holders: dict[str, Holder] = {}
        self.cap = cap
        self.placement: dict[str, str] = {}  # domain -> engine, as of the last `place`
        self._placed: frozenset[str] = frozenset()  # the domains `place` was given
        self._first_seen: dict[str, float] = {}

    async def heartbeat(self) -> None:
        """Say this engine is up, and learn who else is."""
        alive = await self._within(
            self._leases.heartbeat(self.identity, self.name, self.ttl, serves_all=self.serves_all)
        )
        now = time.monotonic()
        self.alive = sorted(set(alive) | {self.identity})
        self._first_seen = {e: self._first_seen.get(e, now) for e in self.alive}

    async def acquire(self, domain: str, at_least: int = 0) -> Lease | None:
        """The domain's lease, if nobody else holds it, under an epoch of at least `at_least`."""
        sent = time.monotonic()
        taking = self._leases.acquire(domain, self.identity, self.ttl, at_least)
        epoch = await self._within(taking)
        if epoch is None:
            return None
        self.holders[domain] = Holder(domain=domain, engine=self.identity, epoch=epoch)
        return Lease(domain=domain, epoch=epoch, until=sent + self.ttl - MARGIN)

    async def renew(self, held: Mapping[str, Lease]) -> list[str]:
        """Extend the leases of `held` that are still ours (in place); the domains lost.

        The store renews only a lease that has not run out by its own clock, and every taking
        over draws a new epoch: a renewal under our epoch proves the lease never lapsed, even
        when our own count ran out meanwhile (an event loop held up by a long decision).
        A lease renewed under another epoch was taken over and given back: lost."""
        sent = time.monotonic()
        kept = await self._within(self._leases.renew(self.identity, list(held), self.ttl))
        lost = []
        for domain, lease in held.items():
            if kept.get(domain) == lease.epoch:
                lease.until = sent + self.ttl - MARGIN
            else:
                lost.append(domain)
        return lost

    async def release(self, lease: Lease) -> None:
        await self._within(self._leases.release(lease.domain, self.identity, lease.epoch))
        self.holders.pop(lease.domain, None)

    async def look(self) -> None:
        """Learn who holds which domain now."""
        self.holders = {h.domain: h for h in await self._within(self._leases.holders())}

    async def leave(self) -> None:
        await self._within(self._leases.leave(self.identity))

    async def _within(self, call: Awaitable[_T]) -> _T:
        return await within(self.ttl, call, "the lease store did not answer")

    def place(self, domains: list[str]) -> None:
        """Place `domains` (the log's) on the live engines, as every engine does."""
        self._placed = frozenset(domains)
        self.placement = spread(domains, self.alive, self.cap) if self.serves_all else {}

    def preferred(self, domain: str) -> str | None:
        """The engine `domain` is placed on; None when every engine is at its cap (whoever
        is asked for it writes it). An engine limited to some domains (TRELLIS_DOMAINS) is
        placed on itself for each of them, the operator having placed them there. A domain
        newer than the last placement prefers its rendezvous engine meanwhile."""
        if not self.serves_all:
            return self.identity
        placed = self.placement.get(domain)
        if placed is not None or domain in self._placed:
            return placed
        return preferred(domain, self.alive) or self.identity

    def stable(self, engine: str) -> bool:
        """Up for at least two lease times: worth handing a domain to."""
        seen = self._first_seen.get(engine)
        return seen is not None and time.monotonic() - seen >= 2 * self.ttl

    def elsewhere(self, domain: str) -> str | None:
        """The engine that should serve `domain` if not this one: its live holder, or, when
        nobody holds it, its preferred engine; None for this engine."""
        holder = self.holders.get(domain)  # leases that had not run out at the last look
        if holder is not None:
            return None if holder.engine == self.identity else holder.engine
        chosen = self.preferred(domain)
        return None if chosen in (None, self.identity) else chosen
