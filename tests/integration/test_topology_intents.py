"""Topology administration through `<prefix>.admin.<domain>.<verb>` and the `topology` query.

Every test drives a real engine over real NATS and Postgres as an operator's client would, and
checks both the reply and what the log holds afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from fabrics import (
    Doc,
    device,
    edited,
    event_types,
    expect_error,
    expect_ok,
    fabric,
    gpu,
    ids,
    link,
    row_counts,
)
from harness import Harness, serving

DOMAIN = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest.fixture
def log(database_url: str, pg_schema: str) -> Any:
    """`await log()` -> the domain's event types in version order."""

    async def types() -> list[str]:
        return await event_types(database_url, pg_schema, DOMAIN)

    return types


async def imported(h: Harness, doc: Doc | None = None) -> dict[str, Any]:
    """Given: the domain exists with `doc` (the standard fabric by default)."""
    reply = await h.client.admin(DOMAIN, "import-topology", doc or fabric())
    expect_ok(reply)
    return reply


async def topology(h: Harness) -> dict[str, Any]:
    result: dict[str, Any] = expect_ok(await h.client.query(DOMAIN, "topology"))
    return result


def by_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in rows}


def shows(row: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Every field of `expected` is in `row` with the same value (rows may carry more)."""
    return {k: row.get(k, "<missing>") for k in expected} == expected


def marks(row: dict[str, Any]) -> tuple[str, bool]:
    return row["health"], row["drained"]


def assert_component(
    result: dict[str, Any],
    cid: str,
    *,
    changed: bool,
    health: str = "healthy",
    drained: bool = False,
    removed: list[str] | None = None,
) -> None:
    """Check the result of add-node, add-link, remove, drain, undrain and report-fault (only the
    fields named here; the result may carry more)."""
    expected = {"component": cid, "changed": changed, "health": health, "drained": drained}
    if removed is not None:
        expected["removed"] = removed
    assert shows(result, expected), result


# ---- import-topology ----


async def test_import_topology_makes_the_topology_query_show_the_fabric(h: Harness, log) -> None:
    doc = fabric()

    reply = await h.client.admin(DOMAIN, "import-topology", doc)

    assert shows(
        expect_ok(reply),
        {
            "domain": DOMAIN,
            "unchanged": False,
            "nodes": 8,
            "links": 7,
            "added": sorted(ids(doc)),
            "updated": [],
            "removed": [],
        },
    )
    assert reply["replayed"] is False
    assert await log() == ["TopologyImported"]
    topo = await topology(h)
    assert topo["circuits"] == []
    nodes, links = by_id(topo["nodes"]), by_id(topo["links"])
    assert [n["id"] for n in topo["nodes"]] == sorted(n["id"] for n in doc["nodes"])
    for spec in doc["nodes"]:
        row = dict(nodes[spec["id"]])
        assert marks(row) == ("healthy", False)
        assert shows(row, spec)
    for spec in doc["links"]:
        row = dict(links[spec["id"]])
        assert marks(row) == ("healthy", False)
        assert row["free_gbps"] == spec["capacity_gbps"]
        assert shows(row, spec)
    assert links["l-gpu-02"]["a_port"] == 2 and "b_port" not in links["l-gpu-02"]


async def test_reimporting_the_same_fabric_with_a_new_request_id_is_unchanged_and_writes_nothing(
    h: Harness, log, database_url: str, pg_schema: str
) -> None:
    first = await imported(h)
    before = await row_counts(database_url, pg_schema)

    # Same content, different key order and a new request_id: still the same fabric.
    doc = fabric()
    again = await h.client.admin(DOMAIN, "import-topology", {"links": doc["links"], **doc})

    result = expect_ok(again)
    assert result["unchanged"] is True
    assert (result["added"], result["updated"], result["removed"]) == ([], [], [])
    assert again["replayed"] is False
    assert again["position"] == first["position"]
    assert await log() == ["TopologyImported"]
    events, requests = await row_counts(database_url, pg_schema)
    assert (events, requests) == (before[0], before[1] + 1)


async def test_reimporting_a_changed_fabric_lists_the_differences_and_keeps_health_and_drain_marks(
    h: Harness, log
) -> None:
    # Given: an imported fabric with marks on components that stay and on one that goes.
    await imported(h)
    for verb, body in [
        ("drain", {"id": "sw-1"}),
        ("drain", {"id": "l-host"}),
        ("report-fault", {"component": "gpu-02", "state": "degraded", "detail": "ecc"}),
        ("report-fault", {"component": "gpu-01", "state": "failed"}),
        ("report-fault", {"component": "l-gpu-01", "state": "failed"}),
        ("drain", {"id": "nic-01"}),
    ]:
        expect_ok(await h.client.admin(DOMAIN, verb, body))
    events_before = await log()

    # When: a new document drops the NIC, changes a GPU and a link, and adds a GPU on port 4.
    doc = edited(fabric())
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] != "nic-01"]
    doc["links"] = [lk for lk in doc["links"] if lk["id"] != "l-nic"]
    by_id(doc["nodes"])["gpu-01"]["memory_gib"] = 96
    by_id(doc["links"])["l-gpu-02"]["capacity_gbps"] = 128
    doc["nodes"].append(gpu("gpu-03", model="H200", generation=10))
    doc["links"].append(link("l-gpu-03", "gpu-03", "ocs-1", b_port=4, capacity_gbps=64))
    reply = await h.client.admin(DOMAIN, "import-topology", doc)

    # Then
    result = expect_ok(reply)
    assert result["unchanged"] is False
    assert result["added"] == ["gpu-03", "l-gpu-03"]
    assert result["updated"] == ["gpu-01", "l-gpu-02"]
    assert result["removed"] == ["l-nic", "nic-01"]
    assert await log() == [*events_before, "TopologyImported"]
    topo = await topology(h)
    nodes, links = by_id(topo["nodes"]), by_id(topo["links"])
    assert set(nodes) | set(links) == ids(doc)
    assert marks(nodes["sw-1"]) == ("healthy", True)
    assert marks(links["l-host"]) == ("healthy", True)
    assert marks(nodes["gpu-02"]) == ("degraded", False)
    assert nodes["gpu-02"]["detail"] == "ecc"
    assert marks(nodes["gpu-01"]) == ("failed", False)
    assert nodes["gpu-01"]["memory_gib"] == 96
    assert marks(links["l-gpu-01"]) == ("failed", False)
    assert links["l-gpu-01"]["free_gbps"] == 0
    assert links["l-gpu-02"]["capacity_gbps"] == 128
    assert marks(nodes["gpu-03"]) == ("healthy", False)


async def test_a_component_removed_by_reimport_and_imported_again_comes_back_unmarked(
    h: Harness,
) -> None:
    await imported(h)
    expect_ok(await h.client.admin(DOMAIN, "drain", {"id": "nic-01"}))
    without = edited(fabric())
    without["nodes"] = [n for n in without["nodes"] if n["id"] != "nic-01"]
    without["links"] = [lk for lk in without["links"] if lk["id"] != "l-nic"]
    expect_ok(await h.client.admin(DOMAIN, "import-topology", without))

    result = expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))

    assert result["added"] == ["l-nic", "nic-01"]
    assert marks(by_id((await topology(h))["nodes"])["nic-01"]) == ("healthy", False)


async def test_rejects_import_with_a_link_to_an_unknown_node_and_the_domain_stays_unknown(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    doc = fabric()
    doc["links"].append(link("l-bad", "host-01", "nowhere"))

    reply = await h.client.admin(DOMAIN, "import-topology", doc)

    assert "nowhere" in expect_error(reply, "invalid")["message"]
    assert await row_counts(database_url, pg_schema) == (0, 0)
    expect_error(await h.client.query(DOMAIN, "topology"), "not_found")
    expect_error(await h.client.admin(DOMAIN, "drain", {"id": "sw-1"}), "not_found")


# ---- add-node and add-link ----


async def test_add_node_adds_a_device_that_the_topology_shows(h: Harness, log) -> None:
    await imported(h)
    node = device("acc-01", "accelerator", vendor="acme", model="X1", generation=2)

    reply = await h.client.admin(DOMAIN, "add-node", {"node": node, "reason": "new card"})

    assert_component(expect_ok(reply), "acc-01", changed=True)
    assert await log() == ["TopologyImported", "NodeAdded"]
    row = by_id((await topology(h))["nodes"])["acc-01"]
    assert shows(row, node)


async def test_rejects_add_node_with_an_id_already_in_use_by_a_node_or_a_link(
    h: Harness, log
) -> None:
    await imported(h)

    for taken in ("gpu-01", "l-host"):
        reply = await h.client.admin(DOMAIN, "add-node", {"node": device(taken, "nic")})
        assert taken in expect_error(reply, "conflict")["message"]

    assert await log() == ["TopologyImported"]


async def test_add_link_cables_a_new_device_to_a_free_ocs_port(h: Harness, log) -> None:
    await imported(h)
    expect_ok(await h.client.admin(DOMAIN, "add-node", {"node": gpu("gpu-03")}))

    reply = await h.client.admin(
        DOMAIN, "add-link", {"link": link("l-gpu-03", "ocs-1", "gpu-03", a_port=7)}
    )

    assert_component(expect_ok(reply), "l-gpu-03", changed=True)
    assert await log() == ["TopologyImported", "NodeAdded", "LinkAdded"]
    row = by_id((await topology(h))["links"])["l-gpu-03"]
    assert (row["a"], row["a_port"], row["b"]) == ("ocs-1", 7, "gpu-03")


@pytest.mark.parametrize(
    ("bad_link", "code", "says"),
    [
        (link("l-x", "host-01", "ghost"), "invalid", "ghost"),
        (link("l-x", "gpu-03", "ocs-1", b_port=1), "invalid", "ocs-1:1"),
        (link("l-x", "gpu-03", "ocs-1", b_port=8), "invalid", "port 8"),
        (link("l-x", "gpu-03", "sw-1", b_port=5), "invalid", "no ocs"),
        (link("l-x", "gpu-03", "ocs-1"), "invalid", "without a port"),
        (link("l-host", "gpu-03", "sw-1"), "conflict", "l-host"),
    ],
    ids=[
        "unknown-endpoint",
        "ocs-port-already-cabled",
        "ocs-port-out-of-range",
        "port-on-a-non-ocs-end",
        "ocs-end-without-port",
        "id-already-in-use",
    ],
)
async def test_rejects_add_link_that_breaks_the_cabling_rules(
    h: Harness, log, database_url: str, pg_schema: str, bad_link: Doc, code: str, says: str
) -> None:
    # Given: the standard fabric (ocs-1 has 8 ports, 0..3 cabled) and an uncabled gpu-03.
    await imported(h)
    expect_ok(await h.client.admin(DOMAIN, "add-node", {"node": gpu("gpu-03")}))
    before = await row_counts(database_url, pg_schema)

    reply = await h.client.admin(DOMAIN, "add-link", {"link": bad_link})

    assert says in expect_error(reply, code)["message"]
    assert await log() == ["TopologyImported", "NodeAdded"]
    assert await row_counts(database_url, pg_schema) == before
    assert "l-x" not in by_id((await topology(h))["links"])


# ---- remove ----


async def test_removing_a_node_also_removes_its_links(h: Harness, log) -> None:
    await imported(h)

    reply = await h.client.admin(DOMAIN, "remove", {"id": "sw-1", "reason": "rma"})

    assert_component(
        expect_ok(reply), "sw-1", changed=True, removed=["l-host", "l-mem", "l-nic", "l-uplink"]
    )
    assert await log() == ["TopologyImported", "ComponentRemoved"]
    topo = await topology(h)
    assert "sw-1" not in by_id(topo["nodes"])
    assert set(by_id(topo["links"])) == {"l-gpu-01", "l-gpu-02", "l-nvme"}


async def test_removing_a_link_frees_its_ocs_port_for_a_new_cable(h: Harness) -> None:
    await imported(h)

    expect_ok(await h.client.admin(DOMAIN, "remove", {"id": "l-nvme"}))
    reply = await h.client.admin(
        DOMAIN, "add-link", {"link": link("l-nvme-2", "nvme-01", "ocs-1", b_port=3)}
    )

    expect_ok(reply)
    links = by_id((await topology(h))["links"])
    assert "l-nvme" not in links and links["l-nvme-2"]["b_port"] == 3


async def test_rejects_remove_of_an_unknown_component_as_not_found(h: Harness, log) -> None:
    await imported(h)

    reply = await h.client.admin(DOMAIN, "remove", {"id": "gpu-99"})

    assert expect_error(reply, "not_found")["details"] == {"id": "gpu-99"}
    assert await log() == ["TopologyImported"]


# ---- drain, undrain and faults ----


@pytest.mark.parametrize("cid", ["gpu-01", "l-uplink"])
async def test_drain_and_undrain_mark_the_component_and_repeats_are_no_ops(
    h: Harness, log, cid: str
) -> None:
    await imported(h)
    section = "links" if cid.startswith("l-") else "nodes"

    async def shown() -> dict[str, Any]:
        return by_id((await topology(h))[section])[cid]

    drained = await h.client.admin(DOMAIN, "drain", {"id": cid, "reason": "maintenance"})
    assert_component(expect_ok(drained), cid, changed=True, drained=True)
    assert marks(await shown()) == ("healthy", True)

    again = await h.client.admin(DOMAIN, "drain", {"id": cid})
    assert_component(expect_ok(again), cid, changed=False, drained=True)
    assert again["position"] == drained["position"]
    assert await log() == ["TopologyImported", "ComponentDrained"]

    undrained = await h.client.admin(DOMAIN, "undrain", {"id": cid})
    assert_component(expect_ok(undrained), cid, changed=True)
    assert undrained["position"] > drained["position"]
    assert marks(await shown()) == ("healthy", False)

    repeat = await h.client.admin(DOMAIN, "undrain", {"id": cid})
    assert_component(expect_ok(repeat), cid, changed=False)
    assert await log() == ["TopologyImported", "ComponentDrained", "ComponentUndrained"]


async def test_report_fault_moves_health_through_failed_degraded_and_healthy(
    h: Harness, log
) -> None:
    await imported(h)

    async def report(state: str, detail: str = "") -> dict[str, Any]:
        body = {"component": "l-gpu-01", "state": state, "detail": detail}
        return expect_ok(await h.client.admin(DOMAIN, "report-fault", body))  # type: ignore[no-any-return]

    async def shown() -> dict[str, Any]:
        return by_id((await topology(h))["links"])["l-gpu-01"]

    assert_component(await report("failed", "los"), "l-gpu-01", changed=True, health="failed")
    row = await shown()
    assert (row["health"], row["detail"], row["free_gbps"]) == ("failed", "los", 0)

    assert (await report("degraded", "high ber"))["health"] == "degraded"
    assert (await shown())["health"] == "degraded"

    assert_component(await report("healthy"), "l-gpu-01", changed=True)
    row = await shown()
    assert (row["health"], row["free_gbps"]) == ("healthy", 64)

    assert_component(await report("healthy"), "l-gpu-01", changed=False)
    assert await log() == [
        "TopologyImported",
        "ComponentFaulted",
        "ComponentFaulted",
        "ComponentRecovered",
    ]


async def test_rejects_drain_and_fault_reports_for_unknown_components(h: Harness, log) -> None:
    await imported(h)

    for verb, body in [
        ("drain", {"id": "ghost"}),
        ("undrain", {"id": "ghost"}),
        ("report-fault", {"component": "ghost", "state": "failed"}),
    ]:
        expect_error(await h.client.admin(DOMAIN, verb, body), "not_found")

    assert await log() == ["TopologyImported"]


# ---- unknown domains ----


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        ("add-node", {"node": gpu("gpu-09")}),
        ("add-link", {"link": link("l-9", "host-01", "sw-1")}),
        ("remove", {"id": "sw-1"}),
        ("drain", {"id": "sw-1"}),
        ("undrain", {"id": "sw-1"}),
        ("report-fault", {"component": "sw-1", "state": "failed"}),
    ],
)
async def test_rejects_any_admin_verb_on_an_unknown_domain_as_not_found(
    h: Harness, database_url: str, pg_schema: str, verb: str, body: dict[str, Any]
) -> None:
    # Given: another domain exists, with the very components the body names.
    await imported(h)

    reply = await h.client.admin("hall-2", verb, body)

    error = expect_error(reply, "not_found")
    assert "hall-2" in error["message"]
    assert await row_counts(database_url, pg_schema) == (1, 1)


@pytest.mark.parametrize(
    ("what", "body"),
    [
        ("topology", {}),
        ("composition", {"id": "c-1"}),
        ("connections", {}),
        ("why", {"id": "gpu-01"}),
        ("free", {}),
        ("blast-radius", {"id": "sw-1"}),
    ],
)
async def test_rejects_queries_on_an_unknown_domain_as_not_found(
    h: Harness, what: str, body: dict[str, Any]
) -> None:
    await imported(h)

    reply = await h.client.query("hall-2", what, body)

    assert "hall-2" in expect_error(reply, "not_found")["message"]
