"""The engine service: one writer per domain, group commit, replies only after commit.

Transport-agnostic: the NATS adapter hands `Engine.handle` a subject's parts and a body and
sends back the bytes it returns. Everything that reaches the log goes through a DomainWriter,
which drains its queue in batches: each batch is decided in arrival order on a scratch state
and committed in one transaction together with its request ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Iterable

import msgspec

from engine import replies
from engine.decide import Context, decide
from engine.errors import ConcurrencyConflict, IntentRejected, StoreUnavailable
from engine.ids import is_valid_id
from engine.intents import (
    Compose,
    CompositionQuery,
    ConnectionsQuery,
    EstablishComposition,
    ExpireLeases,
    Family,
    ImportTopology,
    InvalidIntent,
    WhyQuery,
    decode_intent,
    settle_request_id,
)
from engine.ports import Clock, EventStore, FabricDriver, PendingReply, ReadModels, StoredReply
from engine.queries import STATE_QUERIES, answer
from engine.records import Head, PendingEvent
from engine.saga import FabricSync, Settlement
from engine.state import DomainState, evolve

log = logging.getLogger(__name__)

OPERATOR = "operator"
ENGINE = "engine"  # the actor of what the engine decides on its own: expiries, settlements
_encode = msgspec.json.Encoder().encode


class _ComposeOutcome(msgspec.Struct):
    composition_id: str
    state: str


_decode_outcome = msgspec.json.Decoder(_ComposeOutcome).decode


class _Request(msgspec.Struct, kw_only=True):
    actor: str
    verb: str
    intent: msgspec.Struct
    body_hash: str
    reply: asyncio.Future[bytes]
    correlation_id: str | None = None  # default: the request id

    @property
    def key(self) -> tuple[str, str]:
        return (self.actor, self.intent.request_id)  # type: ignore[attr-defined]


class DomainWriter:
    """The single writer of one domain's stream."""

    def __init__(
        self,
        domain: str,
        store: EventStore,
        clock: Clock,
        max_batch: int,
        on_commit: Callable[[], None] | None = None,
    ):
        self.domain = domain
        self._on_commit = on_commit
        self.state = DomainState(domain=domain)
        self.head = Head()
        self._store = store
        self._clock = clock
        self._max_batch = max_batch
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._stale = True  # must catch up from the log before the next decision
        self._task: asyncio.Task[None] | None = None

    async def catch_up(self) -> None:
        """Fold every event after our head into the state (start, or after a lost race)."""
        state, head = self.state, self.head
        async for recorded in self._store.read(self.domain, after_version=head.version):
            state = evolve(state, recorded.event())
            head = Head(recorded.version, recorded.position, recorded.hash)
        self.state, self.head, self._stale = state, head, False

    def submit(self, request: _Request) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"writer-{self.domain}")
        self._queue.put_nowait(request)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # A cancellation that surfaced as a store error was answered as `unavailable`;
                # it is still a request to stop.
                raise asyncio.CancelledError
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._commit_isolating_failures(batch)

    async def _commit_isolating_failures(self, batch: list[_Request]) -> None:
        """Commit the batch; if it fails unexpectedly, retry its requests one by one so a
        single poisonous request cannot take the others down with it."""
        try:
            await self._commit_batch(batch)
            return
        except Exception:  # a bug must not kill the writer; the clients get an answer
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # asyncpg may surface a cancellation inside a dying transaction as another
                # error; swallowing it would make close() wait forever.
                raise
            log.exception("domain %s: batch of %d failed", self.domain, len(batch))
            self._stale = True
        if len(batch) == 1:
            _answer_all(batch, replies.error("unavailable", "internal error; retry later"))
            return
        for request in batch:
            await self._commit_isolating_failures([request])

    async def _commit_batch(self, batch: list[_Request]) -> None:
        for _attempt in range(3):
            try:
                if self._stale:
                    await self.catch_up()
                await self._decide_and_append(batch)
                return
            except ConcurrencyConflict as exc:
                # Another engine wrote to this domain: re-read the log and decide again.
                log.info("domain %s: %s; catching up", self.domain, exc)
                self._stale = True
            except StoreUnavailable as exc:
                # The commit may or may not have happened; the log is the truth, so re-read it
                # before deciding anything else. Clients retry with the same request_id.
                self._stale = True
                _answer_all(batch, replies.error("unavailable", f"event store unavailable: {exc}"))
                return
        _answer_all(batch, replies.error("unavailable", "too much write contention; retry"))

    async def _decide_and_append(self, batch: list[_Request]) -> None:
        stored = await self._store.find_replies(self.domain, [r.key for r in batch])
        state = self.state
        events: list[PendingEvent] = []
        pending: list[PendingReply] = []
        # Per request: the final reply now, or ("first" | "resend", index into `pending`).
        answers: list[bytes | tuple[str, int]] = []
        first_in_batch: dict[tuple[str, str], int] = {}
        now = self._clock.now()
        for req in batch:
            earlier = stored.get(req.key)
            index = first_in_batch.get(req.key)
            if earlier is not None:
                answers.append(_resend(earlier.body_hash, earlier.reply, req))
                continue
            if index is not None:
                same = pending[index].body_hash == req.body_hash
                answers.append(("resend", index) if same else _conflict(req))
                continue
            ctx = Context(domain=self.domain, actor=req.actor, verb=req.verb, now=now)
            try:
                decision = decide(state, req.intent, ctx)
            except IntentRejected as exc:
                answers.append(replies.rejection(exc))
                continue
            for event in decision.events:
                state = evolve(state, event)
                events.append(
                    PendingEvent.of(
                        event,
                        actor=req.actor,
                        causation_id=req.intent.request_id,  # type: ignore[attr-defined]
                        correlation_id=req.correlation_id or req.intent.request_id,  # type: ignore[attr-defined]
                        at=now,
                    )
                )
            first_in_batch[req.key] = len(pending)
            answers.append(("first", len(pending)))
            pending.append(
                PendingReply(
                    actor=req.actor,
                    request_id=req.intent.request_id,  # type: ignore[attr-defined]
                    verb=req.verb,
                    body_hash=req.body_hash,
                    # A recorded rejection (no_capacity, no_path) is stored like any answer.
                    ok=decision.error is None,
                    body=(
                        _encode(decision.result)
                        if decision.error is None
                        else replies.rejection(decision.error)
                    ),
                    event_index=len(events) - 1 if events else None,
                )
            )
        committed: list[StoredReply] = []
        if pending:
            appended = await self._store.append(self.domain, self.head, events, pending)
            self.state, self.head, committed = state, appended.head, appended.replies
            if events and self._on_commit is not None:
                self._on_commit()  # e.g. wake the projection runner
        # Only now, after the commit, does anyone hear back.
        for req, ans in zip(batch, answers, strict=True):
            if isinstance(ans, bytes):
                _answer(req, ans)
            else:
                kind, index = ans
                reply = committed[index].reply
                _answer(req, replies.as_replayed(reply) if kind == "resend" else reply)


