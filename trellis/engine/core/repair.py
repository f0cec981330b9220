"""Keeping compositions whole when hardware is not (ARCHITECTURE section 8), decided purely.

A binding is broken when anything on its path (or its device) is unusable. Repair tries, in
order: the same device over another path (PathRerouted), then another device that meets the
binding's original request entry (DeviceReplaced). A composition whose bindings are all whole
again is activated; one that cannot be mended stays impaired and says why.

A circuit whose port or OCS is down breaks every path through it, so all of them must leave
it, and its ports are free for their new paths only once the last one has. A step (a fault's
repair, a drain, a retry) is first decided letting each path leave such a circuit as if the
others had already: kept when every path through it did leave, else decided again keeping the
circuit for those still on it (a drained port still carries them).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from functools import reduce

import msgspec

from trellis.engine.core.errors import IntentRejected
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


def repair(
    state: DomainState, composition: Composition, why: str, *, leave_down: bool = False
) -> list[Event]:
    """Events that mend every broken binding of `composition` that can be mended.

    `state` already holds the fault (or drain) and any CompositionImpaired for it. With
    `leave_down`, a binding leaves a circuit that is down even while others still pass it
    (`together` keeps that only when they all leave it too).
    """
    events: list[Event] = []
    host = state.nodes.get(composition.host)
    if host is None or not usable(host):
        return events  # nothing reaches a host that is down; recovery retries
    mended_all = True
    for binding in composition.bindings:
        if not broken(state, binding):
            continue
        fix = _reroute(state, composition, binding, why, leave_down) or _replace(
            state, composition, binding, why, leave_down
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


def together(step: Callable[[DomainState, bool], list[Event]], state: DomainState) -> list[Event]:
    """`step(state, leave_down)`'s events: first letting paths leave a circuit that is down
    while others still pass it, kept when no live path is left on a circuit that came down;
    else `step` again keeping such circuits up (as a refused trial is, too)."""
    try:
        events = step(state, True)
    except IntentRejected:
        return step(state, False)
    took_down = any(isinstance(e, CircuitRemoved) for e in events)
    if took_down and _stranded(reduce(evolve, events, state)):
        return step(state, False)
    return events


def _stranded(state: DomainState) -> bool:
    """True when a live composition's path names a circuit that is no longer up."""
    return any(
        not _is_up(state, c)
        for composition in state.compositions.values()
        for b in composition.bindings
        for c in b.circuits
    )


def impair_and_repair(state: DomainState, component: str, why: str) -> list[Event]:
    """After `component` became unusable: impair each live composition whose path uses it,
    then mend what can be mended."""
    return together(lambda s, leave_down: _impair_and_repair(s, component, why, leave_down), state)


def _impair_and_repair(
    state: DomainState, component: str, why: str, leave_down: bool
) -> list[Event]:
    events: list[Event] = []
    for cid in sorted(state.compositions):
        composition = state.compositions[cid]
        if composition.state == "pending" or not composition.uses(component):
            continue  # a pending one is checked when it is established
        if component in composition.impaired_by:
            continue  # failed -> degraded (or back): it was unusable and still is; nothing new
        impaired = CompositionImpaired(composition_id=cid, component=component, reason=why)
        state = evolve(state, impaired)
        mended = repair(state, state.compositions[cid], why, leave_down=leave_down)
        state = reduce(evolve, mended, state)
        events += [impaired, *mended]
    return events


def in_turn(state: DomainState, after: str, n: int) -> frozenset[str]:
    """`n` impaired compositions, the first ids after `after` in sorted order, wrapping: an
    intent that frees capacity tries a few, not all (each try that fails costs a placement),
    and the ones tried move round with the intents' ids, so none waits for ever."""
    ids = sorted(state.impaired)
    start = bisect.bisect_right(ids, after)
    return frozenset((ids[start:] + ids[:start])[:n])


def retry_impaired(
    state: DomainState, why: str, among: frozenset[str] | None = None
) -> list[Event]:
    """After a recovery, an undrain, or capacity freed or added: give every impaired
    composition (of `among`, if given) another try."""
    tried = state.impaired if among is None else state.impaired & among
    if not tried:
        return []
    return together(lambda s, leave_down: _retry_impaired(s, tried, why, leave_down), state)


