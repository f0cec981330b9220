"""The engine on the Redfish driver, over real NATS and Postgres, with DMTF's Mockup Server as
the fabric manager serving a tree made from examples/fabric.json: compose and release as
Zones, memory Connections and OCS circuits on the server; a fabric manager that stops
answering, refuses connections, answers 5xx or answers slowly (`failed`, nothing left); a port
going down becomes a recorded fault and a repaired composition (by polling and by the
EventService); reconciliation adopts, removes and reports; tenants stay apart.

The topology is imported from the server by discovery, as `trellis topology import
--from-redfish` does, so node and link ids are the driver's. One server serves the module's
calm tests (each test in a domain of its own, the server wiped after each); tests that stop,
slow or break the server get one of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
import urllib.error
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fabrics import expect_error, expect_ok
from harness import Harness, cli_env, run_cli, serving
from mockup_server import MockupServer, at, wipe
from redfish_trees import write_tree

from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.discovery import discover
from trellis.adapters.fabric.redfish.driver import RedfishFabric

EXAMPLE = json.loads((Path(__file__).resolve().parents[2] / "examples/fabric.json").read_text())
F = "/redfish/v1/Fabrics/Trellis"
ZONES, CONNECTIONS = f"{F}/Zones", f"{F}/Connections"
MEM_01_CHUNKS = "/redfish/v1/Chassis/mem-01/MemoryDomains/mem-01/MemoryChunks"
GPU_AND_MEMORY = {
    "host": "host-01",
    "devices": [{"kind": "gpu", "count": 2}, {"kind": "memory", "capacity_gib": 64}],
    "reason": "a decode worker",
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tree(EXAMPLE, tmp_path_factory.mktemp("example-tree"))


@pytest.fixture(scope="module")
def shared(tree: Path) -> Iterator[MockupServer]:
    with MockupServer(tree) as server:
        yield server


@pytest.fixture
def domain() -> str:
    return f"rf{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def on_redfish(
    server: MockupServer,
    nats_url: str,
    database_url: str,
    schema: str,
    prefix: str,
    domain: str,
    **options: Any,
) -> AsyncIterator[Harness]:
    """An engine driving `server`, with the domain imported from it."""
    engine_options = {"saga_deadline": options.pop("saga_deadline", 5.0)}
    driver = RedfishFabric(
        RedfishClient(server.url, timeout=options.pop("timeout", 2.0)),
        resync_s=options.pop("resync_s", 5.0),
        poll_s=options.pop("poll_s", 1.0),
        **options,
    )
    try:
        async with serving(
            database_url=database_url,
            nats_url=nats_url,
            schema=schema,
            prefix=prefix,
            fabric=driver,
            **engine_options,
        ) as h:
            client = RedfishClient(server.url)
            document = (await discover(client)).document
            await client.close()
            expect_ok(await h.client.admin(domain, "import-topology", document))
            await h.fabric_idle(domain, timeout=30.0)  # the driver's first look reads it all
            yield h
    finally:
        if server.proc is not None:
            await asyncio.to_thread(wipe, server)


async def until(what: str, check: Callable[[], Awaitable[bool]], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within} s: {what}")
        await asyncio.sleep(0.1)


async def trellis_resources(server: MockupServer) -> dict[str, list[dict[str, Any]]]:
    """What Trellis holds on the server: zones, connections and chunks it tagged, circuits.
    (Read in a thread: the server answers one connection at a time, so a read on the event
    loop, while the engine on the loop has a connection open, would wait for itself.)"""
    return await asyncio.to_thread(_trellis_resources, server)


def _still_there(server: MockupServer, uri: str) -> Any:
    """A member's body; None when it went between the collection's read and this one (the
    engine's reconciliation deletes while a test polls: a CI run read a zone's 404 so)."""
    try:
        return server.get(uri)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _trellis_resources(server: MockupServer) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for kind, collection in (
        ("zones", ZONES),
        ("connections", CONNECTIONS),
        ("chunks", MEM_01_CHUNKS),
        ("chunks", MEM_01_CHUNKS.replace("mem-01", "mem-02")),
    ):
        for uri in server.members(collection):
            body = _still_there(server, uri)
            if body is not None and body.get("Oem", {}).get("Trellis"):
                found.setdefault(kind, []).append(body)
    for port in server.members(f"{F}/Switches/ocs-1/Ports"):
        to = (server.get(port).get("Oem") or {}).get("Trellis", {}).get("CircuitTo")
        if to:
            found.setdefault("circuit ports", []).append({"port": port, "to": to})
    return found


async def in_step(h: Harness, domain: str) -> bool:
    report = expect_ok(await h.client.query(domain, "fabric"))
    return bool(report["in_step"]) and not report["differences"]["pending"]


async def test_compose_and_release_make_and_take_away_zones_connections_and_circuits(
    shared: MockupServer,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    domain: str,
) -> None:
    async with on_redfish(shared, nats_url, database_url, pg_schema, subject_prefix, domain) as h:
        composed = expect_ok(await h.client.intent(domain, "acme", "compose", GPU_AND_MEMORY))
        cid = composed["composition_id"]
        assert composed["state"] == "active"
        held = await trellis_resources(shared)
        (zone,) = held["zones"]
        gpus = sorted(d["id"] for d in composed["devices"] if d["id"].startswith("gpu"))
        assert zone["ZoneType"] == "ZoneOfEndpoints"
        assert zone["Oem"]["Trellis"]["CompositionId"] == cid
        assert zone["Oem"]["Trellis"]["Domain"] == domain
        assert sorted(e["@odata.id"] for e in zone["Links"]["Endpoints"]) == sorted(
            [f"{F}/Endpoints/I-host-01", *(f"{F}/Endpoints/T-{g}" for g in gpus)]
        )
        (connection,) = held["connections"]
        (chunk,) = held["chunks"]
        assert connection["ConnectionType"] == "Memory"
        assert connection["MemoryChunkInfo"][0]["MemoryChunk"]["@odata.id"] == chunk["@odata.id"]
        assert connection["Links"]["InitiatorEndpoints"] == [
            {"@odata.id": f"{F}/Endpoints/I-host-01"}
        ]
        assert chunk["MemoryChunkSizeMiB"] == 64 * 1024
        assert {c["Oem"]["Trellis"]["CompositionId"] for c in (connection, chunk)} == {cid}
        assert len(held["circuit ports"]) == 2  # host-01's rack reaches the memory pool by OCS
        report = expect_ok(await h.client.query(domain, "fabric"))
        assert report["in_step"] is True and report["findings"] == []
        assert len(report["bindings"]) == 3 and len(report["circuits"]) == 1

        expect_ok(await h.client.intent(domain, "acme", "release", {"composition_id": cid}))
        await h.fabric_idle(domain)
        assert (await trellis_resources(shared)) == {}
        assert await in_step(h, domain)


async def test_the_fabric_manager_stopped_mid_compose_fails_it_and_leaves_nothing(
    tree: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    domain: str,
    tmp_path: Path,
) -> None:
    # Making a memory chunk takes half a second (-T), so the test can stop the server while
    # it makes one: the GPUs' zone is made, the chunk in flight.
    slow = shutil.copytree(tree, tmp_path / "slow-tree")
    chunks = slow / MEM_01_CHUNKS.removeprefix("/redfish/v1/")
    times = {f"{m}_Time": 0 for m in ("GET", "HEAD", "PATCH", "DELETE")} | {"POST_Time": 0.5}
    (chunks / "time.json").write_text(json.dumps(times))
    with MockupServer(slow, timed=True) as server:
        async with on_redfish(
            server, nats_url, database_url, pg_schema, subject_prefix, domain, saga_deadline=1.5
        ) as h:
            # Paused (SIGSTOP) while the saga makes the chunk: calls in flight and after get
            # no answer, and the chunk completes late, once the server runs again.
            driver = h.fabric
            assert isinstance(driver, RedfishFabric)
            posting, post = asyncio.Event(), driver.client.post

            async def watched_post(collection: str, body: dict[str, Any]) -> str:
                if collection.endswith("/MemoryChunks"):
                    posting.set()
                return await post(collection, body)

            driver.client.post = watched_post  # type: ignore[method-assign]
            composing = asyncio.create_task(
                h.client.intent(domain, "acme", "compose", GPU_AND_MEMORY)
            )
            await asyncio.wait_for(posting.wait(), 10.0)
            await asyncio.sleep(0.1)  # the POST is at the server, which takes 0.5 s over it
            server.pause()
            try:
                failed = expect_error(await composing, "failed")
            finally:
                server.resume()
            assert failed["details"]["target"] == "mem-01", failed
            await until("nothing of it left on the fabric manager", lambda: _empty(server))
            await until("the fabric in step with the log", lambda: in_step(h, domain))

            # Refused connections: the server is down.
            server.stop()
            failed = expect_error(
                await h.client.intent(domain, "acme", "compose", GPU_AND_MEMORY), "failed"
            )
            assert "refused" in failed["message"] or "failed" in failed["message"], failed
            server.start()  # the same port, the tree as it was: nothing of either compose
            assert await _empty(server)
            composed = expect_ok(await h.client.intent(domain, "acme", "compose", GPU_AND_MEMORY))
            assert composed["state"] == "active"


async def _empty(server: MockupServer) -> bool:
    return await trellis_resources(server) == {}


async def test_a_5xx_from_the_fabric_manager_fails_the_step_and_undoes_it(
    tree: Path, nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, domain: str
) -> None:
    with MockupServer(tree, etag=True, strict=True) as server:
        async with on_redfish(
            server, nats_url, database_url, pg_schema, subject_prefix, domain
        ) as h:
            server.fail_next(503, "POST", "/Connections")
            failed = expect_error(
                await h.client.intent(domain, "acme", "compose", GPU_AND_MEMORY), "failed"
            )
            assert failed["details"]["step"] == "bind"
            assert failed["details"]["component"].startswith("mem-"), failed
            assert "503" in failed["message"]
            await h.fabric_idle(domain)
            assert (await trellis_resources(server)) == {}  # the zone and the chunk were undone too
            assert await in_step(h, domain)


async def test_slow_answers_slow_the_compose_and_a_deadline_shorter_fails_it_cleanly(
    tree: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    domain: str,
    tmp_path: Path,
) -> None:
    # Making a zone takes half a second (its -T: a time.json beside the Zones collection;
    # the server fails a request whose method the file leaves out, so it names them all).
    slow = shutil.copytree(tree, tmp_path / "slow-tree")
    times = {f"{m}_Time": 0 for m in ("GET", "HEAD", "PATCH", "DELETE")} | {"POST_Time": 0.5}
    (slow / "Fabrics/Trellis/Zones/time.json").write_text(json.dumps(times))
    one_gpu = {"host": "host-01", "devices": [{"kind": "gpu"}]}
    with MockupServer(slow, timed=True) as server:
        async with on_redfish(
            server, nats_url, database_url, pg_schema, subject_prefix, domain,
            saga_deadline=5.0, poll_s=60.0,
        ) as h:  # fmt: skip
            composed = expect_ok(await h.client.intent(domain, "acme", "compose", one_gpu))
            assert composed["state"] == "active"
        other = f"{domain}x"
        async with on_redfish(
            server, nats_url, database_url, pg_schema, subject_prefix, other,
            saga_deadline=0.3, poll_s=60.0,
        ) as h:  # fmt: skip
            failed = expect_error(
                await h.client.intent(other, "acme", "compose", one_gpu), "failed"
            )
            assert failed["details"]["step"] == "bind", failed
            assert "no answer within 0.3s" in failed["message"], failed

            # The zone's POST lands after the saga gave up; reconciliation takes it away.
            async def none_left() -> bool:
                held = await trellis_resources(server)
                return not [
                    z for z in held.get("zones", []) if z["Oem"]["Trellis"]["Domain"] == other
                ]

            await until("the late zone removed", none_left)
            await until("the fabric in step with the log", lambda: in_step(h, other))


async def test_a_port_going_down_is_a_recorded_fault_and_the_composition_is_repaired(
    shared: MockupServer,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    domain: str,
) -> None:
    async with on_redfish(
        shared, nats_url, database_url, pg_schema, subject_prefix, domain, poll_s=0.3
    ) as h:
        composed = expect_ok(
            await h.client.intent(
                domain, "acme", "compose", {"host": "host-01", "devices": [{"kind": "gpu"}]}
            )
        )
        cid, (gpu,) = composed["composition_id"], [d["id"] for d in composed["devices"]]
        port = await asyncio.to_thread(_switch_port_to, shared, f"T-{gpu}")
        link = f"sw-r1-{port.rsplit('/', 1)[1]}"
        try:
            await at(shared).patch(
                port, {"LinkStatus": "LinkDown", "Status": {"Health": "Critical"}}
            )

            async def replaced() -> bool:
                now = expect_ok(await h.client.query(domain, "composition", {"id": cid}))
                return now["state"] == "active" and gpu not in [d["id"] for d in now["devices"]]

            await until("the GPU behind the pulled cable replaced", replaced)
            topology = expect_ok(await h.client.query(domain, "topology"))
            pulled = next(lk for lk in topology["links"] if lk["id"] == link)
            assert pulled["health"] == "failed", pulled
            history = expect_ok(await h.client.query(domain, "why", {"id": cid}))
            assert "DeviceReplaced" in [step["type"] for step in history["chain"]], history
            await h.fabric_idle(domain)
            (zone,) = (await trellis_resources(shared))["zones"]
            endpoints = [e["@odata.id"] for e in zone["Links"]["Endpoints"]]
            assert f"{F}/Endpoints/T-{gpu}" not in endpoints and len(endpoints) == 2
        finally:
            await at(shared).patch(port, {"LinkStatus": "LinkUp", "Status": {"Health": "OK"}})

        async def recovered() -> bool:
            topology = expect_ok(await h.client.query(domain, "topology"))
            return next(lk for lk in topology["links"] if lk["id"] == link)["health"] == "healthy"

        await until("the cable healthy again", recovered)


def _switch_port_to(server: MockupServer, endpoint: str) -> str:
    for switch in server.members(f"{F}/Switches"):
        for port in server.members(f"{switch}/Ports"):
            ends = server.get(port).get("Links", {}).get("AssociatedEndpoints", [])
            if f"{F}/Endpoints/{endpoint}" in [e["@odata.id"] for e in ends]:
                return port
    raise AssertionError(f"no port leads to {endpoint}")


async def test_an_event_from_the_fabric_manager_is_acted_on_before_the_next_poll(
    tree: Path, nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, domain: str
) -> None:
    with MockupServer(tree) as server:
        async with on_redfish(
            server, nats_url, database_url, pg_schema, subject_prefix, domain,
            poll_s=120.0, events_at=("127.0.0.1", 0),
        ) as h:  # fmt: skip
            watch = h.fabric_watch
            assert watch is not None
            await until("subscribed", lambda: _subscribed(server, watch.events_url))
            await until("the first poll done", lambda: _true(watch.polls >= 1))
            polls = watch.polls
            port = f"{F}/Switches/sw-r1/Ports/P1"  # host-01's first cable
            await at(server).patch(port, {"Status": {"Health": "Warning"}})
            await at(server).post(
                "/redfish/v1/EventService/Actions/EventService.SubmitTestEvent",
                {
                    "EventType": "StatusChange",
                    "EventId": "1",
                    "EventTimestamp": "2026-12-01T00:00:00Z",
                    "Severity": "Warning",
                    "Message": "Port P1 of sw-r1 is degraded.",
                    "MessageId": "Fabric.1.0.PortDegraded",
                    "MessageArgs": ["P1"],
                    "OriginOfCondition": port,
                },
            )

            async def degraded() -> bool:
                topology = expect_ok(await h.client.query(domain, "topology"))
                cable = next(lk for lk in topology["links"] if lk["id"] == "sw-r1-P1")
                return bool(cable["health"] == "degraded")

            await until("the degraded cable recorded", degraded, within=10.0)
            assert watch.events >= 1 and watch.polls == polls + 1
        assert server.members("/redfish/v1/EventService/Subscriptions") == []  # engine stopped


async def _true(condition: bool) -> bool:
    return condition


async def _subscribed(server: MockupServer, url: str | None) -> bool:
    subscriptions = await at(server).members("/redfish/v1/EventService/Subscriptions")
    destinations = [(await at(server).get(s))["Destination"] for s in subscriptions]
    return url is not None and url in destinations


async def test_reconciliation_remakes_removes_and_reports_but_touches_nothing_else(
    shared: MockupServer,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    domain: str,
    tmp_path: Path,
) -> None:
    async with on_redfish(
        shared, nats_url, database_url, pg_schema, subject_prefix, domain, resync_s=1.0
    ) as h:
        composed = expect_ok(
            await h.client.intent(
                domain, "acme", "compose", {"host": "host-02", "devices": [{"kind": "gpu"}]}
            )
        )
        (zone,) = (await trellis_resources(shared))["zones"]
        gpu = composed["devices"][0]["id"]
        # Someone deletes Trellis's zone, leaves a zone of Trellis's for a composition the
        # log never held, and zones the composition's GPU to its host themselves (to another
        # host, it would be a conflict: test_redfish_driver_faults.py).
        await at(shared).delete(zone["@odata.id"])
        stray = {"CompositionId": "c-unknown", "Domain": domain, "Host": "host-03",
                 "Paths": {"gpu-009": ["host-03", "sw-r2", "gpu-009"]}}  # fmt: skip
        await at(shared).post(ZONES, _zone("stray", ["I-host-03", "T-gpu-009"], stray))
        await at(shared).post(ZONES, _zone("someone else's", ["I-host-02", f"T-{gpu}"]))
        pool = {"TargetEndpoints": [{"@odata.id": f"{F}/Endpoints/T-mem-02"}]}
        theirs = {"Name": "someone else's", "ConnectionType": "Memory", "Links": pool}
        await at(shared).post(CONNECTIONS, theirs)

        async def reconciled() -> bool:
            zones = await still_there(shared, await at(shared).members(ZONES))
            ours = [z for z in zones if z.get("Oem", {}).get("Trellis", {}).get("Domain") == domain]
            return [z["Oem"]["Trellis"]["CompositionId"] for z in ours] == [
                composed["composition_id"]
            ]

        try:
            await until("the zone made again and the stray one removed", reconciled)
            report = expect_ok(await h.client.query(domain, "fabric"))
            assert report["in_step"] is True
            assert any(f"T-{gpu}" in finding for finding in report["findings"]), report
            assert any(
                f.startswith("connection") and f.endswith("T-mem-02") for f in report["findings"]
            ), report
            env = cli_env(tmp_path, nats_url, database_url, pg_schema, subject_prefix)
            code, out, err = await run_cli(env, "fabric", "check", "--domain", domain)
            assert code == 0, (out, err)
            assert f"{domain}: hardware holds what the log says" in out
            assert "found, not Trellis's to change: zone" in out and f"T-{gpu}" in out
            for collection in (ZONES, CONNECTIONS):  # reported, never touched
                theirs = [
                    z
                    for z in await still_there(shared, await at(shared).members(collection))
                    if z.get("Name") == "someone else's"
                ]
                assert theirs
        finally:  # wipe() leaves what is not Trellis's: it would hold the next test's GPU
            for collection in (ZONES, CONNECTIONS):
                for zone in await still_there(shared, await at(shared).members(collection)):
                    if zone.get("Name") == "someone else's":
                        await at(shared).delete(zone["@odata.id"])


async def still_there(server: MockupServer, uris: list[str]) -> list[dict[str, Any]]:
    """The resources at `uris` that are still there: the engine's reconciliation may remove
    one between the listing and the reading (a 404 then, not a failure)."""
    found = []
    for uri in uris:
        try:
            found.append(await at(server).get(uri))
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
    return found


def _zone(name: str, endpoints: list[str], trellis: dict[str, Any] | None = None) -> dict[str, Any]:
    zone: dict[str, Any] = {
        "Name": name,
        "ZoneType": "ZoneOfEndpoints",
        "Links": {"Endpoints": [{"@odata.id": f"{F}/Endpoints/{e}"} for e in endpoints]},
    }
    return zone | ({"Oem": {"Trellis": trellis}} if trellis else {})


async def test_tenants_stay_apart_on_the_redfish_fabric(
    shared: MockupServer,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    domain: str,
) -> None:
    async with on_redfish(shared, nats_url, database_url, pg_schema, subject_prefix, domain) as h:
        exclusive = {"host": "host-01", "devices": [{"kind": "gpu"}],
                     "constraints": {"isolation": "exclusive"}}  # fmt: skip
        a = expect_ok(await h.client.intent(domain, "acme", "compose", exclusive))
        b = expect_ok(
            await h.client.intent(
                domain, "globex", "compose", {"host": "host-03", "devices": [{"kind": "gpu"}]}
            )
        )
        refused = await h.client.intent(
            domain, "globex", "compose", {"host": "host-02", "devices": [{"kind": "gpu"}]}
        )
        assert refused["ok"] is False  # acme holds sw-r1 exclusively: host-02 reaches nothing
        expect_error(
            await h.client.view(domain, "globex", "composition", {"id": a["composition_id"]}),
            "not_found",
        )
        zones = {
            z["Oem"]["Trellis"]["CompositionId"]: {e["@odata.id"] for e in z["Links"]["Endpoints"]}
            for z in (await trellis_resources(shared))["zones"]
        }
        assert zones == {
            c["composition_id"]: {f"{F}/Endpoints/I-{host}", f"{F}/Endpoints/T-{gpu}"}
            for c, host in ((a, "host-01"), (b, "host-03"))
            for gpu in [c["devices"][0]["id"]]
        }
        assert await in_step(h, domain)
