"""The state of one fabric domain and `evolve`, the pure fold that builds it from events.

State is immutable: `evolve` returns a new DomainState and copies only the maps an event
touches, so a batch can be decided on a scratch state and thrown away if its commit fails.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

import msgspec

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CircuitCreated,
    CircuitRemoved,
    ComponentDrained,
    ComponentFaulted,
    ComponentRecovered,
    ComponentRemoved,
    ComponentUndrained,
    CompositionActivated,
    CompositionFailed,
    CompositionImpaired,
    CompositionReleased,
    CompositionRequested,
    DeviceBinding,
    DeviceReplaced,
    DevicesReserved,
    Event,
    LeaseExtended,
    LinkAdded,
    NodeAdded,
    PathRerouted,
    QuotaCleared,
    QuotaSet,
    ReservationApplied,
    ReservationCancelled,
    ReservationExpired,
    ReservationMade,
    TopologyImported,
)
from trellis.engine.core.ids import split_ref
from trellis.engine.core.intents import Compose
from trellis.engine.core.model import Health, LinkSpec, NodeSpec

CompositionState = Literal["pending", "active", "impaired", "released", "failed"]


class NodeState(msgspec.Struct, frozen=True, kw_only=True):
    spec: NodeSpec
    health: Health = "healthy"
    drained: bool = False
    detail: str = ""


class LinkState(msgspec.Struct, frozen=True, kw_only=True):
    spec: LinkSpec
    health: Health = "healthy"
    drained: bool = False
    detail: str = ""


Component = NodeState | LinkState


class Composition(msgspec.Struct, frozen=True, kw_only=True):
    """A live composition: a host plus devices over reserved paths."""

    id: str
    tenant: str
    host: str
    state: CompositionState
    request: Compose
    requested_at: datetime
    expires_at: datetime | None = None
    bindings: list[DeviceBinding] = []
    impaired_by: list[str] = []

    @property
    def exclusive(self) -> bool:
        return self.request.constraints.isolation == "exclusive"

    def uses(self, component: str) -> bool:
        """True when any of its paths passes `component` (a node, link or OCS)."""
        return any(component in b.path or component in b.links for b in self.bindings)


ReservationEnd = Literal["applied", "cancelled", "expired"]


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """A live reservation: devices (and memory slices) held for a tenant until `expires_at`."""

    id: str
    tenant: str
    host: str
    request: Compose
    devices: list[DeviceBinding]
    made_at: datetime
    expires_at: datetime


class EndedReservation(msgspec.Struct, frozen=True, kw_only=True):
    """What is kept of a reservation that ended: whose it was and how it ended, so an `apply`
    of it is answered `conflict` naming why, not `not_found`."""

    tenant: str
    end: ReservationEnd
    expires_at: datetime
    composition_id: str | None = None  # applied: the composition it became


class Circuit(msgspec.Struct, frozen=True, kw_only=True):
    ocs: str
    a_port: int
    b_port: int
    host: str


class Quota(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's limits for one device kind; None: no limit on that measure."""

    count: int | None = None  # devices held at once (memory: slices)
    capacity_gib: float | None = None  # memory only: GiB held at once


class Held(msgspec.Struct, frozen=True, kw_only=True):
    """What a tenant's live compositions (pending, active, impaired) hold of one device kind."""

    count: int = 0
    capacity_gib: float = 0.0  # memory: the slices' GiB, a pool asked for by id whole


class Staged(msgspec.Struct, frozen=True, kw_only=True):
    """The nodes and links of an import's first parts, until its last part applies them all."""

    nodes: list[NodeSpec]
    links: list[LinkSpec]


