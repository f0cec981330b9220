"""Quotas per tenant and device kind over real NATS and Postgres (issue 9 item 5).

An operator sets a tenant's quota with `trellis.admin.<domain>.set-quota` (recorded as
QuotaSet), tenants compose up to it, and one compose more is refused with `quota`, recorded as
CompositionRejected and stored as the request's answer. Releasing frees quota; quotas are per
domain and per tenant; memory is limited in GiB; the `quotas` query and the tenant's view show
them; they survive a restart (folded from the log); and the log's content checks know the new
events (schema/009).

The fabric: host-01 and host-02 on one switch with four GPUs, a NIC and two memory pools, so
GPUs are never short of a path and every refusal here is the quota's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio
from fabrics import Doc, device, expect_error, expect_ok, fetch, gpu, host, link, row_counts, switch
from harness import Harness, serving

from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.errors import EventRefused
from trellis.engine.core.events import EVENT_TYPES
from trellis.engine.core.records import Head, PendingEvent

DOMAIN, OTHER = "hall-1", "hall-2"
GPU = {"kind": "gpu"}


def pooled() -> Doc:
    nodes = [host("host-01"), host("host-02"), switch("sw-1")]
    nodes += [gpu(f"gpu-0{i}") for i in range(1, 5)]
    nodes += [device("nic-01", "nic"), device("mem-01", "memory", capacity_gib=1024)]
    nodes += [device("mem-02", "memory", capacity_gib=1024)]
    links = [link(f"l-{n['id']}", n["id"], "sw-1") for n in nodes if n["id"] != "sw-1"]
    return {"nodes": nodes, "links": links}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        for domain in (DOMAIN, OTHER):
            expect_ok(await harness.client.admin(domain, "import-topology", pooled()))
        yield harness


@pytest.fixture
def log(database_url: str, pg_schema: str) -> Any:
    """`await log(request_id=None)`: DOMAIN's events (type, actor, causation_id, data) in order,
    only those the request caused when given."""

    async def events(request_id: str | None = None) -> list[dict[str, Any]]:
        rows = await fetch(
            database_url,
            pg_schema,
            "SELECT type, actor, causation_id, data::text AS data FROM trellis_events"
            " WHERE domain = $1 AND ($2::text IS NULL OR causation_id = $2) ORDER BY position",
            DOMAIN,
            request_id,
        )
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    return events


async def set_quota(h: Harness, tenant: str, kind: str, domain: str = DOMAIN, **limits: Any) -> Any:
    body = {"tenant": tenant, "kind": kind, **limits}
    return expect_ok(await h.client.admin(domain, "set-quota", body))


async def compose(
    h: Harness, tenant: str, devices: list[dict[str, Any]], domain: str = DOMAIN, **body: Any
) -> dict[str, Any]:
    request = {"host": "host-01", "devices": devices, **body}
    return await h.client.intent(domain, tenant, "compose", request)


async def composed(
    h: Harness, tenant: str, devices: list[dict[str, Any]], domain: str = DOMAIN
) -> str:
    result = expect_ok(await compose(h, tenant, devices, domain))
    assert result["state"] == "active", result
    return str(result["composition_id"])


async def release(h: Harness, tenant: str, cid: str) -> None:
    expect_ok(await h.client.intent(DOMAIN, tenant, "release", {"composition_id": cid}))


async def quota_rows(h: Harness, **filters: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = expect_ok(await h.client.query(DOMAIN, "quotas", filters))[
        "quotas"
    ]
    return rows


async def test_up_to_the_quota_then_quota_recorded_as_rejected_and_release_frees_it(
    h: Harness, log: Any, database_url: str, pg_schema: str
) -> None:
    result = await set_quota(h, "acme", "gpu", count=2, reason="contract 7")
    assert result == {
        "tenant": "acme",
        "kind": "gpu",
        "limit": {"count": 2, "capacity_gib": None},
        "held": {"count": 0},
        "over": False,
        "changed": True,
    }
    [recorded] = [e for e in await log() if e["type"] == "QuotaSet"]
    assert recorded["actor"] == "operator"
    assert recorded["data"] == {
        "type": "QuotaSet",
        "tenant": "acme",
        "kind": "gpu",
        "count": 2,
        "capacity_gib": None,
        "reason": "contract 7",
    }
    first = await composed(h, "acme", [GPU])
    await composed(h, "acme", [GPU])

    over = {"request_id": "r-over", "host": "host-01", "devices": [GPU]}
    before = await row_counts(database_url, pg_schema)
    reply = await h.client.intent(DOMAIN, "acme", "compose", over)

    error = expect_error(reply, "quota")
    assert error["details"] == {
        "tenant": "acme",
        "kind": "gpu",
        "exceeds": "count",
        "limit": {"count": 2, "capacity_gib": None},
        "held": {"count": 2},
        "asked": {"count": 1},
    }
    assert "holds 2 gpu" in error["message"] and "2 gpu" in error["message"]
    [event] = await log("r-over")
    assert (event["type"], event["actor"]) == ("CompositionRejected", "acme")
    assert event["data"]["code"] == "quota" and event["data"]["message"] == error["message"]
    assert event["data"]["details"] == error["details"]
    assert event["data"]["request"]["devices"][0]["kind"] == "gpu"
    assert await row_counts(database_url, pg_schema) == (before[0] + 1, before[1] + 1)
    # The stored answer: a resend is answered word for word, marked as the replay it is, and
    # writes nothing.
    again = await h.client.intent(DOMAIN, "acme", "compose", over)
    assert again == {**reply, "error": {**error, "details": {**error["details"], "replayed": True}}}
    assert await row_counts(database_url, pg_schema) == (before[0] + 1, before[1] + 1)
    # Nothing was placed for it.
    free = expect_ok(await h.client.query(DOMAIN, "free", {"kind": "gpu"}))["devices"]
    assert len(free) == 2

    await release(h, "acme", first)

    await composed(h, "acme", [GPU])  # a new request_id; the freed quota serves it
    [row] = await quota_rows(h, tenant="acme")
    assert (row["held"], row["over"]) == ({"count": 2}, False)


async def test_quotas_are_per_tenant_and_per_domain_and_per_kind(h: Harness) -> None:
    await set_quota(h, "acme", "gpu", count=0)

    expect_error(await compose(h, "acme", [GPU]), "quota")
    await composed(h, "globex", [GPU])  # another tenant
    await composed(h, "acme", [GPU], domain=OTHER)  # another domain
    await composed(h, "acme", [{"kind": "nic"}])  # another kind

    other = expect_ok(await h.client.query(OTHER, "quotas", {}))["quotas"]
    assert [(r["tenant"], r["kind"], r["limit"]) for r in other] == [("acme", "gpu", None)]


async def test_memory_is_limited_in_gib(h: Harness) -> None:
    await set_quota(h, "acme", "memory", capacity_gib=1024)
    await composed(h, "acme", [{"kind": "memory", "capacity_gib": 768}])

    error = expect_error(
        await compose(h, "acme", [{"kind": "memory", "capacity_gib": 512}]), "quota"
    )

    assert error["details"]["exceeds"] == "capacity_gib"
    assert error["details"]["held"] == {"count": 1, "capacity_gib": 768.0}
    assert error["details"]["asked"] == {"count": 1, "capacity_gib": 512.0}
    assert error["details"]["limit"] == {"count": None, "capacity_gib": 1024.0}
    await composed(h, "acme", [{"kind": "memory", "capacity_gib": 256}])  # exactly up to it
    [row] = await quota_rows(h, tenant="acme", kind="memory")
    assert row["held"] == {"count": 2, "capacity_gib": 1024.0}


async def test_a_lowered_quota_takes_nothing_away_and_clear_quota_lifts_it(h: Harness) -> None:
    held = [await composed(h, "acme", [GPU]), await composed(h, "acme", [GPU])]

    lowered = await set_quota(h, "acme", "gpu", count=1)

    assert lowered["over"] is True and lowered["held"] == {"count": 2}
    for cid in held:
        composition = expect_ok(await h.client.query(DOMAIN, "composition", {"id": cid}))
        assert composition["state"] == "active"
    expect_error(await compose(h, "acme", [GPU]), "quota")
    await release(h, "acme", held[0])
    expect_error(await compose(h, "acme", [GPU]), "quota")  # 1 held, 1 allowed

    cleared = expect_ok(
        await h.client.admin(DOMAIN, "clear-quota", {"tenant": "acme", "kind": "gpu"})
    )

    assert (cleared["changed"], cleared["limit"]) == (True, None)
    await composed(h, "acme", [GPU])
    again = expect_ok(
        await h.client.admin(DOMAIN, "clear-quota", {"tenant": "acme", "kind": "gpu"})
    )
    assert again["changed"] is False


async def test_the_quotas_query_and_each_tenants_view(h: Harness) -> None:
    await set_quota(h, "acme", "gpu", count=3)
    await set_quota(h, "globex", "memory", count=1, capacity_gib=64)
    await composed(h, "acme", [GPU])

    everyone = await quota_rows(h)
    acme = expect_ok(await h.client.view(DOMAIN, "acme", "quotas", {}))["quotas"]
    peeking = expect_ok(await h.client.view(DOMAIN, "acme", "quotas", {"tenant": "globex"}))
    stranger = expect_ok(await h.client.view(DOMAIN, "initech", "quotas", {}))["quotas"]

    assert [(r["tenant"], r["kind"]) for r in everyone] == [("acme", "gpu"), ("globex", "memory")]
    assert acme == [everyone[0]] and acme[0]["held"] == {"count": 1}
    assert peeking["quotas"] == [] and stranger == []


async def test_set_quota_refusals_are_invalid_and_write_nothing(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    before = await row_counts(database_url, pg_schema)
    bodies = [
        {"tenant": "acme", "kind": "gpu"},
        {"tenant": "acme", "kind": "gpu", "capacity_gib": 8},
        {"tenant": "engine", "kind": "gpu", "count": 1},
        {"tenant": "acme", "kind": "gpu", "count": 2**63},
    ]
    for body in bodies:
        expect_error(await h.client.admin(DOMAIN, "set-quota", body), "invalid")
    missing = await h.client.admin(
        "hall-9", "set-quota", {"tenant": "a", "kind": "gpu", "count": 1}
    )
    expect_error(missing, "not_found")
    assert await row_counts(database_url, pg_schema) == before


async def test_quotas_survive_a_restart(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        expect_ok(await h.client.admin(DOMAIN, "import-topology", pooled()))
        await set_quota(h, "acme", "gpu", count=1)
        await composed(h, "acme", [GPU])

    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        error = expect_error(await compose(h, "acme", [GPU]), "quota")
        assert error["details"]["held"] == {"count": 1}


# ---- the log's content checks know the new events (schema/009) ----


def pending(type_: str, data: dict[str, Any]) -> PendingEvent:
    return PendingEvent(
        id=str(uuid.uuid4()),
        type=type_,
        schema_version=1,
        actor="operator",
        causation_id="r-1",
        correlation_id="r-1",
        recorded_at=datetime(2026, 12, 1, tzinfo=UTC),
        data=json.dumps({"type": type_, **data}).encode(),
    )


@pytest.mark.parametrize("type_", ["QuotaSet", "QuotaCleared"])
async def test_the_log_refuses_a_quota_event_whose_tenant_is_not_an_id(
    database_url: str, pg_schema: str, type_: str
) -> None:
    store = await PostgresEventStore.open(database_url, schema=pg_schema)
    try:
        good = pending(type_, {"tenant": "acme", "kind": "gpu", "count": 1})
        head = (await store.append(DOMAIN, Head(), [good], [])).head
        bad = pending(type_, {"tenant": "acme\n", "kind": "gpu", "count": 1})

        with pytest.raises(EventRefused) as refused:
            await store.append(DOMAIN, head, [bad], [])

        assert "$.tenant" in str(refused.value)
        assert await store.head(DOMAIN) == head
    finally:
        await store.close()


async def test_every_event_type_has_a_line_in_the_logs_content_checks(
    database_url: str, pg_schema: str
) -> None:
    """Each event type this code writes carries ids, so each needs its jsonpaths in
    trellis_event_id_paths; a type without (its ids unchecked) fails here."""
    rows = await fetch(
        database_url,
        pg_schema,
        "SELECT t AS type, cardinality(trellis_event_id_paths(t)) AS paths"
        " FROM unnest($1::text[]) AS t",
        sorted(EVENT_TYPES),
    )
    assert [r["type"] for r in rows if r["paths"] == 0] == []
