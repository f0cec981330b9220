"""Faults, drains and blast radius on one OCS port ("ocs-1:3"): recorded on the port's cable."""

from __future__ import annotations

import re

import msgspec
import pytest
from core.fabric_builder import FabricBuilder, apply, composed, report_fault, request_id, run

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CircuitCreated,
    CircuitRemoved,
    ComponentDrained,
    ComponentFaulted,
    ComponentRecovered,
    ComponentUndrained,
    CompositionActivated,
    CompositionImpaired,
    DeviceReplaced,
    PathRerouted,
)
from trellis.engine.core.intents import BlastRadiusQuery, Drain, Undrain
from trellis.engine.core.queries import answer
from trellis.engine.core.state import DomainState

GPU = {"kind": "gpu"}


def two_light_paths() -> DomainState:
    """Two disjoint light paths from h to sw through ocs o; o:4 and o:5 have no cable.

    h -l-01- o:0 | o:1 -l-02- sw
    h -l-03- o:2 | o:3 -l-04- sw -l-05- g1
    """
    b = FabricBuilder().host("h").ocs("o", ports=6).switch("sw").gpu("g1")
    b.link("h", "o").link("o", "sw").link("h", "o").link("o", "sw").link("sw", "g1")
    return b.state()


def one_light_path() -> DomainState:
    """h -l-01- o:0 | o:1 -l-02- sw -l-03- g1: no way around."""
    b = FabricBuilder().host("h").ocs("o", ports=4).switch("sw").gpu("g1")
    return b.chain("h", "o", "sw", "g1").state()


def one_port_per_gpu() -> DomainState:
    """h -l-01- o:0, h -l-02- o:1 | o:2 -l-03- g1, o:3 -l-04- g2: each GPU on its own port."""
    b = FabricBuilder().host("h").ocs("o", ports=4).gpu("g1").gpu("g2")
    return b.link("h", "o").link("h", "o").link("o", "g1").link("o", "g2").state()


def on_g1(state: DomainState) -> tuple[DomainState, str]:
    """g1 composed over the lowest ports and links: o:0 -> o:1, l-01 and l-02."""
    state, result = composed(state, "t", host="h", device_ids=["g1"])
    assert result.devices[0].path == ["h", "o", "sw", "g1"]
    assert state.compositions[result.composition_id].bindings[0].links[:2] == ["l-01", "l-02"]
    return state, result.composition_id


def test_a_failed_ocs_port_impairs_the_composition_on_its_cable_and_routes_around_it() -> None:
    state, cid = on_g1(two_light_paths())

    events, outcome = report_fault(state, "o:1", detail="loss of light")

    assert events[0] == ComponentFaulted(
        component="l-02", state="failed", detail="o port 1: loss of light"
    )
    assert [type(e) for e in events[1:]] == [
        CompositionImpaired,
        CircuitRemoved,  # the old light path first: its ports may be needed again
        CircuitCreated,
        PathRerouted,
        CompositionActivated,
    ]
    impaired, rerouted = events[1], events[4]
    assert impaired.component == "l-02" and "o port 1 failed: loss of light" in impaired.reason
    # Port 0 is free again once its old circuit is down, and l-01 sorts before l-03.
    assert rerouted.binding.links == ["l-01", "l-04", "l-05"]
    assert rerouted.binding.circuits[0].a_port == 0 and rerouted.binding.circuits[0].b_port == 3
    assert (outcome.component, outcome.link, outcome.health) == ("o:1", "l-02", "failed")
    assert outcome.compositions == [cid] and outcome.impaired == []
    after = apply(state, events)
    assert after.links["l-02"].health == "failed"
    assert after.links["l-02"].detail == "o port 1: loss of light"  # topology shows the port
    assert after.compositions[cid].state == "active"


def test_a_failed_ocs_port_on_the_device_side_replaces_the_device() -> None:
    state, result = composed(one_port_per_gpu(), "t", host="h", devices=[GPU])
    assert result.devices[0].id == "g1"

    events, outcome = report_fault(state, "o:2")

    assert events[0] == ComponentFaulted(component="l-03", state="failed", detail="o port 2")
    replaced = next(e for e in events if isinstance(e, DeviceReplaced))
    assert (replaced.old_device, replaced.binding.device) == ("g1", "g2")
    after = apply(state, events)
    assert after.compositions[result.composition_id].state == "active"
    assert outcome.compositions == [result.composition_id]


