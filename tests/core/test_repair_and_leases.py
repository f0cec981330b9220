"""Section 8 decided purely: faults are repaired, drains move compositions, leases expire."""

from __future__ import annotations

from datetime import timedelta
from functools import reduce

import msgspec
import pytest
from core.fabric_builder import (
    NOW,
    FabricBuilder,
    apply,
    compose,
    compose_pending,
    composed,
    release,
    report_fault,
    run,
)

from trellis.engine.core.decide import TRIES_PER_FREEING
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
from trellis.engine.core.intents import (
    AddLink,
    AddNode,
    CancelReservation,
    Drain,
    ExpireLeases,
    ExpireReservations,
    FailComposition,
    Reserve,
    settle_request_id,
)
from trellis.engine.core.model import LinkSpec, NodeSpec
from trellis.engine.core.repair import in_turn
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


# ---- capacity freed or added gives impaired compositions another try ----


def one_spare_taken() -> tuple[DomainState, str, str]:
    """h - sw - {g1, g2}: t holds g1, u holds g2, then g1 fails. t is impaired: no spare."""
    state, t = composed(one_path_each(), "t", host="h", devices=[GPU])
    state, u = composed(state, "u", host="h", devices=[GPU])
    state = apply(state, report_fault(state, "g1")[0])
    assert state.compositions[t.composition_id].state == "impaired"
    assert state.impaired == {t.composition_id}
    return state, t.composition_id, u.composition_id


def _mended_by(events: list, cid: str, reason: str) -> None:
    replaced = [e for e in events if isinstance(e, DeviceReplaced)]
    assert [(e.composition_id, e.old_device, e.binding.device) for e in replaced] == [
        (cid, "g1", "g2")
    ]
    assert replaced[0].reason == reason
    assert [e.composition_id for e in events if isinstance(e, CompositionActivated)] == [cid]


def test_a_release_gives_the_devices_it_frees_to_an_impaired_composition_in_its_commit() -> None:
    state, t, u = one_spare_taken()

    events, outcome = release(state, "u", u)

    assert isinstance(events[0], CompositionReleased) and outcome.devices == ["g2"]
    # The reason names no composition: the one released may be another tenant's.
    _mended_by(events, t, "devices freed by a release")
    after = apply(state, events)
    assert after.compositions[t].state == "active" and after.impaired == frozenset()
    assert after.device_owner == {"g2": t}


def test_an_expired_lease_gives_what_it_frees_to_an_impaired_composition() -> None:
    state, t = composed(one_path_each(), "t", host="h", devices=[GPU])
    state, _ = composed(state, "u", host="h", devices=[GPU], lease_seconds=60)
    state = apply(state, report_fault(state, "g1")[0])

    events, _ = run(state, ExpireLeases(request_id="x"), now=NOW + timedelta(seconds=60))

    assert [type(e) for e in events[:2]] == [LeaseExpired, CompositionReleased]
    _mended_by(events, t.composition_id, "devices freed by an expired lease")


def test_a_failed_compose_gives_what_it_held_to_an_impaired_composition() -> None:
    state, t = composed(one_path_each(), "t", host="h", devices=[GPU])
    # u's compose of g2 is pending when g1 fails, so t cannot take g2; the fabric then fails
    # u's compose.
    events, pending = compose_pending(state, "u", host="h", device_ids=["g2"])
    state = apply(state, events)
    state = apply(state, report_fault(state, "g1")[0])
    assert state.impaired == {t.composition_id}
    fail = FailComposition(
        request_id=settle_request_id(pending.composition_id),
        composition_id=pending.composition_id,
        step="bind",
        target="g2",
    )

    events, _ = run(state, fail, "engine")

    _mended_by(events, t.composition_id, "devices freed by a failed compose")


@pytest.mark.parametrize("end", ["cancel", "expire"])
def test_a_reservation_that_ends_gives_its_devices_to_an_impaired_composition(end: str) -> None:
    state, t = composed(one_path_each(), "t", host="h", devices=[GPU])
    body = {"request_id": "r", "manifest": {"host": "h", "device_ids": ["g2"]}}
    made, _ = run(state, msgspec.convert({**body, "duration_seconds": 60}, Reserve), "u")
    state = apply(state, made)
    state = apply(state, report_fault(state, "g1")[0])
    assert state.impaired == {t.composition_id}
    rid = state.reserved_by["g2"]

    if end == "cancel":
        events, _ = run(state, CancelReservation(request_id="c", reservation_id=rid), "u")
        why = "devices freed by a cancelled reservation"
    else:
        later = NOW + timedelta(seconds=60)
        events, _ = run(state, ExpireReservations(request_id="e"), now=later)
        why = "devices freed by an expired reservation"

    _mended_by(events, t.composition_id, why)
    assert apply(state, events).reserved_by == {}


