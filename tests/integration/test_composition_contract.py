"""Compositions through the wire contract only: compose, release, extend, faults and queries.

Every test talks to a real engine over real NATS and Postgres as a client that knows nothing
but ARCHITECTURE §3-6 (plus the as-built notes of docs/architecture.md §11): it sends intents
and queries, reads reply envelopes, and looks at the log only where the contract says what the
log holds (events, causation, request ids).

The standard fabric (tests/integration/fabrics.py) is small enough to reason about by hand:

    host-01 ─l-host─ sw-1 ─l-uplink─ ocs-1:0      ocs-1:1 ─l-gpu-01─ gpu-01 (H100, gen 9, rack r3)
                      │                           ocs-1:2 ─l-gpu-02─ gpu-02 (A100, gen 8)
                      ├─l-mem─ mem-01 (2048 GiB)  ocs-1:3 ─l-nvme─── nvme-01
                      └─l-nic─ nic-01

host-01 has one uplink into the OCS, so it reaches one device behind the OCS at a time (one
circuit per port); either GPU is 4 hops away (l-host, l-uplink, a circuit, the GPU's cable) at
50 + 150 + 50 + 30 + 50 = 330 ns, and the oldest generation (gpu-02) goes first.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import pytest_asyncio
from fabrics import (
    Doc,
    expect_error,
    expect_ok,
    fabric,
    fetch,
    gpu,
    host,
    link,
    row_counts,
    switch,
)
from harness import Harness, serving

DOMAIN = "hall-1"
GPU = {"kind": "gpu"}
EXCLUSIVE = {"isolation": "exclusive"}
FUNNEL_STAGES = [
    "kind and model",
    "health",
    "free",
    "isolation and labels",
    "hops",
    "latency",
    "bandwidth",
]
COMPOSITION_EVENTS = [
    "CompositionRequested",
    "CircuitCreated",
    "DevicesReserved",
    "PathEstablished",
    "PathEstablished",
    "CompositionActivated",
]
CHAIN_KEYS = ["type", "position", "time", "actor", "request_id"]
WHY_KEYS = ["request_id", "actor", "reason", "labels", "constraints", "position"]


# ---- fixtures and helpers ----


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest.fixture
def counts(database_url: str, pg_schema: str) -> Any:
    """`await counts()` -> (rows in trellis_events, rows in trellis_requests)."""

    async def count() -> tuple[int, int]:
        return await row_counts(database_url, pg_schema)

    return count


@pytest.fixture
def log(database_url: str, pg_schema: str) -> Any:
    """`await log(request_id=None)` -> the domain's events (type, position, actor, causation_id,
    recorded_at, data), in log order; only those that follow from `request_id` (its correlation
    id: the request's own events and the saga's that settle it) when given."""

    async def events(request_id: str | None = None) -> list[dict[str, Any]]:
        rows = await fetch(
            database_url,
            pg_schema,
            "SELECT type, position, actor, causation_id, recorded_at, data::text AS data"
            " FROM trellis_events WHERE domain = $1 AND ($2::text IS NULL OR correlation_id = $2)"
            " ORDER BY position",
            DOMAIN,
            request_id,
        )
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    return events


async def imported(h: Harness, doc: Doc | None = None) -> None:
    """Given: the domain exists with `doc` (the standard fabric by default)."""
    expect_ok(await h.client.admin(DOMAIN, "import-topology", doc or fabric()))


async def compose(h: Harness, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    return await h.client.intent(DOMAIN, tenant, "compose", body)


async def composed(h: Harness, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    """Given: a composition that the engine accepted; its result."""
    result: dict[str, Any] = expect_ok(await compose(h, tenant, body))
    return result


async def query(h: Harness, what: str, body: dict[str, Any] | None = None) -> Any:
    return expect_ok(await h.client.query(DOMAIN, what, body or {}))


async def connections(h: Harness, **filters: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = (await query(h, "connections", filters))["connections"]
    return rows


async def free_ids(h: Harness, kind: str | None = None) -> list[str]:
    body = {"kind": kind} if kind else {}
    return [d["id"] for d in (await query(h, "free", body))["devices"]]


def by_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in rows}


def when(text: str) -> datetime:
    """A timestamp as the wire shows it (RFC 3339, UTC)."""
    at = datetime.fromisoformat(text)
    assert at.utcoffset() == timedelta(0), text
    return at


def hops_and_latency(doc: Doc, path: list[str]) -> tuple[int, int]:
    """What section 5 says a path costs: a hop per link and per circuit; latency = its links'
    latencies plus every switch and OCS passed through. (Computed from the fabric document,
    not from anything the engine says.)"""
    nodes = by_id(doc["nodes"])
    hops, latency = 0, 0
    for a, b in itertools.pairwise(path):
        cables = [lk for lk in doc["links"] if {lk["a"], lk["b"]} == {a, b}]
        assert cables, f"no link between {a} and {b}"
        latency += min(lk["latency_ns"] for lk in cables)
        hops += 1
    for inner in path[1:-1]:
        assert nodes[inner]["kind"] in ("switch", "ocs"), path
        latency += nodes[inner].get("latency_ns", 0)
        hops += nodes[inner]["kind"] == "ocs"  # crossing an OCS takes a circuit: one more hop
    return hops, latency


def check_funnel(details: dict[str, Any]) -> list[tuple[str, int, int]]:
    """The funnel of a rejection, checked for the contract's shape; as (stage, removed, left)."""
    funnel = details["funnel"]
    assert [s["stage"] for s in funnel] == FUNNEL_STAGES, details
    rows = [(s["stage"], s["removed"], s["remaining"]) for s in funnel]
    for (_, _, before), (_, removed, after) in itertools.pairwise(rows):
        assert removed == before - after >= 0, rows
    return rows


def one_sentence(text: str) -> None:
    assert isinstance(text, str) and text.endswith("."), text
    assert ". " not in text and "\n" not in text, text


# ==== compose with a host ====

FULL_COMPOSE = {
    "request_id": "r-full",
    "host": "host-01",
    "devices": [{"kind": "gpu", "bandwidth_gbps": 32}, {"kind": "nic", "bandwidth_gbps": 16}],
    "constraints": {"max_hops": 4, "max_latency_ns": 1000},
    "lease_seconds": 3600,
    "labels": {"workload": "decode"},
    "reason": "decode pool scale-up",
}


async def test_compose_with_a_host_replies_with_each_device_on_its_path_host_first(
    h: Harness,
) -> None:
    await imported(h)
    before = datetime.now().astimezone()

    reply = await compose(h, "acme", FULL_COMPOSE)

    result = expect_ok(reply)
    assert reply["replayed"] is False and reply["position"] > 0
    assert set(result) >= {"composition_id", "host", "state", "expires_at", "devices"}
    assert result["host"] == "host-01" and result["state"] == "active"
    expires = when(result["expires_at"])
    assert before + timedelta(seconds=3590) < expires < before + timedelta(seconds=3660)
    devices = by_id(result["devices"])
    assert list(devices) == ["gpu-02", "nic-01"]  # served in order; the oldest generation first
    assert devices["gpu-02"]["path"] == ["host-01", "sw-1", "ocs-1", "gpu-02"]
    assert devices["nic-01"]["path"] == ["host-01", "sw-1", "nic-01"]
    for entry, spec in zip(result["devices"], FULL_COMPOSE["devices"], strict=True):
        assert set(entry) >= {"id", "path", "hops", "latency_ns", "bandwidth_gbps"}
        assert entry["path"][0] == "host-01" and entry["path"][-1] == entry["id"]
        assert (entry["hops"], entry["latency_ns"]) == hops_and_latency(fabric(), entry["path"])
        assert entry["bandwidth_gbps"] == spec["bandwidth_gbps"]
    assert (devices["gpu-02"]["hops"], devices["gpu-02"]["latency_ns"]) == (4, 330)


