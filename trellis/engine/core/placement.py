"""Device choice for a compose request (ARCHITECTURE section 5), and why-not when it fails.

Pure: reads a DomainState, asks the path core for best paths, returns bindings or a Rejection
whose funnel counts what each constraint removed. Entries are served in order and each entry's
count one device at a time; every pick sees the reservations and circuits of the picks before.

The path core holds each device's attributes and whether it is taken or sliced, so a pick
names its candidates by a Selector and the core tests each device its search reaches: the
cost follows the search, not the number of devices in the hall.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import msgspec

from trellis.engine.core.events import CircuitRef, DeviceBinding
from trellis.engine.core.intents import Compose, DeviceRequest
from trellis.engine.core.model import NodeSpec
from trellis.engine.core.policy import rank
from trellis.engine.core.state import Component, DomainState, sliced_gib, taken, usable
from trellis.ext import (
    Conditions,
    DeviceInfo,
    Fabric,
    LinkInfo,
    LiveConditions,
    NodeInfo,
    Path,
    PathRequest,
    Selector,
    best_costs,
    best_devices,
    census,
    reachable,
)

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
    code: str  # "no_capacity" | "no_path" | "quota" (engine.core.quotas)
    message: str
    details: dict[str, Any]


Costs = dict[str, tuple[int, int]]  # device -> (hops, latency_ns) of its best path


# ---- the fabric as the path core sees it ----


def fabric_of(state: DomainState) -> Fabric:
    """The static graph of `state`'s topology, with what a Selector tests of each device."""
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
    devices = {n: device_info(s.spec) for n, s in state.nodes.items() if s.spec.kind == "device"}
    return Fabric(nodes, links, devices)


def device_info(spec: NodeSpec) -> DeviceInfo:
    """A device's spec as a Selector tests it: absent numbers count as 0, no kind matches none."""
    return DeviceInfo(
        spec.device_kind or "",
        spec.model or "",
        spec.generation or 0,
        spec.memory_gib or 0.0,
        spec.capacity_gib or 0.0,
        rank(spec),
        spec.labels,
    )


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
        taken=set(state.device_owner) | set(state.reserved_by),
        sliced_gib={d: sliced_gib(state, d) for d in state.memory_used.keys() | state.reserved_gib},
    )


class _Core:
    """A domain's fabric and its live conditions, as of the last state placement saw.

    The fabric is rebuilt only when the topology changes. Conditions follow the state by
    difference: state maps are replaced, never mutated, so a map that is the same object as
    last time is skipped, and a changed one is compared with the one seen (its items'
    symmetric difference, a C-speed set operation, where the values hash; by identity of
    the values where they are maps, which evolve replaces when they change) and only the
    entries that differ are sent to the path core, each an O(1) update there.
    Any state of the domain may come next (a scratch state thrown away after a failed commit,
    an older one in a test): the difference is taken against whatever was seen last.
    """

    def __init__(self, state: DomainState) -> None:
        self.fabric = fabric_of(state)
        self.live = LiveConditions(self.fabric, conditions_of(state))
        # Static while the topology is: the hosts in id order.
        self.hosts = sorted(n for n, s in state.nodes.items() if s.spec.kind == "host")
        self._seen(state)

    def _seen(self, state: DomainState) -> None:
        self.nodes = state.nodes
        self.links = state.links
        self.reserved = state.reserved_gbps
        self.circuits = state.circuits
        self.switch_tenants = state.switch_tenants
        self.exclusive_tenants = state.exclusive_tenants
        self.owners = state.device_owner
        self.memory_used = state.memory_used
        self.reserved_by = state.reserved_by
        self.reserved_gib = state.reserved_gib

    def sync(self, state: DomainState) -> bool:
        """Bring the live conditions to `state`; False when its topology differs."""
        live = self.live
        try:
            if not (
                _sync_components(self.nodes, state.nodes, live)
                and _sync_components(self.links, state.links, live)
            ):
                return False
            # Maps of hashable values differ by the entries of their items' symmetric
            # difference, taken at C speed: only those entries are looked at again.
            old, new = self.reserved, state.reserved_gbps
            if new is not old:
                for link in {link for link, _ in old.items() ^ new.items()}:
                    live.set_reserved(link, new.get(link, 0.0))
            before, after = self.circuits, state.circuits
            if after is not before:
                for key in {key for key, _ in before.items() ^ after.items()}:
                    c = after.get(key)
                    if c is None:
                        port, _ = _circuit_ports(key, before[key])
                        live.clear_circuit(before[key].ocs, port)
                    else:
                        port, other = _circuit_ports(key, c)
                        live.set_circuit(c.ocs, port, other, c.host)
            # Taken whole by a composition or a reservation; sliced by either (state.taken).
            if state.device_owner is not self.owners or state.reserved_by is not self.reserved_by:
                # Key sets, compared at C speed: only who holds a device whole matters here.
                changed = self.owners.keys() ^ state.device_owner.keys()
                changed |= self.reserved_by.keys() ^ state.reserved_by.keys()
                for device in changed:
                    live.set_taken(device, taken(state, device))
            sliced: set[str] = set()
            if state.memory_used is not self.memory_used:
                sliced.update(d for d, _ in self.memory_used.items() ^ state.memory_used.items())
            if state.reserved_gib is not self.reserved_gib:
                sliced.update(d for d, _ in self.reserved_gib.items() ^ state.reserved_gib.items())
            for device in sliced:
                was = self.memory_used.get(device, 0.0) + self.reserved_gib.get(device, 0.0)
                now = sliced_gib(state, device)
                if was != now:
                    live.set_sliced(device, now)
            for old_t, new_t, update in (
                (self.switch_tenants, state.switch_tenants, live.set_switch_tenants),
                (self.exclusive_tenants, state.exclusive_tenants, live.set_exclusive_tenants),
            ):
                if new_t is not old_t:
                    for switch in old_t.keys() | new_t.keys():
                        if new_t.get(switch) is not old_t.get(switch):
                            update(switch, new_t.get(switch, {}))
        except KeyError:  # names a component the fabric lacks: rebuild from the state
            return False
        self._seen(state)
        return True


