"""decide/evolve for topology intents: given events, when an intent, then events or a rejection."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import reduce

import msgspec
import pytest

from trellis.engine.core.decide import Context, decide
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    ComponentDrained,
    ComponentFaulted,
    ComponentRecovered,
    ComponentRemoved,
    Event,
    LinkAdded,
    NodeAdded,
    TopologyImported,
)
from trellis.engine.core.intents import (
    AddLink,
    AddNode,
    Drain,
    ImportTopology,
    Remove,
    ReportFault,
    Undrain,
)
from trellis.engine.core.model import LinkSpec, NodeSpec
from trellis.engine.core.state import DomainState, evolve

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

NODES = [
    NodeSpec(id="host-1", kind="host"),
    NodeSpec(id="sw-1", kind="switch", latency_ns=150),
    NodeSpec(id="ocs-1", kind="ocs", ports=4, latency_ns=30),
    NodeSpec(id="gpu-1", kind="device", device_kind="gpu", model="H100", generation=9),
]
LINKS = [
    LinkSpec(id="l-1", a="host-1", b="sw-1", capacity_gbps=256),
    LinkSpec(id="l-2", a="sw-1", b="ocs-1", b_port=0, capacity_gbps=256),
    LinkSpec(id="l-3", a="gpu-1", b="ocs-1", b_port=1, capacity_gbps=64),
]


def ctx(verb: str = "test") -> Context:
    return Context(domain="d1", actor="operator", verb=verb, now=NOW)


def given(*events: Event) -> DomainState:
    return reduce(evolve, events, DomainState(domain="d1"))


def imported() -> DomainState:
    return given(TopologyImported(nodes=NODES, links=LINKS))


def test_import_into_empty_domain_records_one_event_listing_everything_added() -> None:
    decision = decide(given(), ImportTopology(request_id="r", nodes=NODES, links=LINKS), ctx())
    (event,) = decision.events
    assert isinstance(event, TopologyImported)
    assert event.added == sorted([n.id for n in NODES] + [lk.id for lk in LINKS])
    assert decision.result.unchanged is False


def test_reimport_of_the_same_content_records_nothing() -> None:
    reordered = ImportTopology(request_id="r2", nodes=NODES[::-1], links=LINKS[::-1])
    decision = decide(imported(), reordered, ctx())
    assert decision.events == []
    assert decision.result.unchanged is True


def test_reimport_with_changes_lists_added_updated_and_removed() -> None:
    nodes = [*NODES[:3], NodeSpec(id="gpu-2", kind="device", device_kind="gpu")]
    links = [LINKS[0], msgspec.structs.replace(LINKS[1], capacity_gbps=128)]
    decision = decide(imported(), ImportTopology(request_id="r", nodes=nodes, links=links), ctx())
    (event,) = decision.events
    assert (event.added, event.updated, event.removed) == (["gpu-2"], ["l-2"], ["gpu-1", "l-3"])


def test_reimport_keeps_drain_and_health_marks_of_components_that_stay() -> None:
    state = given(
        TopologyImported(nodes=NODES, links=LINKS),
        ComponentDrained(component="sw-1"),
        ComponentFaulted(component="l-1", state="failed"),
    )
    changed = [*NODES, NodeSpec(id="host-2", kind="host")]
    (event,) = decide(
        state, ImportTopology(request_id="r", nodes=changed, links=LINKS), ctx()
    ).events
    after = evolve(state, event)
    assert after.nodes["sw-1"].drained and after.links["l-1"].health == "failed"
    assert "host-2" in after.nodes


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([LinkSpec(id="x", a="host-1", b="nope", capacity_gbps=1)], "unknown node"),
        ([LinkSpec(id="x", a="sw-1", b="ocs-1", capacity_gbps=1)], "without a port"),
        ([LinkSpec(id="x", a="sw-1", b="ocs-1", b_port=4, capacity_gbps=1)], "outside"),
        ([LinkSpec(id="x", a="sw-1", a_port=1, b="host-1", capacity_gbps=1)], "no ocs"),
        (
            [
                LinkSpec(id="x", a="sw-1", b="ocs-1", b_port=2, capacity_gbps=1),
                LinkSpec(id="y", a="host-1", b="ocs-1", b_port=2, capacity_gbps=1),
            ],
            "already has a cable",
        ),
    ],
)
def test_rejects_an_import_whose_links_break_the_cabling_rules(
    links: list[LinkSpec], message: str
) -> None:
    with pytest.raises(IntentRejected) as err:
        decide(given(), ImportTopology(request_id="r", nodes=NODES, links=links), ctx())
    assert err.value.code == "invalid"
    assert message in err.value.message


def test_rejects_an_import_that_reuses_an_id_for_a_node_and_a_link() -> None:
    clash = [LinkSpec(id="sw-1", a="host-1", b="gpu-1", capacity_gbps=1)]
    with pytest.raises(IntentRejected, match="unique") as err:
        decide(given(), ImportTopology(request_id="r", nodes=NODES, links=clash), ctx())
    assert err.value.details == {"ids": ["sw-1"]}


def test_rejects_anything_but_an_import_on_a_domain_that_does_not_exist() -> None:
    with pytest.raises(IntentRejected) as err:
        decide(given(), Drain(request_id="r", id="sw-1"), ctx())
    assert err.value.code == "not_found"


def test_add_node_then_link_to_it() -> None:
    node = NodeSpec(id="nic-1", kind="device", device_kind="nic")
    state = imported()
    (added,) = decide(state, AddNode(request_id="r", node=node), ctx()).events
    assert added == NodeAdded(node=node)
    state = evolve(state, added)
    link = LinkSpec(id="l-9", a="sw-1", b="nic-1", capacity_gbps=64)
    (linked,) = decide(state, AddLink(request_id="r", link=link), ctx()).events
    assert linked == LinkAdded(link=link)


def test_rejects_adding_a_node_whose_id_is_taken() -> None:
    with pytest.raises(IntentRejected) as err:
        decide(imported(), AddNode(request_id="r", node=NodeSpec(id="l-1", kind="host")), ctx())
    assert err.value.code == "conflict"


def test_rejects_a_link_onto_an_ocs_port_that_already_has_a_cable() -> None:
    link = LinkSpec(id="l-9", a="host-1", b="ocs-1", b_port=1, capacity_gbps=64)
    with pytest.raises(IntentRejected, match="already has a cable"):
        decide(imported(), AddLink(request_id="r", link=link), ctx())


def test_removing_a_node_removes_its_links() -> None:
    (event,) = decide(imported(), Remove(request_id="r", id="sw-1"), ctx()).events
    assert event == ComponentRemoved(component="sw-1", kind="node", links=["l-1", "l-2"])
    after = evolve(imported(), event)
    assert "sw-1" not in after.nodes and set(after.links) == {"l-3"}


def test_rejects_removing_what_does_not_exist() -> None:
    with pytest.raises(IntentRejected) as err:
        decide(imported(), Remove(request_id="r", id="ghost"), ctx())
    assert err.value.code == "not_found"


def test_drain_and_undrain_are_idempotent() -> None:
    state = imported()
    (drained,) = decide(state, Drain(request_id="r", id="sw-1"), ctx()).events
    state = evolve(state, drained)
    again = decide(state, Drain(request_id="r2", id="sw-1"), ctx())
    assert again.events == [] and again.result.changed is False
    (undrained,) = decide(state, Undrain(request_id="r3", id="sw-1"), ctx()).events
    assert evolve(state, undrained).nodes["sw-1"].drained is False


def test_fault_reports_move_health_and_recovery_brings_it_back() -> None:
    state = imported()
    (failed,) = decide(
        state, ReportFault(request_id="r", component="l-2", state="failed"), ctx()
    ).events
    assert failed == ComponentFaulted(component="l-2", state="failed")
    state = evolve(state, failed)
    assert state.links["l-2"].health == "failed"
    healthy = ReportFault(request_id="r2", component="l-2", state="healthy", detail="replaced")
    (recovered,) = decide(state, healthy, ctx()).events
    assert recovered == ComponentRecovered(component="l-2", detail="replaced")
    assert evolve(state, recovered).links["l-2"].health == "healthy"


def test_evolve_never_mutates_the_state_it_is_given() -> None:
    before = imported()
    snapshot = msgspec.json.encode(before)
    evolve(before, ComponentDrained(component="sw-1"))
    evolve(before, ComponentRemoved(component="sw-1", kind="node", links=["l-1", "l-2"]))
    assert msgspec.json.encode(before) == snapshot