async def test_compose_without_a_lease_never_expires(h: Harness) -> None:
    await imported(h)

    result = await composed(h, "acme", {"host": "host-01", "devices": [GPU]})

    assert result["expires_at"] is None
    assert (await query(h, "composition", {"id": result["composition_id"]}))["expires_at"] is None


async def test_the_composition_query_shows_the_compose_result_with_tenant_labels_and_reason(
    h: Harness,
) -> None:
    await imported(h)
    before = datetime.now().astimezone()
    result = await composed(h, "acme", FULL_COMPOSE)

    shown = await query(h, "composition", {"id": result["composition_id"]})

    assert {k: shown[k] for k in result} == result
    assert shown["tenant"] == "acme"
    assert shown["state"] == "active"
    assert shown["labels"] == {"workload": "decode"}
    assert shown["reason"] == "decode pool scale-up"
    created = when(shown["created_at"])
    assert before - timedelta(seconds=5) < created <= when(result["expires_at"])


async def test_connections_show_one_row_per_device_with_why_it_is_connected(
    h: Harness, log
) -> None:
    await imported(h)
    result = await composed(h, "acme", FULL_COMPOSE)
    requested = [e for e in await log("r-full") if e["type"] == "CompositionRequested"]

    rows = await connections(h, tenant="acme")

    assert [r["device"] for r in rows] == ["gpu-02", "nic-01"]
    for row, entry in zip(rows, result["devices"], strict=True):
        assert row["host"] == "host-01"
        assert row["composition_id"] == result["composition_id"]
        assert row["tenant"] == "acme"
        assert row["path"] == entry["path"]
        assert row["bandwidth_gbps"] == entry["bandwidth_gbps"]
        when(row["since"])
        why = row["why"]
        assert list(why) == WHY_KEYS
        assert why["request_id"] == "r-full" and why["actor"] == "acme"
        assert why["reason"] == "decode pool scale-up"
        assert why["labels"] == {"workload": "decode"}
        assert why["position"] == requested[0]["position"]
        constraints = {k: v for k, v in why["constraints"].items() if v not in (None, {})}
        assert constraints == {"max_hops": 4, "max_latency_ns": 1000, "isolation": "shared"}
    assert await connections(h, device="nic-01") == rows[1:]
    assert await connections(h, host="host-01") == rows
    assert await connections(h, tenant="globex") == []


async def test_free_no_longer_lists_the_devices_a_composition_took(h: Harness) -> None:
    await imported(h)
    assert await free_ids(h, "gpu") == ["gpu-01", "gpu-02"]

    await composed(h, "acme", FULL_COMPOSE)

    assert await free_ids(h) == ["gpu-01", "mem-01", "nvme-01"]
    assert await free_ids(h, "gpu") == ["gpu-01"]
    assert await free_ids(h, "nic") == []


async def test_topology_shows_reserved_bandwidth_and_the_circuit_with_its_host(
    h: Harness,
) -> None:
    await imported(h)

    await composed(h, "acme", FULL_COMPOSE)

    topo = await query(h, "topology")
    links = {lk["id"]: lk["free_gbps"] for lk in topo["links"]}
    assert links == {
        "l-host": 256 - 32 - 16,  # both paths leave the host over it
        "l-uplink": 256 - 32,
        "l-gpu-02": 64 - 32,
        "l-nic": 100 - 16,
        "l-gpu-01": 64,
        "l-nvme": 32,
        "l-mem": 128,
    }
    assert topo["circuits"] == [{"ocs": "ocs-1", "a_port": 0, "b_port": 2, "host": "host-01"}]


async def test_the_log_holds_the_composition_events_caused_by_the_request_id(
    h: Harness, log
) -> None:
    await imported(h)

    reply = await compose(h, "acme", FULL_COMPOSE)

    cid = expect_ok(reply)["composition_id"]
    events = await log("r-full")
    assert [e["type"] for e in events] == COMPOSITION_EVENTS
    # The tenant asked and reserved; the engine's fabric saga established what it reserved.
    saga = {"PathEstablished", "CompositionActivated"}
    who = {(e["type"], e["actor"], e["causation_id"]) for e in events}
    assert who == {
        (t, *(("engine", f"settle-{cid}") if t in saga else ("acme", "r-full")))
        for t in COMPOSITION_EVENTS
    }
    assert all(e["data"].get("composition_id") == cid for e in events)
    assert events[-1]["position"] == reply["position"]
    requested = events[0]["data"]
    assert (requested["tenant"], requested["host"]) == ("acme", "host-01")
    established = [e["data"]["device"] for e in events if e["type"] == "PathEstablished"]
    assert established == ["gpu-02", "nic-01"]


# ==== other ways to compose ====


def selector_fabric() -> Doc:
    """host-a (pool p) ─ sw-1 ─ sw-2 ─ gpu-1; host-b (pool p) and host-c (pool q) on sw-2.
    host-a sorts first but is a hop farther from the GPU than host-b."""
    return {
        "nodes": [
            host("host-a", pool="p"),
            host("host-b", pool="p"),
            host("host-c", pool="q"),
            switch("sw-1"),
            switch("sw-2"),
            gpu("gpu-1"),
        ],
        "links": [
            link("l-a", "host-a", "sw-1"),
            link("l-12", "sw-1", "sw-2"),
            link("l-b", "host-b", "sw-2"),
            link("l-c", "host-c", "sw-2"),
            link("l-g", "sw-2", "gpu-1"),
        ],
    }


async def test_compose_with_a_host_selector_picks_the_matching_host_with_the_shortest_paths(
    h: Harness,
) -> None:
    await imported(h, selector_fabric())

    result = await composed(
        h, "acme", {"host_selector": {"labels": {"pool": "p"}}, "devices": [GPU]}
    )

    assert result["host"] == "host-b"
    assert result["devices"][0]["path"] == ["host-b", "sw-2", "gpu-1"]
    assert (await query(h, "composition", {"id": result["composition_id"]}))["host"] == "host-b"
    assert [r["host"] for r in await connections(h, tenant="acme")] == ["host-b"]


async def test_compose_with_a_host_selector_that_matches_no_host_is_refused(
    h: Harness, log
) -> None:
    await imported(h, selector_fabric())

    reply = await compose(
        h, "acme", {"host_selector": {"labels": {"pool": "zz"}}, "devices": [GPU]}
    )

    error = expect_error(reply, "no_capacity")
    assert "selector" in error["message"] and "zz" in error["message"]
    assert [e["type"] for e in await log()] == ["TopologyImported", "CompositionRejected"]