def _sync_components(old: dict[str, Any], new: dict[str, Any], live: LiveConditions) -> bool:
    """Health and drain marks; False when a component was added, removed or respecified."""
    if new is old:
        return True
    if old.keys() != new.keys():
        return False
    for key, now in new.items():
        was: Component = old[key]
        if now is was:
            continue
        if now.spec is not was.spec and now.spec != was.spec:
            return False
        if usable(now) != usable(was):
            live.set_usable(key, usable(now))
    return True


def _circuit_ports(key: str, c: Any) -> tuple[int, int]:
    """(this port, the other port) of a circuit as stored under `key` (as conditions_of)."""
    return (c.a_port, c.b_port) if key == f"{c.ocs}:{c.a_port}" else (c.b_port, c.a_port)


_CORES: dict[str, _Core] = {}
_CORES_LOCK = threading.Lock()  # one decision at a time uses a domain's live conditions


def hosts_of(state: DomainState) -> list[str]:
    """Every host of the domain, in id order (from the cached topology, not a scan)."""
    with _CORES_LOCK:
        return _core(state).hosts


def _core(state: DomainState) -> _Core:
    core = _CORES.get(state.domain)
    if core is None or not core.sync(state):
        core = _Core(state)
        if len(_CORES) >= 64:
            _CORES.pop(next(iter(_CORES)))
        _CORES[state.domain] = core
    return core


# ---- choosing devices ----


def place(
    state: DomainState,
    intent: Compose,
    tenant: str,
    host: str,
    pinned: list[DeviceBinding] | None = None,
) -> Placement | Rejection:
    """Choose every device of `intent` for `host`, or say why not. `pinned`: take exactly the
    devices of these bindings, in their order (an applied reservation's), over paths found
    now; `intent` then gives the constraints only."""
    with _CORES_LOCK:
        core = _core(state)
        # Each pick holds its bandwidth, circuits, switches and device for the next ones; all
        # of it is undone afterwards, since the decision is recorded as events, not here.
        mark = core.live.checkpoint()
        try:
            return _place(state, core, intent, tenant, host, pinned)
        finally:
            core.live.rollback(mark)