class DomainState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `decide` needs about one domain. Maps are never mutated after construction.

    Besides the topology and the live compositions it keeps the indexes placement reads on
    every request (owners, reserved bandwidth, circuits by port, switch tenants, what each
    tenant holds), updated by `evolve` so a decision never scans all compositions.
    """

    domain: str
    created: bool = False  # set by the first TopologyImported; an emptied fabric still exists
    nodes: dict[str, NodeState] = {}
    links: dict[str, LinkState] = {}
    compositions: dict[str, Composition] = {}
    circuits: dict[str, Circuit] = {}  # "<ocs>:<port>" -> circuit, once for each of its ports
    device_owner: dict[str, str] = {}  # whole device -> composition id
    memory_used: dict[str, float] = {}  # memory device -> GiB sliced out
    reserved_gbps: dict[str, float] = {}  # link -> bandwidth reserved by live paths
    switch_tenants: dict[str, dict[str, int]] = {}  # switch -> tenant -> live paths through it
    exclusive_tenants: dict[str, dict[str, int]] = {}  # switch -> tenant -> exclusive paths
    quotas: dict[str, dict[str, Quota]] = {}  # tenant -> device kind -> its limits
    held: dict[str, dict[str, Held]] = {}  # tenant -> device kind -> what its live ones hold
    # The impaired compositions: what a release or new capacity gives another try, found
    # without scanning every composition on each release.
    impaired: frozenset[str] = frozenset()
    # Reservations (engine/core/reservations.py): the live ones, what they hold (apart from
    # what compositions hold, though placement treats both as taken) and how ended ones ended.
    reservations: dict[str, Reservation] = {}
    reserved_by: dict[str, str] = {}  # whole device -> reservation id
    reserved_gib: dict[str, float] = {}  # memory device -> GiB its reservations' slices hold
    ended_reservations: dict[str, EndedReservation] = {}
    # The parts of an import recorded in parts (TopologyImported.part < parts) before its last.
    staged: Staged | None = None

    @property
    def exists(self) -> bool:
        """A domain exists from its first topology import on."""
        return self.created

    def component(self, component_id: str) -> Component | None:
        return self.nodes.get(component_id) or self.links.get(component_id)


def taken(state: DomainState, device: str) -> bool:
    """Held whole, by a composition or a reservation."""
    return device in state.device_owner or device in state.reserved_by


def sliced_gib(state: DomainState, device: str) -> float:
    """GiB of a memory device sliced out, by compositions and reservations."""
    return state.memory_used.get(device, 0.0) + state.reserved_gib.get(device, 0.0)


def resolve_ref(state: DomainState, ref: str) -> str:
    """The node or link a ComponentRef names: a plain id as it is (callers check that it exists);
    `<ocs>:<port>` the link cabled to that port. One cable per OCS port, so the port and its
    cable are one light path: a fault on either is a fault of both.

    Raises:
        IntentRejected: `not_found` when the OCS does not exist, is no OCS, has no such port, or
            nothing is cabled to the port.
    """
    ocs, port = split_ref(ref)
    if port is None:
        return ref
    details = {"id": ref, "ocs": ocs, "port": port}
    node = state.nodes.get(ocs)
    if node is None or node.spec.kind != "ocs":
        what = "no node" if node is None else f"a {node.spec.kind}, not an ocs"
        raise IntentRejected("not_found", f"{ocs!r} is {what}, so {ref!r} names no port", details)
    ports = node.spec.ports or 0
    if port >= ports:
        raise IntentRejected(
            "not_found",
            f"{ocs} has {ports} ports (0-{ports - 1}); there is no port {port}",
            details,
        )
    # A scan, not an index: faults and blast-radius queries are rare next to compositions, and
    # an index would be one more map every topology event has to keep right.
    for link_id, link in state.links.items():
        spec = link.spec
        if (spec.a, spec.a_port) == (ocs, port) or (spec.b, spec.b_port) == (ocs, port):
            return link_id
    raise IntentRejected("not_found", f"port {port} of {ocs} has no cable", details)


def usable(component: Component) -> bool:
    """Section 5: only healthy, undrained components carry paths."""
    return component.health == "healthy" and not component.drained


def evolve(state: DomainState, event: Event) -> DomainState:
    """Apply one event. Unknown-to-this-fold events (compositions, later) leave state as is."""
    replace = msgspec.structs.replace
    match event:
        case TopologyImported(nodes=nodes, links=links, part=part, parts=parts):
            if parts > 1:
                earlier = state.staged if part > 1 else None
                nodes = [*(earlier.nodes if earlier else []), *nodes]
                links = [*(earlier.links if earlier else []), *links]
                if part < parts:
                    return replace(state, staged=Staged(nodes=nodes, links=links))
            # Components that stay keep their health and drain marks; the specs are replaced.
            return replace(
                state,
                created=True,
                nodes={n.id: _respec(state.nodes.get(n.id), n, NodeState) for n in nodes},
                links={lk.id: _respec(state.links.get(lk.id), lk, LinkState) for lk in links},
                staged=None,
            )
        case NodeAdded(node=node):
            return replace(state, nodes={**state.nodes, node.id: NodeState(spec=node)})
        case LinkAdded(link=link):
            return replace(state, links={**state.links, link.id: LinkState(spec=link)})
        case ComponentRemoved(component=cid, kind="node", links=attached):
            gone = set(attached)
            return replace(
                state,
                nodes={k: v for k, v in state.nodes.items() if k != cid},
                links={k: v for k, v in state.links.items() if k not in gone},
            )
        case ComponentRemoved(component=cid, kind="link"):
            return replace(state, links={k: v for k, v in state.links.items() if k != cid})
        case ComponentDrained(component=cid):
            return _mark(state, cid, drained=True)
        case ComponentUndrained(component=cid):
            return _mark(state, cid, drained=False)
        case ComponentFaulted(component=cid, state=health, detail=detail):
            return _mark(state, cid, health=health, detail=detail)
        case ComponentRecovered(component=cid, detail=detail):
            return _mark(state, cid, health="healthy", detail=detail)
        case QuotaSet(tenant=tenant, kind=kind, count=count, capacity_gib=gib):
            limits = {**state.quotas.get(tenant, {}), kind: Quota(count=count, capacity_gib=gib)}
            return replace(state, quotas={**state.quotas, tenant: limits})
        case QuotaCleared(tenant=tenant, kind=kind):
            limits = {k: q for k, q in state.quotas.get(tenant, {}).items() if k != kind}
            quotas = dict(state.quotas)
            if limits:
                quotas[tenant] = limits
            else:
                quotas.pop(tenant, None)
            return replace(state, quotas=quotas)
        case CompositionRequested():
            composition = Composition(
                id=event.composition_id,
                tenant=event.tenant,
                host=event.host,
                state="pending",
                request=event.request,
                requested_at=event.requested_at,
                expires_at=event.expires_at,
            )
            return replace(state, compositions={**state.compositions, composition.id: composition})
        case CircuitCreated(ocs=ocs, a_port=a, b_port=b, host=host):
            circuit = Circuit(ocs=ocs, a_port=a, b_port=b, host=host)
            return replace(
                state, circuits={**state.circuits, f"{ocs}:{a}": circuit, f"{ocs}:{b}": circuit}
            )
        case CircuitRemoved(ocs=ocs, a_port=a, b_port=b):
            gone = {f"{ocs}:{a}", f"{ocs}:{b}"}
            return replace(
                state, circuits={k: v for k, v in state.circuits.items() if k not in gone}
            )
        case DevicesReserved(composition_id=cid, devices=bindings):
            composition = state.compositions[cid]
            state = _reserve(state, composition, bindings, sign=1)
            updated = replace(composition, bindings=[*composition.bindings, *bindings])
            return replace(state, compositions={**state.compositions, cid: updated})
        case CompositionActivated(composition_id=cid):
            # Also the end of a repair: whatever impaired it no longer lies on its paths.
            state = _set_composition(state, cid, state="active", impaired_by=[])
            return _mended(state, cid)
        case PathRerouted(composition_id=cid, device=device, binding=new):
            return _swap_binding(state, cid, device, new)
        case DeviceReplaced(composition_id=cid, old_device=device, binding=new):
            return _swap_binding(state, cid, device, new)
        case CompositionImpaired(composition_id=cid, component=component):
            before = state.compositions[cid].impaired_by
            impaired_by = before if component in before else [*before, component]
            state = replace(state, impaired=state.impaired | {cid})
            return _set_composition(state, cid, state="impaired", impaired_by=impaired_by)
        case LeaseExtended(composition_id=cid, expires_at=expires_at):
            return _set_composition(state, cid, expires_at=expires_at)
        case CompositionReleased(composition_id=cid) | CompositionFailed(composition_id=cid):
            composition = state.compositions[cid]
            state = _reserve(state, composition, composition.bindings, sign=-1)
            state = replace(
                state, compositions={k: v for k, v in state.compositions.items() if k != cid}
            )
            return _mended(state, cid)
        case ReservationMade():
            reservation = Reservation(
                id=event.reservation_id,
                tenant=event.tenant,
                host=event.host,
                request=event.request,
                devices=event.devices,
                made_at=event.made_at,
                expires_at=event.expires_at,
            )
            state = _hold_reservation(state, reservation, sign=1)
            return replace(state, reservations={**state.reservations, reservation.id: reservation})
        case ReservationApplied(reservation_id=rid, composition_id=cid):
            return _end_reservation(state, rid, "applied", cid)
        case ReservationCancelled(reservation_id=rid):
            return _end_reservation(state, rid, "cancelled")
        case ReservationExpired(reservation_id=rid):
            return _end_reservation(state, rid, "expired")
        case _:
            return state


#: How long past its expiry an ended reservation is remembered (for apply's `conflict`).
ENDED_RESERVATIONS_KEPT = timedelta(days=1)


def _end_reservation(
    state: DomainState, rid: str, end: ReservationEnd, cid: str | None = None
) -> DomainState:
    """The reservation ends: what it held goes back, and how it ended is kept, for a day past
    its expiry (measured from when this one was made, a moment the log has reached): the
    state stays bounded by a day's reservations, and older ones are simply unknown."""
    reservation = state.reservations[rid]
    state = _hold_reservation(state, reservation, sign=-1)
    ended = EndedReservation(
        tenant=reservation.tenant, end=end, expires_at=reservation.expires_at, composition_id=cid
    )
    horizon = reservation.made_at - ENDED_RESERVATIONS_KEPT
    kept = {k: v for k, v in state.ended_reservations.items() if v.expires_at >= horizon}
    return msgspec.structs.replace(
        state,
        reservations={k: v for k, v in state.reservations.items() if k != rid},
        ended_reservations={**kept, rid: ended},
    )


