"""Keeping compositions whole when hardware is not (ARCHITECTURE section 8), decided purely.

A binding is broken when anything on its path (or its device) is unusable. Repair tries, in
order: the same device over another path (PathRerouted), then another device that meets the
binding's original request entry (DeviceReplaced). A composition whose bindings are all whole
again is activated; one that cannot be mended stays impaired and says why.
"""

from __future__ import annotations

from functools import reduce

import msgspec

from trellis.engine.core.events import (
    CircuitCreated,
    CircuitRef,
    CircuitRemoved,
    CompositionActivated,
    CompositionImpaired,
    DeviceBinding,
    DeviceReplaced,
    Event,
    PathRerouted,
)
from trellis.engine.core.intents import Compose, DeviceRequest
from trellis.engine.core.placement import Placement, place
from trellis.engine.core.state import Composition, DomainState, evolve, usable, without_binding


def broken(state: DomainState, binding: DeviceBinding) -> list[str]:
    """The components on `binding`'s path (device included) that cannot carry it now."""
    parts = [*binding.path, *binding.links]
    return [p for p in parts if (c := state.component(p)) is None or not usable(c)]


def repair(state: DomainState, composition: Composition, why: str) -> list[Event]:
    """Events that mend every broken binding of `composition` that can be mended.

    `state` already holds the fault (or drain) and any CompositionImpaired for it.
    """
    events: list[Event] = []
    host = state.nodes.get(composition.host)
    if host is None or not usable(host):
        return events  # nothing reaches a host that is down; recovery retries
    mended_all = True
    for binding in composition.bindings:
        if not broken(state, binding):
            continue
        fix = _reroute(state, composition, binding, why) or _replace(
            state, composition, binding, why
        )
        if fix is None:
            mended_all = False
            continue
        events += fix
        state = reduce(evolve, fix, state)
        composition = state.compositions[composition.id]
    if mended_all and composition.state == "impaired":
        events.append(CompositionActivated(composition_id=composition.id))
    return events


def impair_and_repair(state: DomainState, component: str, why: str) -> list[Event]:
    """After `component` became unusable: impair each live composition whose path uses it,
    then mend what can be mended."""
    events: list[Event] = []
    for cid in sorted(state.compositions):
        composition = state.compositions[cid]
        if composition.state == "pending" or not composition.uses(component):
            continue  # a pending one is checked when it is established
        if component in composition.impaired_by:
            continue  # failed -> degraded (or back): it was unusable and still is; nothing new
        impaired = CompositionImpaired(composition_id=cid, component=component, reason=why)
        state = evolve(state, impaired)
        mended = repair(state, state.compositions[cid], why)
        state = reduce(evolve, mended, state)
        events += [impaired, *mended]
    return events


def retry_impaired(state: DomainState, why: str) -> list[Event]:
    """After a recovery or an undrain: give every impaired composition another try."""
    events: list[Event] = []
    for cid in sorted(state.compositions):
        composition = state.compositions[cid]
        if composition.state != "impaired":
            continue
        mended = repair(state, composition, why)
        state = reduce(evolve, mended, state)
        events += mended
    return events


def _reroute(
    state: DomainState, composition: Composition, binding: DeviceBinding, why: str
) -> list[Event] | None:
    """The same device over the best path that is usable now, under the original bounds.
    (A memory slice shares its pool, so it moves through `_replace`, which may keep the pool.)"""
    if binding.capacity_gib is not None or not usable(state.nodes[binding.device]):
        return None
    scratch = _without(state, composition, binding)
    kind = DeviceRequest(kind=binding.kind)  # type: ignore[arg-type]  # a stored device kind
    probe = _single(composition, kind, device=binding.device)
    found = place(scratch, probe, composition.tenant, composition.host)
    if not isinstance(found, Placement):
        return None
    new = _carry(found.bindings[0], binding)
    if not _bandwidth_fits(scratch, new):
        return None
    event = PathRerouted(
        composition_id=composition.id,
        device=binding.device,
        old_path=binding.path,
        binding=new,
        reason=why,
    )
    return _with_circuits(state, composition, binding, found, event)


