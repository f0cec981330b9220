"""Leases and repairs over real NATS and Postgres, with a clock the test controls."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest_asyncio
from harness import Harness, ManualClock, bucket_values, serving

DOMAIN = "hall-1"


@pytest_asyncio.fixture
async def clock() -> ManualClock:
    return ManualClock()


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, clock: ManualClock
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as harness:
        yield harness


FABRIC: dict[str, Any] = {
    "nodes": [
        {"id": "host-1", "kind": "host"},
        {"id": "sw-a", "kind": "switch"},
        {"id": "sw-b", "kind": "switch"},
        {"id": "gpu-1", "kind": "device", "device_kind": "gpu", "generation": 8},
        {"id": "gpu-2", "kind": "device", "device_kind": "gpu", "generation": 9},
    ],
    "links": [
        {"id": "l-ha", "a": "host-1", "b": "sw-a", "capacity_gbps": 100},
        {"id": "l-a1", "a": "sw-a", "b": "gpu-1", "capacity_gbps": 100},
        {"id": "l-hb", "a": "host-1", "b": "sw-b", "capacity_gbps": 100},
        {"id": "l-b1", "a": "sw-b", "b": "gpu-1", "capacity_gbps": 100},
        {"id": "l-b2", "a": "sw-b", "b": "gpu-2", "capacity_gbps": 100},
    ],
}


async def composed(h: Harness, **body: Any) -> dict[str, Any]:
    reply = await h.client.intent(DOMAIN, "acme", "compose", {"host": "host-1", **body})
    assert reply["ok"], reply
    result: dict[str, Any] = reply["result"]
    return result


async def types_of(h: Harness) -> list[str]:
    return [e.type async for e in h.store.read(DOMAIN)]


async def test_a_lease_that_falls_due_is_expired_and_everything_returns(
    h: Harness, clock: ManualClock
) -> None:
    await h.client.admin(DOMAIN, "import-topology", FABRIC)
    result = await composed(h, devices=[{"kind": "gpu"}], lease_seconds=30)
    clock.advance(29)
    assert await h.engine.expire_due_leases() == []

    clock.advance(1)
    (reply,) = await h.engine.expire_due_leases()

    assert b'"expired":["' + result["composition_id"].encode() in reply
    assert (await types_of(h))[-2:] == ["LeaseExpired", "CompositionReleased"]
    free = await h.client.query(DOMAIN, "free", {"kind": "gpu"})
    assert [d["id"] for d in free["result"]["devices"]] == ["gpu-1", "gpu-2"]
    composition = await h.client.query(DOMAIN, "composition", {"id": result["composition_id"]})
    assert composition["result"]["state"] == "released"


async def test_a_lease_that_fell_due_while_no_engine_ran_ends_after_a_restart(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, clock: ManualClock
) -> None:
    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as h:
        await h.client.admin(DOMAIN, "import-topology", FABRIC)
        result = await composed(h, devices=[{"kind": "gpu"}], lease_seconds=60)
    clock.advance(3600)  # the engine is down for an hour

    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as h:
        await h.engine.expire_due_leases()
        composition = await h.client.query(DOMAIN, "composition", {"id": result["composition_id"]})
        assert composition["result"]["state"] == "released"


async def test_extend_moves_the_deadline_the_keeper_uses(h: Harness, clock: ManualClock) -> None:
    await h.client.admin(DOMAIN, "import-topology", FABRIC)
    result = await composed(h, devices=[{"kind": "gpu"}], lease_seconds=30)
    cid = result["composition_id"]
    extend = {"composition_id": cid, "lease_seconds": 60}
    assert (await h.client.intent(DOMAIN, "acme", "extend", extend))["ok"]
    clock.advance(45)
    assert await h.engine.expire_due_leases() == []
    clock.advance(60)
    assert len(await h.engine.expire_due_leases()) == 1


async def test_a_fault_is_repaired_over_the_wire_and_why_says_so(h: Harness) -> None:
    await h.client.admin(DOMAIN, "import-topology", FABRIC)
    result = await composed(h, device_ids=["gpu-1"])
    assert result["devices"][0]["path"] == ["host-1", "sw-a", "gpu-1"]

    fault = {"component": "l-a1", "state": "failed", "detail": "CRC errors"}
    reply = await h.client.admin(DOMAIN, "report-fault", fault)

    assert reply["ok"] and reply["result"]["impaired"] == []
    assert reply["result"]["compositions"] == [result["composition_id"]]
    rows = (await h.client.query(DOMAIN, "connections", {"device": "gpu-1"}))["result"]
    assert rows["connections"][0]["path"] == ["host-1", "sw-b", "gpu-1"]
    why = (await h.client.query(DOMAIN, "why", {"id": result["composition_id"]}))["result"]
    assert "PathRerouted" in [e["type"] for e in why["chain"]]
    state = await h.client.query(DOMAIN, "composition", {"id": result["composition_id"]})
    assert state["result"]["state"] == "active"


SHARED_CIRCUIT: dict[str, Any] = {
    "nodes": [
        {"id": "host-1", "kind": "host"},
        {"id": "ocs-1", "kind": "ocs", "ports": 4},
        {"id": "sw-p", "kind": "switch"},
        {"id": "gpu-1", "kind": "device", "device_kind": "gpu"},
        {"id": "gpu-2", "kind": "device", "device_kind": "gpu"},
    ],
    "links": [
        {"id": "l-h0", "a": "host-1", "b": "ocs-1", "b_port": 0, "capacity_gbps": 100},
        {"id": "l-h1", "a": "host-1", "b": "ocs-1", "b_port": 1, "capacity_gbps": 100},
        {"id": "l-p2", "a": "ocs-1", "a_port": 2, "b": "sw-p", "capacity_gbps": 100},
        {"id": "l-g1", "a": "sw-p", "b": "gpu-1", "capacity_gbps": 100},
        {"id": "l-g2", "a": "sw-p", "b": "gpu-2", "capacity_gbps": 100},
    ],
}


async def test_two_compositions_on_one_circuit_move_together_when_its_port_fails(
    h: Harness,
) -> None:
    """A scheduler author's probe: a host's two compositions shared circuit 0-2, port 0 failed,
    and both were left impaired, though circuit 1-2 could carry both. Over the wire and the
    simulated fabric: both move, and the fabric holds circuit 1-2 alone."""
    await h.client.admin(DOMAIN, "import-topology", SHARED_CIRCUIT)
    first = await composed(h, devices=[{"kind": "gpu"}])
    second = await composed(h, devices=[{"kind": "gpu"}])

    fault = {"component": "ocs-1:0", "state": "failed", "detail": "loss of light"}
    reply = await h.client.admin(DOMAIN, "report-fault", fault)

    assert reply["ok"] and reply["result"]["impaired"] == [], reply
    moved = {m["composition_id"] for m in reply["result"]["moved"]}
    assert moved == {first["composition_id"], second["composition_id"]}
    for result in (first, second):
        cid = result["composition_id"]
        state = await h.client.query(DOMAIN, "composition", {"id": cid})
        assert state["result"]["state"] == "active", state
    hardware = (await h.client.query(DOMAIN, "fabric", {}))["result"]
    assert hardware["circuits"] == [{"ocs": "ocs-1", "a_port": 1, "b_port": 2}], hardware
    assert hardware["in_step"] and hardware["findings"] == [], hardware


async def test_a_release_gives_its_device_to_another_tenants_impaired_composition(
    h: Harness,
) -> None:
    """gpu-1 fails under acme while globex holds the only spare; globex's release hands
    gpu-2 to acme in the release's own commit, and the fabric follows."""
    await h.client.admin(DOMAIN, "import-topology", FABRIC)
    acme = await composed(h, devices=[{"kind": "gpu"}])
    assert [d["id"] for d in acme["devices"]] == ["gpu-1"]
    reply = await h.client.intent(
        DOMAIN, "globex", "compose", {"host": "host-1", "devices": [{"kind": "gpu"}]}
    )
    globex = reply["result"]
    fault = {"component": "gpu-1", "state": "failed", "detail": "ECC errors"}
    reply = await h.client.admin(DOMAIN, "report-fault", fault)
    assert reply["result"]["impaired"] == [acme["composition_id"]]

    released = await h.client.intent(
        DOMAIN,
        "globex",
        "release",
        {"composition_id": globex["composition_id"], "request_id": "r-globex-project-falcon"},
    )

    assert released["ok"] and released["result"]["devices"] == ["gpu-2"], released
    # Its position is its own event's, not that of acme's repair after it in the commit.
    log = [e async for e in h.store.read(DOMAIN)]
    (gone,) = [e for e in log if e.type == "CompositionReleased"]
    assert released["position"] == gone.position < log[-1].position, released
    cid = acme["composition_id"]
    state = (await h.client.query(DOMAIN, "composition", {"id": cid}))["result"]
    assert state["state"] == "active" and [d["id"] for d in state["devices"]] == ["gpu-2"]
    why = (await h.client.view(DOMAIN, "acme", "why", {"id": cid}))["result"]
    # The repair is the engine's: acme's history names neither globex, nor its composition,
    # nor its request (which a client may have named for its project).
    (entry,) = [e for e in why["chain"] if e["type"] == "DeviceReplaced"]
    assert entry["actor"] == "engine" and entry["request_id"].startswith("freed-"), entry
    # Nor derived from globex's: a Redfish probe reversed a hash of it by guessing.
    guess = hashlib.sha256(b"globex\nr-globex-project-falcon").hexdigest()[:24]
    assert guess not in entry["request_id"]
    for told in ("globex", globex["composition_id"], "r-globex-project-falcon"):
        assert told not in str(why), why
    (replaced,) = [e async for e in h.store.read(DOMAIN) if e.type == "DeviceReplaced"]
    assert b'"reason":"devices freed by a release"' in replaced.data
    hardware = (await h.client.query(DOMAIN, "fabric", {}))["result"]
    assert hardware["in_step"] and hardware["findings"] == [], hardware