def _place(
    state: DomainState,
    core: _Core,
    intent: Compose,
    tenant: str,
    host: str,
    pinned: list[DeviceBinding] | None,
) -> Placement | Rejection:
    fabric, live = core.fabric, core.live
    exclusive = intent.constraints.isolation == "exclusive"
    memory_used = {d: sliced_gib(state, d) for d in state.memory_used.keys() | state.reserved_gib}
    picked: set[str] = set()
    bindings: list[DeviceBinding] = []
    new_circuits: list[CircuitRef] = []
    # A device named in `device_ids` is kept for its own slot (served after the `devices`
    # entries): an entry that took it first left the named slot only a refusal.
    named = [d for d in intent.device_ids if pinned is None and not taken(state, d)]
    for device in named:
        live.set_taken(device, True)
    for index, slot in enumerate(_slots(state, intent, pinned)):
        if slot.device is not None and named:
            for device in named:
                live.set_taken(device, False)
            named = []
        entry = slot.entry
        for nth in range(entry.count):
            request = PathRequest(
                host,
                tenant,
                exclusive,
                intent.constraints.max_hops,
                intent.constraints.max_latency_ns,
                entry.bandwidth_gbps,
            )
            # One search for every candidate, ordered by (hops, latency, policy rank, id).
            candidates = _candidates(state, slot, intent, memory_used, picked)
            chosen = best_devices(fabric, live, request, candidates, 1)
            if not chosen:
                return _why_not(
                    state, core, intent, slot, index, nth, host, tenant, memory_used, picked
                )
            best = chosen[0]
            binding = _bind(state, best, entry)
            bindings.append(binding)
            picked.add(best.device)
            live.set_taken(best.device, True)  # one slice per device per composition, too
            if binding.capacity_gib is not None:
                memory_used[best.device] = memory_used.get(best.device, 0.0) + binding.capacity_gib
            new_circuits += _hold(state, live, best, entry, host, tenant, exclusive)
    return Placement(host=host, bindings=bindings, new_circuits=new_circuits)


class _Slot(msgspec.Struct, frozen=True):
    """One `devices` entry, or one of `device_ids` (a specific device, taken whole)."""

    entry: DeviceRequest
    device: str | None = None
    whole: bool = True  # a memory device named here: taken whole, or (False) a slice of it


def _slots(state: DomainState, intent: Compose, pinned: list[DeviceBinding] | None) -> list[_Slot]:
    """`device_ids` are served after `devices`, each as a one-device entry of its own kind.
    decide() has checked that each names a device of this domain. `pinned`: exactly these
    devices (a reservation's), each as its binding asked (a slice stays a slice)."""
    if pinned is not None:
        return [
            _Slot(
                DeviceRequest(
                    kind=b.kind,  # type: ignore[arg-type]
                    capacity_gib=b.capacity_gib,
                    bandwidth_gbps=b.bandwidth_gbps,
                ),
                b.device,
                whole=b.capacity_gib is None,
            )
            for b in pinned
        ]
    slots = [_Slot(entry) for entry in intent.devices]
    for device in intent.device_ids:
        kind = state.nodes[device].spec.device_kind or "gpu"
        slots.append(_Slot(DeviceRequest(kind=kind), device))
    return slots


def _candidates(
    state: DomainState,
    slot: _Slot,
    intent: Compose,
    memory_used: dict[str, float],
    picked: set[str],
) -> Selector | dict[str, int]:
    """What the path core may pick for a slot: a Selector over the fabric's devices (the core
    knows what is taken and sliced, this composition's picks included), or the one device
    asked for by id, with its rank, when it is free."""
    if slot.device is None:
        return _selector(slot.entry, intent)
    return _by_id(state, slot, slot.device, intent, memory_used, picked)


def _by_id(
    state: DomainState,
    slot: _Slot,
    device: str,
    intent: Compose,
    memory_used: dict[str, float],
    picked: set[str],
) -> dict[str, int]:
    """The device asked for by id, with its rank, when it is usable, free and labelled."""
    node = state.nodes[device]
    if (
        usable(node)
        and _free(state, device, slot, memory_used, picked)
        and _labels_match(node.spec, intent)
    ):
        return {device: rank(node.spec)}
    return {}


def _selector(entry: DeviceRequest, intent: Compose) -> Selector:
    """An entry's devices as the path core tests them (ext._paths_py.selected)."""
    return Selector(
        entry.kind,
        tuple(entry.models),
        entry.min_generation,
        entry.min_memory_gib,
        entry.capacity_gib if entry.kind == "memory" else None,
        intent.constraints.labels,
    )