async def test_compose_with_device_ids_takes_the_named_device(h: Harness) -> None:
    await imported(h)

    result = await composed(h, "acme", {"host": "host-01", "device_ids": ["gpu-01", "nic-01"]})

    assert [d["id"] for d in result["devices"]] == ["gpu-01", "nic-01"]
    assert result["devices"][0]["path"] == ["host-01", "sw-1", "ocs-1", "gpu-01"]
    assert await free_ids(h, "gpu") == ["gpu-02"]
    taken = await compose(h, "globex", {"host": "host-01", "device_ids": ["nic-01"]})
    error = expect_error(taken, "no_capacity")
    assert check_funnel(error["details"])[2] == ("free", 1, 0)
    unknown = await compose(h, "globex", {"host": "host-01", "device_ids": ["gpu-99"]})
    assert "gpu-99" in expect_error(unknown, "not_found")["message"]


async def test_compose_with_a_memory_slice_takes_capacity_from_the_pool(h: Harness) -> None:
    await imported(h)
    slice_ = {"kind": "memory", "capacity_gib": 512, "bandwidth_gbps": 32}

    result = await composed(h, "acme", {"host": "host-01", "devices": [slice_]})

    [entry] = result["devices"]
    assert (entry["id"], entry["capacity_gib"]) == ("mem-01", 512)
    assert entry["path"] == ["host-01", "sw-1", "mem-01"]
    [row] = await connections(h, device="mem-01")
    assert row["capacity_gib"] == 512
    pools = by_id((await query(h, "free", {"kind": "memory"}))["devices"])
    assert pools["mem-01"]["free_gib"] == 2048 - 512

    # The rest of the pool goes to another tenant; then nothing is left.
    rest = {"kind": "memory", "capacity_gib": 1536}
    other = await composed(h, "globex", {"host": "host-01", "devices": [rest]})
    assert other["devices"][0]["id"] == "mem-01"
    assert await free_ids(h, "memory") == []
    assert len(await connections(h, device="mem-01")) == 2
    more = await compose(
        h, "initech", {"host": "host-01", "devices": [{**rest, "capacity_gib": 1}]}
    )
    error = expect_error(more, "no_capacity")
    assert check_funnel(error["details"])[2] == ("free", 1, 0)


async def test_an_exclusive_composition_keeps_other_tenants_off_its_switch(h: Harness, log) -> None:
    await imported(h)
    held = await composed(
        h, "acme", {"host": "host-01", "devices": [{"kind": "nic"}], "constraints": EXCLUSIVE}
    )

    reply = await compose(
        h, "globex", {"request_id": "r-blocked", "host": "host-01", "devices": [GPU]}
    )

    # Every path from host-01 passes sw-1, which acme holds exclusively. (Which of the two
    # codes: the test below pins no_path.)
    assert reply["ok"] is False and reply["error"]["code"] in ("no_path", "no_capacity"), reply
    error = expect_error(reply, reply["error"]["code"])
    funnel = check_funnel(error["details"])
    assert funnel[:4] == [
        ("kind and model", 0, 2),
        ("health", 0, 2),
        ("free", 0, 2),
        ("isolation and labels", 2, 0),
    ]
    assert [e["type"] for e in await log("r-blocked")] == ["CompositionRejected"]
    # The holder itself may keep using its switch; once it lets go, so may others.
    mine = await composed(h, "acme", {"host": "host-01", "devices": [GPU]})
    assert mine["devices"][0]["path"][1] == "sw-1"
    for cid in (held["composition_id"], mine["composition_id"]):
        expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid}))
    expect_ok(await compose(h, "globex", {"host": "host-01", "devices": [GPU]}))


async def test_a_tenant_blocked_only_by_another_tenants_exclusive_switch_gets_no_path(
    h: Harness,
) -> None:
    await imported(h)
    await composed(
        h, "acme", {"host": "host-01", "devices": [{"kind": "nic"}], "constraints": EXCLUSIVE}
    )

    reply = await compose(h, "globex", {"host": "host-01", "devices": [GPU]})

    expect_error(reply, "no_path")


async def test_the_message_of_a_compose_cut_off_by_an_exclusive_switch_names_isolation(
    h: Harness,
) -> None:
    await imported(h)
    await composed(
        h, "acme", {"host": "host-01", "devices": [{"kind": "nic"}], "constraints": EXCLUSIVE}
    )

    reply = await compose(h, "globex", {"host": "host-01", "devices": [GPU]})

    assert reply["ok"] is False, reply
    assert "0 pass isolation and labels" in reply["error"]["message"], reply


async def test_label_constraints_choose_the_device_with_those_labels(h: Harness) -> None:
    await imported(h)

    result = await composed(
        h, "acme", {"host": "host-01", "devices": [GPU], "constraints": {"labels": {"rack": "r3"}}}
    )

    # gpu-02 (older) would go first without the constraint; only gpu-01 is in rack r3.
    assert [d["id"] for d in result["devices"]] == ["gpu-01"]
    [row] = await connections(h, device="gpu-01")
    assert row["why"]["constraints"]["labels"] == {"rack": "r3"}
    nothing = await compose(
        h, "acme", {"host": "host-01", "devices": [GPU], "constraints": {"labels": {"rack": "r9"}}}
    )
    error = expect_error(nothing, "no_capacity")
    assert check_funnel(error["details"])[3] == ("isolation and labels", 1, 0)


# ==== rejections: why not, recorded, replayed ====

# (case, components failed first, compose body, reply code, the funnel as (removed, remaining)
# per stage, words the message must carry: the counts and the nearest miss).
REJECTIONS = [
    (
        "hops",
        [],
        {"devices": [GPU], "constraints": {"max_hops": 3}},
        "no_path",
        [(0, 2), (0, 2), (0, 2), (0, 2), (2, 0), (0, 0), (0, 0)],
        "0 reachable within 3 hops (nearest: gpu-01 at 4 hops)",
    ),
    (
        "latency",
        [],
        {"devices": [GPU], "constraints": {"max_latency_ns": 329}},
        "no_path",
        [(0, 2), (0, 2), (0, 2), (0, 2), (0, 2), (2, 0), (0, 0)],
        "0 within 329 ns (nearest: gpu-01 at 330 ns)",
    ),
    (
        "bandwidth",
        [],
        {"devices": [{"kind": "gpu", "bandwidth_gbps": 65}]},
        "no_path",
        [(0, 2), (0, 2), (0, 2), (0, 2), (0, 2), (0, 2), (2, 0)],
        "0 with 65 Gbps free (nearest: gpu-01 at 4 hops, short of bandwidth)",
    ),
    (
        "kind-and-model",
        [],
        {"devices": [{"kind": "gpu", "models": ["B200"]}]},
        "no_capacity",
        [(0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0)],
        "0 gpu B200 exist",
    ),
    (
        "health",
        ["gpu-01"],
        {"devices": [{"kind": "gpu", "models": ["H100"]}]},
        "no_capacity",
        [(0, 1), (1, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0)],
        "1 gpu H100 exist, 0 healthy",
    ),
    (
        "second-of-count",
        [],
        {"devices": [{"kind": "nic", "count": 2}]},
        "no_capacity",
        # The one nic is free and reachable: it is the one found, and one is not two.
        [(0, 1), (0, 1), (0, 1), (0, 1), (0, 1), (0, 1), (0, 1)],
        "needs 2 nic, found 1: 1 nic exist, 1 healthy, 1 free, 1 reachable",
    ),
    (
        # host-01's one OCS uplink carries the circuit to the first GPU, so the second has no
        # path; the request fails whole, taking back the first GPU and its circuit.
        "second-gpu-behind-a-busy-uplink",
        [],
        {"devices": [{"kind": "gpu", "count": 2}]},
        "no_path",
        # Both free; the one found holds the uplink, so the other has no path.
        [(0, 2), (0, 2), (0, 2), (0, 2), (1, 1), (0, 1), (0, 1)],
        "needs 2 gpu, found 1: 2 gpu exist, 2 healthy, 2 free, 1 reachable",
    ),
]


