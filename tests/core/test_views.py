"""Tenant views (engine/core/views.py): each query's answer as one tenant may see it."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from fabric_builder import FabricBuilder, composed

from trellis.engine.core import queries, views
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import BlastRadiusQuery, ConnectionsQuery, TopologyQuery
from trellis.engine.core.results import (
    CompositionResult,
    Connection,
    ConnectionsResult,
    FreeDevice,
    FreeResult,
    Requested,
    WhyResult,
)
from trellis.engine.core.state import DomainState
from trellis.engine.service.router import AUDIT_QUERIES


def two_tenants() -> tuple[DomainState, str, str]:
    """acme on h1 and globex on h2, both through one OCS and one switch."""
    b = FabricBuilder().host("h1").host("h2").ocs("o", ports=8).switch("sw").gpu("g1").gpu("g2")
    b.link("h1", "o").link("h2", "o").link("o", "sw").link("o", "sw").chain("sw", "g1")
    b.chain("sw", "g2")
    state, mine = composed(b.state(), "acme", host="h1", device_ids=["g1"])
    state, theirs = composed(state, "globex", host="h2", device_ids=["g2"])
    return state, mine.composition_id, theirs.composition_id


def row(tenant: str, cid: str, device: str = "g") -> Connection:
    return Connection(
        device=device,
        host="h1",
        composition_id=cid,
        tenant=tenant,
        path=["h1", device],
        bandwidth_gbps=0.0,
        capacity_gib=None,
        since="2026-11-30T12:00:00Z",
        why=Requested(request_id="r", actor=tenant, reason="r"),
    )


def composition(cid: str, tenant: str, reason: str) -> CompositionResult:
    return CompositionResult(
        composition_id=cid,
        host="h1",
        state="active",
        expires_at=None,
        devices=[],
        tenant=tenant,
        labels={},
        reason=reason,
        request_id="r",
        created_at=datetime(2026, 11, 30, 12, tzinfo=UTC),
        impaired_by=[],
        chain=[],
    )


def test_another_tenants_composition_is_not_found_exactly_as_an_unknown_one() -> None:
    state, _, theirs = two_tenants()
    result = composition(theirs, "globex", "secret")
    with pytest.raises(IntentRejected) as refused:
        views.scope("composition", result, "acme", state)
    unknown = views.unknown_composition(theirs)
    assert (refused.value.code, refused.value.message, refused.value.details) == (
        unknown.code,
        unknown.message,
        unknown.details,
    )
    assert unknown.code == "not_found" and "globex" not in unknown.message


def test_a_tenant_sees_its_own_composition_whole() -> None:
    state, mine, _ = two_tenants()
    result = composition(mine, "acme", "mine")
    assert views.scope("composition", result, "acme", state) == result


def test_connections_keep_only_the_tenants_rows() -> None:
    state, mine, theirs = two_tenants()
    rows = [row("acme", mine), row("globex", theirs), row("acme", mine, "h")]
    scoped = views.scope("connections", ConnectionsResult(connections=rows), "acme", state)
    assert scoped == ConnectionsResult(connections=[row("acme", mine), row("acme", mine, "h")])


def test_a_view_asks_connections_for_the_tenant_unless_the_body_names_one() -> None:
    assert views.scoped_query(ConnectionsQuery(host="h1"), "acme") == ConnectionsQuery(
        host="h1", tenant="acme"
    )
    # Naming another tenant keeps that filter: the scope then leaves none of its rows.
    assert views.scoped_query(ConnectionsQuery(tenant="globex"), "acme") == ConnectionsQuery(
        tenant="globex"
    )
    assert views.scoped_query(TopologyQuery(), "acme") == TopologyQuery()


def test_split_rows_tells_whether_others_were_left_out_and_nothing_else() -> None:
    rows = [row("acme", "c-1"), row("globex", "c-2"), row("initech", "c-3")]
    assert views.split_rows(rows, "acme") == ([row("acme", "c-1")], True)
    assert views.split_rows(rows[:1], "acme") == ([row("acme", "c-1")], False)
    assert views.split_rows(rows, None) == (rows, False)  # an operator's query
    assert views.may_see("acme", "acme") and views.may_see("acme", None)
    assert not views.may_see("globex", "acme")


def test_a_why_answer_that_names_another_tenant_is_refused_not_shown() -> None:
    state, mine, theirs = two_tenants()
    scoped = WhyResult(id="g1", kind="device", connected_to=[row("acme", mine)], chain=[], text="t")
    assert views.scope("why", scoped, "acme", state) == scoped
    unscoped = msgspec.structs.replace(
        scoped, connected_to=[row("acme", mine), row("globex", theirs)]
    )
    with pytest.raises(IntentRejected) as refused:
        views.scope("why", unscoped, "acme", state)
    assert "globex" not in refused.value.message


def test_blast_radius_lists_only_the_tenants_compositions_and_no_other_name() -> None:
    state, mine, _ = two_tenants()
    everyone = queries.answer(state, BlastRadiusQuery(id="sw"), "blast-radius")
    assert everyone.tenants == ["acme", "globex"]
    scoped = views.scope("blast-radius", everyone, "acme", state)
    assert [c.composition_id for c in scoped.compositions] == [mine]
    assert scoped.tenants == ["acme"]
    nobody = views.scope("blast-radius", everyone, "initech", state)
    assert nobody.compositions == [] and nobody.tenants == []


def test_topology_shows_the_whole_fabric_but_only_the_tenants_circuits() -> None:
    state, _, _ = two_tenants()
    everyone = queries.answer(state, TopologyQuery(), "topology")
    assert {c.host for c in everyone.circuits} == {"h1", "h2"}
    scoped = views.scope("topology", everyone, "acme", state)
    assert {c.host for c in scoped.circuits} == {"h1"}
    assert scoped.nodes == everyone.nodes and scoped.links == everyone.links


def test_free_capacity_names_no_holder_and_is_shown_as_is() -> None:
    state, _, _ = two_tenants()
    result = FreeResult(devices=[FreeDevice(id="g9", kind="device", device_kind="gpu")])
    assert views.scope("free", result, "acme", state) == result


def test_a_query_without_a_view_is_refused() -> None:
    state, _, _ = two_tenants()
    assert not views.serves("no-such-query") and views.serves("why")
    with pytest.raises(IntentRejected) as refused:
        views.scope("no-such-query", FreeResult(devices=[]), "acme", state)
    assert refused.value.code == "invalid"
    assert set(views.SCOPES) == {
        *queries.STATE_QUERIES,
        "composition",
        "connections",
        "why",
        *AUDIT_QUERIES,
        "history",
    }
