"""The engine: checks who may ask, then routes each request to its domain's writer or to the
query answers.

Transport-agnostic: the NATS adapter hands `Engine.handle` a subject's parts and a body and
sends back the bytes it returns. Which domains this engine writes, and their writers and
fabrics, are the custody's (engine/service/custody.py); queries are answered by
engine/service/answers.py; a compose is answered once its saga settled (settled.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from trellis.engine.core import replies, views
from trellis.engine.core.actors import OPERATOR, is_reserved
from trellis.engine.core.errors import IntentRejected, ServedElsewhere, StoreUnavailable
from trellis.engine.core.ids import is_valid_id
from trellis.engine.core.intents import (
    Apply,
    Compose,
    Family,
    ImportTopology,
    Intent,
    InvalidIntent,
    Query,
    RecordCheckpoint,
    decode_intent,
)
from trellis.engine.core.records import Head
from trellis.engine.core.results import ImportResult, UploadProgress
from trellis.engine.core.state import DomainState
from trellis.engine.core.throttle import Bucket, RateLimit, ViewBudget, kept, take
from trellis.engine.core.uploads import Uploads
from trellis.engine.service.answers import QueryAnswers
from trellis.engine.service.custody import Custody, HeldElsewhere, unknown_domain
from trellis.engine.service.follower import Followers
from trellis.engine.service.ports import (
    AuditTrail,
    Clock,
    EventStore,
    FabricDriver,
    LeaseStore,
    ReadModels,
    SnapshotStore,
    Telemetry,
)
from trellis.engine.service.saga import FabricSync
from trellis.engine.service.settled import once_settled
from trellis.engine.service.view_meter import ViewMeter

_encode = msgspec.json.Encoder().encode


class Engine:
    """Answers requests: the domains it writes are `custody`'s, their queries `answers`'."""

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
        domain_cap: int = 0,
        snapshots: SnapshotStore | None = None,
        snapshot_every: int = 0,
        audit: AuditTrail | None = None,
        telemetry: Telemetry | None = None,
        read_wait: float = 2.0,
        rate_limit: RateLimit | None = None,
        view_budget: ViewBudget | None = None,
    ):
        self._store = store
        self._clock = clock
        self._saga_deadline = saga_deadline
        self.custody = Custody(
            store,
            clock,
            fabric,
            saga_deadline=saga_deadline,
            domains=domains,
            max_batch=max_batch,
            followers=followers,
            leases=leases,
            identity=identity,
            name=name,
            lease_ttl=lease_ttl,
            domain_cap=domain_cap,
            snapshots=snapshots,
            snapshot_every=snapshot_every,
            telemetry=telemetry,
        )
        self.answers = QueryAnswers(
            self.custody,
            store,
            fabric,
            saga_deadline=saga_deadline,
            read_models=read_models,
            snapshots=snapshots,
            audit=audit,
            read_wait=read_wait,
        )
        # Each tenant's intents, through a token bucket (engine/core/throttle.py); None: no limit.
        self._rate = rate_limit if rate_limit is not None and rate_limit.per_second > 0 else None
        self._buckets: dict[str, Bucket] = {}
        # Each tenant's views, by the engine time they take; None: no limit.
        self._views = ViewMeter(view_budget)
        self._uploads = Uploads()  # imports sent in parts, until their last part

    # ---- the custody's, for the transports and the tests ----

    @property
    def identity(self) -> str:
        return self.custody.identity

    @property
    def domains(self) -> list[str]:
        """The domains this engine writes now."""
        return self.custody.domains

    def lease_problem(self) -> str | None:
        """Why this engine cannot keep writer leases now (health), else None."""
        return self.custody.lease_problem()

    async def start(self, *, lease_tick_seconds: float | None = 1.0) -> None:
        await self.custody.start(lease_tick_seconds=lease_tick_seconds)

    async def close(self) -> None:
        await self.custody.close()

    def route(self, domain: str) -> str | None:
        return self.custody.route(domain)

    def fence(self, domain: str) -> int | None:
        return self.custody.fence(domain)

    def state(self, domain: str) -> DomainState | None:
        return self.custody.state(domain)

    def head(self, domain: str) -> Head | None:
        return self.custody.head(domain)

    def fabric_sync(self, domain: str) -> FabricSync | None:
        return self.custody.fabric_sync(domain)

    async def expire_due_leases(self) -> list[bytes]:
        return await self.custody.expire_due_leases()

    # ---- requests ----

    async def handle(
        self,
        family: Family,
        domain: str,
        tenant: str | None,
        verb: str,
        body: bytes,
        *,
        forwarded: bool = False,
        admitted: bool = False,
    ) -> bytes:
        """Answer one request; never raises for bad input. `tenant` is the subject's tenant
        token: of an intent, or of a view (a query with a tenant is that tenant's view).
        `admitted`: the caller has taken the tenant's token already (`admit`, or
        `admit_view` for a view).

        Raises:
            ServedElsewhere: another engine turned out to write the domain (unless the request
                was `forwarded` here already: then it is answered `unavailable`).
        """
        refused = self._who_may_ask(family, domain, tenant, verb, admitted=admitted)
        if family != "query" or tenant is None:
            if refused is not None:
                return refused
            return await self._answer(family, domain, tenant, verb, body, forwarded=forwarded)
        if refused is not None and not admitted:
            return refused  # no place in flight was taken for it
        # A view holds one of its tenant's places in flight (taken by the transport, or by
        # _who_may_ask just now) until it ends, answered or refused.
        try:
            if refused is not None:
                return refused
            return await self._answer(family, domain, tenant, verb, body, forwarded=forwarded)
        finally:
            self._views.release(tenant)

    async def _answer(
        self,
        family: Family,
        domain: str,
        tenant: str | None,
        verb: str,
        body: bytes,
        *,
        forwarded: bool,
    ) -> bytes:
        try:
            message = decode_intent(family, verb, body)
        except InvalidIntent as exc:
            return replies.error("invalid", str(exc))
        try:
            if isinstance(message, Query):
                if tenant is not None:  # a view: the query as that tenant may ask it
                    view = views.scoped_query(message, tenant)
                    return await self._views.metered(
                        tenant, lambda: self.answers.answer(domain, verb, view, viewer=tenant)
                    )
                return await self.answers.answer(domain, verb, message, viewer=None)
            if isinstance(message, ImportTopology) and message.upload is not None:
                assembled = self._assemble(domain, message)
                if not isinstance(assembled, ImportTopology):
                    return assembled
                message = assembled
            return await self._write(domain, tenant, verb, family, message)
        except StoreUnavailable as exc:
            return replies.error("unavailable", f"event store unavailable: {exc}")
        except HeldElsewhere as exc:
            if forwarded or exc.holder is None:
                return exc.reply()
            raise ServedElsewhere(domain, exc.holder.engine) from None

    def _who_may_ask(
        self, family: Family, domain: str, tenant: str | None, verb: str, *, admitted: bool
    ) -> bytes | None:
        """Every check of who may ask what, before anything is decoded: None, or the refusal.
        (A tenant's intents are then decided within its own rights: engine/core/policy.py.)"""
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
        if not self.custody.serves(domain):
            return replies.error("not_found", f"this engine does not serve domain {domain!r}")
        if family == "query" and tenant is not None:
            if not views.serves(verb):
                return replies.error("invalid", f"query {verb!r} has no tenant view")
            return None if admitted else self.admit_view(tenant)
        if family == "intent" and tenant is not None and not admitted:
            return self.admit(tenant)
        return None

    def admit_view(self, tenant: str) -> bytes | None:
        """Whether one of `tenant`'s views may start (engine/service/view_meter.py): None, or
        the `throttled` answer. Cheap and synchronous, as `admit` is."""
        return self._views.refusal(tenant)

    def admit(self, tenant: str) -> bytes | None:
        """Take a token for one of `tenant`'s intents: None when it may go on, else the
        `throttled` answer (nothing is decided, queued or written for it). Cheap and
        synchronous, so a transport can answer a flood before anything else is spent on it."""
        limit = self._rate
        if limit is None:
            return None
        now = self._clock.now().timestamp()
        self._buckets = kept(self._buckets, now, limit.per_second, limit.burst)
        self._buckets[tenant], wait_ms = take(self._buckets.get(tenant), now, limit)
        if not wait_ms:
            return None
        return replies.error(
            "throttled",
            f"tenant {tenant!r} sent more intents than its rate allows ({limit.per_second:g} "
            f"a second, bursts of {limit.burst}); nothing was written: resend in {wait_ms} ms",
            {"retry_after_ms": wait_ms},
        )

    def _assemble(self, domain: str, part: ImportTopology) -> ImportTopology | bytes:
        """One part of an import sent in parts: the whole import with its last part, else the
        reply saying how far the upload is."""
        try:
            assembled = self._uploads.add(domain, OPERATOR, part, self._clock.now().timestamp())
        except IntentRejected as exc:
            return replies.rejection(exc)
        if isinstance(assembled, UploadProgress):
            head = self.head(domain)
            result = ImportResult(
                domain=domain, unchanged=False, nodes=0, links=0, upload=assembled
            )
            return replies.ok(_encode(result), head.position if head else 0)
        return assembled

    async def _write(
        self, domain: str, tenant: str | None, verb: str, family: Family, intent: Intent
    ) -> bytes:
        served = await self.custody.runtime(domain, create=isinstance(intent, ImportTopology))
        if served is None:
            return unknown_domain(domain)
        if isinstance(intent, RecordCheckpoint):
            return await self.answers.checkpoint(domain, served, intent.request_id)
        reply = await served.writer.request(tenant or OPERATOR, verb, intent, family)
        if isinstance(intent, Compose | Apply):  # an apply composes: answered once settled too
            return await once_settled(self._store, served, reply, 3 * self._saga_deadline)
        return reply
