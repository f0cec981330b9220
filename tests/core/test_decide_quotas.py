"""Quotas per tenant and device kind (issue 9 item 5), decided purely: set, clear, enforce.

Given a small fabric and the quotas an operator set, when tenants compose, release, fail or get
repaired, then composes over a quota are `quota` (recorded as CompositionRejected, saying the
kind, the limit, what is held and what was asked), and the holdings index `evolve` keeps equals
what a scan of the live compositions says.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from fabric_builder import (
    FabricBuilder,
    apply,
    compose,
    compose_pending,
    composed,
    release,
    report_fault,
    request_id,
    run,
)

from trellis.engine.core import queries, quotas, views
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CompositionRejected,
    DeviceReplaced,
    QuotaCleared,
    QuotaSet,
)
from trellis.engine.core.intents import (
    ClearQuota,
    FailComposition,
    InvalidIntent,
    QuotasQuery,
    SetQuota,
    decode_intent,
    settle_request_id,
)
from trellis.engine.core.results import QuotasResult
from trellis.engine.core.state import DomainState, Held, Quota, held_gib

GPU: dict[str, Any] = {"kind": "gpu"}


def hall() -> DomainState:
    """h1 and h2 on one switch with four GPUs, two NICs and two 1024 GiB memory pools."""
    b = FabricBuilder().host("h1").host("h2").switch("sw")
    b.gpu("g1").gpu("g2").gpu("g3").gpu("g4").nic("n1").nic("n2")
    b.memory("m1", 1024).memory("m2", 1024)
    for node in ("h1", "h2", "g1", "g2", "g3", "g4", "n1", "n2", "m1", "m2"):
        b.link(node, "sw")
    return b.state()


def set_quota(state: DomainState, tenant: str, kind: str, **limits: Any) -> DomainState:
    intent = msgspec.convert(
        {"request_id": request_id(), "tenant": tenant, "kind": kind, **limits}, SetQuota
    )
    events, result = run(state, intent)
    assert not isinstance(result, IntentRejected), result.message
    return apply(state, events)


def refused(events: list[Any], result: object) -> IntentRejected:
    """A recorded `quota` rejection: one CompositionRejected that carries what the error says."""
    assert isinstance(result, IntentRejected), result
    assert result.code == "quota", f"{result.code}: {result.message}"
    [event] = events
    assert isinstance(event, CompositionRejected)
    assert (event.code, event.message, event.details) == ("quota", result.message, result.details)
    return result


def scanned(state: DomainState) -> dict[str, dict[str, Held]]:
    """What each tenant holds, by a scan of the live compositions (the index must agree)."""
    out: dict[str, dict[str, Held]] = {}
    for c in state.compositions.values():
        for b in c.bindings:
            kinds = out.setdefault(c.tenant, {})
            was = kinds.get(b.kind, Held())
            kinds[b.kind] = Held(
                count=was.count + 1, capacity_gib=was.capacity_gib + held_gib(state, b)
            )
    return out


# ---- setting and clearing ----


def test_set_quota_records_quota_set_and_the_state_holds_it() -> None:
    intent = SetQuota(request_id="r", tenant="acme", kind="gpu", count=2, reason="contract")

    events, result = run(hall(), intent)

    assert events == [QuotaSet(tenant="acme", kind="gpu", count=2, reason="contract")]
    assert apply(hall(), events).quotas == {"acme": {"gpu": Quota(count=2)}}
    assert (result.changed, result.limit, result.held, result.over) == (
        True,
        Quota(count=2),
        quotas.Usage(count=0),
        False,
    )


def test_setting_the_same_quota_again_records_nothing() -> None:
    state = set_quota(hall(), "acme", "memory", count=2, capacity_gib=512)
    again = SetQuota(request_id="r", tenant="acme", kind="memory", count=2, capacity_gib=512)

    events, result = run(state, again)

    assert events == [] and result.changed is False
    assert result.held == quotas.Usage(count=0, capacity_gib=0.0)


def test_a_quota_is_replaced_whole_a_limit_left_out_is_no_limit() -> None:
    state = set_quota(hall(), "acme", "memory", count=1, capacity_gib=512)
    state = set_quota(state, "acme", "memory", capacity_gib=2048)
    assert state.quotas["acme"]["memory"] == Quota(capacity_gib=2048)
    state, _ = composed(state, "acme", host="h1", devices=[{"kind": "memory", "capacity_gib": 8}])
    _, result = compose(state, "acme", host="h1", devices=[{"kind": "memory", "capacity_gib": 8}])
    assert not isinstance(result, IntentRejected)  # no count limit any more


def test_clear_quota_records_quota_cleared_and_lifts_the_limit() -> None:
    state = set_quota(hall(), "acme", "gpu", count=0)
    state = set_quota(state, "acme", "nic", count=1)

    events, result = run(state, ClearQuota(request_id="r", tenant="acme", kind="gpu"))

    assert events == [QuotaCleared(tenant="acme", kind="gpu")]
    assert result.changed is True and result.limit is None
    state = apply(state, events)
    assert state.quotas == {"acme": {"nic": Quota(count=1)}}
    _, composed_now = compose(state, "acme", host="h1", devices=[GPU])
    assert not isinstance(composed_now, IntentRejected)


def test_clearing_a_quota_that_is_not_set_records_nothing() -> None:
    events, result = run(hall(), ClearQuota(request_id="r", tenant="acme", kind="gpu"))
    assert events == [] and result.changed is False


def test_clearing_the_last_quota_of_a_tenant_leaves_no_trace() -> None:
    state = set_quota(hall(), "acme", "gpu", count=1)
    events, _ = run(state, ClearQuota(request_id="r", tenant="acme", kind="gpu"))
    assert apply(state, events).quotas == {}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tenant": "acme", "kind": "gpu"}, "give `count`, `capacity_gib` or both"),
        ({"tenant": "acme", "kind": "gpu", "capacity_gib": 80}, "limits memory only"),
        ({"tenant": "acme", "kind": "nvme", "count": 1, "capacity_gib": 1}, "limits memory only"),
        ({"tenant": "engine", "kind": "gpu", "count": 1}, "reserved"),
        ({"tenant": "Operator", "kind": "gpu", "count": 1}, "reserved"),
        ({"tenant": "_batch", "kind": "gpu", "count": 1}, "reserved"),
        ({"tenant": "acme", "kind": "gpu", "count": -1}, "Expected `int` >= 0"),
        ({"tenant": "acme", "kind": "memory", "capacity_gib": -1.0}, "Expected `float` >= 0"),
        ({"tenant": "acme", "kind": "fpga", "count": 1}, "Invalid enum value 'fpga'"),
    ],
)
def test_set_quota_bodies_outside_the_rules_are_invalid_at_the_boundary(
    body: dict[str, Any], says: str
) -> None:
    with pytest.raises(InvalidIntent) as err:
        decode_intent("admin", "set-quota", msgspec.json.encode({"request_id": "r", **body}))
    assert says in str(err.value), str(err.value)


def test_clear_quota_for_a_reserved_name_is_invalid_at_the_boundary() -> None:
    body = {"request_id": "r", "tenant": "auditor", "kind": "gpu"}
    with pytest.raises(InvalidIntent, match="reserved"):
        decode_intent("admin", "clear-quota", msgspec.json.encode(body))


# ---- enforcing ----


def test_a_tenant_composes_up_to_its_count_and_one_more_is_quota() -> None:
    state = set_quota(hall(), "acme", "gpu", count=3)
    state, _ = composed(state, "acme", host="h1", devices=[{"kind": "gpu", "count": 2}])
    state, _ = composed(state, "acme", host="h1", devices=[GPU])

    events, result = compose(state, "acme", host="h1", devices=[GPU])

    error = refused(events, result)
    assert error.details == {
        "tenant": "acme",
        "kind": "gpu",
        "exceeds": "count",
        "limit": {"count": 3, "capacity_gib": None},
        "held": {"count": 3},
        "asked": {"count": 1},
    }
    assert error.message == (
        "tenant acme holds 3 gpu and asks for 1 more; its quota in domain d1 is 3 gpu"
    )
    assert events[0].request is not None and events[0].tenant == "acme"


def test_a_request_that_would_cross_the_limit_is_refused_whole() -> None:
    state = set_quota(hall(), "acme", "gpu", count=3)
    state, _ = composed(state, "acme", host="h1", devices=[GPU])

    events, result = compose(state, "acme", host="h1", devices=[{"kind": "gpu", "count": 3}])

    assert refused(events, result).details["asked"] == {"count": 3}
    assert apply(state, events).held == state.held  # the rejection holds nothing


def test_named_devices_count_too() -> None:
    state = set_quota(hall(), "acme", "gpu", count=1)
    events, result = compose(state, "acme", host="h1", device_ids=["g1", "g2"])
    assert refused(events, result).details["asked"] == {"count": 2}


def test_memory_is_limited_in_gib() -> None:
    state = set_quota(hall(), "acme", "memory", capacity_gib=1536)
    slice_512 = {"kind": "memory", "capacity_gib": 512}
    state, _ = composed(state, "acme", host="h1", devices=[slice_512])
    state, _ = composed(state, "acme", host="h1", devices=[{**slice_512, "capacity_gib": 1000}])
    assert state.held["acme"]["memory"] == Held(count=2, capacity_gib=1512)

    events, result = compose(state, "acme", host="h2", devices=[{**slice_512, "capacity_gib": 25}])

    error = refused(events, result)
    assert error.details["exceeds"] == "capacity_gib"
    assert error.details["held"] == {"count": 2, "capacity_gib": 1512.0}
    assert error.details["asked"] == {"count": 1, "capacity_gib": 25.0}
    assert "1512 GiB of memory" in error.message and "1536 GiB of memory" in error.message
    # Exactly up to the limit is fine.
    state, _ = composed(state, "acme", host="h2", devices=[{**slice_512, "capacity_gib": 24}])
    assert state.held["acme"]["memory"] == Held(count=3, capacity_gib=1536)
    assert state.held == scanned(state)


def test_a_memory_pool_named_by_id_counts_its_whole_capacity() -> None:
    state = set_quota(hall(), "acme", "memory", capacity_gib=1000)
    events, result = compose(state, "acme", host="h1", device_ids=["m1"])
    assert refused(events, result).details["asked"] == {"count": 1, "capacity_gib": 1024.0}

    state = set_quota(state, "acme", "memory", capacity_gib=1024)
    state, _ = composed(state, "acme", host="h1", device_ids=["m1"])
    assert state.held["acme"]["memory"] == Held(count=1, capacity_gib=1024)
    assert state.held == scanned(state)


def test_memory_count_counts_slices() -> None:
    state = set_quota(hall(), "acme", "memory", count=1)
    state, _ = composed(state, "acme", host="h1", devices=[{"kind": "memory", "capacity_gib": 1}])
    events, result = compose(
        state, "acme", host="h1", devices=[{"kind": "memory", "capacity_gib": 1}]
    )
    assert refused(events, result).details["exceeds"] == "count"


def test_the_quota_is_checked_before_placement() -> None:
    """Five GPUs exist nowhere here, but the answer is the quota: no search is tried."""
    state = set_quota(hall(), "acme", "gpu", count=1)
    events, result = compose(state, "acme", host="h1", devices=[{"kind": "gpu", "count": 5}])
    assert refused(events, result).code == "quota"


def test_the_first_kind_over_its_quota_in_request_order_is_named() -> None:
    state = set_quota(hall(), "acme", "gpu", count=0)
    state = set_quota(state, "acme", "nic", count=0)
    events, result = compose(state, "acme", host="h1", devices=[{"kind": "nic"}, GPU])
    assert refused(events, result).details["kind"] == "nic"


def test_quotas_are_per_tenant_and_per_kind() -> None:
    state = set_quota(hall(), "acme", "gpu", count=0)

    _, other_tenant = compose(state, "globex", host="h1", devices=[GPU])
    _, other_kind = compose(state, "acme", host="h1", devices=[{"kind": "nic"}])

    assert not isinstance(other_tenant, IntentRejected)
    assert not isinstance(other_kind, IntentRejected)


def test_a_pending_composition_counts_and_release_or_failure_frees_it() -> None:
    state = set_quota(hall(), "acme", "gpu", count=1)
    events, pending = compose_pending(state, "acme", host="h1", devices=[GPU])
    state = apply(state, events)
    assert state.compositions[pending.composition_id].state == "pending"

    events, result = compose(state, "acme", host="h1", devices=[GPU])
    refused(events, result)

    fail = FailComposition(
        request_id=settle_request_id(pending.composition_id),
        composition_id=pending.composition_id,
        step="bind",
    )
    more, _ = run(state, fail, "engine")
    state = apply(state, more)
    assert state.held == {}
    state, active = composed(state, "acme", host="h1", devices=[GPU])
    events, _ = release(state, "acme", active.composition_id)
    state = apply(state, events)
    assert state.held == {} == scanned(state)
    state, _ = composed(state, "acme", host="h1", devices=[GPU])


def test_a_quota_lowered_below_what_is_held_takes_nothing_away_and_refuses_new_composes() -> None:
    state, _ = composed(hall(), "acme", host="h1", devices=[{"kind": "gpu", "count": 2}])
    live = dict(state.compositions)

    intent = SetQuota(request_id="r", tenant="acme", kind="gpu", count=1)
    events, result = run(state, intent)

    assert [type(e) for e in events] == [QuotaSet]
    assert result.over is True and result.held == quotas.Usage(count=2)
    state = apply(state, events)
    assert state.compositions == live
    refused(*compose(state, "acme", host="h1", devices=[GPU]))
    assert [r.over for r in quotas.quotas(state)] == [True]


def test_a_repair_that_replaces_a_device_keeps_the_count_and_is_never_refused() -> None:
    """At its quota, or over it after a lowered quota: a replacement holds what the device it
    replaces held, so repair goes on."""
    state, result = composed(hall(), "acme", host="h1", devices=[GPU])
    state = set_quota(state, "acme", "gpu", count=0)  # over it now
    device = result.devices[0].id

    events, _ = report_fault(state, device)

    replaced = [e for e in events if isinstance(e, DeviceReplaced)]
    assert [e.old_device for e in replaced] == [device]
    state = apply(state, events)
    assert state.compositions[result.composition_id].state == "active"
    assert state.held == {"acme": {"gpu": Held(count=1)}} == scanned(state)


def test_a_memory_slice_moved_by_repair_keeps_its_gib() -> None:
    state = set_quota(hall(), "acme", "memory", capacity_gib=100)
    slice_100 = {"kind": "memory", "capacity_gib": 100}
    state, result = composed(state, "acme", host="h1", devices=[slice_100])
    events, _ = report_fault(state, result.devices[0].id)
    state = apply(state, events)
    assert [type(e) for e in events if isinstance(e, DeviceReplaced)] == [DeviceReplaced]
    assert state.held["acme"]["memory"] == Held(count=1, capacity_gib=100)


def test_the_holdings_index_equals_a_scan_through_a_busy_history() -> None:
    state = hall()
    live: list[tuple[str, str]] = []
    steps: list[tuple[str, dict[str, Any]]] = [
        ("acme", {"devices": [{"kind": "gpu", "count": 2}]}),
        ("globex", {"devices": [{"kind": "memory", "capacity_gib": 300}, {"kind": "nic"}]}),
        ("acme", {"device_ids": ["m2"]}),
        ("globex", {"devices": [GPU]}),
    ]
    for tenant, body in steps:
        state, result = composed(state, tenant, host="h1", **body)
        live.append((tenant, result.composition_id))
        assert state.held == scanned(state)
    events, _ = report_fault(state, "g1")
    state = apply(state, events)
    assert state.held == scanned(state)
    for tenant, cid in live:
        events, _ = release(state, tenant, cid)
        state = apply(state, events)
        assert state.held == scanned(state)
    assert state.held == {}


# ---- reading ----


def test_the_quotas_query_lists_quotas_and_holdings_by_tenant_and_kind() -> None:
    state = set_quota(hall(), "acme", "gpu", count=2)
    state = set_quota(state, "globex", "memory", count=2, capacity_gib=512)
    state, _ = composed(state, "acme", host="h1", devices=[GPU, {"kind": "nic"}])

    answer = msgspec.to_builtins(queries.answer(state, QuotasQuery(), "quotas"))

    assert answer == {
        "quotas": [
            {
                "tenant": "acme",
                "kind": "gpu",
                "limit": {"count": 2, "capacity_gib": None},
                "held": {"count": 1},
                "over": False,
            },
            {"tenant": "acme", "kind": "nic", "limit": None, "held": {"count": 1}, "over": False},
            {
                "tenant": "globex",
                "kind": "memory",
                "limit": {"count": 2, "capacity_gib": 512.0},
                "held": {"count": 0, "capacity_gib": 0.0},
                "over": False,
            },
        ]
    }
    only = queries.answer(state, QuotasQuery(tenant="acme", kind="nic"), "quotas")
    assert [(r.tenant, r.kind) for r in only.quotas] == [("acme", "nic")]


def test_a_tenants_view_of_quotas_shows_only_its_own() -> None:
    state = set_quota(hall(), "acme", "gpu", count=2)
    state = set_quota(state, "globex", "gpu", count=9)

    query = views.scoped_query(QuotasQuery(), "acme")
    everyone = queries.answer(state, QuotasQuery(), "quotas")
    scoped = views.scope("quotas", queries.answer(state, query, "quotas"), "acme", state)
    asked_for_other = views.scope(
        "quotas",
        queries.answer(state, views.scoped_query(QuotasQuery(tenant="globex"), "acme"), "quotas"),
        "acme",
        state,
    )

    assert query == QuotasQuery(tenant="acme")
    assert [r.tenant for r in scoped.quotas] == ["acme"]
    assert asked_for_other == QuotasResult(quotas=[])
    assert [r.tenant for r in views.scope("quotas", everyone, "acme", state).quotas] == ["acme"]
