"""The engine service: routes each request to its domain's writer and answers queries.

Transport-agnostic: the NATS adapter hands `Engine.handle` a subject's parts and a body and
sends back the bytes it returns. Writes go through the domain's DomainWriter (engine.writer);
after each commit the domain's FabricSync (engine.saga) drives its fabric. Queries are answered
from committed state or from the projections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import msgspec

from engine import replies, views
from engine.actors import ENGINE, OPERATOR, is_reserved
from engine.errors import IntentRejected, StoreUnavailable
from engine.follower import Followers
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
    lease_expiry_request_id,
    settle_request_id,
)
from engine.ports import Clock, EventStore, FabricDriver, ReadModels
from engine.queries import STATE_QUERIES, answer
from engine.saga import FabricSync, Settlement
from engine.state import DomainState
from engine.writer import DomainWriter

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode


class _ComposeOutcome(msgspec.Struct):
    composition_id: str
    state: str


_decode_outcome = msgspec.json.Decoder(_ComposeOutcome).decode


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
        followers: Followers | None = None,
    ):
        self._store = store
        self._clock = clock
        self._fabric = fabric
        self._saga_deadline = saga_deadline
        self._syncs: dict[str, FabricSync] = {}
        self._read_models = read_models
        self._followers = followers
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
                expire = ExpireLeases(request_id=lease_expiry_request_id(due))
                answers.append(await writer.request(ENGINE, "expire", expire, "internal"))
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
        return await writer.request(ENGINE, verb, settlement, "internal", correlation)

    async def handle(
        self, family: Family, domain: str, tenant: str | None, verb: str, body: bytes
    ) -> bytes:
        """Answer one request; never raises for bad input. `tenant` is the subject's tenant
        token: of an intent, or of a view (a query with a tenant is that tenant's view)."""
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
            writer = await self._writer(domain, create=isinstance(intent, ImportTopology))
            if writer is None:
                return _no_domain(domain)
            reply = await writer.request(tenant or OPERATOR, verb, intent, family)
            if isinstance(intent, Compose):
                return await self._once_settled(writer, reply)
            return reply
        except StoreUnavailable as exc:
            return replies.error("unavailable", f"event store unavailable: {exc}")

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

    async def _query(
        self, domain: str, verb: str, query: msgspec.Struct, *, viewer: str | None = None
    ) -> bytes:
        """Answer a query; with `viewer`, as that tenant's view (engine/views.py)."""
        if viewer is not None:
            if not views.serves(verb):
                return replies.error("invalid", f"query {verb!r} has no tenant view")
            query = views.scoped_query(query, viewer)
        writer = await self._writer(domain, create=False)
        if writer is None:
            return _no_domain(domain)
        head = writer.head.position
        try:
            if verb in STATE_QUERIES:
                result = answer(writer.state, query, verb)
            else:
                result = await self._read_model_query(domain, query, head, viewer)
            if viewer is not None:
                result = views.scope(verb, result, viewer, writer.state)
        except IntentRejected as exc:
            return replies.rejection(exc)
        return replies.ok(_encode(result), head)

    async def _read_model_query(
        self, domain: str, query: msgspec.Struct, head: int, viewer: str | None
    ) -> dict[str, object]:
        """History-bearing queries, answered from projections that include every committed
        event up to `head` (read-your-writes: a client that just composed sees it)."""
        models = self._read_models
        if models is None:
            raise IntentRejected("unavailable", "this engine runs without projections")
        if not await models.wait_for(domain, head):
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
                row = await models.composition(domain, cid)
                if row is None:
                    raise views.unknown_composition(cid)
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
                row = await models.why(domain, target, viewer=viewer)
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
                    domain, self._store, self._clock, self._max_batch, self._committed(domain, sync)
                )
                await writer.catch_up()
                if not (writer.state.exists or create):
                    return None  # keep no writer for names nobody created
                self._writers[domain] = writer
                self._syncs[domain] = sync
                if self._followers is not None:
                    self._followers.follow(domain)
        return writer

    def _committed(self, domain: str, sync: FabricSync) -> Callable[[], None]:
        """After a commit: wake the domain's followers and its fabric."""

        def committed() -> None:
            if self._followers is not None:
                self._followers.notify(domain)
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