def _free(
    state: DomainState, device: str, slot: _Slot, memory_used: dict[str, float], picked: set[str]
) -> bool:
    if device in picked or taken(state, device):
        return False
    if slot.entry.kind != "memory":
        return True
    if slot.device is not None and slot.whole:  # a memory device asked for by id: whole
        return device not in memory_used
    capacity = state.nodes[device].spec.capacity_gib or 0.0
    return capacity - memory_used.get(device, 0.0) + 1e-9 >= (slot.entry.capacity_gib or 0.0)


def _labels_match(spec: NodeSpec, intent: Compose) -> bool:
    return all(spec.labels.get(k) == v for k, v in intent.constraints.labels.items())


def _bind(state: DomainState, path: Path, entry: DeviceRequest) -> DeviceBinding:
    spec = state.nodes[path.device].spec
    return DeviceBinding(
        device=path.device,
        kind=entry.kind,
        model=spec.model,
        cost_per_hour=spec.cost_per_hour,
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
    live: LiveConditions,
    path: Path,
    entry: DeviceRequest,
    host: str,
    tenant: str,
    exclusive: bool,
) -> list[CircuitRef]:
    """Make the next pick see this one: bandwidth, circuits and switch tenancy."""
    for link in path.links:
        live.reserve(link, entry.bandwidth_gbps)
    created = []
    for c in path.circuits:
        if c.new:
            live.add_circuit(c.ocs, c.a_port, c.b_port, host)
            created.append(CircuitRef(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port))
    for node in path.nodes:
        if state.nodes[node].spec.kind == "switch":
            live.hold_switch(node, tenant, exclusive)
    return created


# ---- why not ----