@pytest.mark.parametrize(
    ("failed", "body", "code", "funnel", "says"),
    [c[1:] for c in REJECTIONS],
    ids=[c[0] for c in REJECTIONS],
)
async def test_a_refused_compose_says_why_not_with_a_funnel_and_the_nearest_miss(
    h: Harness,
    log,
    counts,
    failed: list[str],
    body: dict[str, Any],
    code: str,
    funnel: list[tuple[int, int]],
    says: str,
) -> None:
    await imported(h)
    for component in failed:
        fault = {"component": component, "state": "failed"}
        expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))
    request = {"request_id": "r-no", "host": "host-01", **body}
    before = await counts()

    reply = await compose(h, "acme", request)

    error = expect_error(reply, code)
    assert [(removed, left) for _, removed, left in check_funnel(error["details"])] == funnel
    assert says in error["message"], error["message"]
    # Recorded for auditors: one CompositionRejected, caused by the request, carrying the why.
    [event] = await log("r-no")
    assert (event["type"], event["actor"]) == ("CompositionRejected", "acme")
    assert event["data"]["code"] == code and event["data"]["message"] == error["message"]
    assert event["data"]["details"]["funnel"] == error["details"]["funnel"]
    assert await counts() == (before[0] + 1, before[1] + 1)
    assert await connections(h) == [] and (await query(h, "topology"))["circuits"] == []
    assert await free_ids(h, "nic") == ["nic-01"]
    assert await free_ids(h, "gpu") == sorted({"gpu-01", "gpu-02"} - set(failed))

    # A resend is answered from the log, word for word but marked as the replay it is (a
    # refusal is final for its request_id: retrying with it never composes), and writes nothing.
    again = await compose(h, "acme", request)

    marked = {**reply["error"], "details": {**reply["error"]["details"], "replayed": True}}
    assert again == {**reply, "error": marked}
    assert await counts() == (before[0] + 1, before[1] + 1)


# ==== release and extend ====


async def test_release_returns_the_devices_and_removed_circuits_and_disconnects_them(
    h: Harness, log
) -> None:
    await imported(h)
    cid = (await composed(h, "acme", FULL_COMPOSE))["composition_id"]

    reply = await h.client.intent(
        DOMAIN, "acme", "release", {"request_id": "r-rel", "composition_id": cid}
    )

    result = expect_ok(reply)
    assert result["composition_id"] == cid
    assert result["state"] == "released"
    assert sorted(result["devices"]) == ["gpu-02", "nic-01"]
    assert len(result["circuits_removed"]) == 1 and "ocs-1" in result["circuits_removed"][0]
    assert [e["type"] for e in await log("r-rel")] == ["CompositionReleased", "CircuitRemoved"]
    assert await connections(h) == []
    shown = await query(h, "composition", {"id": cid})
    assert (shown["state"], shown["tenant"]) == ("released", "acme")
    assert await free_ids(h) == ["gpu-01", "gpu-02", "mem-01", "nic-01", "nvme-01"]
    topo = await query(h, "topology")
    assert topo["circuits"] == []
    assert all(lk["free_gbps"] == lk["capacity_gbps"] for lk in topo["links"])


async def test_releasing_a_released_composition_again_is_not_found(h: Harness, counts) -> None:
    await imported(h)
    cid = (await composed(h, "acme", {"host": "host-01", "devices": [GPU]}))["composition_id"]
    expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid}))
    before = await counts()

    again = await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid})

    assert cid in expect_error(again, "not_found")["message"]
    never = await h.client.intent(DOMAIN, "acme", "release", {"composition_id": "c-nothing"})
    expect_error(never, "not_found")
    assert await counts() == before


async def test_another_tenant_cannot_release_or_extend_a_composition(h: Harness, counts) -> None:
    await imported(h)
    result = await composed(h, "acme", {"host": "host-01", "devices": [GPU], "lease_seconds": 60})
    cid = result["composition_id"]
    before = await counts()

    release = await h.client.intent(DOMAIN, "globex", "release", {"composition_id": cid})
    extend = await h.client.intent(
        DOMAIN, "globex", "extend", {"composition_id": cid, "lease_seconds": 600}
    )

    # Answered as an id that does not exist, word for word: no existence oracle.
    unknown = await h.client.intent(DOMAIN, "globex", "release", {"composition_id": "c-none"})
    for reply in (release, extend):
        error = expect_error(reply, "not_found")
        assert error["message"] == expect_error(unknown, "not_found")["message"].replace(
            "c-none", cid
        )
    assert await counts() == before
    shown = await query(h, "composition", {"id": cid})
    assert (shown["state"], shown["expires_at"]) == ("active", result["expires_at"])
    assert [r["device"] for r in await connections(h, tenant="acme")] == ["gpu-02"]


async def test_extend_moves_the_lease_deadline_on_by_lease_seconds(h: Harness, log) -> None:
    await imported(h)
    result = await composed(h, "acme", {"host": "host-01", "devices": [GPU], "lease_seconds": 3600})
    cid = result["composition_id"]

    reply = await h.client.intent(
        DOMAIN,
        "acme",
        "extend",
        {"request_id": "r-ext", "composition_id": cid, "lease_seconds": 600},
    )

    extended = expect_ok(reply)
    assert extended["composition_id"] == cid
    assert when(extended["expires_at"]) == when(result["expires_at"]) + timedelta(seconds=600)
    assert (await query(h, "composition", {"id": cid}))["expires_at"] == extended["expires_at"]
    assert [e["type"] for e in await log("r-ext")] == ["LeaseExtended"]


# ==== faults and blast radius ====

MEMORY_SLICE = {"host": "host-01", "devices": [{"kind": "memory", "capacity_gib": 256}]}


async def test_blast_radius_lists_the_compositions_and_tenants_whose_paths_use_a_component(
    h: Harness, counts
) -> None:
    await imported(h)
    acme = (await composed(h, "acme", FULL_COMPOSE))["composition_id"]
    globex = (await composed(h, "globex", MEMORY_SLICE))["composition_id"]
    before = await counts()

    radius = {
        cid: await query(h, "blast-radius", {"id": cid})
        for cid in ("sw-1", "l-host", "l-uplink", "ocs-1", "gpu-02", "mem-01", "gpu-01", "l-nvme")
    }

    def hit(cid: str) -> tuple[list[str], list[str]]:
        found = radius[cid]
        return [c["composition_id"] for c in found["compositions"]], found["tenants"]

    both = (sorted([acme, globex]), ["acme", "globex"])
    assert hit("sw-1") == hit("l-host") == both
    assert hit("l-uplink") == hit("ocs-1") == hit("gpu-02") == ([acme], ["acme"])
    assert hit("mem-01") == ([globex], ["globex"])
    assert hit("gpu-01") == hit("l-nvme") == ([], [])
    assert await counts() == before
    unknown = await h.client.query(DOMAIN, "blast-radius", {"id": "gpu-99"})
    assert "gpu-99" in expect_error(unknown, "not_found")["message"]


