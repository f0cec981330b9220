"""Device choice for a compose request (ARCHITECTURE section 5), and why-not when it fails.

Pure: reads a DomainState, asks the path core for best paths, returns bindings or a Rejection
whose funnel counts what each constraint removed. Entries are served in order and each entry's
count one device at a time; every pick sees the reservations and circuits of the picks before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from engine.events import CircuitRef, DeviceBinding
from engine.intents import Compose, DeviceRequest
from engine.model import NodeSpec
from engine.policy import rank
from engine.state import DomainState, usable
from ext import Conditions, Fabric, LinkInfo, NodeInfo, Path, PathRequest, best_paths

FUNNEL_STAGES = (
    "kind and model",
    "health",
    "free",
    "isolation and labels",
    "hops",
    "latency",
    "bandwidth",
)


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    bindings: list[DeviceBinding]
    new_circuits: list[CircuitRef]

    @property
    def score(self) -> tuple[int, int]:
        return (sum(b.hops for b in self.bindings), sum(b.latency_ns for b in self.bindings))


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    code: str  # "no_capacity" | "no_path"
    message: str
    details: dict[str, Any]


# ---- the fabric as the path core sees it ----

_FABRICS: dict[tuple[int, int], tuple[object, object, Fabric]] = {}


def fabric_of(state: DomainState) -> Fabric:
    """The static graph of `state`'s topology, built once per topology version.

    State maps are replaced, never mutated, so the identity of the node and link maps names a
    topology version; the maps are kept alongside so their ids cannot be reused meanwhile.
    """
    key = (id(state.nodes), id(state.links))
    cached = _FABRICS.get(key)
    if cached is not None and cached[0] is state.nodes and cached[1] is state.links:
        return cached[2]
    nodes = {n: NodeInfo(s.spec.kind, s.spec.latency_ns) for n, s in state.nodes.items()}
    links = [
        LinkInfo(
            lk.spec.id,
            lk.spec.a,
            lk.spec.b,
            lk.spec.capacity_gbps,
            lk.spec.latency_ns,
            lk.spec.a_port,
            lk.spec.b_port,
        )
        for lk in state.links.values()
    ]
    fabric = Fabric(nodes, links)
    if len(_FABRICS) >= 8:
        _FABRICS.pop(next(iter(_FABRICS)))
    _FABRICS[key] = (state.nodes, state.links, fabric)
    return fabric


def conditions_of(state: DomainState) -> Conditions:
    unusable = {k for k, v in state.nodes.items() if not usable(v)}
    unusable |= {k for k, v in state.links.items() if not usable(v)}
    circuits = {
        port: (c.b_port if port == f"{c.ocs}:{c.a_port}" else c.a_port, c.host)
        for port, c in state.circuits.items()
    }
    return Conditions(
        unusable=unusable,
        reserved_gbps=dict(state.reserved_gbps),
        circuits=circuits,
        switch_tenants={k: dict(v) for k, v in state.switch_tenants.items()},
        exclusive_tenants={k: dict(v) for k, v in state.exclusive_tenants.items()},
    )


# ---- choosing devices ----


def place(state: DomainState, intent: Compose, tenant: str, host: str) -> Placement | Rejection:
    """Choose every device of `intent` for `host`, or say why not."""
    fabric = fabric_of(state)
    cond = conditions_of(state)
    exclusive = intent.constraints.isolation == "exclusive"
    memory_used = dict(state.memory_used)
    picked: set[str] = set()
    bindings: list[DeviceBinding] = []
    new_circuits: list[CircuitRef] = []
    for index, slot in enumerate(_slots(state, intent)):
        entry = slot.entry
        for nth in range(entry.count):
            candidates = [
                d
                for d in _matching(state, slot)
                if usable(state.nodes[d])
                and _free(state, d, slot, memory_used, picked)
                and _labels_match(state.nodes[d].spec, intent)
            ]
            request = PathRequest(
                host,
                tenant,
                exclusive,
                intent.constraints.max_hops,
                intent.constraints.max_latency_ns,
                entry.bandwidth_gbps,
            )
            paths = best_paths(fabric, cond, request, set(candidates))
            if not paths:
                return _why_not(
                    state, cond, intent, slot, index, nth, host, tenant, memory_used, picked
                )
            best = min(
                paths.values(),
                key=lambda p: (p.hops, p.latency_ns, rank(state.nodes[p.device].spec), p.device),
            )
            binding = _bind(state, best, entry)
            bindings.append(binding)
            picked.add(best.device)
            if binding.capacity_gib is not None:
                memory_used[best.device] = memory_used.get(best.device, 0.0) + binding.capacity_gib
            new_circuits += _hold(state, cond, best, entry, host, tenant, exclusive)
    return Placement(host=host, bindings=bindings, new_circuits=new_circuits)


class _Slot(msgspec.Struct, frozen=True):
    """One `devices` entry, or one of `device_ids` (a specific device, taken whole)."""

    entry: DeviceRequest
    device: str | None = None


def _slots(state: DomainState, intent: Compose) -> list[_Slot]:
    """`device_ids` are served after `devices`, each as a one-device entry of its own kind.
    decide() has checked that each names a device of this domain."""
    slots = [_Slot(entry) for entry in intent.devices]
    for device in intent.device_ids:
        kind = state.nodes[device].spec.device_kind or "gpu"
        slots.append(_Slot(DeviceRequest(kind=kind), device))
    return slots


def _matching(state: DomainState, slot: _Slot) -> Iterable[str]:
    if slot.device is not None:
        yield slot.device
        return
    entry = slot.entry
    for node_id, node in state.nodes.items():
        spec = node.spec
        if spec.kind != "device" or spec.device_kind != entry.kind:
            continue
        if entry.models and spec.model not in entry.models:
            continue
        if entry.min_generation is not None and (spec.generation or 0) < entry.min_generation:
            continue
        if entry.min_memory_gib is not None and (spec.memory_gib or 0) < entry.min_memory_gib:
            continue
        yield node_id


def _free(
    state: DomainState, device: str, slot: _Slot, memory_used: dict[str, float], picked: set[str]
) -> bool:
    if device in picked or device in state.device_owner:
        return False
    if slot.entry.kind != "memory":
        return True
    if slot.device is not None:  # a memory device asked for by id is taken whole
        return device not in memory_used
    capacity = state.nodes[device].spec.capacity_gib or 0.0
    return capacity - memory_used.get(device, 0.0) + 1e-9 >= (slot.entry.capacity_gib or 0.0)


def _labels_match(spec: NodeSpec, intent: Compose) -> bool:
    return all(spec.labels.get(k) == v for k, v in intent.constraints.labels.items())


def _bind(state: DomainState, path: Path, entry: DeviceRequest) -> DeviceBinding:
    return DeviceBinding(
        device=path.device,
        kind=entry.kind,
        path=list(path.nodes),
        links=list(path.links),
        circuits=[CircuitRef(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port) for c in path.circuits],
        hops=path.hops,
        latency_ns=path.latency_ns,
        bandwidth_gbps=entry.bandwidth_gbps,
        capacity_gib=entry.capacity_gib if entry.kind == "memory" else None,
    )


def _hold(
    state: DomainState,
    cond: Conditions,
    path: Path,
    entry: DeviceRequest,
    host: str,
    tenant: str,
    exclusive: bool,
) -> list[CircuitRef]:
    """Make the next pick see this one: bandwidth, circuits and switch tenancy."""
    reserved = cond.reserved_gbps
    for link in path.links:
        reserved[link] = reserved.get(link, 0.0) + entry.bandwidth_gbps  # type: ignore[index]
    created = []
    for c in path.circuits:
        if c.new:
            cond.circuits[f"{c.ocs}:{c.a_port}"] = (c.b_port, host)  # type: ignore[index]
            cond.circuits[f"{c.ocs}:{c.b_port}"] = (c.a_port, host)  # type: ignore[index]
            created.append(CircuitRef(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port))
    for node in path.nodes:
        if state.nodes[node].spec.kind == "switch":
            for table, applies in (
                (cond.switch_tenants, True),
                (cond.exclusive_tenants, exclusive),
            ):
                if applies:
                    counts = table.setdefault(node, {})  # type: ignore[attr-defined]
                    counts[tenant] = counts.get(tenant, 0) + 1
    return created


# ---- why not ----


def _why_not(
    state: DomainState,
    cond: Conditions,
    intent: Compose,
    slot: _Slot,
    index: int,
    nth: int,
    host: str,
    tenant: str,
    memory_used: dict[str, float],
    picked: set[str],
) -> Rejection:
    """Count what each constraint removed, in the contract's order, and name the nearest miss.

    Only runs on a rejection, so it may search the fabric a few more times.
    """
    fabric = fabric_of(state)
    entry = slot.entry
    c = intent.constraints
    exclusive = c.isolation == "exclusive"
    kind_model = list(_matching(state, slot))
    healthy = [d for d in kind_model if usable(state.nodes[d])]
    free = [d for d in healthy if _free(state, d, slot, memory_used, picked)]
    labelled = [d for d in free if _labels_match(state.nodes[d].spec, intent)]

    def search(**limits: Any) -> dict[str, Path]:
        request = PathRequest(host, tenant, exclusive, **limits)
        return best_paths(fabric, cond, request, set(labelled))

    anywhere = search(isolation=False)
    isolated = search()
    within_hops = search(max_hops=c.max_hops)
    within_latency = search(max_hops=c.max_hops, max_latency_ns=c.max_latency_ns)
    with_bandwidth = search(
        max_hops=c.max_hops, max_latency_ns=c.max_latency_ns, bandwidth_gbps=entry.bandwidth_gbps
    )
    counts = [
        len(kind_model),
        len(healthy),
        len(free),
        len([d for d in labelled if d in isolated or d not in anywhere]),
        len(within_hops),
        len(within_latency),
        len(with_bandwidth),
    ]
    funnel = []
    before = counts[0]
    for stage, remaining in zip(FUNNEL_STAGES, counts, strict=True):
        removed = 0 if stage == "kind and model" else before - remaining
        funnel.append({"stage": stage, "removed": removed, "remaining": remaining})
        before = remaining
    nearest = _nearest(isolated, within_hops, within_latency)
    what = slot.device or entry.kind + (f" {'/'.join(entry.models)}" if entry.models else "")
    parts = [f"{counts[0]} {what} exist", f"{counts[1]} healthy", f"{counts[2]} free"]
    if c.labels or exclusive:
        parts.append(f"{counts[3]} pass isolation and labels")
    parts.append(f"{counts[4]} reachable" + (f" within {c.max_hops} hops" if c.max_hops else ""))
    if c.max_latency_ns is not None:
        parts.append(f"{counts[5]} within {c.max_latency_ns} ns")
    if entry.bandwidth_gbps:
        parts.append(f"{counts[6]} with {entry.bandwidth_gbps:g} Gbps free")
    message = f"entry {index} needs {entry.count} {what}, found {nth}: " + ", ".join(parts)
    if nearest:
        message += f" (nearest: {nearest['text']})"
    code = "no_capacity" if counts[3] == 0 else "no_path"
    details = {
        "entry": index,
        "needed": entry.count,
        "found": nth,
        "host": host,
        "funnel": funnel,
        "nearest": nearest,
    }
    return Rejection(code=code, message=message, details=details)


def _nearest(
    reachable: dict[str, Path], within_hops: dict[str, Path], within_latency: dict[str, Path]
) -> dict[str, Any] | None:
    """The closest device lost at the first path stage that lost any."""
    for pool, kept, what in (
        (reachable, within_hops, "hops"),
        (within_hops, within_latency, "latency"),
        (within_latency, {}, "bandwidth"),
    ):
        missed = [p for d, p in pool.items() if d not in kept]
        if missed:
            p = min(missed, key=lambda p: (p.hops, p.latency_ns, p.device))
            text = {
                "hops": f"{p.device} at {p.hops} hops",
                "latency": f"{p.device} at {p.latency_ns} ns",
                "bandwidth": f"{p.device} at {p.hops} hops, short of bandwidth",
            }[what]
            return {"device": p.device, "hops": p.hops, "latency_ns": p.latency_ns, "text": text}
    return None