def _why_not(
    state: DomainState,
    core: _Core,
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
    entry = slot.entry
    c = intent.constraints
    exclusive = c.isolation == "exclusive"
    fabric, live = core.fabric, core.live
    labelled: Selector | set[str]
    held: str | None = None  # a device asked for by id that someone holds: how
    if slot.device is None:
        # The core counts the first stages and searches by the selector: no list of the
        # hall's devices is built here.
        labelled = _selector(entry, intent)
        counts = list(census(fabric, live, labelled))
    else:  # one device asked for by id: the same stages, on it alone
        healthy = usable(state.nodes[slot.device])
        free = healthy and _free(state, slot.device, slot, memory_used, picked)
        labelled = set(_by_id(state, slot, slot.device, intent, memory_used, picked))
        counts = [1, int(healthy), int(free), len(labelled)]
        held = _held(state, slot) if healthy and not free else None

    def search(targets: Selector | Iterable[str], **limits: Any) -> Costs:
        """(hops, latency) of each target's best path: counts and the nearest need no more."""
        wanted = targets if isinstance(targets, Selector) else set(targets)
        if not wanted:
            return {}
        return best_costs(fabric, live, PathRequest(host, tenant, exclusive, **limits), wanted)

    # A device's best path does not depend on the other targets, and each stage only adds a
    # limit to the one before, so a stage searches only what the one before reached (and
    # what isolation reaches, ignoring it reaches too). Best paths come fewest hops first, so
    # the hop stage keeps those within the hops as they are.
    bounds = {"max_hops": c.max_hops, "max_latency_ns": c.max_latency_ns}
    n_labelled = counts[3]
    isolated = search(labelled) if n_labelled else {}
    # Ignoring isolation only how many are reached counts, which costs no search (reachable).
    anywhere = n_labelled
    if len(isolated) < n_labelled:
        unisolated = PathRequest(host, tenant, exclusive, isolation=False)
        anywhere = reachable(fabric, live, unisolated, labelled)
    within_hops = (
        isolated
        if c.max_hops is None
        else {d: cost for d, cost in isolated.items() if cost[0] <= c.max_hops}
    )
    within_latency = within_hops if c.max_latency_ns is None else search(within_hops, **bounds)
    # Of the bandwidth stage only how many remain counts, which without bounds a BFS answers
    # (reachable) rather than a search for each one's best path.
    with_bandwidth = len(within_latency)
    if entry.bandwidth_gbps and within_latency:
        request = PathRequest(
            host, tenant, exclusive, c.max_hops, c.max_latency_ns, entry.bandwidth_gbps
        )
        with_bandwidth = reachable(fabric, live, request, set(within_latency))
    # Isolation's stage keeps those it reaches and those nothing reaches (counted as lost to
    # the path stages): all labelled but the ones only ignoring isolation reaches.
    counts[3] = n_labelled - (anywhere - len(isolated))
    counts += [len(within_hops), len(within_latency), with_bandwidth]
    # The `nth` devices this entry already took passed every stage (they were chosen under
    # all of them); the counts above see them taken. Counted as passing, "free" removes only
    # what was not free to begin with ("2 exist, 2 free, 2 reachable" for a third one, not
    # "0 free"), and what the path stages remove is what this entry's own picks left no path.
    counts[2:] = [n + nth for n in counts[2:]]
    funnel = []
    before = counts[0]
    for stage, remaining in zip(FUNNEL_STAGES, counts, strict=True):
        removed = 0 if stage == "kind and model" else before - remaining
        funnel.append({"stage": stage, "removed": removed, "remaining": remaining})
        before = remaining
    nearest = _nearest(isolated, within_hops, within_latency)
    what = slot.device or entry.kind + (f" {'/'.join(entry.models)}" if entry.models else "")
    exist = f"{counts[0]} {what} exist"
    if not counts[0] and entry.models and not slot.device:
        exist += " (a model is matched exactly, case included)"  # `h100` finds no H100
    parts = [exist, f"{counts[1]} healthy", f"{counts[2]} free"]
    if c.labels or exclusive or counts[3] != counts[2]:
        parts.append(f"{counts[3]} pass isolation and labels")
    parts.append(f"{counts[4]} reachable" + (f" within {c.max_hops} hops" if c.max_hops else ""))
    if c.max_latency_ns is not None:
        parts.append(f"{counts[5]} within {c.max_latency_ns} ns")
    if entry.bandwidth_gbps:
        parts.append(f"{counts[6]} with {entry.bandwidth_gbps:g} Gbps free")
    message = f"entry {index} needs {entry.count} {what}, found {nth}: " + ", ".join(parts)
    if nearest:
        message += f" (nearest: {nearest['text']})"
    if held is not None:
        message += f"; {slot.device} is {'reserved' if held == 'reserved' else 'in use'}"
    # Labels are device attributes, isolation a path rule: with free devices of the right
    # labels left, the refusal is about paths.
    code = "no_capacity" if not n_labelled else "no_path"
    details = {
        "entry": index,
        "needed": entry.count,
        "found": nth,
        "host": host,
        "funnel": funnel,
        "nearest": nearest,
    }
    if held is not None:
        details["held"] = held  # "reserved" or "composed": why the device asked for is not free
    return Rejection(code=code, message=message, details=details)


def _held(state: DomainState, slot: _Slot) -> str | None:
    """Why a device asked for by id is not free: `reserved` (a reservation holds it, or too
    much of a pool), `composed` (a composition does), or None (this request took it already)."""
    device = slot.device
    assert device is not None
    if device in state.reserved_by:
        return "reserved"
    if device in state.device_owner:
        return "composed"
    if slot.entry.kind == "memory" and (
        device in state.reserved_gib or device in state.memory_used
    ):
        return "reserved" if device in state.reserved_gib else "composed"
    return None


def _nearest(reachable: Costs, within_hops: Costs, within_latency: Costs) -> dict[str, Any] | None:
    """The closest device lost at the first path stage that lost any."""
    for pool, kept, what in (
        (reachable, within_hops, "hops"),
        (within_hops, within_latency, "latency"),
        (within_latency, {}, "bandwidth"),
    ):
        if kept is pool:
            continue  # a stage without its bound keeps all (the same mapping)
        missed = [(hops, latency, d) for d, (hops, latency) in pool.items() if d not in kept]
        if missed:
            hops, latency, device = min(missed)
            text = {
                "hops": f"{device} at {hops} hops",
                "latency": f"{device} at {latency} ns",
                "bandwidth": f"{device} at {hops} hops, short of bandwidth",
            }[what]
            return {"device": device, "hops": hops, "latency_ns": latency, "text": text}
    return None
