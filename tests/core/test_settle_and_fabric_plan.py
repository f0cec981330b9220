"""The saga's pure parts: settling a pending composition, and what the hardware should hold."""

from __future__ import annotations

from datetime import timedelta

import msgspec
from core.fabric_builder import (
    NOW,
    FabricBuilder,
    apply,
    compose_pending,
    release,
    report_fault,
    run,
)

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import CircuitRemoved, CompositionFailed
from trellis.engine.core.fabric import FabricBinding, FabricCircuit, FabricSnapshot
from trellis.engine.core.fabric_plan import bindings_of, circuits_of, reconcile
from trellis.engine.core.intents import (
    EstablishComposition,
    ExpireLeases,
    FailComposition,
    settle_request_id,
)
from trellis.engine.core.state import DomainState


def through_an_ocs() -> DomainState:
    """h - sw - o(0) ... o(1) - g1, o(2) - g2, and h - sw - g3: two GPUs need a circuit."""
    b = FabricBuilder().host("h").switch("sw").ocs("o").gpu("g1").gpu("g2").gpu("g3")
    b.link("h", "sw", id="l-h").link("sw", "o", id="l-up", b_port=0)
    b.link("o", "g1", id="l-1", a_port=1).link("o", "g2", id="l-2", a_port=2)
    b.link("sw", "g3", id="l-3")
    return b.state()


def pending(state: DomainState, **body: object) -> tuple[DomainState, str]:
    events, result = compose_pending(state, "t", host="h", **body)
    assert not isinstance(result, IntentRejected), result
    assert result.state == "pending"
    return apply(state, events), result.composition_id


def establish(cid: str) -> EstablishComposition:
    return EstablishComposition(request_id=settle_request_id(cid), composition_id=cid)


def fail(cid: str) -> FailComposition:
    return FailComposition(
        request_id=settle_request_id(cid),
        composition_id=cid,
        step="bind",
        target="g1",
        component="g1",
        error="controller said no",
    )


# ---- settling ----


def test_compose_reserves_and_leaves_the_composition_pending_for_the_saga() -> None:
    events, result = compose_pending(through_an_ocs(), "t", host="h", device_ids=["g1"])

    kinds = [type(e).__name__ for e in events]
    assert kinds == ["CompositionRequested", "CircuitCreated", "DevicesReserved"]
    assert result.state == "pending"
    state = apply(through_an_ocs(), events)
    assert state.device_owner == {"g1": result.composition_id}  # held while it is programmed


def test_establish_activates_with_one_path_established_per_device() -> None:
    state, cid = pending(through_an_ocs(), device_ids=["g1", "g3"])

    events, result = run(state, establish(cid), "engine")

    kinds = [type(e).__name__ for e in events]
    assert kinds == ["PathEstablished", "PathEstablished", "CompositionActivated"]
    assert result.state == "active" and [d.id for d in result.devices] == ["g1", "g3"]


def test_a_part_that_failed_while_pending_impairs_the_composition_at_establish() -> None:
    """Faults skip pending compositions (the saga is programming them); establishing one
    whose path broke meanwhile impairs it and tries the usual repair."""
    state, cid = pending(through_an_ocs(), devices=[{"kind": "gpu"}])
    device = state.compositions[cid].bindings[0].device
    faulted, _ = report_fault(state, device)
    assert [type(e).__name__ for e in faulted] == ["ComponentFaulted"]
    state = apply(state, faulted)

    events, result = run(state, establish(cid), "engine")

    kinds = [type(e).__name__ for e in events]
    assert kinds[:3] == ["PathEstablished", "CompositionActivated", "CompositionImpaired"]
    assert "DeviceReplaced" in kinds and result.state == "active"
    assert device not in [d.id for d in result.devices]


