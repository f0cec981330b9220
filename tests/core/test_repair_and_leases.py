"""Section 8 decided purely: faults are repaired, drains move compositions, leases expire."""

from __future__ import annotations

from datetime import timedelta
from functools import reduce

import msgspec
from core.fabric_builder import (
    NOW,
    FabricBuilder,
    apply,
    compose,
    composed,
    report_fault,
    run,
)

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CircuitRemoved,
    ComponentFaulted,
    CompositionActivated,
    CompositionImpaired,
    CompositionReleased,
    DeviceReplaced,
    LeaseExpired,
    PathRerouted,
)
from trellis.engine.core.intents import Drain, ExpireLeases
from trellis.engine.core.results import Moved
from trellis.engine.core.state import DomainState, evolve

GPU = {"kind": "gpu"}


def two_ways_to_one_gpu() -> DomainState:
    """h - sw-a - g1 and h - sw-b - g1: two paths to the same GPU, g2 only behind sw-a."""
    b = FabricBuilder().host("h").switch("sw-a").switch("sw-b").gpu("g1").gpu("g2")
    b.link("h", "sw-a", id="l-ha").link("sw-a", "g1", id="l-a1").link("sw-a", "g2", id="l-a2")
    b.link("h", "sw-b", id="l-hb").link("sw-b", "g1", id="l-b1")
    return b.state()


def one_path_each() -> DomainState:
    """h - sw - {g1, g2}: no second path, but a second GPU."""
    b = FabricBuilder().host("h").switch("sw").gpu("g1", generation=8).gpu("g2", generation=9)
    b.link("h", "sw", id="l-h").link("sw", "g1", id="l-1").link("sw", "g2", id="l-2")
    return b.state()


def test_a_failed_link_on_the_path_is_routed_around_to_the_same_device() -> None:
    state, result = composed(two_ways_to_one_gpu(), "t", host="h", device_ids=["g1"])
    assert result.devices[0].path == ["h", "sw-a", "g1"]

    events, outcome = report_fault(state, "l-a1")

    kinds = [type(e) for e in events[1:]]
    assert kinds == [CompositionImpaired, PathRerouted, CompositionActivated]
    rerouted = events[2]
    assert rerouted.binding.path == ["h", "sw-b", "g1"] and "l-a1 failed" in rerouted.reason
    after = apply(state, events)
    composition = after.compositions[result.composition_id]
    assert composition.state == "active" and composition.impaired_by == []
    assert outcome.impaired == [] and outcome.compositions == [result.composition_id]
    assert outcome.moved == [
        Moved(
            composition_id=result.composition_id,
            device="g1",
            to="g1",
            path=["h", "sw-b", "g1"],
            links=["l-hb", "l-b1"],
        )
    ]
    assert after.reserved_gbps.get("l-a1", 0.0) == 0.0


def test_a_failed_device_is_replaced_by_one_that_meets_the_original_request() -> None:
    state, result = composed(one_path_each(), "t", host="h", devices=[GPU])
    assert result.devices[0].id == "g1"  # the older generation goes first

    events, outcome = report_fault(state, "g1", detail="ECC errors")

    replaced = next(e for e in events if isinstance(e, DeviceReplaced))
    assert (replaced.old_device, replaced.binding.device) == ("g1", "g2")
    # The reply says what moved where, as the log does.
    assert [(m.composition_id, m.device, m.to) for m in outcome.moved] == [
        (result.composition_id, "g1", "g2")
    ]
    after = apply(state, events)
    assert after.device_owner == {"g2": result.composition_id}
    assert after.compositions[result.composition_id].state == "active"


def test_without_a_way_around_the_composition_stays_impaired_until_recovery() -> None:
    state, result = composed(one_path_each(), "t", host="h", devices=[GPU])
    events, outcome = report_fault(state, "l-h")
    assert [type(e) for e in events[1:]] == [CompositionImpaired]
    assert outcome.impaired == [result.composition_id] and outcome.moved == []
    state = apply(state, events)

    events, outcome = report_fault(state, "l-h", "healthy")

    assert [type(e) for e in events[1:]] == [CompositionActivated]
    assert apply(state, events).compositions[result.composition_id].state == "active"


