"""Section-5 path semantics, one rule per test, on small hand-built fabrics with known answers.

Given a fabric (and the events of earlier intents), when a tenant composes, releases, extends
or an operator reports a fault, then the events, the chosen paths and the state indexes are
exactly what ARCHITECTURE.md sections 4 and 5 say.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgspec
import pytest
from fabric_builder import (
    NOW,
    FabricBuilder,
    apply,
    compose,
    composed,
    drain,
    extend,
    release,
    report_fault,
)

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CircuitCreated,
    CircuitRemoved,
    CompositionImpaired,
    CompositionRejected,
    CompositionReleased,
    Event,
)
from trellis.engine.core.intents import LEASE_SECONDS_RANGE
from trellis.engine.core.records import format_time
from trellis.engine.core.state import DomainState

GPU: dict[str, Any] = {"kind": "gpu"}
MEMORY_16: dict[str, Any] = {"kind": "memory", "capacity_gib": 16}


def encoded(state: DomainState) -> bytes:
    return msgspec.json.encode(state)


def rejected(events: list[Event], result: object, code: str) -> IntentRejected:
    """The result is a recorded rejection with `code`: one CompositionRejected event."""
    assert isinstance(result, IntentRejected), result
    assert result.code == code, f"{result.code}: {result.message}"
    assert [type(e) for e in events] == [CompositionRejected]
    return result


def paths(result: Any) -> list[list[str]]:
    return [d.path for d in result.devices]


def funnel(error: IntentRejected) -> list[tuple[str, int, int]]:
    return [(s["stage"], s["removed"], s["remaining"]) for s in error.details["funnel"]]


def two_routes() -> FabricBuilder:
    """h reaches g over sw-1 (l-01, l-02) or over sw-2 (l-03, l-04); sw-1 wins by id."""
    b = FabricBuilder().host("h").switch("sw-1").switch("sw-2").gpu("g")
    return b.chain("h", "sw-1", "g").chain("h", "sw-2", "g")


# ---- usable paths ----


def test_without_faults_the_path_goes_over_the_switch_with_the_smaller_id() -> None:
    _, result = compose(two_routes().state(), "t", host="h", devices=[GPU])
    assert paths(result) == [["h", "sw-1", "g"]]


@pytest.mark.parametrize(
    ("component", "how"),
    [
        ("l-01", "failed"),
        ("l-02", "degraded"),
        ("sw-1", "failed"),
        ("sw-1", "degraded"),
        ("sw-1", "drained"),
        ("l-01", "drained"),
    ],
)
def test_a_failed_degraded_or_drained_component_is_avoided(component: str, how: str) -> None:
    state = two_routes().state()
    events, _ = drain(state, component) if how == "drained" else report_fault(state, component, how)
    _, result = compose(apply(state, events), "t", host="h", devices=[GPU])
    assert paths(result) == [["h", "sw-2", "g"]]


def test_a_device_with_no_usable_path_is_rejected_with_no_path() -> None:
    state = two_routes().state()
    for component in ("l-01", "sw-2"):
        state = apply(state, report_fault(state, component)[0])
    events, result = compose(state, "t", host="h", devices=[GPU])
    error = rejected(events, result, "no_path")
    assert funnel(error)[4] == ("hops", 1, 0)


def test_a_device_that_is_not_cabled_at_all_is_rejected_with_no_path() -> None:
    state = FabricBuilder().host("h").switch("sw").gpu("g").chain("h", "sw").state()
    rejected(*compose(state, "t", host="h", devices=[GPU]), "no_path")


def test_a_failed_device_is_not_a_candidate_so_the_request_has_no_capacity() -> None:
    state = two_routes().state()
    state = apply(state, report_fault(state, "g")[0])
    error = rejected(*compose(state, "t", host="h", devices=[GPU]), "no_capacity")
    assert funnel(error)[:2] == [("kind and model", 0, 1), ("health", 1, 0)]


def test_a_drained_host_cannot_compose() -> None:
    state = two_routes().state()
    state = apply(state, drain(state, "h")[0])
    error = rejected(*compose(state, "t", host="h", devices=[GPU]), "no_path")
    assert "drained" in error.message


def test_hosts_and_devices_are_endpoints_never_passed_through() -> None:
    # The only way to g2 would pass through host h2 or device g1.
    b = FabricBuilder().host("h").host("h2").gpu("g1").gpu("g2").nic("n")
    state = b.chain("h", "h2", "g2").chain("h", "n", "g2").state()
    rejected(*compose(state, "t", host="h", device_ids=["g2"]), "no_path")


def test_a_devices_entry_leaves_the_devices_named_in_device_ids_to_them() -> None:
    # g1 is the nearer GPU, so the `devices` entry would take it, and g1 by id found it held.
    b = FabricBuilder().host("h").switch("sw").gpu("g1").gpu("g2")
    state = b.chain("h", "g1").chain("h", "sw", "g2").state()
    _, result = composed(state, "t", host="h", devices=[GPU], device_ids=["g1"])
    assert sorted(paths(result)) == [["h", "g1"], ["h", "sw", "g2"]]
    # With only the named one free, the entry finds nothing, and the funnel counts g1 held.
    b = FabricBuilder().host("h").gpu("g1")
    error = rejected(
        *compose(b.chain("h", "g1").state(), "t", host="h", devices=[GPU], device_ids=["g1"]),
        "no_capacity",
    )
    assert funnel(error)[:3] == [("kind and model", 0, 1), ("health", 0, 1), ("free", 1, 0)]


# ---- hops ----


def line_of_switches(n: int) -> FabricBuilder:
    """h - sw-1 - ... - sw-n - g: n + 1 hops."""
    b = FabricBuilder().host("h").gpu("g")
    for i in range(1, n + 1):
        b.switch(f"sw-{i}")
    return b.chain("h", *(f"sw-{i}" for i in range(1, n + 1)), "g")


def test_max_hops_is_an_upper_bound_met_exactly_by_a_path_of_that_length() -> None:
    _, result = compose(
        line_of_switches(2).state(), "t", host="h", devices=[GPU], constraints={"max_hops": 3}
    )
    assert [d.hops for d in result.devices] == [3]


def test_a_path_one_hop_longer_than_max_hops_is_rejected_naming_the_nearest_miss() -> None:
    events, result = compose(
        line_of_switches(2).state(), "t", host="h", devices=[GPU], constraints={"max_hops": 2}
    )
    error = rejected(events, result, "no_path")
    assert "nearest: g at 3 hops" in error.message
    assert error.details["nearest"]["hops"] == 3


def test_a_path_through_an_ocs_counts_link_in_circuit_and_link_out_as_three_hops() -> None:
    b = FabricBuilder().host("h").ocs("o").gpu("g").chain("h", "o", "g")
    state = b.state()
    _, result = compose(state, "t", host="h", devices=[GPU], constraints={"max_hops": 3})
    assert [(d.path, d.hops) for d in result.devices] == [(["h", "o", "g"], 3)]
    rejected(*compose(state, "t", host="h", devices=[GPU], constraints={"max_hops": 2}), "no_path")


# ---- latency ----


def latency_fabric() -> FabricBuilder:
    """h -10ns- sw(150) -20ns- ocs(30) -40ns- g: 10 + 150 + 20 + 30 + 40 = 250 ns."""
    b = FabricBuilder().host("h").switch("sw", latency_ns=150).ocs("o", latency_ns=30).gpu("g")
    return b.link("h", "sw", ns=10).link("sw", "o", ns=20).link("o", "g", ns=40)


def test_latency_counts_link_latencies_plus_every_switch_and_ocs_passed() -> None:
    state = latency_fabric().state()
    _, result = compose(state, "t", host="h", devices=[GPU], constraints={"max_latency_ns": 250})
    assert [(d.latency_ns, d.hops) for d in result.devices] == [(250, 4)]


def test_a_path_one_ns_over_max_latency_is_rejected_naming_its_latency() -> None:
    state = latency_fabric().state()
    events, result = compose(
        state, "t", host="h", devices=[GPU], constraints={"max_latency_ns": 249}
    )
    error = rejected(events, result, "no_path")
    assert "nearest: g at 250 ns" in error.message
    assert funnel(error)[4:6] == [("hops", 0, 1), ("latency", 1, 0)]


def short_slow_long_fast() -> FabricBuilder:
    """h - slow(1000) - g is 2 hops, 1000 ns; h - fa(10) - fb(10) - g is 3 hops, 20 ns."""
    b = FabricBuilder().host("h").gpu("g").switch("slow", latency_ns=1000)
    b.switch("fa", latency_ns=10).switch("fb", latency_ns=10)
    return b.chain("h", "slow", "g").chain("h", "fa", "fb", "g")


def test_without_a_latency_bound_the_path_with_fewer_hops_wins_even_if_slower() -> None:
    _, result = compose(short_slow_long_fast().state(), "t", host="h", devices=[GPU])
    assert paths(result) == [["h", "slow", "g"]]


def test_a_longer_but_faster_path_is_chosen_when_the_short_one_breaks_the_latency_bound() -> None:
    _, result = compose(
        short_slow_long_fast().state(),
        "t",
        host="h",
        devices=[GPU],
        constraints={"max_latency_ns": 500},
    )
    assert [(d.path, d.hops, d.latency_ns) for d in result.devices] == [
        (["h", "fa", "fb", "g"], 3, 20)
    ]


def test_hop_and_latency_bounds_must_hold_together() -> None:
    state = short_slow_long_fast().state()
    bounds = {"max_latency_ns": 500, "max_hops": 2}
    rejected(*compose(state, "t", host="h", devices=[GPU], constraints=bounds), "no_path")


# ---- bandwidth ----


def narrow_uplink() -> FabricBuilder:
    """h -100 Gbps- sw, and g1, g2, g3 behind sw on wide links."""
    b = FabricBuilder().host("h").switch("sw").gpu("g1").gpu("g2").gpu("g3")
    b.link("h", "sw", id="up", gbps=100)
    return b.chain("sw", "g1").chain("sw", "g2").chain("sw", "g3")


def test_bandwidth_reservations_add_up_across_compositions() -> None:
    state, _ = composed(
        narrow_uplink().state(), "t", host="h", devices=[{**GPU, "bandwidth_gbps": 60}]
    )
    assert state.reserved_gbps["up"] == 60
    events, result = compose(state, "u", host="h", devices=[{**GPU, "bandwidth_gbps": 60}])
    error = rejected(events, result, "no_path")
    assert funnel(error)[-1] == ("bandwidth", 2, 0)
    assert "short of bandwidth" in error.message
    state, _ = composed(state, "u", host="h", devices=[{**GPU, "bandwidth_gbps": 40}])
    assert state.reserved_gbps["up"] == 100  # exactly full still fits


def test_bandwidth_reservations_add_up_across_the_devices_of_one_request() -> None:
    state = narrow_uplink().state()
    two = [{**GPU, "count": 2, "bandwidth_gbps": 60}]
    error = rejected(*compose(state, "t", host="h", devices=two), "no_path")
    assert (error.details["needed"], error.details["found"]) == (2, 1)
    state, _ = composed(state, "t", host="h", devices=[{**GPU, "count": 2, "bandwidth_gbps": 50}])
    assert state.reserved_gbps["up"] == 100


def test_the_second_device_of_a_request_routes_around_the_first_ones_reservation() -> None:
    b = FabricBuilder().host("h").switch("sw-1").switch("sw-2").gpu("g1").gpu("g2")
    b.link("h", "sw-1", gbps=100).link("h", "sw-2", gbps=100).link("sw-2", "sw-1")
    state = b.chain("sw-1", "g1").chain("sw-1", "g2").state()
    _, result = compose(state, "t", host="h", devices=[{**GPU, "count": 2, "bandwidth_gbps": 60}])
    assert paths(result) == [["h", "sw-1", "g1"], ["h", "sw-2", "sw-1", "g2"]]


# ---- OCS circuits ----


def ocs_behind_one_cable() -> FabricBuilder:
    """h -p0- o -p1- sw - {g1, g2}: both GPUs need the circuit p0-p1."""
    b = FabricBuilder().host("h").ocs("o", ports=4).switch("sw").gpu("g1").gpu("g2")
    return b.chain("h", "o", "sw").chain("sw", "g1").chain("sw", "g2")


def test_a_new_circuit_is_created_on_two_free_ports_for_the_host() -> None:
    events, result = compose(ocs_behind_one_cable().state(), "t", host="h", device_ids=["g1"])
    cid = result.composition_id
    created = [e for e in events if isinstance(e, CircuitCreated)]
    assert created == [CircuitCreated(ocs="o", a_port=0, b_port=1, host="h", composition_id=cid)]


def test_a_second_composition_of_the_same_host_reuses_the_existing_circuit() -> None:
    state, _ = composed(ocs_behind_one_cable().state(), "t", host="h", device_ids=["g1"])
    events, result = compose(state, "t", host="h", device_ids=["g2"])
    assert not [e for e in events if isinstance(e, CircuitCreated)]
    assert paths(result) == [["h", "o", "sw", "g2"]]
    state = apply(state, events)
    assert {k: (c.a_port, c.b_port, c.host) for k, c in state.circuits.items()} == {
        "o:0": (0, 1, "h"),
        "o:1": (0, 1, "h"),
    }


def test_each_ocs_port_is_in_at_most_one_circuit() -> None:
    # h has one cable into o (p0); once p0-p1 exists, p0-p2 cannot be made for g2.
    b = FabricBuilder().host("h").ocs("o", ports=4).gpu("g1").gpu("g2")
    state = b.chain("h", "o", "g1").chain("o", "g2").state()
    state, _ = composed(state, "t", host="h", device_ids=["g1"])
    rejected(*compose(state, "t", host="h", device_ids=["g2"]), "no_path")


def test_a_port_in_another_hosts_circuit_is_never_used() -> None:
    # h1 -p0, h2 -p1, p2- sw - {g1, g3}, p3- g2. h1's circuit p0-p2 walls sw off from h2.
    b = FabricBuilder().host("h1").host("h2").ocs("o", ports=4).switch("sw")
    b.gpu("g1").gpu("g2").gpu("g3")
    b.chain("h1", "o").chain("h2", "o").chain("o", "sw").chain("o", "g2")
    state = b.chain("sw", "g1").chain("sw", "g3").state()
    state, _ = composed(state, "a", host="h1", device_ids=["g1"])
    rejected(*compose(state, "b", host="h2", device_ids=["g3"]), "no_path")
    events, result = compose(state, "b", host="h2", devices=[GPU])
    assert paths(result) == [["h2", "o", "g2"]]
    created = [(e.a_port, e.b_port, e.host) for e in events if isinstance(e, CircuitCreated)]
    assert created == [(1, 3, "h2")]


def test_a_circuit_shared_by_compositions_is_removed_only_when_the_last_one_releases() -> None:
    state, first = composed(ocs_behind_one_cable().state(), "t", host="h", device_ids=["g1"])
    state, second = composed(state, "t", host="h", device_ids=["g2"])
    events, result = release(state, "t", first.composition_id)
    assert not [e for e in events if isinstance(e, CircuitRemoved)]
    assert result.circuits_removed == []
    state = apply(state, events)
    assert len(state.circuits) == 2
    events, result = release(state, "t", second.composition_id)
    assert events[1:] == [
        CircuitRemoved(
            ocs="o",
            a_port=0,
            b_port=1,
            host="h",
            reason="unused",
            composition_id=second.composition_id,
        )
    ]
    assert result.circuits_removed == ["o:0-1"]
    assert apply(state, events).circuits == {}


# ---- exclusive isolation ----


def two_switches_two_gpus_each() -> FabricBuilder:
    """h - sw-1 - {g1, g2}, h - sw-2 - {g3, g4}."""
    b = FabricBuilder().host("h").switch("sw-1").switch("sw-2")
    b.gpu("g1").gpu("g2").gpu("g3").gpu("g4")
    return (
        b.chain("h", "sw-1", "g1").chain("sw-1", "g2").chain("h", "sw-2", "g3").chain("sw-2", "g4")
    )


EXCLUSIVE = {"isolation": "exclusive"}


def test_another_tenant_cannot_path_through_a_switch_held_exclusively() -> None:
    state = two_switches_two_gpus_each().state()
    state, _ = composed(state, "a", host="h", device_ids=["g1"], constraints=EXCLUSIVE)
    # g2 is free: what stands in the way is the path (isolation is a path rule).
    error = rejected(*compose(state, "b", host="h", device_ids=["g2"]), "no_path")
    assert funnel(error)[3] == ("isolation and labels", 1, 0)
    _, result = compose(state, "b", host="h", devices=[GPU])
    assert paths(result) == [["h", "sw-2", "g3"]]


def test_the_holding_tenant_may_keep_using_its_exclusive_switch() -> None:
    state = two_switches_two_gpus_each().state()
    state, _ = composed(state, "a", host="h", device_ids=["g1"], constraints=EXCLUSIVE)
    _, result = compose(state, "a", host="h", devices=[GPU])
    assert paths(result) == [["h", "sw-1", "g2"]]


def test_an_exclusive_request_avoids_switches_other_tenants_use() -> None:
    state = two_switches_two_gpus_each().state()
    state, _ = composed(state, "a", host="h", device_ids=["g1"])
    _, result = compose(state, "b", host="h", devices=[GPU], constraints=EXCLUSIVE)
    assert paths(result) == [["h", "sw-2", "g3"]]


def test_a_released_exclusive_composition_frees_its_switches_for_others() -> None:
    state = two_switches_two_gpus_each().state()
    state, held = composed(state, "a", host="h", device_ids=["g1"], constraints=EXCLUSIVE)
    state = apply(state, release(state, "a", held.composition_id)[0])
    assert state.exclusive_tenants == {} and state.switch_tenants == {}
    _, result = compose(state, "b", host="h", devices=[GPU])
    assert paths(result) == [["h", "sw-1", "g1"]]


def test_an_ocs_does_not_count_for_exclusive_isolation() -> None:
    b = FabricBuilder().host("h1").host("h2").ocs("o", ports=4).gpu("g1").gpu("g2")
    state = b.chain("h1", "o", "g1").chain("h2", "o", "g2").state()
    state, _ = composed(state, "a", host="h1", devices=[GPU], constraints=EXCLUSIVE)
    _, result = compose(state, "b", host="h2", devices=[GPU], constraints=EXCLUSIVE)
    assert paths(result) == [["h2", "o", "g2"]]


# ---- labels ----


def zoned() -> FabricBuilder:
    b = FabricBuilder().host("h").switch("sw").gpu("g-us", zone="us").gpu("g-eu", zone="eu")
    return b.chain("h", "g-us").chain("h", "sw", "g-eu")


def test_label_constraints_pick_the_matching_device_even_when_farther() -> None:
    state = zoned().state()
    _, result = compose(state, "t", host="h", devices=[GPU], constraints={"labels": {"zone": "eu"}})
    assert [d.id for d in result.devices] == ["g-eu"]


def test_label_constraints_that_no_device_matches_leave_no_capacity() -> None:
    state = zoned().state()
    events, result = compose(
        state, "t", host="h", devices=[GPU], constraints={"labels": {"zone": "ap"}}
    )
    error = rejected(events, result, "no_capacity")
    assert funnel(error)[3] == ("isolation and labels", 2, 0)


# ---- tie-breaks for the path to one device ----


def test_tie_break_fewest_hops_first() -> None:
    b = FabricBuilder().host("h").switch("a").switch("b").switch("c").gpu("g")
    state = b.chain("h", "a", "b", "g").chain("h", "c", "g").state()
    assert paths(compose(state, "t", host="h", devices=[GPU])[1]) == [["h", "c", "g"]]


def test_tie_break_lowest_latency_among_equal_hops() -> None:
    b = FabricBuilder().host("h").switch("a", latency_ns=200).switch("b", latency_ns=100)
    state = b.gpu("g").chain("h", "a", "g").chain("h", "b", "g").state()
    result = compose(state, "t", host="h", devices=[GPU])[1]
    assert [(d.path, d.latency_ns) for d in result.devices] == [(["h", "b", "g"], 100)]


def test_tie_break_smallest_node_id_sequence_among_equal_hops_and_latency() -> None:
    b = FabricBuilder().host("h").switch("b").switch("a").switch("z").switch("c").gpu("g")
    state = b.chain("h", "b", "a", "g").chain("h", "b", "z", "g").chain("h", "c", "g").state()
    assert paths(compose(state, "t", host="h", devices=[GPU])[1]) == [["h", "c", "g"]]
    state = b.state(*report_fault(state, "c")[0])
    assert paths(compose(state, "t", host="h", devices=[GPU])[1]) == [["h", "b", "a", "g"]]


def test_tie_break_parallel_cables_are_taken_lowest_link_id_first() -> None:
    b = FabricBuilder().host("h").switch("sw").gpu("g")
    b.link("h", "sw", id="l-b").link("h", "sw", id="l-a").link("sw", "g", id="l-c")
    state = b.state()
    state, result = composed(state, "t", host="h", devices=[GPU])
    (binding,) = state.compositions[result.composition_id].bindings
    assert binding.links == ["l-a", "l-c"]


def test_tie_break_ocs_ports_are_taken_by_the_lowest_link_id_of_their_cables() -> None:
    b = FabricBuilder().host("h").ocs("o", ports=8).gpu("g")
    b.link("h", "o", b_port=5).link("h", "o", b_port=2).link("o", "g", a_port=7)
    b.link("o", "g", a_port=3)
    events, _ = compose(b.state(), "t", host="h", devices=[GPU])
    created = [(e.a_port, e.b_port) for e in events if isinstance(e, CircuitCreated)]
    # l-01 (port 5) has the lower link id; the exit takes l-03 (port 7) before l-04 (port 3).
    assert created == [(5, 7)]


def test_tie_break_equal_node_sequences_prefer_reusing_an_existing_circuit() -> None:
    # h has cables p0 (l-01) and p1 (l-02) into o; sw hangs on p2 (l-03) and p3 (l-04).
    # With l-01 down the first composition makes p1-p2; once l-01 is back, a new circuit
    # p0-p3 (links l-01, l-04) would have smaller link ids, but reusing p1-p2 wins.
    b = FabricBuilder().host("h").ocs("o", ports=4).switch("sw").gpu("g1").gpu("g2")
    b.link("h", "o").link("h", "o").link("o", "sw").link("o", "sw")
    state = b.chain("sw", "g1").chain("sw", "g2").state()
    state = apply(state, report_fault(state, "l-01")[0])
    state, _ = composed(state, "t", host="h", device_ids=["g1"])
    assert sorted(state.circuits) == ["o:1", "o:2"]
    state = apply(state, report_fault(state, "l-01", "healthy")[0])
    state, result = composed(state, "t", host="h", device_ids=["g2"])
    (binding,) = state.compositions[result.composition_id].bindings
    assert binding.links == ["l-02", "l-03", "l-06"]
    assert sorted(state.circuits) == ["o:1", "o:2"]


# ---- device choice ----


def test_device_choice_prefers_fewer_hops_over_an_older_generation() -> None:
    b = FabricBuilder().host("h").switch("sw").gpu("g-old", generation=7).gpu("g-new")
    state = b.chain("h", "sw", "g-old").chain("h", "g-new").state()
    assert [d.id for d in compose(state, "t", host="h", devices=[GPU])[1].devices] == ["g-new"]


def test_device_choice_prefers_lower_latency_over_an_older_generation() -> None:
    b = FabricBuilder().host("h").gpu("g-old", generation=7).gpu("g-new")
    state = b.link("h", "g-old", ns=20).link("h", "g-new", ns=10).state()
    assert [d.id for d in compose(state, "t", host="h", devices=[GPU])[1].devices] == ["g-new"]


def test_device_choice_takes_the_oldest_generation_before_the_id() -> None:
    b = FabricBuilder().host("h").gpu("g-a", generation=10).gpu("g-b", generation=9)
    b.gpu("g-c", generation=None)
    state = b.chain("h", "g-a").chain("h", "g-b").chain("h", "g-c").state()
    _, result = compose(state, "t", host="h", devices=[{**GPU, "count": 3}])
    assert [d.id for d in result.devices] == ["g-c", "g-b", "g-a"]  # no generation counts as 0


def test_device_choice_falls_back_to_the_smallest_id() -> None:
    b = FabricBuilder().host("h").gpu("g-2").gpu("g-1").gpu("g-3")
    state = b.chain("h", "g-2").chain("h", "g-1").chain("h", "g-3").state()
    _, result = compose(state, "t", host="h", devices=[{**GPU, "count": 2}])
    assert [d.id for d in result.devices] == ["g-1", "g-2"]


def test_min_generation_and_models_filter_before_ranking() -> None:
    b = FabricBuilder().host("h").gpu("g-a", generation=8).gpu("g-b", generation=9)
    b.gpu("g-c", generation=10, model="B200")
    state = b.chain("h", "g-a").chain("h", "g-b").chain("h", "g-c").state()
    entry = {**GPU, "min_generation": 9, "models": ["H100"]}
    assert [d.id for d in compose(state, "t", host="h", devices=[entry])[1].devices] == ["g-b"]


def test_a_model_no_device_has_says_models_match_exactly() -> None:
    """A front-door probe asked for `h100` and read only '0 gpu h100 exist'."""
    b = FabricBuilder().host("h").gpu("g-1", model="H100")
    state = b.chain("h", "g-1").state()
    events, result = compose(state, "t", host="h", devices=[{**GPU, "models": ["h100"]}])
    error = rejected(events, result, "no_capacity")
    assert "0 gpu h100 exist (a model is matched exactly, case included)" in error.message
    # Where the model exists, nothing more is said about it.
    taken = compose(state, "u", host="h", devices=[{**GPU, "models": ["H100"]}])[0]
    events, result = compose(
        apply(state, taken), "t", host="h", devices=[{**GPU, "models": ["H100"]}]
    )
    assert "matched exactly" not in rejected(events, result, "no_capacity").message


def test_devices_entries_are_served_in_order_each_seeing_the_picks_before() -> None:
    b = FabricBuilder().host("h").switch("sw").gpu("g1").gpu("g2").gpu("g3").nic("n1")
    state = b.chain("h", "sw", "g3").chain("h", "g2").chain("h", "g1").chain("h", "n1").state()
    entries = [{"kind": "nic"}, {**GPU, "count": 2}, GPU]
    _, result = compose(state, "t", host="h", devices=entries)
    assert [d.id for d in result.devices] == ["n1", "g1", "g2", "g3"]


# ---- all or nothing ----


def test_a_request_succeeds_whole_or_not_at_all() -> None:
    b = FabricBuilder().host("h").gpu("g1").gpu("g2").memory("m", 100)
    before = b.chain("h", "g1").chain("h", "g2").chain("h", "m").state()
    entries = [{"kind": "memory", "capacity_gib": 10, "bandwidth_gbps": 5}, {**GPU, "count": 3}]
    events, result = compose(before, "t", host="h", devices=entries)
    error = rejected(events, result, "no_capacity")
    assert (error.details["entry"], error.details["found"]) == (1, 2)
    (event,) = events
    assert event.request is not None and event.tenant == "t" and event.code == "no_capacity"
    assert encoded(apply(before, events)) == encoded(before)


# ---- memory slices ----


def test_memory_slices_are_carved_from_one_pool_until_it_is_full() -> None:
    state = FabricBuilder().host("h").memory("m", 100).chain("h", "m").state()
    slice_40 = [{"kind": "memory", "capacity_gib": 40}]
    state, first = composed(state, "a", host="h", devices=slice_40)
    state, _ = composed(state, "b", host="h", devices=slice_40)
    assert state.memory_used == {"m": 80} and state.device_owner == {}
    error = rejected(*compose(state, "c", host="h", devices=slice_40), "no_capacity")
    assert funnel(error)[2] == ("free", 1, 0)
    state, _ = composed(state, "c", host="h", devices=[{"kind": "memory", "capacity_gib": 20}])
    assert state.memory_used == {"m": 100}
    state = apply(state, release(state, "a", first.composition_id)[0])
    assert state.memory_used == {"m": 60}
    state, result = composed(state, "c", host="h", devices=slice_40)
    assert [d.capacity_gib for d in result.devices] == [40]


def test_a_memory_request_takes_the_closest_pool_with_enough_free() -> None:
    b = FabricBuilder().host("h").switch("sw").memory("m-near", 50).memory("m-far", 500)
    state = b.chain("h", "m-near").chain("h", "sw", "m-far").state()
    _, result = compose(state, "t", host="h", devices=[{"kind": "memory", "capacity_gib": 60}])
    assert [d.id for d in result.devices] == ["m-far"]


def test_a_memory_entry_with_count_n_takes_slices_from_n_different_pools() -> None:
    # docs/architecture.md (as built): count n interleaves across n pools.
    b = FabricBuilder().host("h").memory("m1", 100).memory("m2", 100)
    state = b.chain("h", "m1").chain("h", "m2").state()
    entries = [{"kind": "memory", "capacity_gib": 10, "count": 2}]
    state, result = composed(state, "t", host="h", devices=entries)
    assert [d.id for d in result.devices] == ["m1", "m2"]
    assert state.memory_used == {"m1": 10, "m2": 10}
    one_pool = FabricBuilder().host("h").memory("m", 100).chain("h", "m").state()
    error = rejected(*compose(one_pool, "t", host="h", devices=entries), "no_capacity")
    # The one pool is free: it is the slice this entry found, short of the second.
    assert (error.details["found"], funnel(error)[2]) == (1, ("free", 0, 1))


def test_a_composition_holds_at_most_one_slice_of_a_pool() -> None:
    # One binding per device keeps "one row per connected device"; a bigger slice is asked
    # for with a bigger capacity_gib (docs/architecture.md, section 11).
    state = FabricBuilder().host("h").memory("m", 100).chain("h", "m").state()
    entries = [{"kind": "memory", "capacity_gib": 10}, {"kind": "memory", "capacity_gib": 20}]
    _, error = compose(state, "t", host="h", devices=entries)
    assert error.code == "no_capacity"
    assert (error.details["entry"], funnel(error)[2]) == (1, ("free", 1, 0))


# ---- device_ids ----


def test_device_ids_take_the_named_devices_whole() -> None:
    b = FabricBuilder().host("h").gpu("g1").gpu("g2").memory("m", 100)
    state = b.chain("h", "g1").chain("h", "g2").chain("h", "m").state()
    state, result = composed(state, "t", host="h", device_ids=["g2", "m"])
    assert [d.id for d in result.devices] == ["g2", "m"]
    assert state.device_owner == {"g2": result.composition_id, "m": result.composition_id}
    rejected(
        *compose(state, "u", host="h", devices=[{"kind": "memory", "capacity_gib": 1}]),
        "no_capacity",
    )


def test_device_ids_naming_a_busy_device_have_no_capacity() -> None:
    state = FabricBuilder().host("h").gpu("g1").chain("h", "g1").state()
    state, _ = composed(state, "a", host="h", device_ids=["g1"])
    error = rejected(*compose(state, "b", host="h", device_ids=["g1"]), "no_capacity")
    assert funnel(error)[:3] == [("kind and model", 0, 1), ("health", 0, 1), ("free", 1, 0)]


def test_device_ids_naming_a_partly_sliced_memory_pool_have_no_capacity() -> None:
    state = FabricBuilder().host("h").memory("m", 100).chain("h", "m").state()
    state, _ = composed(state, "a", host="h", devices=[{"kind": "memory", "capacity_gib": 1}])
    rejected(*compose(state, "b", host="h", device_ids=["m"]), "no_capacity")


def test_device_ids_naming_an_unknown_device_are_not_found() -> None:
    state = FabricBuilder().host("h").gpu("g1").chain("h", "g1").state()
    events, error = compose(state, "t", host="h", device_ids=["nope"])
    assert events == [] and error.code == "not_found"


# ---- host_selector ----


def test_host_selector_picks_the_matching_host_with_the_shortest_paths() -> None:
    b = FabricBuilder().host("h-a", rack="r1").host("h-b", rack="r1").host("h-c", rack="r2")
    b.switch("sw-1").switch("sw-2").gpu("g")
    state = b.chain("h-a", "sw-1", "sw-2", "g").chain("h-b", "sw-2").chain("h-c", "g").state()
    selector = {"labels": {"rack": "r1"}}
    _, result = compose(state, "t", host_selector=selector, devices=[GPU])
    assert (result.host, paths(result)) == ("h-b", [["h-b", "sw-2", "g"]])
    _, result = compose(state, "t", host_selector={"labels": {}}, devices=[GPU])
    assert result.host == "h-c"


def test_host_selector_matching_no_usable_host_has_no_capacity() -> None:
    state = FabricBuilder().host("h", rack="r1").gpu("g").chain("h", "g").state()
    rejected(
        *compose(state, "t", host_selector={"labels": {"rack": "r9"}}, devices=[GPU]),
        "no_capacity",
    )


# ---- why not ----


def funnel_fabric() -> DomainState:
    """h - s1 - s2 - s3 - s4 - g-far (5 hops); g-busy and g-dead behind s1; a NIC, not a GPU."""
    b = FabricBuilder().host("h").gpu("g-far").gpu("g-busy").gpu("g-dead").nic("n")
    for i in range(1, 5):
        b.switch(f"s{i}")
    b.chain("h", "s1", "s2", "s3", "s4", "g-far").chain("s1", "g-busy").chain("s1", "g-dead")
    state = b.chain("h", "n").state()
    state = apply(state, report_fault(state, "g-dead")[0])
    return composed(state, "other", host="h", device_ids=["g-busy"])[0]


def test_why_not_funnel_counts_each_stage_in_the_contracts_order_and_names_the_nearest() -> None:
    events, result = compose(
        funnel_fabric(), "t", host="h", devices=[GPU], constraints={"max_hops": 4}
    )
    error = rejected(events, result, "no_path")
    assert funnel(error) == [
        ("kind and model", 0, 3),
        ("health", 1, 2),
        ("free", 1, 1),
        ("isolation and labels", 0, 1),
        ("hops", 1, 0),
        ("latency", 0, 0),
        ("bandwidth", 0, 0),
    ]
    assert error.message == (
        "entry 0 needs 1 gpu, found 0: 3 gpu exist, 2 healthy, 1 free, "
        "0 reachable within 4 hops (nearest: g-far at 5 hops)"
    )
    assert events[0].details == error.details


def test_why_not_says_no_capacity_when_nothing_free_is_left_to_path_to() -> None:
    error = rejected(
        *compose(funnel_fabric(), "t", host="h", devices=[{**GPU, "count": 2}]), "no_capacity"
    )
    # g-busy is another's; g-far, the one this entry found, counts as free and reachable (it
    # was: "0 free" read as if nothing had been), and one is all there is for two.
    assert (error.details["found"], funnel(error)[2]) == (1, ("free", 1, 1))
    assert funnel(error)[-1] == ("bandwidth", 0, 1)
    assert "2 healthy, 1 free, 1 reachable" in error.message


def test_why_not_isolation_stage_follows_faults_between_decisions() -> None:
    """Isolation loses what only ignoring it reaches; a device that nothing reaches any more
    after a fault is lost at the hops stage instead, in the very next decision."""
    b = FabricBuilder().host("h").switch("s").gpu("g1").gpu("g2")
    b.link("h", "s").link("s", "g1").link("s", "g2", id="l-g2")
    state, _ = composed(b.state(), "other", host="h", device_ids=["g1"])
    exclusive = {"host": "h", "devices": [GPU], "constraints": EXCLUSIVE}
    error = rejected(*compose(state, "t", **exclusive), "no_path")
    assert funnel(error)[3:5] == [("isolation and labels", 1, 0), ("hops", 0, 0)]
    state = apply(state, report_fault(state, "l-g2")[0])
    error = rejected(*compose(state, "t", **exclusive), "no_path")
    assert funnel(error)[3:5] == [("isolation and labels", 0, 1), ("hops", 1, 0)]
    state = apply(state, report_fault(state, "l-g2", "healthy")[0])
    error = rejected(*compose(state, "t", **exclusive), "no_path")
    assert funnel(error)[3:5] == [("isolation and labels", 1, 0), ("hops", 0, 0)]


def test_why_not_counts_a_port_of_another_hosts_circuit_as_unreachable() -> None:
    """A pool slice held through another host's circuit leaves the pool free but out of
    reach: the funnel loses it at the hops stage, not to isolation."""
    b = FabricBuilder().host("h").host("h2").ocs("o", ports=4).memory("m", 64)
    state = b.chain("h", "o").chain("h2", "o").chain("o", "m").state()
    state, _ = composed(state, "other", host="h2", devices=[MEMORY_16])
    error = rejected(*compose(state, "t", host="h", devices=[MEMORY_16]), "no_path")
    assert funnel(error)[2:5] == [
        ("free", 0, 1),
        ("isolation and labels", 0, 1),
        ("hops", 1, 0),
    ]


# ---- release and extend ----


def test_release_returns_every_reservation_and_circuit() -> None:
    b = FabricBuilder().host("h").ocs("o", ports=4).switch("sw").gpu("g").memory("m", 64)
    before = b.chain("h", "o", "sw", "g").chain("sw", "m").state()
    entries = [{**GPU, "bandwidth_gbps": 10}, {"kind": "memory", "capacity_gib": 32}]
    state, result = composed(before, "t", host="h", devices=entries, constraints=EXCLUSIVE)
    assert state.circuits and state.reserved_gbps and state.memory_used
    assert state.device_owner and state.switch_tenants and state.exclusive_tenants
    events, released = release(state, "t", result.composition_id)
    assert type(events[0]) is CompositionReleased
    assert released.devices == ["g", "m"] and released.circuits_removed == ["o:0-1"]
    assert encoded(apply(state, events)) == encoded(before)


def test_extend_counts_from_the_deadline_while_the_lease_runs() -> None:
    state = FabricBuilder().host("h").gpu("g").chain("h", "g").state()
    state, result = composed(state, "t", host="h", devices=[GPU], lease_seconds=3600)
    assert result.expires_at == NOW + timedelta(hours=1)
    events, extended = extend(
        state, "t", result.composition_id, 600, now=NOW + timedelta(minutes=10)
    )
    assert extended.expires_at == NOW + timedelta(hours=1, minutes=10)
    assert apply(state, events).compositions[result.composition_id].expires_at == (
        extended.expires_at
    )


def test_extend_counts_from_now_once_the_deadline_has_passed() -> None:
    state = FabricBuilder().host("h").gpu("g").chain("h", "g").state()
    state, result = composed(state, "t", host="h", devices=[GPU], lease_seconds=60)
    later = NOW + timedelta(hours=2)
    _, extended = extend(state, "t", result.composition_id, 600, now=later)
    assert extended.expires_at == later + timedelta(minutes=10)


def test_extend_of_a_lease_without_expiry_counts_from_now() -> None:
    state = FabricBuilder().host("h").gpu("g").chain("h", "g").state()
    state, result = composed(state, "t", host="h", devices=[GPU])
    assert result.expires_at is None
    _, extended = extend(state, "t", result.composition_id, 60)
    assert extended.expires_at == NOW + timedelta(seconds=60)


def test_a_lease_ends_at_most_the_longest_lease_from_now_however_it_is_extended() -> None:
    """Extensions of the longest lease each once ran the deadline past year 9999; the 80th
    raised OverflowError in the writer, answered `unavailable`, which no retry mends."""
    longest = LEASE_SECONDS_RANGE[1]
    state = FabricBuilder().host("h").gpu("g").chain("h", "g").state()
    state, result = composed(state, "t", host="h", devices=[GPU], lease_seconds=longest - 60)
    events, extended = extend(state, "t", result.composition_id, 60)
    assert extended.expires_at == NOW + timedelta(seconds=longest)  # exactly the longest: ok
    state = apply(state, events)
    for seconds in (1, longest):
        events, error = extend(state, "t", result.composition_id, seconds)
        assert events == [] and isinstance(error, IntentRejected), error
        assert error.code == "conflict" and "the longest a lease may run" in error.message
        assert error.details["expires_at"] == format_time(extended.expires_at)
    # Once time has passed, the same extension fits again.
    _, later = extend(state, "t", result.composition_id, 1, now=NOW + timedelta(seconds=1))
    assert later.expires_at == NOW + timedelta(seconds=longest + 1)


@pytest.mark.parametrize("verb", ["release", "extend"])
def test_release_or_extend_by_another_tenant_is_not_found_as_for_an_unknown_id(verb: str) -> None:
    state = FabricBuilder().host("h").gpu("g").chain("h", "g").state()
    state, result = composed(state, "a", host="h", devices=[GPU])
    cid = result.composition_id

    def attempt(tenant: str, target: str) -> tuple[list[Any], Any]:
        if verb == "release":
            return release(state, tenant, target)
        return extend(state, tenant, target, 60)

    events, error = attempt("b", cid)
    _, unknown = attempt("b", "c-nothing")
    assert events == [] and error.code == "not_found"
    # Word for word the answer for an id that does not exist: no existence oracle.
    assert error.message == unknown.message.replace("c-nothing", cid)
    assert error.details == {"id": cid} and unknown.details == {"id": "c-nothing"}


@pytest.mark.parametrize("verb", ["release", "extend"])
def test_release_or_extend_of_an_unknown_or_released_composition_is_not_found(verb: str) -> None:
    state = FabricBuilder().host("h").gpu("g").chain("h", "g").state()
    state, result = composed(state, "a", host="h", devices=[GPU])
    state = apply(state, release(state, "a", result.composition_id)[0])
    for cid in ("c-unknown", result.composition_id):
        events, error = (
            release(state, "a", cid) if verb == "release" else extend(state, "a", cid, 9)
        )
        assert events == [] and error.code == "not_found"


# ---- faults impair compositions ----


def three_compositions() -> tuple[DomainState, dict[str, str]]:
    """c1: h - sw-1 - g1; c2: h - sw-1 - g2; c3: h - sw-2 - g3 (links l-01 .. l-06)."""
    b = FabricBuilder().host("h").switch("sw-1").switch("sw-2").gpu("g1").gpu("g2").gpu("g3")
    b.chain("h", "sw-1", "g1").chain("sw-1", "g2").chain("h", "sw-2", "g3")
    state = b.state()
    ids = {}
    for name, device in (("c1", "g1"), ("c2", "g2"), ("c3", "g3")):
        state, result = composed(state, "t", host="h", device_ids=[device])
        ids[name] = result.composition_id
    return state, ids


@pytest.mark.parametrize(
    ("component", "impaired"),
    [("l-02", ["c1"]), ("sw-1", ["c1", "c2"]), ("l-01", ["c1", "c2"]), ("g3", ["c3"])],
)
def test_a_fault_impairs_exactly_the_compositions_whose_paths_use_the_component(
    component: str, impaired: list[str]
) -> None:
    state, ids = three_compositions()
    events, result = report_fault(state, component, "degraded", "flapping")
    hit = sorted(ids[name] for name in impaired)
    assert [e.composition_id for e in events if isinstance(e, CompositionImpaired)] == hit
    assert sorted(result.impaired) == hit
    state = apply(state, events)
    assert sorted(c.id for c in state.compositions.values() if c.state == "impaired") == hit


def test_a_repeated_fault_report_impairs_nothing_again() -> None:
    state, _ = three_compositions()
    state = apply(state, report_fault(state, "sw-1")[0])
    assert report_fault(state, "sw-1")[0] == []


def test_a_fault_on_an_unused_component_or_a_recovery_impairs_nothing() -> None:
    b = FabricBuilder().host("h").switch("sw").gpu("g1").gpu("g2")
    state = b.chain("h", "sw", "g1").chain("sw", "g2").state()
    state, _ = composed(state, "t", host="h", device_ids=["g1"])
    events, _ = report_fault(state, "g2")
    assert not [e for e in events if isinstance(e, CompositionImpaired)]
    events, _ = report_fault(apply(state, events), "g2", "healthy")
    assert not [e for e in events if isinstance(e, CompositionImpaired)]


# ---- regressions ----


# best_paths used to drop every later label at a settled vertex, losing this path (fixed in
# b84f784: a label only dominates one that passed every OCS it passed).
def test_a_feasible_path_is_found_when_the_best_prefix_uses_an_ocs_the_rest_needs() -> None:
    # h -p0- o, o -p1- s1, s1 -p2- o, o -p3- s4 - {gb, gd}, and h - s2 - s3 - s1.
    # gb is composed while l-hx is down (circuit p2-p3 over the long way round), then ga over
    # o (circuit p0-p1). gd is reachable exactly like gb: h s2 s3 s1 o(p2-p3) s4 gd, 7 hops.
    # The best label to s1 goes over o (h o s1 < h s2 s3 s1), and from there o is used up.
    b = FabricBuilder().host("h").ocs("o", ports=4)
    for switch in ("s1", "s2", "s3", "s4"):
        b.switch(switch)
    b.gpu("ga").gpu("gb").gpu("gd")
    b.link("h", "o", id="l-hx").link("o", "s1").link("s1", "o").link("o", "s4")
    b.chain("h", "s2", "s3", "s1").chain("s1", "ga").chain("s4", "gb").chain("s4", "gd")
    state = b.state()
    state = apply(state, report_fault(state, "l-hx")[0])
    state, result = composed(state, "t", host="h", device_ids=["gb"])
    assert paths(result) == [["h", "s2", "s3", "s1", "o", "s4", "gb"]]
    state = apply(state, report_fault(state, "l-hx", "healthy")[0])
    state, result = composed(state, "t", host="h", device_ids=["ga"])
    assert paths(result) == [["h", "o", "s1", "ga"]]
    _, result = compose(state, "t", host="h", device_ids=["gd"])
    assert not isinstance(result, IntentRejected), result.message
    assert paths(result) == [["h", "s2", "s3", "s1", "o", "s4", "gd"]]