def test_a_fault_on_another_port_of_the_same_ocs_leaves_the_composition_alone() -> None:
    state, cid = on_g1(two_light_paths())

    events, outcome = report_fault(state, "o:3")

    assert events == [ComponentFaulted(component="l-04", state="failed", detail="o port 3")]
    assert outcome.compositions == [] and outcome.link == "l-04"
    assert apply(state, events).compositions[cid].state == "active"


def test_a_port_with_no_way_around_stays_impaired_until_the_port_recovers() -> None:
    state, cid = on_g1(one_light_path())
    events, outcome = report_fault(state, "o:0", "degraded")
    assert [type(e) for e in events] == [ComponentFaulted, CompositionImpaired]
    assert outcome.impaired == [cid]
    state = apply(state, events)

    events, outcome = report_fault(state, "o:0", "healthy", detail="fiber cleaned")

    assert events == [
        ComponentRecovered(component="l-01", detail="o port 0: fiber cleaned"),
        CompositionActivated(composition_id=cid),
    ]
    assert (outcome.component, outcome.link, outcome.health) == ("o:0", "l-01", "healthy")
    after = apply(state, events)
    assert after.links["l-01"].health == "healthy" and after.compositions[cid].state == "active"


def test_a_port_and_its_cable_are_one_light_path() -> None:
    state = two_light_paths()
    state = apply(state, report_fault(state, "l-02")[0])

    again, outcome = report_fault(state, "o:1")  # already failed: nothing new to record
    assert again == [] and outcome.changed is False and outcome.link == "l-02"

    recovered, _ = report_fault(state, "o:1", "healthy")
    assert recovered == [ComponentRecovered(component="l-02", detail="o port 1")]


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("ghost:1", "'ghost' is no node"),
        ("sw:1", "'sw' is a switch, not an ocs"),
        ("l-02:1", "'l-02' is no node"),
        ("o:6", "o has 6 ports \\(0-5\\); there is no port 6"),
        ("o:65536", "there is no port 65536"),
        ("o:4", "port 4 of o has no cable"),
    ],
)
def test_rejects_a_port_that_is_not_there_and_records_nothing(ref: str, message: str) -> None:
    state, _ = on_g1(two_light_paths())
    for health in ("failed", "healthy"):
        events, error = report_fault(state, ref, health)
        assert isinstance(error, IntentRejected) and events == []
        assert error.code == "not_found" and error.details["id"] == ref
        assert re.search(message, error.message), error.message
    with pytest.raises(IntentRejected, match=message):
        answer(state, BlastRadiusQuery(id=ref), "blast-radius")


def test_blast_radius_of_a_port_names_the_compositions_on_its_cable() -> None:
    state, cid = on_g1(two_light_paths())

    used = msgspec.to_builtins(answer(state, BlastRadiusQuery(id="o:1"), "blast-radius"))
    spare = msgspec.to_builtins(answer(state, BlastRadiusQuery(id="o:3"), "blast-radius"))

    assert used["link"] == "l-02" and used["tenants"] == ["t"]
    assert [(c["composition_id"], c["devices"]) for c in used["compositions"]] == [(cid, ["g1"])]
    assert spare == {"link": "l-04", "compositions": [], "tenants": []}
    cable = answer(state, BlastRadiusQuery(id="l-02"), "blast-radius")
    assert "link" not in msgspec.to_builtins(cable)


def test_draining_a_port_moves_compositions_off_its_cable_and_undrain_gives_it_back() -> None:
    state, cid = on_g1(two_light_paths())

    events, outcome = run(state, Drain(request_id=request_id(), id="o:1", reason="swap optic"))

    assert events[0] == ComponentDrained(component="l-02", reason="o port 1: swap optic")
    assert PathRerouted in [type(e) for e in events]
    assert (outcome.component, outcome.link) == ("o:1", "l-02")
    state = apply(state, events)
    assert not state.compositions[cid].uses("l-02")

    events, outcome = run(state, Undrain(request_id=request_id(), id="o:1"))
    assert events == [ComponentUndrained(component="l-02", reason="o port 1")]
    assert apply(state, events).links["l-02"].drained is False