def test_a_new_fault_state_on_a_component_that_already_impaired_it_records_only_the_mark() -> None:
    state, result = composed(one_path_each(), "t", host="h", devices=[GPU])
    state = apply(state, report_fault(state, "l-h")[0])

    events, outcome = report_fault(state, "l-h", "degraded")

    assert [type(e) for e in events] == [ComponentFaulted]
    assert outcome.compositions == [] and outcome.impaired == []
    assert apply(state, events).compositions[result.composition_id].impaired_by == ["l-h"]


def test_a_drain_moves_compositions_off_the_component_first() -> None:
    state, result = composed(two_ways_to_one_gpu(), "t", host="h", device_ids=["g1"])
    events, outcome = run(state, Drain(request_id="d", id="sw-a", reason="firmware"))
    assert [type(e) for e in events[1:]] == [PathRerouted]
    after = apply(state, events)
    assert not after.compositions[result.composition_id].uses("sw-a")
    assert outcome.impaired == []
    assert [(m.device, m.to, m.path) for m in outcome.moved] == [("g1", "g1", ["h", "sw-b", "g1"])]


def test_a_drain_refuses_to_break_an_exclusive_composition_unless_forced() -> None:
    state, result = composed(
        one_path_each(), "t", host="h", devices=[GPU], constraints={"isolation": "exclusive"}
    )
    events, error = run(state, Drain(request_id="d", id="sw"))
    assert isinstance(error, IntentRejected) and error.code == "conflict" and events == []

    events, outcome = run(state, Drain(request_id="d2", id="sw", force=True))
    assert outcome.impaired == [result.composition_id]
    assert apply(state, events).nodes["sw"].drained


def test_leases_expire_into_lease_expired_and_released_and_return_everything() -> None:
    b = FabricBuilder().host("h").ocs("o", ports=4).switch("sw").gpu("g1")
    b.link("h", "o").link("o", "sw").link("sw", "g1")
    state, result = composed(b.state(), "t", host="h", devices=[GPU], lease_seconds=60)
    assert state.circuits

    early, _ = run(state, ExpireLeases(request_id="x"), now=NOW + timedelta(seconds=59))
    assert early == []

    events, outcome = run(state, ExpireLeases(request_id="y"), now=NOW + timedelta(seconds=60))
    assert [type(e) for e in events] == [LeaseExpired, CompositionReleased, CircuitRemoved]
    assert outcome == {"expired": [result.composition_id]}
    after = apply(state, events)
    assert after.compositions == {} and after.circuits == {} and after.device_owner == {}


def test_a_repaired_history_replays_to_the_same_state() -> None:
    base = two_ways_to_one_gpu()
    composed_events, _ = compose(base, "t", host="h", device_ids=["g1"])
    state = apply(base, composed_events)
    fault_events, _ = report_fault(state, "l-a1")
    live = apply(state, fault_events)

    replayed = reduce(evolve, [*composed_events, *fault_events], base)

    assert msgspec.json.encode(replayed) == msgspec.json.encode(live)


def test_a_reroute_inside_one_ocs_frees_the_old_circuit_before_making_the_new() -> None:
    """h - sw = ocs (uplinks on ports 0 and 4) - g (port 1): the circuit 0-1 holds port 1,
    which the new path needs too, so the old circuit comes down first."""
    b = FabricBuilder().host("h").switch("sw").ocs("o").gpu("g")
    b.link("h", "sw", id="l-h").link("sw", "o", id="l-up", b_port=0)
    b.link("sw", "o", id="l-up2", b_port=4).link("o", "g", id="l-g", a_port=1)
    state, result = composed(b.state(), "t", host="h", device_ids=["g"])
    [old] = state.compositions[result.composition_id].bindings[0].circuits
    up = "l-up" if old.a_port == 0 else "l-up2"

    events, _ = report_fault(state, up)

    kinds = [type(e).__name__ for e in events[2:]]
    assert kinds == ["CircuitRemoved", "CircuitCreated", "PathRerouted", "CompositionActivated"]
    after = apply(state, events)
    [moved] = after.compositions[result.composition_id].bindings
    assert up not in moved.links and moved.circuits[0] != old
    assert sorted(after.circuits) == [f"o:{p}" for p in sorted((1, 4 - old.a_port))]