async def test_a_fault_on_a_link_in_use_impairs_the_compositions_that_pass_it(
    h: Harness, log
) -> None:
    await imported(h)
    acme = (await composed(h, "acme", FULL_COMPOSE))["composition_id"]
    globex = (await composed(h, "globex", MEMORY_SLICE))["composition_id"]

    reply = await h.client.admin(
        DOMAIN,
        "report-fault",
        {"request_id": "r-los", "component": "l-uplink", "state": "failed", "detail": "los"},
    )

    assert expect_ok(reply)["impaired"] == [acme]
    assert [e["type"] for e in await log("r-los")] == ["ComponentFaulted", "CompositionImpaired"]
    assert (await query(h, "composition", {"id": acme}))["state"] == "impaired"
    assert (await query(h, "composition", {"id": globex}))["state"] == "active"
    # Still connected (impaired, not released); blast radius shows the new state.
    assert [r["device"] for r in await connections(h, tenant="acme")] == ["gpu-02", "nic-01"]
    [hit] = (await query(h, "blast-radius", {"id": "l-uplink"}))["compositions"]
    assert (hit["composition_id"], hit["state"]) == (acme, "impaired")
    why = await query(h, "why", {"id": "gpu-02"})
    assert "impaired" in why["text"] and "l-uplink" in why["text"]
    # The same report again changes nothing and impairs nothing more.
    again = await h.client.admin(
        DOMAIN, "report-fault", {"component": "l-uplink", "state": "failed", "detail": "los"}
    )
    assert expect_ok(again)["impaired"] == []


# ==== why ====


async def check_chain(chain: list[dict[str, Any]], log) -> list[str]:
    """Every chain entry is an event of the log, told as the contract says; returns the types."""
    events = {e["position"]: e for e in await log()}
    assert chain and [e["position"] for e in chain] == sorted({e["position"] for e in chain})
    for entry in chain:
        assert list(entry) == CHAIN_KEYS, entry
        event = events[entry["position"]]
        assert entry["type"] == event["type"]
        assert entry["actor"] == event["actor"]
        assert entry["request_id"] == event["causation_id"]
        assert when(entry["time"]) == event["recorded_at"]
    return [e["type"] for e in chain]


async def test_why_says_in_one_sentence_what_a_device_host_composition_or_link_is_connected_to(
    h: Harness, log
) -> None:
    await imported(h)
    cid = (await composed(h, "acme", FULL_COMPOSE))["composition_id"]

    answers = {
        target: await query(h, "why", {"id": target})
        for target in ("gpu-02", "host-01", cid, "l-uplink", "gpu-01")
    }

    for target, why in answers.items():
        one_sentence(why["text"])
        assert target in why["text"], why["text"]
    device, host_, composition, cable = (
        answers[t]["text"] for t in ("gpu-02", "host-01", cid, "l-uplink")
    )
    assert "host-01" in device and cid in device and "acme" in device and "r-full" in device
    assert "gpu-02" in host_ and "nic-01" in host_ and cid in host_
    assert "host-01" in composition and "gpu-02" in composition and "nic-01" in composition
    assert "host-01" in cable and "gpu-02" in cable and "nic-01" not in cable
    assert "nothing" in answers["gpu-01"]["text"]
    made_it_so = COMPOSITION_EVENTS
    for target in ("gpu-02", "host-01", cid, "l-uplink"):
        types = await check_chain(answers[target]["chain"], log)
        assert [t for t in types if t != "TopologyImported"] == made_it_so, (target, types)
        assert {e["request_id"] for e in answers[target]["chain"] if e["type"] in made_it_so} == {
            "r-full",
            f"settle-{cid}",
        }


async def test_why_of_a_released_composition_says_when_it_ended(h: Harness, log) -> None:
    await imported(h)
    cid = (await composed(h, "acme", FULL_COMPOSE))["composition_id"]
    expect_ok(
        await h.client.intent(
            DOMAIN, "acme", "release", {"request_id": "r-rel", "composition_id": cid}
        )
    )

    why = await query(h, "why", {"id": cid})

    one_sentence(why["text"])
    assert "released" in why["text"] and "host-01" in why["text"]
    types = await check_chain(why["chain"], log)
    assert types[-2:] == ["CompositionReleased", "CircuitRemoved"]


async def test_why_of_a_device_that_holds_nothing_names_what_let_it_go_to_whom_may_see(
    h: Harness, log
) -> None:
    await imported(h)
    cid = (await composed(h, "acme", FULL_COMPOSE))["composition_id"]
    released = await h.client.intent(
        DOMAIN, "acme", "release", {"request_id": "r-rel", "composition_id": cid}
    )
    position = expect_ok(released) and released["position"]

    device = await query(h, "why", {"id": "gpu-02"})

    one_sentence(device["text"])
    assert device["text"].startswith("gpu-02 is connected to nothing; it is free and healthy;")
    assert (
        f"last connected to host-01 in composition {cid} for tenant acme until " in (device["text"])
    )
    assert device["text"].endswith(", when the composition was released.")
    types = await check_chain(device["chain"], log)
    assert types[-1] == "CompositionReleased" and device["chain"][-1]["position"] < position
    # The tenant whose it was reads the same; another tenant learns nothing of it.
    own = expect_ok(await h.client.view(DOMAIN, "acme", "why", {"id": "gpu-02"}))
    assert own["text"] == device["text"]
    other = expect_ok(await h.client.view(DOMAIN, "globex", "why", {"id": "gpu-02"}))
    assert other["text"] == "gpu-02 is connected to nothing; it is free and healthy."
    assert "CompositionReleased" not in [e["type"] for e in other["chain"]]
    # At the moment of the release, from a fold in memory, the same answer.
    past = expect_ok(await h.client.query(DOMAIN, "why", {"id": "gpu-02", "at": position}))
    assert (past["text"], past["chain"]) == (device["text"], device["chain"])


async def test_why_of_a_reserved_device_says_whose_reservation_holds_it_not_free(
    h: Harness,
) -> None:
    """A re-check probe: `why` of a GPU a live reservation held said 'it is free', while
    `free` left it out and the KV value named the reservation."""
    await imported(h)
    made = await h.client.intent(
        DOMAIN,
        "beta",
        "reserve",
        {"request_id": "rsv-1", "manifest": {"host": "host-01", "device_ids": ["gpu-02"]}},
    )
    rid = expect_ok(made)["reservation_id"]

    device = await query(h, "why", {"id": "gpu-02"})

    one_sentence(device["text"])
    assert f"it is reserved for tenant beta by {rid} until " in device["text"], device
    assert "free" not in device["text"]
    own = expect_ok(await h.client.view(DOMAIN, "beta", "why", {"id": "gpu-02"}))
    assert own["text"] == device["text"]
    other = expect_ok(await h.client.view(DOMAIN, "acme", "why", {"id": "gpu-02"}))
    assert other["text"] == "gpu-02 is reserved by others; it is healthy."
    # At the moment it was reserved, from the state of then, the same; before it, free.
    at = expect_ok(await h.client.query(DOMAIN, "why", {"id": "gpu-02", "at": made["position"]}))
    assert at["text"] == device["text"]
    before = made["position"] - 1
    earlier = expect_ok(await h.client.query(DOMAIN, "why", {"id": "gpu-02", "at": before}))
    assert "it is free and healthy" in earlier["text"]


