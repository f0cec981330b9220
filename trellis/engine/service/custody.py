"""Custody of domains: which this engine writes now, loading each from the log on first use,
keeping its writer lease, and letting it go.

A domain served here has a DomainWriter (engine/service/writer.py) and a FabricSync
(engine/service/saga.py). With leases (engine/service/ownership.py), a domain is written only
while this engine holds its writer lease: `route` names the engine a request belongs to when it
is another one, and a lease that is lost ends the domain's writer and fabric here at once.

The ownership loop keeps ticking whatever one tick meets (a database restarting under it, a step
that waits on a lock): each tick gets a lease time, a load as long, and a drop waits a tick for
the domain's writer, fabric and followers to end before going on without them. Going on is safe:
whatever of the dropped domain still runs holds an epoch the log and the fabric refuse once
another writer has taken the lease, so a survivor takes over a free lease within a tick or two
of the database answering again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable, Sequence

import msgspec

from trellis.engine.core import replies
from trellis.engine.core.actors import ENGINE
from trellis.engine.core.errors import StoreUnavailable, WriterFenced
from trellis.engine.core.events import Event
from trellis.engine.core.intents import (
    EstablishComposition,
    ExpireLeases,
    ExpireReservations,
    lease_expiry_request_id,
    reservation_expiry_request_id,
)
from trellis.engine.core.records import Head
from trellis.engine.core.reservations import due_reservations
from trellis.engine.core.state import DomainState
from trellis.engine.service.follower import Followers
from trellis.engine.service.ownership import (
    Lease,
    Overran,
    Ownership,
    tick_of,
    wait_running,
    within,
)
from trellis.engine.service.ports import (
    Clock,
    DropReason,
    EventStore,
    FabricDriver,
    Holder,
    LeaseStore,
    NoTelemetry,
    SnapshotStore,
    Telemetry,
)
from trellis.engine.service.saga import FabricSync, Settlement
from trellis.engine.service.writer import DomainWriter, OnCommit

log = logging.getLogger(__name__)


class Served(msgspec.Struct, kw_only=True):
    """A domain this engine writes now: its writer, its fabric, and the lease it holds."""

    writer: DomainWriter
    sync: FabricSync
    lease: Lease | None  # None: an engine without leases (one engine, tests)

    def holds(self) -> bool:
        return self.lease is None or self.lease.holds()


class Custody:
    """The domains this engine writes: each one's writer and fabric, under its writer lease
    when there are leases (None: one engine, tests), and every tick, the compositions whose
    lease fell due are ended."""

    def __init__(
        self,
        store: EventStore,
        clock: Clock,
        fabric: FabricDriver,
        *,
        saga_deadline: float = 10.0,
        domains: Iterable[str] | None = None,
        max_batch: int = 256,
        followers: Followers | None = None,
        leases: LeaseStore | None = None,
        identity: str | None = None,
        name: str = "",
        lease_ttl: float = 3.0,
        domain_cap: int = 0,
        snapshots: SnapshotStore | None = None,
        snapshot_every: int = 0,
        telemetry: Telemetry | None = None,
    ):
        self._store = store
        self._clock = clock
        self._fabric = fabric
        self._saga_deadline = saga_deadline
        self._followers = followers
        self._max_batch = max_batch
        self._snapshots = snapshots
        self._snapshot_every = snapshot_every
        self._telemetry = telemetry or NoTelemetry()
        self._allowed = frozenset(domains) if domains else None
        self.identity = identity or f"e-{uuid.uuid4().hex[:12]}"
        self._ownership = (
            Ownership(
                leases,
                self.identity,
                name or self.identity,
                lease_ttl,
                serves_all=self._allowed is None,
                cap=domain_cap,
            )
            if leases is not None
            else None
        )
        self._served: dict[str, Served] = {}
        # The lowest epoch this engine may next write a domain under: one above what a fabric
        # that refused it had seen (its record outlives a rebuilt log's leases).
        self._floors: dict[str, int] = {}
        # Domains this engine handed over: to whom, until when (loop time). A request for one
        # goes to the successor meanwhile; taking the domain back on a request (our view of
        # the leases still naming us, another engine's view placing it here) made a domain
        # pass to and fro under load instead of reaching its place.
        self._handed: dict[str, tuple[str, float]] = {}
        # Domains it warned it stopped writing: taking one back is worth a warning too.
        self._stopped: set[str] = set()
        # What a tick and a load are given, and a drop (see above): a drop only cancels tasks
        # and waits for them, so it is given a tick, and the tick goes on to claim what is free.
        self._patience = lease_ttl
        self._drop_within = tick_of(lease_ttl)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()  # drops, and ticks that overran
        self._loading = asyncio.Lock()  # loads are rare; one lock keeps them simple
        # Since when (loop time) and why the writer lease ticks fail, None while they succeed:
        # a tick writes (the heartbeat, the renewals), so this is the engine's sign that
        # PostgreSQL takes no writes now (a full disk, a synchronous standby gone) while it
        # still answers reads.
        self._failing: tuple[float, str] | None = None

    @property
    def domains(self) -> list[str]:
        """The domains this engine writes now."""
        return sorted(d for d, s in self._served.items() if s.writer.state.exists)

    def serves(self, domain: str) -> bool:
        return self._allowed is None or domain in self._allowed

    async def start(self, *, lease_tick_seconds: float | None = 1.0) -> None:
        """Take up the domains this engine should write (every served domain without
        leases; with them, those nobody holds that prefer this engine), finishing or undoing
        what a crash interrupted, then keep the writer leases and the compositions' leases:
        every tick, compositions whose lease fell due are ended. Timers are derived from
        state, so a lease that fell due while no engine ran ends at the first tick after a
        start."""
        if self._ownership is None:
            for domain in await self._store.domains():
                if self.serves(domain):
                    await self.runtime(domain, create=True)
        else:
            await self._bounded_tick()
            self._tasks.append(asyncio.create_task(self._own_loop(), name="writer-leases"))
        if lease_tick_seconds is not None:
            self._tasks.append(
                asyncio.create_task(self._expiry_loop(lease_tick_seconds), name="lease-keeper")
            )

    async def close(self) -> None:
        """Stop; writer leases are given up at once, so another engine takes over now."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for domain in list(self._served):
            # The followers stay: whoever closes them drains them first (a clean exit leaves
            # the stream complete).
            await self._drop(domain, "stopping", "the engine stops", release=True, unfollow=False)
        if self._background:  # drops that overran, ticks that did not end when cancelled
            _, stuck = await asyncio.wait(self._background, timeout=self._patience)
            for task in stuck:
                log.error("%s did not end; the engine stops without it", task.get_name())
                task.cancel()
        if self._ownership is not None:
            with contextlib.suppress(Exception):  # the store may be gone; leases run out then
                await self._ownership.leave()

    def route(self, domain: str) -> str | None:
        """The engine that serves `domain` when it is another one (its writer, or who should
        become it); None: this engine answers."""
        served = self._served.get(domain)
        if self._ownership is None or (served is not None and served.holds()):
            return None
        return self._successor(domain) or self._ownership.elsewhere(domain)

    def _successor(self, domain: str) -> str | None:
        """The engine this one handed `domain` to, for two lease times after (None: none)."""
        handed = self._handed.get(domain)
        if handed is None:
            return None
        successor, until = handed
        if asyncio.get_running_loop().time() < until:
            return successor
        del self._handed[domain]
        return None

    def fence(self, domain: str) -> int | None:
        """The writer epoch this engine writes `domain` under (None: no lease, or not ours)."""
        served = self._served.get(domain)
        return served.lease.epoch if served is not None and served.lease is not None else None

    async def expire_due_leases(self) -> list[bytes]:
        """End every lease and every reservation due by the clock's now, in every loaded
        domain; the replies."""
        now = self._clock.now()
        answers = []
        for _, served in sorted(self._served.items()):
            writer = served.writer
            due = sorted(
                cid
                for cid, c in writer.state.compositions.items()
                if c.expires_at is not None and c.expires_at <= now and c.state != "pending"
            )
            if due:
                expire = ExpireLeases(request_id=lease_expiry_request_id(due))
                answers.append(await writer.request(ENGINE, "expire", expire, "internal"))
            # Reservations whose time is up, derived from state the same way (a restart loses
            # no timer); recorded as ReservationExpired.
            ending = due_reservations(writer.state, now)
            if ending:
                end = ExpireReservations(request_id=reservation_expiry_request_id(ending))
                answers.append(await writer.request(ENGINE, "expire-reservations", end, "internal"))
        return answers

    async def _expiry_loop(self, tick: float) -> None:
        while True:
            await asyncio.sleep(tick)
            try:
                await self.expire_due_leases()
            except Exception:  # a failed tick is retried by the next one
                log.exception("lease keeper tick failed")

    async def _own_loop(self) -> None:
        assert self._ownership is not None
        loop = asyncio.get_running_loop()
        said: str | None = None  # the failure the log last told of, in this streak
        while True:
            slept_at = loop.time()
            await asyncio.sleep(self._ownership.tick)
            ticked_at = loop.time()
            stalled = ticked_at - slept_at - self._ownership.tick
            if stalled > self._patience:
                # Woken from a pause (SIGSTOP, a stuck VM, a long GC): the leases ran out
                # meanwhile and other engines took the domains. Say so once; the tick then
                # keeps only what is still ours, and drops the rest quietly.
                self._say_stalled(stalled)
            failure = await self._bounded_tick()
            streak = self._failing  # the failing ticks before this one, if any
            self._note_tick(failure)
            # A pause that began during the tick shows as a tick past its bound (a bounded
            # tick returns within one lease time when the loop runs).
            stalled_in_tick = loop.time() - ticked_at - self._patience
            if stalled_in_tick > self._patience:
                self._say_stalled(stalled_in_tick)
            if failure is None:
                if streak is not None:
                    log.warning(
                        "writer lease ticks succeed again after %.0f s", loop.time() - streak[0]
                    )
                said = None
                continue
            what, exc = failure
            if max(stalled, stalled_in_tick) > self._patience:
                # A driver's own timer (a pool's acquire, a connect) that ran through the
                # pause fires as the loop runs again: the pause's doing, said above. The
                # next tick tries again, as after any failed tick.
                log.warning("%s after the pause%s", what, f": {exc!r}" if exc else "")
            elif said != (failing := f"{what}: {exc!r}"):
                # Said once a streak, and again only when it fails otherwise; /healthz's
                # `leases` problem tells how long it has failed meanwhile.
                log.error(what, exc_info=exc)
                said = failing

    def _note_tick(self, failure: tuple[str, BaseException | None] | None) -> None:
        if failure is None:
            self._failing = None
        elif self._failing is None:
            what, exc = failure
            since = asyncio.get_running_loop().time()
            self._failing = (since, f"{what}: {exc!r}" if exc is not None else what)

    def lease_problem(self) -> str | None:
        """Why this engine cannot keep writer leases, once its ticks have failed for a lease
        time (a domain's lease has run out by then), else None."""
        if self._failing is None:
            return None
        since, why = self._failing
        failing_for = asyncio.get_running_loop().time() - since
        if failing_for < self._patience:
            return None
        return f"writer leases: every tick failed for {failing_for:.0f} s ({why})"

    @staticmethod
    def _say_stalled(seconds: float) -> None:
        log.warning(
            "this engine did not run for %.1f s (a paused process?); keeping only the writer "
            "leases it still holds",
            seconds,
        )

    async def _bounded_tick(self) -> tuple[str, BaseException | None] | None:
        """One tick, in a task of its own, given a lease time; whatever it raised or awaited,
        this returns by then, so the loop goes on: with what went wrong, for the loop to say
        (None: nothing). The next tick tries again (unrenewed leases run out meanwhile)."""
        tick = asyncio.create_task(self._own_tick(), name="writer-lease-tick")
        try:
            # A pause of the process (which `_own_loop` reports) is not the tick's time.
            await wait_running(tick, self._patience)
        finally:
            if not tick.done():  # overran, or the loop is stopping
                tick.cancel()
                self._keep(tick)  # it may take a moment to unwind
        if not tick.done():
            took = f"{self._patience:.1f} s (a lease time)"
            return f"writer lease tick still running after {took}: cancelled", None
        if tick.cancelled():
            # Nobody cancelled it: a driver let a CancelledError out (asyncpg may, when a
            # connection dies under a query). Only this tick is lost, not the loop.
            return "writer lease tick failed: cancelled from within", None
        if (exc := tick.exception()) is not None:
            return "writer lease tick failed", exc
        return None

    def _keep(self, task: asyncio.Task[None]) -> None:
        """Hold on to a task that runs on by itself until it ends (close waits for it)."""
        self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s failed", task.get_name(), exc_info=exc)

    async def _own_tick(self) -> None:
        """Heartbeat, renew what we hold (dropping what we lost), place the domains over the
        live engines, claim what is placed here, and hand over one domain placed elsewhere."""
        ownership = self._ownership
        assert ownership is not None
        await ownership.heartbeat()
        held = {d: s.lease for d, s in self._served.items() if s.lease is not None}
        for domain in await ownership.renew(held):
            await self._drop(domain, "lease_lost", "its writer lease was lost")
        await ownership.look()
        domains = [d for d in await self._store.domains() if self.serves(d)]
        ownership.place(domains)
        for domain in domains:
            if (
                domain not in self._served
                and domain not in ownership.holders
                and ownership.preferred(domain) == self.identity
            ):
                with contextlib.suppress(HeldElsewhere, StoreUnavailable):
                    await self.runtime(domain, create=False)
        for domain in sorted(self._served):
            successor = ownership.preferred(domain)
            if successor not in (None, self.identity) and ownership.stable(successor):
                until = asyncio.get_running_loop().time() + 2 * self._patience
                self._handed[domain] = (successor, until)
                await self._drop(
                    domain, "handed_over", f"handed over to engine {successor}", release=True
                )
                break  # one a tick, so domains move gradually

    def state(self, domain: str) -> DomainState | None:
        served = self._served.get(domain)
        return served.writer.state if served else None

    def head(self, domain: str) -> Head | None:
        """The last committed event of a domain this engine writes (None: it does not)."""
        served = self._served.get(domain)
        return served.writer.head if served else None

    def fabric_sync(self, domain: str) -> FabricSync | None:
        served = self._served.get(domain)
        return served.sync if served else None

    async def _settle(self, domain: str, settlement: Settlement) -> bytes:
        """Record a saga's outcome; the reply is what the composer is told."""
        served = self._served.get(domain)
        if served is None:
            raise WriterFenced(domain, "it no longer writes the domain")
        writer = served.writer
        composition = writer.state.compositions.get(settlement.composition_id)
        verb = "establish" if isinstance(settlement, EstablishComposition) else "fail"
        correlation = composition.request.request_id if composition else None
        return await writer.request(ENGINE, verb, settlement, "internal", correlation)

    async def runtime(self, domain: str, *, create: bool) -> Served | None:
        """The domain's writer and fabric here, loaded from the log on first use (taking the
        domain's writer lease first, when there are leases); None for an unknown domain unless
        `create` (only import-topology brings a domain into being).

        Raises:
            HeldElsewhere: another engine holds the domain's lease.
        """
        served = self._served.get(domain)
        if served is not None and await self._still_ours(domain, served):
            return served
        successor = self._successor(domain)
        if successor is not None:  # just handed over: a request goes there, not back here
            raise HeldElsewhere(domain, Holder(domain=domain, engine=successor, epoch=0))
        async with self._loading:  # two first requests for a domain must not load it twice
            served = self._served.get(domain)
            if served is not None and not await self._still_ours(domain, served):
                # paused past it, say
                await self._drop(domain, "lease_ran_out", "its writer lease ran out")
                served = None
            if served is None:
                served = await self._bounded_load(domain, create=create)
        return served

    async def _bounded_load(self, domain: str, *, create: bool) -> Served | None:
        """`_load`, given a lease time when there are leases: a load that outlasts the lease
        it took could not write under it anyway (the lease is renewed only once the domain
        is served), and it must not hold `_loading`, which every other load waits for."""
        if self._ownership is None:
            return await self._load(domain, create=create)
        try:
            loading = self._load(domain, create=create)
            return await within(self._patience, loading, f"loading domain {domain!r} did not end")
        except Overran:
            log.warning("domain %s: loading it took over %.1f s; given up", domain, self._patience)
            raise

    async def _load(self, domain: str, *, create: bool) -> Served | None:
        if not create and (await self._store.head(domain)).version == 0:
            return None  # no lease for a name nobody created
        lease = None
        if self._ownership is not None:
            lease = await self._ownership.acquire(domain, self._floors.get(domain, 0))
            if lease is None:
                await self._ownership.look()
                raise HeldElsewhere(domain, self._ownership.holders.get(domain))
            self._floors.pop(domain, None)
        fence = lease.epoch if lease is not None else None
        sync = FabricSync(
            domain,
            lambda: writer.state,
            self._fabric,
            self._settle,
            deadline=self._saga_deadline,
            fence=fence,
            on_fenced=lambda seen: self._lost(domain, writer, seen, by_fabric=True),
            telemetry=self._telemetry,
            appending=lambda: writer.appending,
        )
        writer = DomainWriter(
            domain,
            self._store,
            self._clock,
            self._max_batch,
            self._committed(domain, sync),
            fence=fence,
            holds=lease.holds if lease is not None else None,
            reclaim=(lambda: self._reclaim(domain, lease)) if lease is not None else None,
            on_fenced=lambda: self._lost(domain, writer),
            snapshots=self._snapshots,
            snapshot_every=self._snapshot_every,
            telemetry=self._telemetry,
        )
        served = Served(writer=writer, sync=sync, lease=lease)
        try:
            await writer.catch_up()
        except BaseException:
            if lease is not None and self._ownership is not None:
                with contextlib.suppress(Exception):
                    await self._ownership.release(lease)
            raise
        if not (writer.state.exists or create):
            if lease is not None and self._ownership is not None:
                await self._ownership.release(lease)
            return None  # keep no writer for names nobody created
        self._served[domain] = served
        if self._followers is not None:
            self._followers.follow(domain)
        sync.kick()  # finish or undo the sagas a crash or the last writer left, remove leftovers
        if lease is not None:
            self._telemetry.began_writing(domain, lease.epoch)
            again = domain in self._stopped
            self._stopped.discard(domain)
            log.log(
                logging.WARNING if again else logging.INFO,
                "domain %s: writing it%s under epoch %d",
                domain,
                " again" if again else "",
                lease.epoch,
            )
        return served

    async def _still_ours(self, domain: str, served: Served) -> bool:
        """Whether we write `domain`: by our own count of its lease, or else by a renewal
        out of turn (the store still has it ours)."""
        if served.holds():
            return True
        return served.lease is not None and await self._reclaim(domain, served.lease)

    async def _reclaim(self, domain: str, lease: Lease) -> bool:
        """Renew one lease now, out of turn (its writer found our own count run out); True
        when the store still had it ours."""
        if self._ownership is None:
            return False
        try:
            return not await self._ownership.renew({domain: lease})
        except Exception as exc:  # an unreachable store cannot confirm it
            log.warning("domain %s: could not renew its writer lease: %s", domain, exc)
            return False

    def _lost(
        self, domain: str, writer: DomainWriter, seen: int = 0, *, by_fabric: bool = False
    ) -> None:
        """The log or the fabric refused our epoch: stop writing the domain (once).

        A fabric that has seen a later epoch than any lease (`seen`: its record outlived the
        log, as when a new deployment drives an old fabric manager) is no other writer: the
        lease is given up at once and the next one drawn above it, instead of one refusal
        per lease round until the epochs pass the record."""
        served = self._served.get(domain)
        if served is None or served.writer is not writer:
            return
        ahead = served.lease is not None and seen >= served.lease.epoch
        if ahead:
            self._floors[domain] = max(self._floors.get(domain, 0), seen + 1)
        if ahead:
            why = f"the fabric has seen writer epoch {seen}"
        elif by_fabric:  # its reason is on the saga's line before (another deployment...)
            why = "the fabric refused this writer"
        else:
            why = "the log holds a newer writer epoch (another engine, or this one again)"
        drop = self._drop(domain, "fenced", why, release=ahead)
        self._keep(asyncio.create_task(drop, name=f"fenced-{domain}"))

    async def _drop(
        self,
        domain: str,
        reason: DropReason,
        why: str,
        *,
        release: bool = False,
        unfollow: bool = True,
    ) -> None:
        """Stop writing `domain` here: its writer, fabric and (`unfollow`) followers end; with
        `release`, its lease is given up for another engine to take at once.

        Waits a tick at most: the ending goes on in a task of its own (neither a
        cancelled caller nor an overrun stops it half way), and a caller (a tick, a load
        holding `_loading`) goes on without it. Nothing of it can write meanwhile under an
        epoch another writer has superseded: the log and the fabric refuse it."""
        served = self._served.pop(domain, None)
        if served is None:
            return
        self._telemetry.stopped_writing(domain, reason)
        if reason != "stopping":
            self._stopped.add(domain)
        log.log(
            logging.INFO if reason == "stopping" else logging.WARNING,
            "domain %s: this engine stops writing it: %s",
            domain,
            why,
        )
        ending = asyncio.create_task(
            self._end(domain, served, release=release, unfollow=unfollow), name=f"drop-{domain}"
        )
        self._keep(ending)
        # A pause of the process (a SIGSTOP just after the drop began) is not the ending's time.
        await wait_running(ending, self._drop_within)
        if not ending.done():
            log.error(
                "domain %s: its writer, fabric or followers still running %.1f s after this "
                "engine stopped writing it; going on without waiting for them",
                domain,
                self._drop_within,
            )

    async def _end(self, domain: str, served: Served, *, release: bool, unfollow: bool) -> None:
        await served.sync.close()
        await served.writer.close()
        # The followers follow the log, not this writer: a load that took the domain up again
        # while this drop overran keeps them.
        if unfollow and self._followers is not None and domain not in self._served:
            await self._followers.unfollow(domain)
        if release and served.lease is not None and self._ownership is not None:
            with contextlib.suppress(Exception):  # it runs out by itself otherwise
                await self._ownership.release(served.lease)

    def _committed(self, domain: str, sync: FabricSync) -> OnCommit:
        """After a commit: wake the domain's followers and tell its fabric."""

        def committed(before: DomainState, after: DomainState, events: Sequence[Event]) -> None:
            if self._followers is not None:
                self._followers.notify(domain)
            sync.committed(before, after, events)

        return committed


class HeldElsewhere(Exception):
    """Another engine holds the domain's writer lease."""

    def __init__(self, domain: str, holder: Holder | None):
        super().__init__(domain)
        self.domain = domain
        self.holder = holder

    def reply(self) -> bytes:
        writer = self.holder.engine if self.holder is not None else "another engine"
        return replies.error(
            "unavailable",
            f"domain {self.domain!r} is written by {writer} now; resend with the same request_id",
            {"domain": self.domain, "writer": self.holder.engine if self.holder else None},
        )


def unknown_domain(domain: str) -> bytes:
    return replies.error(
        "not_found",
        f"domain {domain!r} does not exist; import a topology first",
        {"domain": domain},
    )
