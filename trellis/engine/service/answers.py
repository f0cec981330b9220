"""Answering queries: from committed state, from the projections, from the audit trail, or
(`fabric`) from the fabric driver; live or at a past moment, and in pages when an answer is
larger than one message.

A live answer is as of the writer's head: a query with `min_position` first waits (a moment at
most) for the log to reach it, so a client reads its own writes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec

from trellis.engine.core import replies, views
from trellis.engine.core.actors import OPERATOR
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import (
    CompositionQuery,
    ConnectionsQuery,
    HistoryQuery,
    PagedQuery,
    Query,
    WhyQuery,
)
from trellis.engine.core.paging import paged
from trellis.engine.core.queries import STATE_QUERIES, answer
from trellis.engine.core.records import Head
from trellis.engine.core.results import ConnectionsResult, HistoryResult
from trellis.engine.core.state import DomainState
from trellis.engine.service import fabric_report, snapshots
from trellis.engine.service.custody import Custody, Served, unknown_domain
from trellis.engine.service.ports import (
    AuditTrail,
    EventStore,
    FabricDriver,
    PastModels,
    ReadModels,
    Reserved,
    SnapshotStore,
)
from trellis.engine.service.writer import DomainWriter

_encode = msgspec.json.Encoder().encode
# Answered by the AuditTrail (signed Merkle checkpoints), not from state or projections.
AUDIT_QUERIES = ("proof", "consistency", "checkpoint-key")
_REACH_POLL_S = 0.01  # how often a query waiting for its `min_position` looks at the head
_GIVEN_OUT_EVERY = 10  # polls between asking the log how far its positions have gone


class QueryAnswers:
    """Answers the queries of the domains `custody` holds."""

    def __init__(
        self,
        custody: Custody,
        store: EventStore,
        fabric: FabricDriver,
        *,
        saga_deadline: float = 10.0,
        read_models: ReadModels | None = None,
        snapshots: SnapshotStore | None = None,
        audit: AuditTrail | None = None,
        read_wait: float = 2.0,
    ):
        self._custody = custody
        self._store = store
        self._fabric = fabric
        self._saga_deadline = saga_deadline
        self._fabric_reads = fabric_report.Reads()
        self._read_models = read_models
        self._snapshots = snapshots
        self._audit = audit
        self._read_wait = read_wait
        self._pages = _Pages()  # answers being read in pages

    async def answer(self, domain: str, verb: str, query: Query, *, viewer: str | None) -> bytes:
        """Answer a query, live or at a past moment; with `viewer`, as that tenant's view
        (engine/core/views.py: the router has scoped the query to it)."""
        served = await self._custody.runtime(domain, create=False)
        if served is None:
            return unknown_domain(domain)
        writer = served.writer
        try:
            await self._reach(domain, writer, query.min_position)
            head = writer.head
            past = await self._past(domain, query, head)
            # The answer is as of this event (the writer's head, which includes `min_position`).
            upto = past or head
            state = writer.state

            async def whole() -> msgspec.Struct:
                nonlocal state
                result: msgspec.Struct
                if verb == "fabric":
                    result = await fabric_report.report(
                        domain,
                        self._fabric,
                        lambda: served.writer.state,
                        settling=lambda: not served.sync.idle,
                        deadline=min(self._saga_deadline, fabric_report.READ_DEADLINE_S),
                        reads=self._fabric_reads,
                    )
                elif verb in AUDIT_QUERIES:
                    result = await self._trail().answer(
                        domain, query, head=upto.version, viewer=viewer
                    )
                elif verb in STATE_QUERIES:
                    if past is not None:
                        state = await snapshots.state_at(self._store, self._snapshots, domain, past)
                    result = answer(state, query, verb)
                else:
                    # (Only `topology`'s view reads the state, and it is a state query; `why`
                    # of a device asks it which reservation holds the device then.)
                    reserved = None
                    if isinstance(query, WhyQuery) and _may_be_a_device(state, query.id):
                        if past is not None:
                            state = await snapshots.state_at(
                                self._store, self._snapshots, domain, past
                            )
                        reserved = reserved_whole(state, query.id)
                    result = await self._read_model_query(
                        domain, query, head.position, viewer, past, reserved
                    )
                if viewer is not None:  # (`fabric` has no view: refused above)
                    result = views.scope(verb, result, viewer, state)
                return result

            if isinstance(query, PagedQuery):  # larger than one message: in pages
                result = await self._pages.page((domain, verb, viewer, upto.position), query, whole)
            else:
                result = await whole()
        except IntentRejected as exc:
            return replies.rejection(exc)
        return replies.ok(_encode(result), upto.position)

    async def _reach(self, domain: str, writer: DomainWriter, min_position: int | None) -> None:
        """Wait, at most `read_wait` seconds, until the domain's log as the writer holds it
        includes `min_position` (read-your-writes; the read models then wait for the head).

        Positions are global: a position another domain's event was given (a scheduler's
        `observed_position` across domains) is one this domain's log includes once the log
        has given it out and no append of this writer is in flight. An append in flight may
        have drawn a lower position and not committed yet; every later append draws a higher
        one.

        Raises:
            IntentRejected: `unavailable` when the head has not reached it in time.
        """
        if min_position is None or writer.head.position >= min_position:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._read_wait
        given_out = 0  # the highest position the log had given out, when last asked
        polls = 0
        # The head moves only by this writer's commits: a short poll, no hook in the writer.
        while writer.head.position < min_position and loop.time() < deadline:
            if given_out < min_position and polls % _GIVEN_OUT_EVERY == 0:
                given_out = await self._store.last_position()
            if given_out >= min_position and not writer.appending:
                return
            polls += 1
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

    async def _past(self, domain: str, query: Query, head: Head) -> Head | None:
        """The event a query's `at` names, when that is before the head; None: answer live.

        Raises:
            IntentRejected: `not_found` when the domain had no event yet at that moment.
        """
        at = query.at
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

    async def checkpoint(self, domain: str, served: Served, request_id: str) -> bytes:
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
        query: Query,
        head: int,
        viewer: str | None,
        past: Head | None = None,
        reserved: Reserved | None = None,
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
                why = await source.why(domain, target, viewer=viewer, reserved=reserved)
                if why is None:
                    raise IntentRejected("not_found", f"nothing named {target!r}", {"id": target})
                return why
            case HistoryQuery(id=target, tenant=tenant, since=since, until=until):
                intervals = await source.history(
                    domain, id=target, tenant=tenant, since=since, until=until
                )
                return HistoryResult(intervals=intervals)
        raise IntentRejected("invalid", "unknown query")


def _may_be_a_device(state: DomainState, target: str) -> bool:
    """A device now, or nothing now (a device removed since a past moment): only then does a
    `why` need the state of its moment (a fold, at a past one)."""
    node = state.nodes.get(target)
    return node is None or node.spec.kind == "device"


def reserved_whole(state: DomainState, device: str) -> Reserved | None:
    """The live reservation holding `device` whole in `state`, if one does."""
    rid = state.reserved_by.get(device)
    if rid is None:
        return None
    held = state.reservations[rid]
    return Reserved(reservation_id=rid, tenant=held.tenant, expires_at=held.expires_at)


class _Pages:
    """The whole answers of paged queries being read page by page, a few, for a minute: the
    pages after the first are cut from the answer the first was cut from, not computed again
    (a 65,536-device topology is fifty pages)."""

    KEPT = 4
    TTL_S = 60.0

    def __init__(self) -> None:
        self._kept: dict[tuple[object, ...], tuple[float, msgspec.Struct]] = {}

    async def page(
        self,
        at: tuple[object, ...],
        query: PagedQuery,
        whole: Callable[[], Awaitable[msgspec.Struct]],
    ) -> msgspec.Struct:
        """The page of `query` (at `at`: domain, verb, viewer, position) of the answer
        `whole` computes, or of the one kept from an earlier page."""
        key = (*at, _encode(msgspec.structs.replace(query, offset=0, at=None, min_position=None)))
        now = time.monotonic()
        for stale in [k for k, (t, _) in self._kept.items() if now - t > self.TTL_S]:
            del self._kept[stale]
        kept = self._kept.get(key) if query.offset else None
        answer = kept[1] if kept is not None else await whole()
        page = paged(answer, query.offset)
        if getattr(page, "next", msgspec.UNSET) is not msgspec.UNSET:
            self._kept[key] = (now, answer)
            while len(self._kept) > self.KEPT:
                del self._kept[min(self._kept, key=lambda k: self._kept[k][0])]
        return page