async def test_a_repair_of_one_path_of_two_names_only_what_still_impairs_it_everywhere(
    h: Harness, subject_prefix: str
) -> None:
    """gpu-1 and gpu-2 of one composition fail with no spare; a GPU added later replaces
    gpu-1 only. The composition, why, the KV value and its Impaired condition named gpu-1
    still (the projection has no links to tell what lay on the paths): now gpu-2 alone."""
    fabric = {
        "nodes": [
            {"id": "host-1", "kind": "host"},
            {"id": "sw-a", "kind": "switch"},
            {"id": "gpu-1", "kind": "device", "device_kind": "gpu"},
            {"id": "gpu-2", "kind": "device", "device_kind": "gpu"},
        ],
        "links": [
            {"id": "l-ha", "a": "host-1", "b": "sw-a", "capacity_gbps": 100},
            {"id": "l-a1", "a": "sw-a", "b": "gpu-1", "capacity_gbps": 100},
            {"id": "l-a2", "a": "sw-a", "b": "gpu-2", "capacity_gbps": 100},
        ],
    }
    assert (await h.client.admin(DOMAIN, "import-topology", fabric))["ok"]
    cid = (await composed(h, devices=[{"kind": "gpu", "count": 2}]))["composition_id"]
    for gpu in ("gpu-1", "gpu-2"):
        fault = {"component": gpu, "state": "failed", "detail": "xid 79"}
        assert (await h.client.admin(DOMAIN, "report-fault", fault))["ok"]
    spare = {"id": "gpu-9", "kind": "device", "device_kind": "gpu"}
    assert (await h.client.admin(DOMAIN, "add-node", {"node": spare}))["ok"]
    cable = {"id": "l-a9", "a": "sw-a", "b": "gpu-9", "capacity_gbps": 100}
    assert (await h.client.admin(DOMAIN, "add-link", {"link": cable}))["ok"]

    await h.projected(DOMAIN)
    await h.relayed(DOMAIN)
    got = (await h.client.query(DOMAIN, "composition", {"id": cid}))["result"]
    assert got["state"] == "impaired"
    assert [d["id"] for d in got["devices"]] == ["gpu-9", "gpu-2"]
    assert [i["component"] for i in got["impaired_by"]] == ["gpu-2"]
    why = (await h.client.query(DOMAIN, "why", {"id": cid}))["result"]
    assert "impaired by gpu-2" in why["text"] and "gpu-1" not in why["text"], why["text"]
    bucket = await bucket_values(h.client.nc.jetstream(), subject_prefix)
    (kv,) = [msgspec.json.decode(v) for k, v in bucket.items() if k.endswith(f".{cid}")]
    assert kv["impaired_by"] == ["gpu-2"]
    (impaired,) = [c for c in kv["conditions"] if c["type"] == "Impaired"]
    assert (impaired["status"], impaired["components"]) == ("True", ["gpu-2"]), impaired


async def test_why_of_a_device_an_expired_lease_let_go_names_the_expiry_in_its_chain(
    h: Harness, clock: ManualClock
) -> None:
    """The re-check probe: once the interval ended at the release, `why` of the device lost
    the LeaseExpired event its sentence speaks of."""
    await h.client.admin(DOMAIN, "import-topology", FABRIC)
    result = await composed(h, devices=[{"kind": "gpu"}], lease_seconds=30)
    clock.advance(30)
    await h.engine.expire_due_leases()
    await h.projected(DOMAIN)
    gpu = result["devices"][0]["id"]

    why = (await h.client.query(DOMAIN, "why", {"id": gpu}))["result"]

    assert why["text"].endswith("when the composition's lease expired."), why["text"]
    held = [e["type"] for e in why["chain"] if e["type"] != "TopologyImported"]
    assert held == ["DevicesReserved", "LeaseExpired", "CompositionReleased"], held