async def test_why_at_a_past_moment_tells_that_moment_and_before_the_domain_not_found(
    h: Harness, log, counts
) -> None:
    await imported(h)
    await composed(h, "acme", FULL_COMPOSE)
    now = (await h.client.query(DOMAIN, "why", {"id": "gpu-02"}))["position"]
    first = (await log())[0]["position"]
    before = await counts()

    past = await h.client.query(DOMAIN, "why", {"id": "gpu-02", "at": first})
    past_time = await h.client.query(DOMAIN, "why", {"id": "gpu-02", "at": "2020-01-01T00:00:00Z"})
    present = await h.client.query(DOMAIN, "why", {"id": "gpu-02", "at": now})
    unknown = await h.client.query(DOMAIN, "why", {"id": "gpu-99"})

    assert expect_ok(past)["text"] == "gpu-02 is connected to nothing; it is free and healthy."
    assert past["position"] == first
    assert "did not exist yet" in expect_error(past_time, "not_found")["message"]
    assert "host-01" in expect_ok(present)["text"]
    assert "gpu-99" in expect_error(unknown, "not_found")["message"]
    assert await counts() == before


# ==== request ids ====


async def test_resending_a_composition_intent_with_its_request_id_replays_the_first_answer(
    h: Harness, counts
) -> None:
    await imported(h)
    body = {"request_id": "r-1", "host": "host-01", "devices": [GPU], "reason": "first"}
    first = await compose(h, "acme", body)
    expect_ok(await compose(h, "acme", {"host": "host-01", "devices": [{"kind": "nic"}]}))
    before = await counts()

    # The same body in another key order: the same intent.
    again = await compose(h, "acme", dict(reversed(body.items())))

    assert again == {**first, "replayed": True}
    assert await counts() == before
    cid = expect_ok(first)["composition_id"]
    assert len(await connections(h, device="gpu-02")) == 1

    # A release resent after it took effect still gets its first answer, not not_found.
    release = {"request_id": "r-2", "composition_id": cid}
    released = await h.client.intent(DOMAIN, "acme", "release", release)
    resent = await h.client.intent(DOMAIN, "acme", "release", release)
    assert expect_ok(released)["state"] == "released"
    assert resent == {**released, "replayed": True}


async def test_a_request_id_reused_with_a_different_body_is_a_conflict_and_writes_nothing(
    h: Harness, counts
) -> None:
    await imported(h)
    first = await composed(h, "acme", {"request_id": "r-1", "host": "host-01", "devices": [GPU]})
    before = await counts()

    other_body = await compose(
        h, "acme", {"request_id": "r-1", "host": "host-01", "devices": [{"kind": "nic"}]}
    )
    other_verb = await h.client.intent(
        DOMAIN, "acme", "release", {"request_id": "r-1", "composition_id": first["composition_id"]}
    )

    for reply in (other_body, other_verb):
        assert expect_error(reply, "conflict")["details"] == {"request_id": "r-1"}
    assert await counts() == before
    assert await free_ids(h, "nic") == ["nic-01"]
    assert (await query(h, "composition", {"id": first["composition_id"]}))["state"] == "active"


async def test_the_same_request_id_from_two_tenants_makes_two_separate_compositions(
    h: Harness, log
) -> None:
    await imported(h)
    body = {
        "request_id": "r-shared",
        "host": "host-01",
        "devices": [{"kind": "memory", "capacity_gib": 64}],
    }

    acme = await compose(h, "acme", body)
    globex = await compose(h, "globex", body)

    assert acme["replayed"] is False and globex["replayed"] is False
    acme_id, globex_id = expect_ok(acme)["composition_id"], expect_ok(globex)["composition_id"]
    assert acme_id != globex_id
    rows = await connections(h, device="mem-01")
    assert {(r["tenant"], r["composition_id"]) for r in rows} == {
        ("acme", acme_id),
        ("globex", globex_id),
    }
    requested = [e for e in await log("r-shared") if e["type"] == "CompositionRequested"]
    assert sorted(e["actor"] for e in requested) == ["acme", "globex"]
    # Each tenant's resend gets its own answer back.
    assert await compose(h, "globex", body) == {**globex, "replayed": True}
    assert await compose(h, "acme", body) == {**acme, "replayed": True}


# ==== bad input ====


def js(value: Any) -> bytes:
    return json.dumps(value).encode()


COMPOSE = f"intent.{DOMAIN}.acme.compose"
RELEASE = f"intent.{DOMAIN}.acme.release"
EXTEND = f"intent.{DOMAIN}.acme.extend"
VALID = {"request_id": "r-bad", "host": "host-01", "devices": [GPU]}
MEM = {"kind": "memory", "capacity_gib": 64}
LONG = "x" * 65


def with_(**changes: Any) -> bytes:
    """The valid compose with fields changed (None drops a field)."""
    body = {**VALID, **changes}
    return js({k: v for k, v in body.items() if v is not None})


