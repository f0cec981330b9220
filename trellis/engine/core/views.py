"""Tenant views: `<prefix>.view.<domain>.<tenant>.<what>`, a query scoped to one tenant
(ARCHITECTURE §3).

A view answers what `<prefix>.query.<domain>.<what>` answers, with only the asking tenant's
compositions, connections and history:

- another tenant's composition is `not_found`, word for word as an unknown one, so a view
  never reveals that it exists;
- what others hold shows only as "in use by others": never their composition ids, request
  ids, reasons, labels or tenant names;
- the shared fabric (nodes, links, health, free capacity) stays visible, since a tenant needs
  it to ask for a placement; circuits show only where the tenant's own paths pass.

A query is served as a view only when `SCOPES` says how to scope it, so a new query is never
shown to tenants unscoped: `history` is one function and one entry in `SCOPES`.
Pure functions over the query's result; the service applies them (engine/service/router.py), and the
`why` read model scopes its own rows and sentence with `split_rows` (it alone knows which
events of a chain are whose).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import (
    ConnectionsQuery,
    HistoryQuery,
    PreviewQuery,
    Query,
    QuotasQuery,
    ReservationsQuery,
)
from trellis.engine.core.results import (
    BlastRadiusResult,
    CompositionResult,
    ConnectionsResult,
    HistoryResult,
    QuotasResult,
    ReservationsResult,
    TopologyResult,
    WhyResult,
)
from trellis.engine.core.state import DomainState

# Each scope takes its query's result (engine/core/results.py) and gives one of the same type.
Scope = Callable[[Any, str, DomainState], msgspec.Struct]


class Held(Protocol):
    """A row that names the tenant it belongs to."""

    @property
    def tenant(self) -> str: ...


Row = TypeVar("Row", bound=Held)
Q = TypeVar("Q", bound=Query)

IN_USE_BY_OTHERS = "in use by others"


def unknown_composition(composition_id: str) -> IntentRejected:
    """The one answer for a composition that does not exist and for another tenant's."""
    return IntentRejected("not_found", f"no composition {composition_id!r}", {"id": composition_id})


def scoped_query(query: Q, tenant: str) -> Q:
    """The query a view runs: `connections`, `quotas`, `history` and `reservations` filtered by
    the tenant (unless the body names a tenant already: then the scope keeps only the rows that
    are both, i.e. none of another's); `preview` chosen as the tenant, whatever the body says."""
    if isinstance(query, PreviewQuery):
        return msgspec.structs.replace(query, tenant=tenant)  # a tenant previews as itself
    if (
        isinstance(query, ConnectionsQuery | QuotasQuery | HistoryQuery | ReservationsQuery)
        and query.tenant is None
    ):
        return msgspec.structs.replace(query, tenant=tenant)
    return query


def serves(verb: str) -> bool:
    """True when `verb` can be answered as a view."""
    return verb in SCOPES


def scope(verb: str, result: msgspec.Struct, tenant: str, state: DomainState) -> msgspec.Struct:
    """`result` of the query `verb` as `tenant` may see it.

    Raises:
        IntentRejected: `not_found` for another tenant's composition; `invalid` for a query
            that has no view.
    """
    scoper = SCOPES.get(verb)
    if scoper is None:
        raise IntentRejected("invalid", f"query {verb!r} has no tenant view", {"query": verb})
    return scoper(result, tenant, state)


def split_rows(rows: Sequence[Row], tenant: str | None) -> tuple[list[Row], bool]:
    """Rows (connections, say) split for `tenant`: its own rows, and whether any other
    tenant's row was left out. `tenant` None sees every row."""
    if tenant is None:
        return list(rows), False
    own = [r for r in rows if r.tenant == tenant]
    return own, len(own) < len(rows)


def may_see(composition_tenant: str, tenant: str | None) -> bool:
    """True when `tenant` (None: an operator's query) may see a composition of
    `composition_tenant`."""
    return tenant is None or composition_tenant == tenant


# ---- one scope per query ----

_replace = msgspec.structs.replace


def composition(result: CompositionResult, tenant: str, state: DomainState) -> CompositionResult:
    if not may_see(result.tenant, tenant):
        raise unknown_composition(result.composition_id)
    return result


def connections(result: ConnectionsResult, tenant: str, state: DomainState) -> ConnectionsResult:
    own, _ = split_rows(result.connections, tenant)
    return _replace(result, connections=own)


def why(result: WhyResult, tenant: str, state: DomainState) -> WhyResult:
    """The read model answers `why` for the tenant itself (ReadModels.why `viewer`: only it
    knows which events of a chain are whose); a row of another tenant here means it did not,
    and the answer is refused rather than shown."""
    _, others = split_rows(result.connected_to, tenant)
    if others:
        raise IntentRejected("unavailable", "the read models did not scope `why` to the tenant")
    return result


def free(result: msgspec.Struct, tenant: str, state: DomainState) -> msgspec.Struct:
    return result  # free capacity is the shared fabric's, and names no holder


def topology(result: TopologyResult, tenant: str, state: DomainState) -> TopologyResult:
    """The fabric as is, with only the circuits the tenant's own live paths pass."""
    own = {
        (ref.ocs, ref.a_port, ref.b_port)
        for c in state.compositions.values()
        if c.tenant == tenant
        for binding in c.bindings
        for ref in binding.circuits
    }
    circuits = [c for c in result.circuits if (c.ocs, c.a_port, c.b_port) in own]
    return _replace(result, circuits=circuits)


def blast_radius(result: BlastRadiusResult, tenant: str, state: DomainState) -> BlastRadiusResult:
    hit, _ = split_rows(result.compositions, tenant)
    return _replace(result, compositions=hit, tenants=[tenant] if hit else [])


def history(result: HistoryResult, tenant: str, state: DomainState) -> HistoryResult:
    """Only the tenant's own intervals: who else held a device, and when, is theirs."""
    return _replace(result, intervals=split_rows(result.intervals, tenant)[0])


def quotas(result: QuotasResult, tenant: str, state: DomainState) -> QuotasResult:
    """The tenant's own quotas and holdings: what it may still compose. Others' never show."""
    return _replace(result, quotas=split_rows(result.quotas, tenant)[0])


def preview(result: msgspec.Struct, tenant: str, state: DomainState) -> msgspec.Struct:
    """Chosen as the tenant (scoped_query): devices and paths of the shared fabric only."""
    return result


def reservations(result: ReservationsResult, tenant: str, state: DomainState) -> ReservationsResult:
    """Only the tenant's own reservations: what others hold shows only as not free."""
    return _replace(result, reservations=split_rows(result.reservations, tenant)[0])


def audited(result: msgspec.Struct, tenant: str, state: DomainState) -> msgspec.Struct:
    """Proofs, checkpoints and the verifier key name no tenant (a proof is hashes only); the
    audit trail itself refuses a view's proof of another tenant's event (AuditTrail.answer
    `viewer`), with the answer an unknown event gets."""
    return result


SCOPES: dict[str, Scope] = {
    "composition": composition,
    "connections": connections,
    "why": why,
    "free": free,
    "topology": topology,
    "blast-radius": blast_radius,
    "quotas": quotas,
    "proof": audited,
    "consistency": audited,
    "checkpoint-key": audited,
    "history": history,
    "preview": preview,
    "reservations": reservations,
}