def _hold_reservation(state: DomainState, reservation: Reservation, sign: int) -> DomainState:
    """Add (sign=1) or return (sign=-1) the devices and slices a reservation holds, and count
    them in its tenant's holdings (a reservation counts against quota as a composition does)."""
    reserved_by = dict(state.reserved_by)
    reserved_gib = dict(state.reserved_gib)
    held = dict(state.held.get(reservation.tenant, {}))
    for binding in reservation.devices:
        _hold(held, binding.kind, sign, sign * held_gib(state, binding))
        if binding.capacity_gib is not None:
            _count(reserved_gib, binding.device, sign * binding.capacity_gib)
        elif sign > 0:
            reserved_by[binding.device] = reservation.id
        else:
            reserved_by.pop(binding.device, None)
    by_tenant = dict(state.held)
    if held:
        by_tenant[reservation.tenant] = held
    else:
        by_tenant.pop(reservation.tenant, None)
    return msgspec.structs.replace(
        state, reserved_by=reserved_by, reserved_gib=reserved_gib, held=by_tenant
    )


def _mended(state: DomainState, cid: str) -> DomainState:
    """`cid` is no longer impaired (repaired, or gone)."""
    if cid not in state.impaired:
        return state
    return msgspec.structs.replace(state, impaired=state.impaired - {cid})