class Engine:
    """Routes requests to domain writers, drives each domain's fabric after its commits, and
    answers queries from committed state."""

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
        on_commit: Callable[[], None] | None = None,
    ):
        self._store = store
        self._clock = clock
        self._fabric = fabric
        self._saga_deadline = saga_deadline
        self._syncs: dict[str, FabricSync] = {}
        self._read_models = read_models
        self._on_commit = on_commit
        self._allowed = frozenset(domains) if domains else None
        self._max_batch = max_batch
        self._writers: dict[str, DomainWriter] = {}
        self._lease_keeper: asyncio.Task[None] | None = None
        self._loading = asyncio.Lock()  # loads are rare; one lock keeps them simple

    @property
    def domains(self) -> list[str]:
        return sorted(d for d, w in self._writers.items() if w.state.exists)

    def serves(self, domain: str) -> bool:
        return self._allowed is None or domain in self._allowed

    async def start(self, *, lease_tick_seconds: float | None = 1.0) -> None:
        """Rebuild every served domain's state from the log, then keep leases: every tick,
        leases that fell due are ended. Timers are derived from state, so a lease that fell
        due while no engine ran ends at the first tick after a start."""
        for domain in await self._store.domains():
            if self.serves(domain):
                await self._writer(domain, create=True)
        for sync in self._syncs.values():
            sync.kick()  # finish or undo what a crash interrupted, remove what it left
        if lease_tick_seconds is not None:
            self._lease_keeper = asyncio.create_task(
                self._keep_leases(lease_tick_seconds), name="lease-keeper"
            )

    async def close(self) -> None:
        if self._lease_keeper is not None:
            self._lease_keeper.cancel()
            await asyncio.gather(self._lease_keeper, return_exceptions=True)
        for sync in self._syncs.values():
            await sync.close()
        for writer in self._writers.values():
            await writer.close()

    async def expire_due_leases(self) -> list[bytes]:
        """End every lease due by the clock's now, in every loaded domain; the replies."""
        now = self._clock.now()
        answers = []
        for _, writer in sorted(self._writers.items()):
            due = sorted(
                cid
                for cid, c in writer.state.compositions.items()
                if c.expires_at is not None and c.expires_at <= now and c.state != "pending"
            )
            if due:
                # Named by what it ends: a resend after a crash replays instead of re-deciding.
                digest = hashlib.sha256(",".join(due).encode()).hexdigest()[:24]
                expire = ExpireLeases(request_id=f"lease-expiry-{digest}")
                answers.append(await self._submit(writer, ENGINE, "expire", expire, "internal"))
        return answers

    async def _keep_leases(self, tick: float) -> None:
        while True:
            await asyncio.sleep(tick)
            try:
                await self.expire_due_leases()
            except Exception:  # a failed tick is retried by the next one
                log.exception("lease keeper tick failed")

    def state(self, domain: str) -> DomainState | None:
        writer = self._writers.get(domain)
        return writer.state if writer else None

    def fabric_sync(self, domain: str) -> FabricSync | None:
        return self._syncs.get(domain)

    async def _settle(self, domain: str, settlement: Settlement) -> bytes:
        """Record a saga's outcome; the reply is what the composer is told."""
        writer = self._writers[domain]
        composition = writer.state.compositions.get(settlement.composition_id)
        verb = "establish" if isinstance(settlement, EstablishComposition) else "fail"
        correlation = composition.request.request_id if composition else None
        return await self._submit(writer, ENGINE, verb, settlement, "internal", correlation)

    async def handle(
        self, family: Family, domain: str, tenant: str | None, verb: str, body: bytes
    ) -> bytes:
        """Answer one request; never raises for bad input."""
        for what, token in (("domain", domain), ("tenant", tenant)):
            if token is not None and not is_valid_id(token):
                return replies.error("invalid", f"{what} {token!r} is not a valid id")
        if not self.serves(domain):
            return replies.error("not_found", f"this engine does not serve domain {domain!r}")
        try:
            intent = decode_intent(family, verb, body)
        except InvalidIntent as exc:
            return replies.error("invalid", str(exc))
        try:
            if family == "query":
                return await self._query(domain, verb, intent)
            writer = await self._writer(domain, create=isinstance(intent, ImportTopology))
            if writer is None:
                return _no_domain(domain)
            reply = await self._submit(writer, tenant or OPERATOR, verb, intent, family)
            if isinstance(intent, Compose):
                return await self._once_settled(writer, reply)
            return reply
        except StoreUnavailable as exc:
            return replies.error("unavailable", f"event store unavailable: {exc}")

    async def _submit(
        self,
        writer: DomainWriter,
        actor: str,
        verb: str,
        intent: msgspec.Struct,
        family: str,
        correlation_id: str | None = None,
    ) -> bytes:
        request = _Request(
            actor=actor,
            verb=verb,
            intent=intent,
            body_hash=_body_hash(family, verb, intent),
            reply=asyncio.get_running_loop().create_future(),
            correlation_id=correlation_id,
        )
        writer.submit(request)
        return await request.reply

    async def _once_settled(self, writer: DomainWriter, reply: bytes) -> bytes:
        """A compose is answered when the fabric saga has settled it: the composition is
        active (or impaired), or it failed and says what failed. A resend gets the same."""
        accepted = replies.decode_ok(reply)
        if accepted is None:
            return reply  # refused, or recorded as rejected: nothing to wait for
        outcome = _decode_outcome(accepted.result)
        if outcome.state != "pending":
            return reply
        cid = outcome.composition_id
        composition = writer.state.compositions.get(cid)
        if composition is not None and composition.state == "pending":
            waiting = self._syncs[writer.domain].settlement(cid)
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

    async def _query(self, domain: str, verb: str, query: msgspec.Struct) -> bytes:
        writer = await self._writer(domain, create=False)
        if writer is None:
            return _no_domain(domain)
        head = writer.head.position
        try:
            if verb in STATE_QUERIES:
                result = answer(writer.state, query, verb)
            else:
                result = await self._read_model_query(domain, query, head)
        except IntentRejected as exc:
            return replies.rejection(exc)
        return replies.ok(_encode(result), head)

    async def _read_model_query(
        self, domain: str, query: msgspec.Struct, head: int
    ) -> dict[str, object]:
        """History-bearing queries, answered from projections that include every committed
        event up to `head` (read-your-writes: a client that just composed sees it)."""
        models = self._read_models
        if models is None:
            raise IntentRejected("unavailable", "this engine runs without projections")
        if not await models.wait_for(head):
            raise IntentRejected("unavailable", "projections are behind the log; retry")
        match query:
            case CompositionQuery(id=cid):
                row = await models.composition(domain, cid)
                if row is None:
                    raise IntentRejected("not_found", f"no composition {cid!r}", {"id": cid})
                return row
            case ConnectionsQuery(host=host, tenant=tenant, device=device):
                rows = await models.connections(domain, host=host, tenant=tenant, device=device)
                return {"connections": rows}
            case WhyQuery(id=target, at=at):
                if at is not None and not _is_now(at, head):
                    raise IntentRejected(
                        "invalid",
                        "`why` at a past moment needs the auditor (not served yet); omit `at`",
                        {"at": at},
                    )
                row = await models.why(domain, target)
                if row is None:
                    raise IntentRejected("not_found", f"nothing named {target!r}", {"id": target})
                return row
        raise IntentRejected("invalid", "unknown query")

    async def _writer(self, domain: str, *, create: bool) -> DomainWriter | None:
        """The domain's writer, loaded from the log on first use; None for an unknown domain
        unless `create` (only import-topology brings a domain into being)."""
        writer = self._writers.get(domain)
        if writer is not None:
            return writer
        async with self._loading:  # two first requests for a domain must not load it twice
            writer = self._writers.get(domain)
            if writer is None:
                sync = FabricSync(
                    domain,
                    lambda: self._writers[domain].state,
                    self._fabric,
                    self._settle,
                    deadline=self._saga_deadline,
                )
                writer = DomainWriter(
                    domain, self._store, self._clock, self._max_batch, self._committed(sync)
                )
                await writer.catch_up()
                if not (writer.state.exists or create):
                    return None  # keep no writer for names nobody created
                self._writers[domain] = writer
                self._syncs[domain] = sync
        return writer

    def _committed(self, sync: FabricSync) -> Callable[[], None]:
        """After a commit: wake the projections and the domain's fabric."""

        def committed() -> None:
            if self._on_commit is not None:
                self._on_commit()
            sync.kick()

        return committed


def _is_now(at: str | int, head: int) -> bool:
    """`at` names the present when it is the current position (or a later one)."""
    return isinstance(at, int) and at >= head


def _no_domain(domain: str) -> bytes:
    return replies.error(
        "not_found",
        f"domain {domain!r} does not exist; import a topology first",
        {"domain": domain},
    )


def _body_hash(family: str, verb: str, intent: msgspec.Struct) -> str:
    """Hash of the decoded body, so key order and whitespace do not make a resend 'different'."""
    return hashlib.sha256(f"{family}.{verb}\n".encode() + _encode(intent)).hexdigest()


def _resend(first_hash: str, first_reply: bytes, req: _Request) -> bytes:
    return replies.as_replayed(first_reply) if first_hash == req.body_hash else _conflict(req)


def _conflict(req: _Request) -> bytes:
    rid = req.intent.request_id  # type: ignore[attr-defined]
    return replies.error(
        "conflict",
        f"request_id {rid!r} was already used with a different body",
        {"request_id": rid},
    )


def _answer(req: _Request, reply: bytes) -> None:
    if not req.reply.done():
        req.reply.set_result(reply)


def _answer_all(batch: list[_Request], reply: bytes) -> None:
    for req in batch:
        _answer(req, reply)