# (case, subject tail, body, a word the message must contain)
BAD_COMPOSE: list[tuple[str, str, bytes, str]] = [
    ("malformed-json", COMPOSE, b'{"request_id": "r-bad", "host": ', "JSON"),
    # msgspec keeps the last of a key named twice; a gateway keeping the first would differ.
    (
        "key-named-twice",
        COMPOSE,
        b'{"request_id": "r-1", "request_id": "r-2", "host": "host-01", '
        b'"devices": [{"kind": "gpu"}]}',
        "named twice",
    ),
    (
        "key-named-twice-in-an-entry",
        COMPOSE,
        b'{"request_id": "r-3", "host": "host-01", "devices": [{"kind": "gpu", "count": 1, '
        b'"count": 2}]}',
        "'count' is named twice",
    ),
    ("json-array", COMPOSE, js([VALID]), "object"),
    ("unknown-field", COMPOSE, with_(colour="red"), "colour"),
    ("unknown-field-in-entry", COMPOSE, with_(devices=[{"kind": "gpu", "flavour": 1}]), "flavour"),
    ("unknown-constraint", COMPOSE, with_(constraints={"max_hop": 3}), "max_hop"),
    (
        "unknown-field-in-selector",
        COMPOSE,
        with_(host=None, host_selector={"label": {"rack": "r1"}}),
        "label",
    ),
    ("tenant-field-in-body", COMPOSE, with_(tenant="globex"), "tenant"),
    ("devices-not-a-list", COMPOSE, with_(devices="gpu"), "devices"),
    ("count-as-string", COMPOSE, with_(devices=[{"kind": "gpu", "count": "2"}]), "count"),
    ("count-as-float", COMPOSE, with_(devices=[{"kind": "gpu", "count": 1.5}]), "count"),
    ("lease-as-string", COMPOSE, with_(lease_seconds="1h"), "lease_seconds"),
    ("host-as-number", COMPOSE, with_(host=7), "host"),
    ("label-value-not-text", COMPOSE, with_(labels={"workload": 1}), "labels"),
    ("models-not-a-list", COMPOSE, with_(devices=[{"kind": "gpu", "models": "H100"}]), "models"),
    (
        "negative-bandwidth",
        COMPOSE,
        with_(devices=[{"kind": "gpu", "bandwidth_gbps": -1}]),
        "bandwidth",
    ),
    ("host-with-dot", COMPOSE, with_(host="host.01"), "host"),
    ("host-with-space", COMPOSE, with_(host="host 01"), "host"),
    ("empty-host", COMPOSE, with_(host=""), "host"),
    ("host-65-chars", COMPOSE, with_(host=LONG), "host"),
    ("device-id-with-star", COMPOSE, with_(devices=None, device_ids=["gpu*"]), "device_ids"),
    ("empty-device-id", COMPOSE, with_(devices=None, device_ids=[""]), "device_ids"),
    (
        "both-host-and-host-selector",
        COMPOSE,
        with_(host_selector={"labels": {"rack": "r1"}}),
        "host_selector",
    ),
    ("neither-host-nor-host-selector", COMPOSE, with_(host=None), "host"),
    ("memory-without-capacity", COMPOSE, with_(devices=[{"kind": "memory"}]), "capacity_gib"),
    (
        "capacity-on-a-gpu",
        COMPOSE,
        with_(devices=[{"kind": "gpu", "capacity_gib": 64}]),
        "capacity_gib",
    ),
    ("zero-capacity", COMPOSE, with_(devices=[{**MEM, "capacity_gib": 0}]), "capacity_gib"),
    ("negative-capacity", COMPOSE, with_(devices=[{**MEM, "capacity_gib": -64}]), "capacity_gib"),
    ("empty-devices", COMPOSE, with_(devices=[]), "devices"),
    ("empty-device-ids", COMPOSE, with_(devices=None, device_ids=[]), "device_ids"),
    ("nothing-to-compose", COMPOSE, with_(devices=None), "devices"),
    ("zero-count", COMPOSE, with_(devices=[{"kind": "gpu", "count": 0}]), "count"),
    ("negative-count", COMPOSE, with_(devices=[{"kind": "gpu", "count": -2}]), "count"),
    ("unknown-device-kind", COMPOSE, with_(devices=[{"kind": "tpu"}]), "kind"),
    ("missing-device-kind", COMPOSE, with_(devices=[{"count": 1}]), "kind"),
    ("unknown-isolation", COMPOSE, with_(constraints={"isolation": "private"}), "isolation"),
    ("zero-max-hops", COMPOSE, with_(constraints={"max_hops": 0}), "max_hops"),
    ("negative-latency", COMPOSE, with_(constraints={"max_latency_ns": -1}), "max_latency_ns"),
    ("zero-lease", COMPOSE, with_(lease_seconds=0), "lease_seconds"),
    ("device-id-twice", COMPOSE, with_(devices=None, device_ids=["gpu-01", "gpu-01"]), "twice"),
    ("missing-request-id", COMPOSE, with_(request_id=None), "request_id"),
    ("empty-request-id", COMPOSE, with_(request_id=""), "request_id"),
    ("control-char-in-reason", COMPOSE, with_(reason="a\u0000b"), "reason"),
    ("tenant-with-dollar", f"intent.{DOMAIN}.ac$me.compose", with_(), "tenant"),
    ("tenant-with-percent", f"intent.{DOMAIN}.ac%me.compose", with_(), "tenant"),
    ("tenant-65-chars", f"intent.{DOMAIN}.{LONG}.compose", with_(), "tenant"),
    ("unknown-intent-verb", f"intent.{DOMAIN}.acme.compost", with_(), "verb"),
]

BAD_RELEASE_AND_EXTEND: list[tuple[str, str, bytes, str]] = [
    ("release-malformed-json", RELEASE, b"{", "JSON"),
    ("release-missing-id", RELEASE, js({"request_id": "r-bad"}), "composition_id"),
    (
        "release-id-with-dot",
        RELEASE,
        js({"request_id": "r-bad", "composition_id": "c.1"}),
        "composition_id",
    ),
    (
        "release-id-as-number",
        RELEASE,
        js({"request_id": "r-bad", "composition_id": 1}),
        "composition_id",
    ),
    (
        "release-unknown-field",
        RELEASE,
        js({"request_id": "r-bad", "composition_id": "c-1", "force": True}),
        "force",
    ),
    (
        "release-tenant-with-dollar",
        f"intent.{DOMAIN}.ac$me.release",
        js({"request_id": "r-bad", "composition_id": "c-1"}),
        "tenant",
    ),
    (
        "extend-missing-lease",
        EXTEND,
        js({"request_id": "r-bad", "composition_id": "c-1"}),
        "lease_seconds",
    ),
    (
        "extend-zero-lease",
        EXTEND,
        js({"request_id": "r-bad", "composition_id": "c-1", "lease_seconds": 0}),
        "lease_seconds",
    ),
    (
        "extend-negative-lease",
        EXTEND,
        js({"request_id": "r-bad", "composition_id": "c-1", "lease_seconds": -60}),
        "lease_seconds",
    ),
    (
        "extend-lease-as-string",
        EXTEND,
        js({"request_id": "r-bad", "composition_id": "c-1", "lease_seconds": "600"}),
        "lease_seconds",
    ),
    (
        "extend-bad-id",
        EXTEND,
        js({"request_id": "r-bad", "composition_id": "c 1", "lease_seconds": 60}),
        "composition_id",
    ),
    (
        "extend-unknown-field",
        EXTEND,
        js({"request_id": "r-bad", "composition_id": "c-1", "lease_seconds": 60, "until": 1}),
        "until",
    ),
    (
        "extend-tenant-65-chars",
        f"intent.{DOMAIN}.{LONG}.extend",
        js({"request_id": "r-bad", "composition_id": "c-1", "lease_seconds": 60}),
        "tenant",
    ),
]


def q(what: str) -> str:
    return f"query.{DOMAIN}.{what}"


BAD_QUERIES: list[tuple[str, str, bytes, str]] = [
    ("composition-without-id", q("composition"), b"{}", "id"),
    ("composition-id-with-dot", q("composition"), js({"id": "c.1"}), "id"),
    ("composition-id-as-number", q("composition"), js({"id": 5}), "id"),
    ("composition-unknown-field", q("composition"), js({"id": "c-1", "full": True}), "full"),
    ("composition-malformed-json", q("composition"), b'{"id": ', "JSON"),
    ("connections-host-as-number", q("connections"), js({"host": 1}), "host"),
    ("connections-tenant-with-space", q("connections"), js({"tenant": "a b"}), "tenant"),
    ("connections-empty-device", q("connections"), js({"device": ""}), "device"),
    ("connections-unknown-field", q("connections"), js({"composition": "c-1"}), "composition"),
    ("why-without-id", q("why"), b"{}", "id"),
    ("why-id-with-slash", q("why"), js({"id": "gpu/01"}), "id"),
    ("why-at-as-list", q("why"), js({"id": "gpu-01", "at": [1]}), "at"),
    ("why-unknown-field", q("why"), js({"id": "gpu-01", "since": 1}), "since"),
    ("free-unknown-kind", q("free"), js({"kind": "tpu"}), "kind"),
    ("free-kind-as-number", q("free"), js({"kind": 1}), "kind"),
    ("free-unknown-field", q("free"), js({"model": "H100"}), "model"),
    ("topology-unknown-field", q("topology"), js({"verbose": True}), "verbose"),
    ("blast-radius-without-id", q("blast-radius"), b"{}", "id"),
    ("blast-radius-id-65-chars", q("blast-radius"), js({"id": LONG}), "id"),
    ("blast-radius-json-array", q("blast-radius"), js(["gpu-01"]), "object"),
    ("unknown-query", q("everything"), b"{}", "verb"),
]