def _set_composition(domain: DomainState, cid: str, **changes: object) -> DomainState:
    updated = msgspec.structs.replace(domain.compositions[cid], **changes)
    return msgspec.structs.replace(domain, compositions={**domain.compositions, cid: updated})


def _swap_binding(state: DomainState, cid: str, device: str, new: DeviceBinding) -> DomainState:
    """Return what the old binding of `device` held and hold what `new` needs."""
    composition = state.compositions[cid]
    old = [b for b in composition.bindings if b.device == device]
    state = _reserve(state, composition, old, sign=-1)
    state = _reserve(state, composition, [new], sign=1)
    bindings = [new if b.device == device else b for b in composition.bindings]
    # What the move left behind impairs it no more: a repair that mends one path of several
    # keeps naming only what still lies on its paths (until CompositionActivated clears all).
    moved = msgspec.structs.replace(composition, bindings=bindings)
    impaired_by = [c for c in composition.impaired_by if moved.uses(c)]
    return _set_composition(state, cid, bindings=bindings, impaired_by=impaired_by)


def without_binding(state: DomainState, cid: str, device: str) -> DomainState:
    """`state` as if the composition let go of `device` (to search for its replacement)."""
    composition = state.compositions[cid]
    old = [b for b in composition.bindings if b.device == device]
    return _reserve(state, composition, old, sign=-1)


