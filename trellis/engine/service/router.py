"""The engine service: routes each request to its domain's writer and answers queries.

Transport-agnostic: the NATS adapter hands `Engine.handle` a subject's parts and a body and
sends back the bytes it returns. Writes go through the domain's DomainWriter (engine.service.writer);
after each commit the domain's FabricSync (engine.service.saga) drives its fabric. Queries are answered
from committed state, from the projections, or (`fabric`) from the fabric driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable

import msgspec

from trellis.engine.service import fabric_report, snapshots

from trellis.engine.core import replies, views
from trellis.engine.core.actors import ENGINE, OPERATOR, is_reserved
from trellis.engine.core.errors import IntentRejected, ServedElsewhere, StoreUnavailable, WriterFenced
from trellis.engine.service.follower import Followers
from trellis.engine.core.ids import is_valid_id
from trellis.engine.core.intents import (
    Compose,
    CompositionQuery,
    ConnectionsQuery,
    EstablishComposition,
    ExpireLeases,
    Family,
    HistoryQuery,
    ImportTopology,
    InvalidIntent,
    RecordCheckpoint,
    WhyQuery,
    decode_intent,
    lease_expiry_request_id,
    settle_request_id,
)
from trellis.engine.service.ownership import Lease, Overran, Ownership, tick_of, within
from trellis.engine.service.ports import AuditTrail, Clock, EventStore, FabricDriver, Holder, LeaseStore, NoTelemetry, PastModels, ReadModels, SnapshotStore, Telemetry
from trellis.engine.core.queries import STATE_QUERIES, answer
from trellis.engine.core.records import Head
from trellis.engine.core.results import ConnectionsResult, HistoryResult
from trellis.engine.service.saga import FabricSync, Settlement
from trellis.engine.core.state import DomainState
from trellis.engine.service.writer import DomainWriter

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
# Answered by the AuditTrail (signed Merkle checkpoints), not from state or projections.
AUDIT_QUERIES = ("proof", "consistency", "checkpoint-key")
_REACH_POLL_S = 0.01  # how often a query waiting for its `min_position` looks at the head


class _ComposeOutcome(msgspec.Struct):
    composition_id: str
    state: str


_decode_outcome = msgspec.json.Decoder(_ComposeOutcome).decode


class _Served(msgspec.Struct, kw_only=True):
    """A domain this engine writes now: its writer, its fabric, and the lease it holds."""

    writer: DomainWriter
    sync: FabricSync
    lease: Lease | None  # None: an engine without leases (one engine, tests)

    def holds(self) -> bool:
        return self.lease is None or self.lease.holds()


class Engine:
    """Routes requests to domain writers, drives each domain's fabric after its commits, and
    answers queries from committed state.

    With `leases`, a domain is written only while this engine holds its writer lease
    (engine/service/ownership.py): `route` names the engine a request belongs to when it is another
    one, and a lease that is lost ends the domain's writer and fabric here at once.

    The ownership loop keeps ticking whatever one tick meets (a database restarting under it,
    a step that waits on a lock): each tick gets a lease time, a load as long, and a drop waits
    a tick for the domain's writer, fabric and followers to end before going on without
    them. Going on is safe: whatever of the dropped domain still runs holds an epoch the log
    and the fabric refuse once another writer has taken the lease, so a survivor takes over a
    free lease within a tick or two of the database answering again.
    """

    def __init__(
        self,
        store: EventStore,
        clock: Clock,
        fabric: FabricDriver,
        *,
        saga_deadline: float = 10.0,
        domains: Iterable[str] | None = None,
        max_batch: int = 256,
        read_models: ReadModels | None = None,
        followers: Followers | None = None,
        leases: LeaseStore | None = None,
        identity: str | None = None,
        name: str = "",
        lease_ttl: float = 3.0,
        snapshots: SnapshotStore | None = None,
        snapshot_every: int = 0,
        audit: AuditTrail | None = None,
        telemetry: Telemetry | None = None,
        read_wait: float = 2.0,
    ):
        self._store = store
        self._read_wait = read_wait
        self._telemetry = telemetry or NoTelemetry()
        self._snapshots = snapshots
        self._snapshot_every = snapshot_every
        self._audit = audit
        self._clock = clock
        self._fabric = fabric
        self._saga_deadline = saga_deadline
        self._read_models = read_models
        self._followers = followers
        self._allowed = frozenset(domains) if domains else None
        self._max_batch = max_batch
        self.identity = identity or f"e-{uuid.uuid4().hex[:12]}"
        self._ownership = (
            Ownership(
                leases,
                self.identity,
                name or self.identity,
                lease_ttl,
                serves_all=self._allowed is None,
            )
            if leases is not None
            else None
        )
        self._served: dict[str, _Served] = {}
        # What a tick and a load are given, and a drop (see above): a drop only cancels tasks
        # and waits for them, so it is given a tick, and the tick goes on to claim what is free.
        self._patience = lease_ttl
        self._drop_within = tick_of(lease_ttl)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()  # drops, and ticks that overran
        self._loading = asyncio.Lock()  # loads are rare; one lock keeps them simple

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
                    await self._runtime(domain, create=True)
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
            await self._drop(domain, "the engine stops", release=True, unfollow=False)
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
        return self._ownership.elsewhere(domain)

    def fence(self, domain: str) -> int | None:
        """The writer epoch this engine writes `domain` under (None: no lease, or not ours)."""
        served = self._served.get(domain)
        return served.lease.epoch if served is not None and served.lease is not None else None

    async def expire_due_leases(self) -> list[bytes]:
        """End every lease due by the clock's now, in every loaded domain; the replies."""
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
        while True:
            await asyncio.sleep(self._ownership.tick)
            await self._bounded_tick()

    async def _bounded_tick(self) -> None:
        """One tick, in a task of its own, given a lease time; whatever it raised or awaited,
        this returns by then, so the loop goes on. The next tick tries again (unrenewed
        leases run out meanwhile)."""
        tick = asyncio.create_task(self._own_tick(), name="writer-lease-tick")
        try:
            await asyncio.wait({tick}, timeout=self._patience)
        finally:
            if not tick.done():  # overran, or the loop is stopping
                tick.cancel()
                self._keep(tick)  # it may take a moment to unwind
        if not tick.done():
            log.error(
                "writer lease tick still running after %.1f s (a lease time): cancelled",
                self._patience,
            )
        elif tick.cancelled():
            # Nobody cancelled it: a driver let a CancelledError out (asyncpg may, when a
            # connection dies under a query). Only this tick is lost, not the loop.
            log.error("writer lease tick failed: cancelled from within")
        elif (exc := tick.exception()) is not None:
            log.error("writer lease tick failed", exc_info=exc)

    def _keep(self, task: asyncio.Task[None]) -> None:
        """Hold on to a task that runs on by itself until it ends (close waits for it)."""
        self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s failed", task.get_name(), exc_info=exc)

    async def _own_tick(self) -> None:
        """Heartbeat, renew what we hold (dropping what we lost), claim what prefers us, and
        hand over one domain that prefers another engine."""
        ownership = self._ownership
        assert ownership is not None
        await ownership.heartbeat()
        held = {d: s.lease for d, s in self._served.items() if s.lease is not None}
        for domain in await ownership.renew(held):
            await self._drop(domain, "its writer lease was lost")
        await ownership.look()
        for domain in await self._store.domains():
            if (
                self.serves(domain)
                and domain not in self._served
                and domain not in ownership.holders
                and ownership.preferred(domain) == self.identity
            ):
                with contextlib.suppress(_HeldElsewhere, StoreUnavailable):
                    await self._runtime(domain, create=False)
        for domain in sorted(self._served):
            successor = ownership.preferred(domain)
            if successor != self.identity and ownership.stable(successor):
                await self._drop(domain, f"handed over to engine {successor}", release=True)
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

    async def handle(
        self,
        family: Family,
        domain: str,
        tenant: str | None,
        verb: str,
        body: bytes,
        *,
        forwarded: bool = False,
    ) -> bytes:
        """Answer one request; never raises for bad input. `tenant` is the subject's tenant
        token: of an intent, or of a view (a query with a tenant is that tenant's view).

        Raises:
            ServedElsewhere: another engine turned out to write the domain (unless the request
                was `forwarded` here already: then it is answered `unavailable`).
        """
        for what, token in (("domain", domain), ("tenant", tenant)):
            if token is not None and not is_valid_id(token):
                return replies.error("invalid", f"{what} {token!r} is not a valid id")
        if tenant is not None and is_reserved(tenant):
            return replies.error(
                "forbidden",
                f"tenant {tenant!r} is reserved for Trellis's internal actors; "
                "tenant names may not be engine, operator or auditor, nor start with '_'",
                {"tenant": tenant},
            )
        if not self.serves(domain):
            return replies.error("not_found", f"this engine does not serve domain {domain!r}")
        try:
            intent = decode_intent(family, verb, body)
        except InvalidIntent as exc:
            return replies.error("invalid", str(exc))
        try:
            if family == "query":
                return await self._query(domain, verb, intent, viewer=tenant)
            served = await self._runtime(domain, create=isinstance(intent, ImportTopology))
            if served is None:
                return _no_domain(domain)
            if isinstance(intent, RecordCheckpoint):
                return await self._record_checkpoint(domain, served, intent.request_id)
            reply = await served.writer.request(tenant or OPERATOR, verb, intent, family)
            if isinstance(intent, Compose):
                return await self._once_settled(served, reply)
            return reply
        except StoreUnavailable as exc:
            return replies.error("unavailable", f"event store unavailable: {exc}")
        except _HeldElsewhere as exc:
            if forwarded or exc.holder is None:
                return exc.reply()
            raise ServedElsewhere(domain, exc.holder.engine) from None

    async def _once_settled(self, served: _Served, reply: bytes) -> bytes:
        """A compose is answered when the fabric saga has settled it: the composition is
        active (or impaired), or it failed and says what failed. A resend gets the same."""
        accepted = replies.decode_ok(reply)
        if accepted is None:
            return reply  # refused, or recorded as rejected: nothing to wait for
        outcome = _decode_outcome(accepted.result)
        if outcome.state != "pending":
            return reply
        cid = outcome.composition_id
        writer = served.writer
        composition = writer.state.compositions.get(cid)
        if composition is not None and composition.state == "pending":
            waiting = served.sync.settlement(cid)
            try:
                settled = await asyncio.wait_for(asyncio.shield(waiting), 3 * self._saga_deadline)
            except TimeoutError:
                return replies.error(
                    "unavailable",
                    f"composition {cid} is still being established; ask again with the same "
                    "request_id",
                    {"composition_id": cid},
                )
        else:
            key = (ENGINE, settle_request_id(cid))
            stored = (await self._store.find_replies(writer.domain, [key])).get(key)
            if stored is None:
                return reply  # cannot happen: a composition leaves pending only by settling
            settled = stored.reply
        return replies.as_replayed(settled) if accepted.replayed else settled

    async def _query(
        self, domain: str, verb: str, query: msgspec.Struct, *, viewer: str | None = None
    ) -> bytes:
        """Answer a query, live or at a past moment; with `viewer`, as that tenant's view
        (engine/core/views.py)."""
        if viewer is not None:
            if not views.serves(verb):
                return replies.error("invalid", f"query {verb!r} has no tenant view")
            query = views.scoped_query(query, viewer)
        served = await self._runtime(domain, create=False)
        if served is None:
            return _no_domain(domain)
        writer = served.writer
        try:
            await self._reach(domain, writer, getattr(query, "min_position", None))
            head = writer.head
            past = await self._past(domain, query, head)
            # The answer is as of this event (the writer's head, which includes `min_position`).
            upto = past or head
            state = writer.state
            result: msgspec.Struct
            if verb == "fabric":
                result = await fabric_report.report(
                    domain,
                    self._fabric,
                    lambda: served.writer.state,
                    settling=lambda: not served.sync.idle,
                    deadline=min(self._saga_deadline, fabric_report.READ_DEADLINE_S),
                )
            elif verb in AUDIT_QUERIES:
                result = await self._trail().answer(domain, query, head=upto.version, viewer=viewer)
            elif verb in STATE_QUERIES:
                if past is not None:
                    state = await snapshots.state_at(self._store, self._snapshots, domain, past)
                result = answer(state, query, verb)
            else:
                # (Only `topology`'s view reads the state, and it is a state query.)
                result = await self._read_model_query(domain, query, head.position, viewer, past)
            if viewer is not None:  # (`fabric` has no view: refused above)
                result = views.scope(verb, result, viewer, state)
        except IntentRejected as exc:
            return replies.rejection(exc)
        return replies.ok(_encode(result), upto.position)

    async def _reach(self, domain: str, writer: DomainWriter, min_position: int | None) -> None:
        """Wait, at most `read_wait` seconds, until the domain's log as the writer holds it
        includes `min_position` (read-your-writes; the read models then wait for the head).

        Raises:
            IntentRejected: `unavailable` when the head has not reached it in time.
        """
        if min_position is None or writer.head.position >= min_position:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._read_wait
        # The head moves only by this writer's commits: a short poll, no hook in the writer.
        while writer.head.position < min_position and loop.time() < deadline:
            await asyncio.sleep(min(_REACH_POLL_S, max(0.0, deadline - loop.time())))
        head = writer.head.position
        if head < min_position:
            raise IntentRejected(
                "unavailable",
                f"the log of domain {domain!r} has not reached position {min_position} within "
                f"{self._read_wait:g} s (its head is at {head}); retry, or ask for a position "
                "a reply of this domain gave",
                {"domain": domain, "min_position": min_position, "head": head},
            )

    async def _past(self, domain: str, query: msgspec.Struct, head: Head) -> Head | None:
        """The event a query's `at` names, when that is before the head; None: answer live.

        Raises:
            IntentRejected: `not_found` when the domain had no event yet at that moment.
        """
        at = getattr(query, "at", None)
        if at is None:
            return None
        located = await self._store.locate(domain, at)
        if located is None:
            shown = msgspec.to_builtins(at)
            raise IntentRejected(
                "not_found", f"domain {domain!r} did not exist yet at {shown}", {"at": shown}
            )
        target, _ = located
        return target if target.version < head.version else None

    def _trail(self) -> AuditTrail:
        if self._audit is None:
            raise IntentRejected("unavailable", "this engine keeps no checkpoints")
        return self._audit

    async def _record_checkpoint(self, domain: str, served: _Served, request_id: str) -> bytes:
        """A signed checkpoint of the log at the writer's head, recorded and published now.
        It records no event and stores no answer (a resend makes the head's checkpoint again,
        the same one while the log stands still); a request id another admin verb used is
        `conflict`, as everywhere."""
        key = (OPERATOR, request_id)
        if key in await self._store.find_replies(domain, [key]):
            return replies.error(
                "conflict",
                f"request_id {request_id!r} was already used with a different body",
                {"request_id": request_id},
            )
        head = served.writer.head
        try:
            result = await self._trail().checkpoint(domain, head.version)
        except IntentRejected as exc:
            return replies.rejection(exc)
        return replies.ok(_encode(result), head.position)

    async def _read_model_query(
        self,
        domain: str,
        query: msgspec.Struct,
        head: int,
        viewer: str | None,
        past: Head | None = None,
    ) -> msgspec.Struct:
        """History-bearing queries: live, from projections that include every committed event
        up to `head` (read-your-writes: a client that just composed sees it); at a past
        moment, from the projections folded up to the event `past`."""
        models = self._read_models
        if models is None:
            raise IntentRejected("unavailable", "this engine runs without projections")
        source: PastModels = models
        if past is not None:
            source = await models.past(domain, past)
        elif not await models.wait_for(domain, head):
            holdup = models.holdup(domain)
            if holdup is None:
                raise IntentRejected("unavailable", "projections are behind the log; retry")
            where = (
                f"at log position {holdup.position}"
                if holdup.position is not None
                else f"after log position {holdup.after}"
            )
            raise IntentRejected(
                "unavailable",
                f"the read models of domain {domain!r} are held up {where}: {holdup.cause}",
                {
                    "domain": domain,
                    "after": holdup.after,
                    "position": holdup.position,
                    "cause": holdup.cause,
                },
            )
        match query:
            case CompositionQuery(id=cid):
                composition = await source.composition(domain, cid)
                if composition is None:
                    raise views.unknown_composition(cid)
                return composition
            case ConnectionsQuery(host=host, tenant=tenant, device=device):
                rows = await source.connections(domain, host=host, tenant=tenant, device=device)
                return ConnectionsResult(connections=rows)
            case WhyQuery(id=target):
                why = await source.why(domain, target, viewer=viewer)
                if why is None:
                    raise IntentRejected("not_found", f"nothing named {target!r}", {"id": target})
                return why
            case HistoryQuery(id=target, tenant=tenant, since=since, until=until):
                intervals = await source.history(
                    domain, id=target, tenant=tenant, since=since, until=until
                )
                return HistoryResult(intervals=intervals)
        raise IntentRejected("invalid", "unknown query")

    async def _runtime(self, domain: str, *, create: bool) -> _Served | None:
        """The domain's writer and fabric here, loaded from the log on first use (taking the
        domain's writer lease first, when there are leases); None for an unknown domain unless
        `create` (only import-topology brings a domain into being).

        Raises:
            _HeldElsewhere: another engine holds the domain's lease.
        """
        served = self._served.get(domain)
        if served is not None and await self._still_ours(domain, served):
            return served
        async with self._loading:  # two first requests for a domain must not load it twice
            served = self._served.get(domain)
            if served is not None and not await self._still_ours(domain, served):
                await self._drop(domain, "its writer lease ran out")  # paused past it, say
                served = None
            if served is None:
                served = await self._bounded_load(domain, create=create)
        return served

    async def _bounded_load(self, domain: str, *, create: bool) -> _Served | None:
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

    async def _load(self, domain: str, *, create: bool) -> _Served | None:
        if not create and (await self._store.head(domain)).version == 0:
            return None  # no lease for a name nobody created
        lease = None
        if self._ownership is not None:
            lease = await self._ownership.acquire(domain)
            if lease is None:
                await self._ownership.look()
                raise _HeldElsewhere(domain, self._ownership.holders.get(domain))
        fence = lease.epoch if lease is not None else None
        sync = FabricSync(
            domain,
            lambda: writer.state,
            self._fabric,
            self._settle,
            deadline=self._saga_deadline,
            fence=fence,
            on_fenced=lambda: self._lost(domain, writer),
            telemetry=self._telemetry,
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
        served = _Served(writer=writer, sync=sync, lease=lease)
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
            log.info("domain %s: writing it under epoch %d", domain, lease.epoch)
        return served

    async def _still_ours(self, domain: str, served: _Served) -> bool:
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

    def _lost(self, domain: str, writer: DomainWriter) -> None:
        """The log or the fabric refused our epoch: stop writing the domain (once)."""
        served = self._served.get(domain)
        if served is not None and served.writer is writer:
            drop = self._drop(domain, "another engine writes it now")
            self._keep(asyncio.create_task(drop, name=f"fenced-{domain}"))

    async def _drop(
        self, domain: str, why: str, *, release: bool = False, unfollow: bool = True
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
        log.log(
            logging.INFO if why == "the engine stops" else logging.WARNING,
            "domain %s: this engine stops writing it: %s",
            domain,
            why,
        )
        ending = asyncio.create_task(
            self._end(domain, served, release=release, unfollow=unfollow), name=f"drop-{domain}"
        )
        self._keep(ending)
        await asyncio.wait({ending}, timeout=self._drop_within)
        if not ending.done():
            log.error(
                "domain %s: its writer, fabric or followers still running %.1f s after this "
                "engine stopped writing it; going on without waiting for them",
                domain,
                self._drop_within,
            )

    async def _end(self, domain: str, served: _Served, *, release: bool, unfollow: bool) -> None:
        await served.sync.close()
        await served.writer.close()
        # The followers follow the log, not this writer: a load that took the domain up again
        # while this drop overran keeps them.
        if unfollow and self._followers is not None and domain not in self._served:
            await self._followers.unfollow(domain)
        if release and served.lease is not None and self._ownership is not None:
            with contextlib.suppress(Exception):  # it runs out by itself otherwise
                await self._ownership.release(served.lease)

    def _committed(self, domain: str, sync: FabricSync) -> Callable[[], None]:
        """After a commit: wake the domain's followers and its fabric."""

        def committed() -> None:
            if self._followers is not None:
                self._followers.notify(domain)
            sync.kick()

        return committed


class _HeldElsewhere(Exception):
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


def _no_domain(domain: str) -> bytes:
    return replies.error(
        "not_found",
        f"domain {domain!r} does not exist; import a topology first",
        {"domain": domain},
    )