def test_fail_returns_everything_and_names_what_failed() -> None:
    before = through_an_ocs()
    state, cid = pending(before, device_ids=["g1"])

    events, error = run(state, fail(cid), "engine")

    assert [type(e) for e in events] == [CompositionFailed, CircuitRemoved]
    assert isinstance(error, IntentRejected) and error.code == "failed"
    assert error.details["step"] == "bind" and "controller said no" in error.message
    after = apply(state, events)
    assert after.device_owner == {} and after.circuits == {} and after.compositions == {}
    assert after.reserved_gbps == before.reserved_gbps


def test_a_composition_is_settled_once() -> None:
    state, cid = pending(through_an_ocs(), device_ids=["g1"])
    events, _ = run(state, establish(cid), "engine")
    state = apply(state, events)

    for settle in (establish(cid), fail(cid)):
        again, error = run(state, settle, "engine")
        assert again == [] and isinstance(error, IntentRejected) and error.code == "conflict"


def test_a_pending_composition_cannot_be_released_and_its_lease_waits() -> None:
    state, cid = pending(through_an_ocs(), device_ids=["g1"], lease_seconds=10)

    events, error = release(state, "t", cid)
    assert events == [] and isinstance(error, IntentRejected) and error.code == "conflict"

    later = NOW + timedelta(seconds=60)
    events, result = run(state, ExpireLeases(request_id="x"), "engine", later)
    assert events == [] and result == {"expired": []}


# ---- what the hardware should hold ----


def test_reconcile_programs_settled_compositions_and_leaves_pending_ones_to_the_saga() -> None:
    state, waiting = pending(through_an_ocs(), device_ids=["g3"])
    state, cid = pending(state, device_ids=["g1"])
    events, _ = run(state, establish(cid), "engine")
    state = apply(state, events)
    composition = state.compositions[cid]

    plan = reconcile(FabricSnapshot(circuits=[], bindings=[]), state)

    assert plan.pending == [waiting]
    assert plan.create == circuits_of(composition) == [FabricCircuit(ocs="o", a_port=0, b_port=1)]
    assert plan.bind == bindings_of(composition) and plan.unbind == plan.remove == []
    done = FabricSnapshot(circuits=plan.create, bindings=plan.bind)
    assert reconcile(done, state).in_step


def test_reconcile_takes_away_what_the_log_no_longer_holds_and_moves_what_changed() -> None:
    state, cid = pending(through_an_ocs(), device_ids=["g1"])
    events, _ = run(state, establish(cid), "engine")
    state = apply(state, events)
    [bound] = bindings_of(state.compositions[cid])
    stale = FabricBinding(host="h", device="g2", path=["h", "sw", "o", "g2"], composition_id="c-x")
    moved = msgspec.structs.replace(bound, path=["h", "somewhere", "g1"])
    orphan = FabricCircuit(ocs="o", a_port=2, b_port=3)
    held = FabricSnapshot(circuits=[*circuits_of(state.compositions[cid]), orphan], bindings=[])

    plan = reconcile(msgspec.structs.replace(held, bindings=[moved, stale]), state)

    assert plan.unbind == [moved, stale]
    assert plan.remove == [orphan] and plan.create == []
    assert plan.bind == [bound]


def test_reconcile_keeps_what_a_pending_composition_has_programmed_so_far() -> None:
    state, cid = pending(through_an_ocs(), device_ids=["g1"])
    composition = state.compositions[cid]
    half_done = FabricSnapshot(circuits=circuits_of(composition), bindings=bindings_of(composition))

    plan = reconcile(half_done, state)

    assert plan.in_step and plan.pending == [cid]


def test_after_a_failure_reconcile_removes_what_the_saga_could_not_undo() -> None:
    state, cid = pending(through_an_ocs(), device_ids=["g1"])
    composition = state.compositions[cid]
    leftovers = FabricSnapshot(circuits=circuits_of(composition), bindings=bindings_of(composition))
    events, _ = run(state, fail(cid), "engine")

    plan = reconcile(leftovers, apply(state, events))

    assert plan.unbind == leftovers.bindings and plan.remove == leftovers.circuits
    assert plan.pending == []