def test_a_node_added_where_a_path_can_reach_it_mends_an_impaired_composition() -> None:
    """h - sw - g1 alone: g1 fails and t is impaired; a new GPU cabled to sw takes its place
    (AddNode, then AddLink: the link is what makes it reachable)."""
    b = FabricBuilder().host("h").switch("sw").gpu("g1")
    b.link("h", "sw", id="l-h").link("sw", "g1", id="l-1")
    state, t = composed(b.state(), "t", host="h", devices=[GPU])
    state = apply(state, report_fault(state, "g1")[0])
    gpu = msgspec.convert(
        {"id": "g9", "kind": "device", "device_kind": "gpu", "generation": 8}, NodeSpec
    )
    node_events, added = run(state, AddNode(request_id="n", node=gpu))
    assert added.moved == [] and state.impaired  # unreachable yet: still impaired
    state = apply(state, node_events)
    link = LinkSpec(id="l-9", a="sw", b="g9", capacity_gbps=256)

    events, outcome = run(state, AddLink(request_id="l", link=link))

    replaced = next(e for e in events if isinstance(e, DeviceReplaced))
    assert (replaced.old_device, replaced.binding.device) == ("g1", "g9")
    assert replaced.reason == "l-9 added"
    assert outcome.compositions == [t.composition_id] and outcome.impaired == []
    assert [m.to for m in outcome.moved] == ["g9"]
    assert apply(state, events).impaired == frozenset()


def test_a_repair_that_mends_one_path_of_two_stops_naming_what_it_moved_off() -> None:
    """h - sw - {g1, g2}, both held: g1 and g2 fail, nothing replaces them; a new GPU mends
    g1's path only. `impaired_by` named g1 until the composition was whole again."""
    b = FabricBuilder().host("h").switch("sw").gpu("g1").gpu("g2")
    b.link("h", "sw", id="l-h").link("sw", "g1", id="l-1").link("sw", "g2", id="l-2")
    state, t = composed(b.state(), "t", host="h", devices=[{"kind": "gpu", "count": 2}])
    for gpu in ("g1", "g2"):
        state = apply(state, report_fault(state, gpu)[0])
    assert state.compositions[t.composition_id].impaired_by == ["g1", "g2"]
    spare = msgspec.convert({"id": "g9", "kind": "device", "device_kind": "gpu"}, NodeSpec)
    state = apply(state, run(state, AddNode(request_id="n", node=spare))[0])
    link = LinkSpec(id="l-9", a="sw", b="g9", capacity_gbps=256)

    events, _ = run(state, AddLink(request_id="l", link=link))

    replaced = [e for e in events if isinstance(e, DeviceReplaced)]
    assert [(e.old_device, e.binding.device) for e in replaced] == [("g1", "g9")]
    after = apply(state, events).compositions[t.composition_id]
    assert after.state == "impaired" and after.impaired_by == ["g2"]


def test_with_nothing_impaired_a_release_records_only_itself() -> None:
    state, t = composed(one_path_each(), "t", host="h", devices=[GPU])
    assert state.impaired == frozenset()

    events, _ = release(state, "t", t.composition_id)

    assert [type(e) for e in events] == [CompositionReleased]


def test_a_drain_that_moves_a_composition_gives_the_device_it_left_to_an_impaired_one() -> None:
    """hA reaches g1 only over s1 (and g3 over s3); hB reaches g1 and g2 over s2. t holds g1
    from hA, u holds g2 from hB, and g2 fails: u is impaired (g1 taken, g3 out of reach).
    Draining s1 moves t to g3, and the g1 it left, healthy, mends u in the same decision (an
    operator's probe: it stayed impaired until an unrelated undrain)."""
    b = FabricBuilder().host("hA").host("hB").switch("s1").switch("s2").switch("s3")
    b.gpu("g1", generation=8).gpu("g2", generation=9).gpu("g3", generation=10)
    b.link("hA", "s1").link("s1", "g1").link("hA", "s3").link("s3", "g3")
    b.link("hB", "s2").link("s2", "g1").link("s2", "g2")
    state, t = composed(b.state(), "t", host="hA", devices=[GPU])
    state, u = composed(state, "u", host="hB", devices=[GPU])
    assert [d.id for d in t.devices] == ["g1"] and [d.id for d in u.devices] == ["g2"]
    state = apply(state, report_fault(state, "g2")[0])
    assert state.impaired == {u.composition_id}

    events, outcome = run(state, Drain(request_id="d", id="s1"))

    replaced = [
        (e.composition_id, e.old_device, e.binding.device, e.reason)
        for e in events
        if isinstance(e, DeviceReplaced)
    ]
    assert replaced == [
        (t.composition_id, "g1", "g3", "s1 drained"),
        (u.composition_id, "g2", "g1", "devices freed by a move"),
    ]
    assert outcome.impaired == [] and outcome.compositions == sorted(
        [t.composition_id, u.composition_id]
    )
    after = apply(state, events)
    assert after.impaired == frozenset() and after.device_owner["g1"] == u.composition_id


def test_an_intent_that_frees_capacity_tries_a_few_impaired_compositions_in_turn() -> None:
    """After a spine's fault left 183 compositions impaired, trying them all made every
    release take 290 ms: a release tries TRIES_PER_FREEING of them, the first ids after its
    request id, wrapping, so successive releases go round them all."""
    state = msgspec.structs.replace(
        DomainState(domain="d"), impaired=frozenset({"c-1", "c-2", "c-3", "c-4"})
    )
    assert TRIES_PER_FREEING == 2
    assert in_turn(state, "c-1", 2) == {"c-2", "c-3"}
    assert in_turn(state, "c-3x", 2) == {"c-4", "c-1"}  # wraps
    assert in_turn(state, "a", 9) == state.impaired
    seen: set[str] = set()
    for request_id in ("c-0", "c-2"):  # two releases cover all four
        seen |= in_turn(state, request_id, TRIES_PER_FREEING)
    assert seen == state.impaired
