"""Read-only answers computed from a domain's state (trellis.query.<domain>.<what>).

`topology`, `free`, `blast-radius`, `quotas`, `preview` and `reservations` are answered here
from the writer's state.
`composition`, `connections` and `why` carry history (who asked, when, which events), so they
are answered from the projections (engine.service.ports.ReadModels) by the service.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from trellis.engine.core import quotas, reservations
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import (
    BlastRadiusQuery,
    FreeQuery,
    PreviewQuery,
    QuotasQuery,
    ReservationsQuery,
    TopologyQuery,
)
from trellis.engine.core.results import (
    BlastRadiusResult,
    FreeDevice,
    FreeResult,
    HitComposition,
    QuotasResult,
    TopologyCircuit,
    TopologyLink,
    TopologyNode,
    TopologyResult,
)
from trellis.engine.core.state import (
    DomainState,
    LinkState,
    NodeState,
    resolve_ref,
    sliced_gib,
    taken,
    usable,
)

STATE_QUERIES = ("topology", "free", "blast-radius", "quotas", "preview", "reservations")


def answer(state: DomainState, query: msgspec.Struct, what: str) -> msgspec.Struct:
    """Answer `query` from `state`.

    Raises:
        IntentRejected: `not_found` for an unknown domain or component.
    """
    if not state.exists:
        raise IntentRejected("not_found", f"domain {state.domain!r} does not exist")
    match query:
        case TopologyQuery():
            return topology(state)
        case FreeQuery(kind=kind):
            return free(state, kind)
        case BlastRadiusQuery(id=component):
            return blast_radius(state, component)
        case QuotasQuery(tenant=tenant, kind=kind):
            return QuotasResult(quotas=quotas.quotas(state, tenant, kind))
        case PreviewQuery():
            return reservations.preview(state, query)
        case ReservationsQuery():
            return reservations.reservations(state, query)
    raise IntentRejected("invalid", f"query {what!r} is not answered from state")


def topology(state: DomainState) -> TopologyResult:
    """Nodes and links with health and free capacity; circuits with their owning host."""
    circuits = {(c.ocs, c.a_port, c.b_port): c for c in state.circuits.values()}
    return TopologyResult(
        nodes=[TopologyNode(**_describe(n)) for _, n in sorted(state.nodes.items())],
        links=[
            TopologyLink(**_describe(lk), free_gbps=_free_gbps(state, lk))
            for _, lk in sorted(state.links.items())
        ],
        circuits=[
            TopologyCircuit(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port, host=c.host)
            for _, c in sorted(circuits.items())
        ],
    )


def free(state: DomainState, kind: str | None) -> FreeResult:
    """Usable devices with capacity left: whole devices nobody holds or reserves, pools with GiB
    to spare (reserved slices count as used)."""
    devices = []
    for device_id, node in sorted(state.nodes.items()):
        spec = node.spec
        if spec.kind != "device" or (kind and spec.device_kind != kind) or not usable(node):
            continue
        if taken(state, device_id):  # held whole by a composition or a reservation
            continue
        left: float | UnsetType = UNSET
        if spec.device_kind == "memory":
            left = (spec.capacity_gib or 0.0) - sliced_gib(state, device_id)
            if left <= 1e-9:
                continue
        devices.append(FreeDevice(**msgspec.structs.asdict(spec), free_gib=left))
    return FreeResult(devices=devices)


def blast_radius(state: DomainState, ref: str) -> BlastRadiusResult:
    """What a failure of `ref` (a node, a link, or an OCS port: its cable) would hit, without
    changing anything."""
    component = resolve_ref(state, ref)
    if state.component(component) is None:
        raise IntentRejected("not_found", f"no node or link {component!r}", {"id": component})
    hit = [c for _, c in sorted(state.compositions.items()) if c.uses(component)]
    return BlastRadiusResult(
        link=UNSET if component == ref else component,
        compositions=[
            HitComposition(
                composition_id=c.id,
                tenant=c.tenant,
                host=c.host,
                state=c.state,
                devices=[b.device for b in c.bindings if component in b.path + b.links],
            )
            for c in hit
        ],
        tenants=sorted({c.tenant for c in hit}),
    )


def _free_gbps(state: DomainState, link: LinkState) -> float:
    if not usable(link):
        return 0.0
    return max(0.0, link.spec.capacity_gbps - state.reserved_gbps.get(link.spec.id, 0.0))


def _describe(component: NodeState | LinkState) -> dict[str, Any]:
    """The spec's fields and the component's marks, for TopologyNode or TopologyLink."""
    return {
        **msgspec.structs.asdict(component.spec),
        "health": component.health,
        "drained": component.drained,
        "detail": component.detail,
    }