def _replace(
    state: DomainState, composition: Composition, binding: DeviceBinding, why: str
) -> list[Event] | None:
    """Another device that meets the binding's original request entry."""
    if binding.entry < 0:
        return None  # a device asked for by id has no stand-in
    entry = msgspec.structs.replace(composition.request.devices[binding.entry], count=1)
    scratch = _without(state, composition, binding)
    found = place(scratch, _single(composition, entry), composition.tenant, composition.host)
    if not isinstance(found, Placement):
        return None
    new = _carry(found.bindings[0], binding)
    if any(b.device == new.device and b is not binding for b in composition.bindings):
        return None  # one slice per pool and composition
    event: Event = (
        PathRerouted(  # the same pool again, over another path
            composition_id=composition.id,
            device=binding.device,
            old_path=binding.path,
            binding=new,
            reason=why,
        )
        if new.device == binding.device
        else DeviceReplaced(
            composition_id=composition.id, old_device=binding.device, binding=new, reason=why
        )
    )
    return _with_circuits(state, composition, binding, found, event)


def _single(composition: Composition, entry: DeviceRequest, device: str | None = None) -> Compose:
    """A one-device request under the composition's original constraints."""
    return Compose(
        request_id=f"repair-{composition.id}",
        host=composition.host,
        devices=[] if device else [entry],
        device_ids=[device] if device else [],
        constraints=composition.request.constraints,
    )


def _carry(new: DeviceBinding, old: DeviceBinding) -> DeviceBinding:
    """The new path keeps what the old binding promised: bandwidth, slice and entry."""
    return msgspec.structs.replace(
        new,
        bandwidth_gbps=old.bandwidth_gbps,
        capacity_gib=old.capacity_gib if new.kind == "memory" else None,
        entry=old.entry,
    )


def _bandwidth_fits(state: DomainState, binding: DeviceBinding) -> bool:
    for link in binding.links:
        spec = state.links[link].spec
        if spec.capacity_gbps - state.reserved_gbps.get(link, 0.0) + 1e-9 < binding.bandwidth_gbps:
            return False
    return True


def _freed_circuits(
    state: DomainState, composition: Composition, binding: DeviceBinding
) -> list[CircuitRef]:
    """Circuits only `binding` passes: no other path of its composition or of its host does."""
    others = {
        _key(c)
        for comp in state.compositions.values()
        if comp.host == composition.host
        for b in comp.bindings
        if not (comp.id == composition.id and b.device == binding.device)
        for c in b.circuits
    }
    return [c for c in binding.circuits if _key(c) not in others]


def _key(circuit: CircuitRef) -> tuple[str, int, int]:
    return (circuit.ocs, circuit.a_port, circuit.b_port)


def _without(state: DomainState, composition: Composition, binding: DeviceBinding) -> DomainState:
    """`state` as if `binding` were gone, with the circuits only it passes: the search for its
    new path may use those ports again (a reroute within one OCS usually must)."""
    scratch = without_binding(state, composition.id, binding.device)
    for c in _freed_circuits(state, composition, binding):
        gone = CircuitRemoved(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port, host=composition.host)
        scratch = evolve(scratch, gone)
    return scratch


def _with_circuits(
    state: DomainState,
    composition: Composition,
    old: DeviceBinding,
    found: Placement,
    event: Event,
) -> list[Event]:
    """Circuits only the old path passed come down first (freeing their ports), then the new
    path's circuits go up, then the binding moves. A circuit both paths pass stays."""
    freed = {_key(c): c for c in _freed_circuits(state, composition, old)}
    new = {_key(c): c for c in found.new_circuits}
    removed: list[Event] = [
        CircuitRemoved(
            ocs=c.ocs,
            a_port=c.a_port,
            b_port=c.b_port,
            host=composition.host,
            reason="unused after repair",
            composition_id=composition.id,
        )
        for k, c in sorted(freed.items())
        if k not in new
    ]
    created: list[Event] = [
        CircuitCreated(
            ocs=c.ocs,
            a_port=c.a_port,
            b_port=c.b_port,
            host=composition.host,
            composition_id=composition.id,
        )
        for k, c in sorted(new.items())
        if k not in freed
    ]
    return [*removed, *created, event]