@pytest.mark.parametrize(
    "cases",
    [BAD_COMPOSE, BAD_RELEASE_AND_EXTEND, BAD_QUERIES],
    ids=["compose", "release-and-extend", "queries"],
)
async def test_bad_input_to_composition_verbs_and_queries_is_invalid_and_writes_nothing(
    h: Harness, counts, cases: list[tuple[str, str, bytes, str]]
) -> None:
    # Given: a live composition, so that release, extend and every query have something to do.
    await imported(h)
    cid = (await composed(h, "acme", {"host": "host-01", "devices": [GPU], "lease_seconds": 60}))[
        "composition_id"
    ]
    before = await counts()

    for case, subject, body, says in cases:
        reply = await h.client.raw(subject, body.replace(b"c-1", cid.encode()))

        error = expect_error(reply, "invalid")
        assert set(error) == {"code", "message", "details"}, (case, reply)
        assert says in error["message"], (case, error["message"])
        assert await counts() == before, case

    # The engine still serves, and the composition is as it was.
    assert (await query(h, "composition", {"id": cid}))["state"] == "active"
    expect_ok(await compose(h, "acme", {"host": "host-01", "devices": [{"kind": "nic"}]}))


async def test_a_compose_lease_beyond_the_calendar_is_invalid_not_unavailable(
    h: Harness, counts
) -> None:
    await imported(h)
    before = await counts()

    reply = await compose(h, "acme", {**VALID, "lease_seconds": 10**12})  # ~31,700 years

    assert await counts() == before
    assert "lease_seconds" in expect_error(reply, "invalid")["message"]


async def test_an_extend_beyond_the_calendar_is_invalid_not_unavailable(h: Harness, counts) -> None:
    await imported(h)
    cid = (await composed(h, "acme", VALID))["composition_id"]
    before = await counts()

    reply = await h.client.intent(
        DOMAIN, "acme", "extend", {"composition_id": cid, "lease_seconds": 10**12}
    )

    assert await counts() == before
    assert "lease_seconds" in expect_error(reply, "invalid")["message"]


async def test_composition_intents_and_queries_for_an_unknown_domain_are_not_found(
    h: Harness, counts
) -> None:
    await imported(h)
    before = await counts()

    replies = [
        await h.client.intent("hall-9", "acme", "compose", VALID),
        await h.client.intent("hall-9", "acme", "release", {"composition_id": "c-1"}),
        await h.client.intent(
            "hall-9", "acme", "extend", {"composition_id": "c-1", "lease_seconds": 60}
        ),
        await h.client.query("hall-9", "composition", {"id": "c-1"}),
        await h.client.query("hall-9", "connections", {}),
        await h.client.query("hall-9", "why", {"id": "gpu-01"}),
        await h.client.query("hall-9", "free", {}),
        await h.client.query("hall-9", "blast-radius", {"id": "gpu-01"}),
    ]

    for reply in replies:
        assert "hall-9" in expect_error(reply, "not_found")["message"]
    assert await counts() == before


# ==== concurrency ====


def contested_fabric() -> Doc:
    """Three hosts (pool a) and eight GPUs on sw-a; gpu-9 hangs off sw-b, which reaches no host."""
    gpus = [f"gpu-{i}" for i in range(1, 10)]
    return {
        "nodes": [
            *(host(f"host-{i}", pool="a") for i in range(1, 4)),
            switch("sw-a"),
            switch("sw-b"),
            *(gpu(g, generation=8 + i % 3) for i, g in enumerate(gpus)),
        ],
        "links": [
            *(link(f"l-host-{i}", f"host-{i}", "sw-a") for i in range(1, 4)),
            *(link(f"l-{g}", "sw-a", g, capacity_gbps=64) for g in gpus[:8]),
            link("l-gpu-9", "sw-b", "gpu-9"),
        ],
    }


async def test_concurrent_composes_for_too_few_gpus_take_each_reachable_gpu_exactly_once(
    h: Harness, log
) -> None:
    await imported(h, contested_fabric())
    tenants = ["acme", "globex", "initech", "umbrella", "hooli"]

    def body(i: int) -> dict[str, Any]:
        where: dict[str, Any] = (
            {"host_selector": {"labels": {"pool": "a"}}}
            if i % 3 == 0
            else {"host": f"host-{i % 3 + 1}"}
        )
        return {"request_id": f"r-{i}", **where, "devices": [{"kind": "gpu", "bandwidth_gbps": 8}]}

    replies = await asyncio.gather(
        *(compose(h, tenants[i % len(tenants)], body(i)) for i in range(30))
    )

    won = [r["result"] for r in replies if r["ok"]]
    lost = [r["error"] for r in replies if not r["ok"]]
    assert len(won) == 8, [r["error"]["code"] for r in replies if not r["ok"]]
    taken = [c["devices"][0]["id"] for c in won]
    assert sorted(taken) == [f"gpu-{i}" for i in range(1, 9)]
    for error in lost:
        assert error["code"] in ("no_capacity", "no_path"), error
        assert check_funnel(error["details"])[2][2] <= 1  # at most the unreachable gpu-9 is free
    # The read side agrees: one connection per GPU, each in its own live composition.
    rows = await connections(h)
    assert sorted(r["device"] for r in rows) == sorted(taken)
    assert len({r["composition_id"] for r in rows}) == 8
    assert {r["composition_id"] for r in rows} == {c["composition_id"] for c in won}
    for row in rows:
        [winner] = [c for c in won if c["composition_id"] == row["composition_id"]]
        assert row["host"] == winner["host"] == row["path"][0]
    assert await free_ids(h, "gpu") == ["gpu-9"]
    types = [e["type"] for e in await log()]
    assert types.count("CompositionActivated") == 8
    assert types.count("CompositionRejected") == 22

    # Releases racing new composes: whatever the order, no GPU is ever held twice.
    owner = {
        r["result"]["composition_id"]: tenants[i % 5] for i, r in enumerate(replies) if r["ok"]
    }
    freed = [c["composition_id"] for c in won[:4]]
    releases = [
        h.client.intent(DOMAIN, owner[cid], "release", {"composition_id": cid}) for cid in freed
    ]
    again = [compose(h, tenants[i % 5], body(100 + i)) for i in range(12)]

    raced = await asyncio.gather(*releases, *again)

    assert all(r["ok"] for r in raced[:4]), raced[:4]
    rewon = [r["result"] for r in raced[4:] if r["ok"]]
    assert len(rewon) <= 4
    rows = await connections(h)
    devices = [r["device"] for r in rows]
    assert len(devices) == len(set(devices)) == 8 - 4 + len(rewon)
    assert sorted(devices + await free_ids(h, "gpu")) == [f"gpu-{i}" for i in range(1, 10)]