def two_host_cables_one_circuit(gbps: float = 256) -> DomainState:
    """h -l-01- o:0, h -l-02- o:1 (`gbps`) | o:2 -l-03- sw -l-04- g1, sw -l-05- g2: every path
    to sw goes through o:2, so two GPUs composed on h share one circuit, 0-2."""
    b = FabricBuilder().host("h").ocs("o", ports=4).switch("sw").gpu("g1").gpu("g2")
    b.link("h", "o").link("h", "o", gbps=gbps).link("o", "sw")
    return b.link("sw", "g1").link("sw", "g2").state()


def on_one_circuit(state: DomainState, together: bool, gbps: float | None = None) -> DomainState:
    """g1 and g2 composed on h over circuit 0-2: by one composition or by two."""
    entry = {**GPU, "bandwidth_gbps": gbps} if gbps else GPU
    if together:
        state, _ = composed(state, "t", host="h", devices=[{**entry, "count": 2}])
    else:
        state, _ = composed(state, "t", host="h", devices=[entry])
        state, _ = composed(state, "t", host="h", devices=[entry])
    assert {(c.a_port, c.b_port) for c in state.circuits.values()} == {(0, 2)}
    return state


def circuits_and_paths(state: DomainState) -> tuple[set[tuple[int, int]], list[str]]:
    """The circuits up, and each composition's state and circuits, as a check reads them."""
    up = {(c.a_port, c.b_port) for c in state.circuits.values()}
    each = [
        f"{c.state} {sorted({(r.a_port, r.b_port) for b in c.bindings for r in b.circuits})}"
        for c in state.compositions.values()
    ]
    return up, each


@pytest.mark.parametrize("one_composition", [True, False], ids=["one-composition", "two"])
@pytest.mark.parametrize("how", ["fault", "drain"])
def test_paths_sharing_a_circuit_whose_port_goes_down_all_move_to_a_new_one(
    one_composition: bool, how: str
) -> None:
    """The probe's case: a host's two paths share circuit 0-2 and port 0 goes down. Each path
    alone could not move while the other held port 2; together they move to circuit 1-2."""
    state = on_one_circuit(two_host_cables_one_circuit(), one_composition)

    events, _ = report_fault(state, "o:0") if how == "fault" else run(state, Drain(
        request_id=request_id(), id="o:0"))  # fmt: skip

    first = min(state.compositions)  # repaired first: the circuit comes down with its path
    assert [e for e in events if isinstance(e, CircuitRemoved | CircuitCreated)] == [
        CircuitRemoved(
            ocs="o", a_port=0, b_port=2, host="h", reason="unused after repair",
            composition_id=first,
        ),
        CircuitCreated(ocs="o", a_port=1, b_port=2, host="h", composition_id=first),
    ]  # fmt: skip
    assert sum(isinstance(e, PathRerouted) for e in events) == 2
    after = apply(state, events)
    up, each = circuits_and_paths(after)
    assert up == {(1, 2)} and set(each) == {"active [(1, 2)]"}, each


@pytest.mark.parametrize("how", ["fault", "drain"])
def test_a_shared_circuit_stays_up_while_a_path_on_it_cannot_move(how: str) -> None:
    """Only one of the two paths fits the other cable (150 Gbps, 100 each): moving one would
    take the circuit down under the other. A drained port still carries it, and a failed one
    is no worse with the circuit kept: neither moves, both wait impaired, circuit 0-2 stays."""
    state = on_one_circuit(two_host_cables_one_circuit(gbps=150), False, gbps=100)

    events, outcome = report_fault(state, "o:0") if how == "fault" else run(state, Drain(
        request_id=request_id(), id="o:0"))  # fmt: skip

    assert not [e for e in events if isinstance(e, CircuitRemoved | CircuitCreated | PathRerouted)]
    up, each = circuits_and_paths(apply(state, events))
    assert up == {(0, 2)} and each == ["impaired [(0, 2)]"] * 2, each
    assert sorted(outcome.impaired) == sorted(state.compositions)