def held_gib(state: DomainState, binding: DeviceBinding) -> float:
    """The GiB of memory a binding holds: its slice, or the whole pool when it was asked for by
    id (its spec cannot change while a live composition uses it)."""
    if binding.kind != "memory":
        return 0.0
    if binding.capacity_gib is not None:
        return binding.capacity_gib
    node = state.nodes.get(binding.device)
    return (node.spec.capacity_gib or 0.0) if node is not None else 0.0


def _reserve(
    state: DomainState, composition: Composition, bindings: list[DeviceBinding], sign: int
) -> DomainState:
    """Add (sign=1) or return (sign=-1) what `bindings` hold: devices, slices, bandwidth, the
    composition's tenancy of every PCIe switch on its paths and its tenant's holdings."""
    owner = dict(state.device_owner)
    memory = dict(state.memory_used)
    reserved = dict(state.reserved_gbps)
    tenants = dict(state.switch_tenants)
    exclusive = dict(state.exclusive_tenants)
    held = dict(state.held.get(composition.tenant, {}))
    for binding in bindings:
        _hold(held, binding.kind, sign, sign * held_gib(state, binding))
        if binding.capacity_gib is not None:
            _count(memory, binding.device, sign * binding.capacity_gib)
        elif sign > 0:
            owner[binding.device] = composition.id
        else:
            owner.pop(binding.device, None)
        for link in binding.links:
            _count(reserved, link, sign * binding.bandwidth_gbps)
        for node in binding.path:
            if node in state.nodes and state.nodes[node].spec.kind == "switch":
                _count_tenant(tenants, node, composition.tenant, sign)
                if composition.exclusive:
                    _count_tenant(exclusive, node, composition.tenant, sign)
    by_tenant = dict(state.held)
    if held:
        by_tenant[composition.tenant] = held
    else:
        by_tenant.pop(composition.tenant, None)
    return msgspec.structs.replace(
        state,
        device_owner=owner,
        memory_used=memory,
        reserved_gbps=reserved,
        switch_tenants=tenants,
        exclusive_tenants=exclusive,
        held=by_tenant,
    )


def _hold(held: dict[str, Held], kind: str, count: int, gib: float) -> None:
    """Add to what a tenant holds of `kind`; the entry goes when it holds none (the count is
    the authority, so rounding in the GiB sum never leaves a trace)."""
    before = held.get(kind, Held())
    total = before.count + count
    if total <= 0:
        held.pop(kind, None)
    else:
        held[kind] = Held(count=total, capacity_gib=max(0.0, before.capacity_gib + gib))


def _count(totals: dict[str, float], key: str, delta: float) -> None:
    """Add `delta`; drop the key at zero so released resources leave no trace."""
    total = totals.get(key, 0.0) + delta
    if total > 1e-9:
        totals[key] = total
    else:
        totals.pop(key, None)


def _count_tenant(table: dict[str, dict[str, int]], switch: str, tenant: str, delta: int) -> None:
    counts = dict(table.get(switch, {}))
    counts[tenant] = counts.get(tenant, 0) + delta
    if counts[tenant] <= 0:
        del counts[tenant]
    if counts:
        table[switch] = counts
    else:
        table.pop(switch, None)


def _respec(old, spec, cls):  # type: ignore[no-untyped-def]
    return cls(spec=spec) if old is None else msgspec.structs.replace(old, spec=spec)


def _mark(state: DomainState, cid: str, **changes: object) -> DomainState:
    replace = msgspec.structs.replace
    if cid in state.nodes:
        nodes = {**state.nodes, cid: replace(state.nodes[cid], **changes)}
        return replace(state, nodes=nodes)
    if cid in state.links:
        links = {**state.links, cid: replace(state.links[cid], **changes)}
        return replace(state, links=links)
    return state