def _retry_impaired(
    state: DomainState, tried: frozenset[str], why: str, leave_down: bool
) -> list[Event]:
    events: list[Event] = []
    for cid in sorted(tried):
        composition = state.compositions[cid]
        mended = repair(state, composition, why, leave_down=leave_down)
        state = reduce(evolve, mended, state)
        events += mended
    return events


def _reroute(
    state: DomainState,
    composition: Composition,
    binding: DeviceBinding,
    why: str,
    leave_down: bool,
) -> list[Event] | None:
    """The same device over the best path that is usable now, under the original bounds.
    (A memory slice shares its pool, so it moves through `_replace`, which may keep the pool.)"""
    if binding.capacity_gib is not None or not usable(state.nodes[binding.device]):
        return None
    scratch = _without(state, composition, binding, leave_down)
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
    return _with_circuits(state, composition, binding, found, event, leave_down)


def _replace(
    state: DomainState,
    composition: Composition,
    binding: DeviceBinding,
    why: str,
    leave_down: bool,
) -> list[Event] | None:
    """Another device that meets the binding's original request entry."""
    if binding.entry < 0:
        return None  # a device asked for by id has no stand-in
    entry = msgspec.structs.replace(composition.request.devices[binding.entry], count=1)
    scratch = _without(state, composition, binding, leave_down)
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
    return _with_circuits(state, composition, binding, found, event, leave_down)


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
    state: DomainState, composition: Composition, binding: DeviceBinding, leave_down: bool
) -> list[CircuitRef]:
    """Circuits still up that only `binding` passes (no other path of its composition or of
    its host does), and with `leave_down` those of them that are down whoever passes them."""
    others = {
        _key(c)
        for comp in state.compositions.values()
        if comp.host == composition.host
        for b in comp.bindings
        if not (comp.id == composition.id and b.device == binding.device)
        for c in b.circuits
    }
    return [
        c
        for c in binding.circuits
        if _is_up(state, c) and (_key(c) not in others or (leave_down and _down(state, binding, c)))
    ]


def _is_up(state: DomainState, circuit: CircuitRef) -> bool:
    """True when `circuit` is up: made and not removed since."""
    now = state.circuits.get(f"{circuit.ocs}:{circuit.a_port}")
    return now is not None and (now.a_port, now.b_port) == (circuit.a_port, circuit.b_port)


def _down(state: DomainState, binding: DeviceBinding, circuit: CircuitRef) -> bool:
    """True when `circuit` cannot carry any path: its OCS, or the cable on one of its ports
    (which every path through it passes, as `binding` does), is unusable."""
    ocs = state.nodes.get(circuit.ocs)
    if ocs is None or not usable(ocs):
        return True
    ports = {(circuit.ocs, circuit.a_port), (circuit.ocs, circuit.b_port)}
    for link_id in binding.links:
        link = state.links.get(link_id)
        if link is None:
            return True
        ends = {(link.spec.a, link.spec.a_port), (link.spec.b, link.spec.b_port)}
        if ends & ports and not usable(link):
            return True
    return False


def _key(circuit: CircuitRef) -> tuple[str, int, int]:
    return (circuit.ocs, circuit.a_port, circuit.b_port)


def _without(
    state: DomainState, composition: Composition, binding: DeviceBinding, leave_down: bool
) -> DomainState:
    """`state` as if `binding` were gone, with the circuits only it passes: the search for its
    new path may use those ports again (a reroute within one OCS usually must)."""
    scratch = without_binding(state, composition.id, binding.device)
    for c in _freed_circuits(state, composition, binding, leave_down):
        gone = CircuitRemoved(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port, host=composition.host)
        scratch = evolve(scratch, gone)
    return scratch


def _with_circuits(
    state: DomainState,
    composition: Composition,
    old: DeviceBinding,
    found: Placement,
    event: Event,
    leave_down: bool,
) -> list[Event]:
    """Circuits only the old path passed come down first (freeing their ports), then the new
    path's circuits go up, then the binding moves. A circuit both paths pass stays."""
    freed = {_key(c): c for c in _freed_circuits(state, composition, old, leave_down)}
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
