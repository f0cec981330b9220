"""The Redfish driver against a fabric manager that answers what DMTF's Mockup Server never
does (tests/redfish_fault_server.py, serving the tree of examples/fabric.json in the test's
own process): every failure is a FabricError naming what failed, and what the hardware holds
is what the snapshot says."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from redfish_fault_server import FaultyRedfish
from redfish_trees import tree

from trellis.adapters.embedded.process import free_port
from trellis.adapters.entrypoints import render
from trellis.adapters.entrypoints.cli import main as cli_main
from trellis.adapters.fabric.redfish.client import (
    READ_RETRIES,
    HttpError,
    RedfishClient,
    Unreachable,
)
from trellis.adapters.fabric.redfish.discovery import DiscoveryError, discover
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.adapters.fabric.redfish.watch import EVENT_POLL_GAP_S, FabricWatch
from trellis.engine.core.errors import FabricError, WriterFenced
from trellis.engine.core.fabric import FabricBinding, FabricCircuit
from trellis.engine.core.fabric_plan import Reconciliation

EXAMPLE = json.loads((Path(__file__).resolve().parents[2] / "examples/fabric.json").read_text())
F = "/redfish/v1/Fabrics/Trellis"
ZONES, CONNECTIONS = f"{F}/Zones", f"{F}/Connections"
MEM_01_CHUNKS = "/redfish/v1/Chassis/mem-01/MemoryDomains/mem-01/MemoryChunks"
D = "dom"


@pytest.fixture
def fm() -> Iterator[FaultyRedfish]:
    with FaultyRedfish(tree(EXAMPLE)) as server:
        yield server


@pytest_asyncio.fixture
async def driver(fm: FaultyRedfish) -> AsyncIterator[RedfishFabric]:
    fabric = RedfishFabric(RedfishClient(fm.url, timeout=2.0), resync_s=0.0)
    yield fabric
    await fabric.close()


def gpu(device: str = "gpu-001", host: str = "host-01", cid: str = "c-1") -> FabricBinding:
    return FabricBinding(host=host, device=device, path=[host, "sw-r1", device], composition_id=cid)


async def test_a_read_answered_5xx_is_tried_again_and_a_change_is_not(fm: FaultyRedfish) -> None:
    """One 500 on a GET failed a whole fabric check or reconciliation pass (the southbound
    probe): a read changes nothing, so it is sent again; a change's 5xx stays its failure."""
    client = RedfishClient(fm.url, timeout=2.0)
    try:
        fm.fail("GET", F, 500, exact=True)
        assert (await client.get(F)).body["Id"]
        assert fm.count("GET", F) == 2
        fm.fail("GET", F, 503, exact=True, times=1 + READ_RETRIES)
        with pytest.raises(HttpError, match="answered 503"):
            await client.get(F)
        assert fm.count("GET", F) == 2 + 1 + READ_RETRIES
        fm.fail("PATCH", F, 500, exact=True)
        with pytest.raises(HttpError, match="answered 500"):
            await client.update(F, lambda body: {"Description": "changed"})
        assert fm.count("PATCH", F) == 1
        # The service's Retry-After is taken (the re-check probe: three tries in 0.3 s).
        fm.fail("GET", F, 503, exact=True, headers={"Retry-After": "1"})
        started = time.monotonic()
        assert (await client.get(F)).body["Id"]
        assert time.monotonic() - started >= 1.0
    finally:
        await client.close()


async def test_a_task_monitor_answering_503_is_polled_again(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    """A 503 on a poll failed the change as if the change had answered 503, though the
    service had taken it: the zone was made while the step was recorded failed (the
    re-check probe). The monitor was busy; the task is asked again."""
    fm.as_task("POST", "/Zones", polls=3)
    fm.fail("GET", "/TaskService/TaskMonitors/", 503, headers={"Retry-After": "0"})
    await driver.bind(D, gpu(), fence=1)
    assert [b.device for b in (await driver.snapshot(D, fence=1)).bindings] == ["gpu-001"]


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (202, {}),  # a task that says not where it is
        (307, {"Location": f"{ZONES}/99"}),
        (200, {"Location": f"{ZONES}/55"}),
    ],
)
async def test_a_create_answered_other_than_201_or_204_is_no_success(
    fm: FaultyRedfish, driver: RedfishFabric, status: int, headers: dict[str, str]
) -> None:
    fm.fail("POST", "/Zones", status, headers=headers)
    with pytest.raises(FabricError, match=f"answered {status}") as failed:
        await driver.bind(D, gpu(), fence=1)
    assert failed.value.component == "gpu-001"
    assert (await driver.snapshot(D, fence=1)).bindings == []


@pytest.mark.parametrize("style", ["monitor", "task"])
async def test_changes_run_as_tasks_take_effect_when_their_tasks_end(
    fm: FaultyRedfish, driver: RedfishFabric, style: str
) -> None:
    fm.as_task("POST", "/Zones", polls=3, style=style)
    await driver.bind(D, gpu(), fence=1)
    assert fm.members(ZONES) == [f"{ZONES}/1"]
    assert fm.count("GET", "/TaskService/") == 3
    fm.as_task("PATCH", f"{ZONES}/1", style=style)  # a PATCH of the zone the task made
    await driver.bind(D, gpu("gpu-002"), fence=1)
    assert len(fm.body(f"{ZONES}/1")["Links"]["Endpoints"]) == 3
    assert (await driver.snapshot(D, fence=1)).bindings == [gpu(), gpu("gpu-002")]
    fm.as_task("DELETE", f"{ZONES}/1", style=style)
    await driver.unbind(D, gpu("gpu-002"), fence=1)
    await driver.unbind(D, gpu(), fence=1)
    assert fm.members(ZONES) == []
    assert fm.count("GET", "/TaskService/") == 3 + 2 + 2


@pytest.mark.parametrize("style", ["monitor", "task"])
async def test_a_task_that_fails_is_an_error_with_the_services_message(
    fm: FaultyRedfish, driver: RedfishFabric, style: str
) -> None:
    fm.as_task("POST", "/Zones", ends="failed", style=style)
    with pytest.raises(FabricError, match="switch busy") as failed:
        await driver.bind(D, gpu(), fence=1)
    assert failed.value.component == "gpu-001"
    assert (await driver.snapshot(D, fence=1)).bindings == []
    await driver.bind(D, gpu(), fence=1)  # the next try is an ordinary create
    assert (await driver.snapshot(D, fence=1)).bindings == [gpu()]


async def test_a_task_whose_monitor_goes_is_an_unknown_outcome_read_before_the_next_change(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    fm.as_task("POST", "/Zones", ends="gone")
    with pytest.raises(FabricError, match=r"task monitor .* is gone \(404\)"):
        await driver.bind(D, gpu(), fence=1)
    # The service made it after all (behind the test's back): found, not made twice.
    tagged = zone(1, ["I-host-01", "T-gpu-001"])
    tagged["Oem"] = {"Trellis": {"CompositionId": "c-1", "Domain": D, "Host": "host-01",
                                 "Paths": {"gpu-001": "host-01>sw-r1>gpu-001"}}}  # fmt: skip
    fm.put(f"{ZONES}/1", tagged, member=True)
    await driver.bind(D, gpu(), fence=1)
    assert fm.members(ZONES) == [f"{ZONES}/1"]


async def test_a_change_given_up_on_mid_task_is_read_before_the_next_change(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    fm.as_task("POST", "/Zones", ends="never")
    with pytest.raises(TimeoutError):  # the saga's deadline, as the engine gives up
        await asyncio.wait_for(driver.bind(D, gpu(), fence=1), 0.3)
    tagged = zone(1, ["I-host-01", "T-gpu-001"])
    tagged["Oem"] = {"Trellis": {"CompositionId": "c-1", "Domain": D, "Host": "host-01",
                                 "Paths": {"gpu-001": "host-01>sw-r1>gpu-001"}}}  # fmt: skip
    fm.put(f"{ZONES}/1", tagged, member=True)  # the task made it after all
    await driver.bind(D, gpu(), fence=1)
    assert fm.members(ZONES) == [f"{ZONES}/1"]


async def test_a_task_that_does_not_end_in_time_is_asked_to_stop(fm: FaultyRedfish) -> None:
    fabric = RedfishFabric(RedfishClient(fm.url, timeout=2.0, task_timeout=0.4), resync_s=0.0)
    try:
        fm.as_task("POST", "/Zones", ends="never")
        with pytest.raises(FabricError, match=r"did not end within 0.4 s \(asked to stop, the"):
            await fabric.bind(D, gpu(), fence=1)
        assert fm.cancelled == ["/redfish/v1/TaskService/TaskMonitors/1"]
        assert fm.members(ZONES) == []
    finally:
        await fabric.close()


async def test_a_relative_location_is_resolved_against_the_collection(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    fm.fail("POST", "/Zones", 201, headers={"Location": "Zones/1"}, apply=True)
    await driver.bind(D, gpu(), fence=1)
    await driver.bind(D, gpu("gpu-002"), fence=1)  # a PATCH of the zone the POST made
    zone = fm.body(f"{ZONES}/1")
    assert len(zone["Links"]["Endpoints"]) == 3
    assert (await driver.snapshot(D, fence=1)).bindings == [gpu(), gpu("gpu-002")]


async def test_a_redirect_is_an_error_naming_its_status(fm: FaultyRedfish) -> None:
    client = RedfishClient(fm.url)
    fm.fail("GET", "/Fabrics", 301, headers={"Location": "https://elsewhere/redfish/v1/Fabrics"})
    try:
        with pytest.raises(HttpError, match=r"answered 301: redirected to https://elsewhere"):
            await client.get("/redfish/v1/Fabrics")
    finally:
        await client.close()


def zone(n: int, endpoints: list[str], **fields: object) -> dict[str, object]:
    return {
        "@odata.id": f"{ZONES}/{n}",
        "ZoneType": "ZoneOfEndpoints",
        "Links": {"Endpoints": [{"@odata.id": f"{F}/Endpoints/{e}"} for e in endpoints]},
        **fields,
    }


@pytest.mark.parametrize(
    "odd",
    [
        {"Oem": "vendor"},
        {"Oem": ["vendor"]},
        {"Links": [1]},
        {"Links": {"Endpoints": [{"@odata.id": 5}, {"@odata.id": None}, "T-gpu-002"]}},
        {"Links": {"Endpoints": {"@odata.id": f"{F}/Endpoints/T-gpu-002"}}},
        {"Oem": {"Trellis": {"CompositionId": "c-9", "Domain": D, "Host": "host-02",
                             "Paths": {"gpu-002": "host-02>sw-r1>gpu-002"}}}},
    ],
)  # fmt: skip
async def test_oddly_typed_fields_of_another_zone_are_read_as_absent(
    fm: FaultyRedfish, driver: RedfishFabric, odd: dict[str, object]
) -> None:
    await driver.bind(D, gpu(), fence=1)
    fm.put(f"{ZONES}/60", zone(60, ["I-host-02", "T-gpu-002"], **odd), member=True)
    assert (await driver.snapshot(D, fence=1)).bindings == [gpu()]


async def test_oddly_typed_fields_of_a_connection_and_an_endpoint_are_read_as_absent(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    tags = {"CompositionId": "c-m", "Domain": D, "Device": "mem-01", "Host": "host-01",
            "Path": ["host-01", "sw-r1", "mem-01"], "CapacityGiB": 4}  # fmt: skip
    fm.put(
        f"{CONNECTIONS}/70",
        {"ConnectionType": "Memory", "MemoryChunkInfo": [{"MemoryChunk": None}, 3],
         "Oem": {"Trellis": tags}},
        member=True,
    )  # fmt: skip
    fm.put(f"{CONNECTIONS}/71", {"ConnectionType": "Memory", "MemoryChunkInfo": "x"}, member=True)
    endpoint = fm.body(f"{F}/Endpoints/T-gpu-012")
    endpoint["ConnectedEntities"][0]["EntityLink"] = "/redfish/v1/Chassis/gpu-012"
    fm.put(f"{F}/Endpoints/T-gpu-012", endpoint)
    await driver.snapshot(D, fence=1)  # reads, whatever it makes of them
    fmap = await driver.fabric_map(D)
    assert "gpu-011" in fmap.device_endpoints and "gpu-012" not in fmap.device_endpoints


@pytest.mark.parametrize(
    ("members", "why"),
    [
        (None, "Members is no list"),
        ({"@odata.id": f"{ZONES}/1"}, "Members is no list"),
        ([f"{ZONES}/1"], "member 0 has no @odata.id"),
        ([{"@odata.id": None}], "member 0 has no @odata.id"),
        ([{"@odata.id": 3}], "member 0 has no @odata.id"),
    ],
)
async def test_a_collection_that_cannot_be_read_is_an_error_naming_it(
    fm: FaultyRedfish, driver: RedfishFabric, members: object, why: str
) -> None:
    await driver.snapshot(D, fence=1)
    fm.put(ZONES, {**fm.body(ZONES), "Members": members})
    with pytest.raises(FabricError, match=f"GET {ZONES}: {why}"):
        await driver.snapshot(D, fence=1)
    endpoints = f"{F}/Endpoints"
    fm.put(endpoints, {**fm.body(endpoints), "Members": members})
    client = RedfishClient(fm.url)
    try:
        with pytest.raises(DiscoveryError, match=f"GET {endpoints}: {why}"):
            await discover(client)
    finally:
        await client.close()


async def test_pages_that_come_round_again_end_the_read_with_an_error(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    await driver.snapshot(D, fence=1)
    page2 = f"{ZONES}Page2"
    fm.put(page2, {"Members": [], "Members@odata.nextLink": ZONES})
    fm.put(ZONES, {**fm.body(ZONES), "Members@odata.nextLink": page2})
    with pytest.raises(FabricError, match=f"GET {ZONES}: its pages do not end"):
        await asyncio.wait_for(driver.snapshot(D, fence=1), 10.0)
    assert fm.count("GET", "/Zones") <= 4


async def test_a_device_another_client_zoned_to_another_host_is_not_bound_again(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    fm.put(f"{ZONES}/80", zone(80, ["I-host-02", "T-gpu-003"]), member=True)
    with pytest.raises(FabricError, match=f"host host-02 by zone {ZONES}/80") as refused:
        await driver.bind(D, gpu("gpu-003"), fence=1)
    assert refused.value.component == "gpu-003"
    await driver.bind(D, gpu("gpu-003", host="host-02"), fence=1)  # to that host: no conflict
    snapshot = await driver.snapshot(D, fence=1)
    assert snapshot.bindings == [gpu("gpu-003", host="host-02")]
    assert [f for f in snapshot.findings if f"{ZONES}/80" in f], snapshot.findings


async def bound_slice(driver: RedfishFabric) -> FabricBinding:
    """An 8 GiB slice of mem-01 bound to host-01 for composition c-m."""
    path = ["host-01", "sw-r1", "ocs-1", "sw-pool", "mem-01"]
    wanted = FabricBinding(
        host="host-01", device="mem-01", path=path, composition_id="c-m", capacity_gib=8
    )
    await driver.bind(D, wanted, fence=1)
    return wanted


async def test_a_slice_whose_chunk_was_deleted_is_a_difference_and_is_made_again(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    wanted = await bound_slice(driver)
    assert (await driver.snapshot(D, fence=1)).bindings == [wanted]
    (chunk,) = fm.members(MEM_01_CHUNKS)
    fm.delete(chunk)  # behind Trellis's back; the connection stays
    snapshot = await driver.snapshot(D, fence=1)
    assert snapshot.bindings == [msgspec.structs.replace(wanted, path=[])]
    assert [f for f in snapshot.findings if "names no memory chunk" in f], snapshot.findings
    await driver.bind(D, wanted, fence=1)  # no silent success: a chunk and a connection anew
    assert (await driver.snapshot(D, fence=1)).bindings == [wanted]
    (connection,) = fm.members(CONNECTIONS)
    (chunk,) = fm.members(MEM_01_CHUNKS)
    assert fm.body(connection)["MemoryChunkInfo"][0]["MemoryChunk"]["@odata.id"] == chunk


async def test_half_a_circuit_is_no_circuit_and_is_made_whole_again(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    circuit = FabricCircuit(ocs="ocs-1", a_port=0, b_port=2)
    await driver.create_circuit(D, circuit, fence=1)
    assert (await driver.snapshot(D, fence=1)).circuits == [circuit]
    port = f"{F}/Switches/ocs-1/Ports/0"
    body = fm.body(port)
    body["Oem"]["Trellis"]["CircuitTo"] = None  # one end cleared at the fabric manager
    fm.put(port, body)
    snapshot = await driver.snapshot(D, fence=1)
    assert snapshot.circuits == []
    assert [f for f in snapshot.findings if "Ports/2 is in a circuit with" in f], snapshot.findings
    await driver.create_circuit(D, circuit, fence=1)
    assert (await driver.snapshot(D, fence=1)).circuits == [circuit]
    assert fm.body(port)["Oem"]["Trellis"]["CircuitTo"] == {
        "@odata.id": f"{F}/Switches/ocs-1/Ports/2"
    }


async def test_a_fabric_that_refuses_oem_leaves_the_in_process_fence(
    fm: FaultyRedfish, driver: RedfishFabric, caplog: pytest.LogCaptureFixture
) -> None:
    refusal = {"error": {"@Message.ExtendedInfo": [{"Message": "Oem is not a known property."}]}}
    fm.fail("PATCH", F, 400, body=refusal, times=100, exact=True)
    await driver.bind(D, gpu(), fence=2)
    await driver.bind(D, gpu("gpu-002"), fence=3)
    with pytest.raises(WriterFenced):
        await driver.bind(D, gpu("gpu-003"), fence=2)
    assert (await driver.snapshot(D, fence=3)).bindings == [gpu(), gpu("gpu-002")]
    assert fm.count("PATCH", F) - fm.count("PATCH", f"{F}/") == 1, "asked once, then known"
    warned = [r for r in caplog.records if "keeps no writer epoch" in r.getMessage()]
    assert len(warned) == 1


class _Engine:
    """What FabricWatch asks of an engine: the domain's links, and the intents it sends."""

    def __init__(self, links: list[str]) -> None:
        self.domains = [D]
        self.links = {
            link: SimpleNamespace(health="healthy", detail="", drained=False) for link in links
        }
        self.intents: list[tuple[str, dict[str, object]]] = []

    def state(self, domain: str) -> SimpleNamespace:
        return SimpleNamespace(links=self.links)

    def fabric_sync(self, domain: str) -> None:
        return None

    async def handle(self, role: str, domain: str, _: None, verb: str, body: bytes) -> bytes:
        self.intents.append((verb, msgspec.json.decode(body)))
        return b'{"ok": true}'


@contextlib.asynccontextmanager
async def watching(fm: FaultyRedfish, **options: Any) -> AsyncIterator[FabricWatch]:
    fabric = RedfishFabric(RedfishClient(fm.url, timeout=2.0), **options)
    fmap = await fabric.fabric_map(D)
    watch = FabricWatch(fabric, _Engine(list(fmap.cables)))  # type: ignore[arg-type]
    await watch.start()
    try:
        yield watch
    finally:
        await watch.close()
        await fabric.close()


async def eventually(what: str, check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        await asyncio.sleep(0.05)


async def test_a_port_that_cannot_be_read_hides_no_other_ports_fault(fm: FaultyRedfish) -> None:
    async with watching(fm, poll_s=60.0, resync_s=60.0) as watch:
        await eventually("the first poll", lambda: watch.polls >= 1)
        fmap = await watch.fabric.fabric_map(D)
        (_, (odd,)), (down_link, (down,)) = sorted(fmap.cables.items())[-2:]
        fm.put(odd, {**fm.body(odd), "Status": "OK"})
        fm.put(down, {**fm.body(down), "LinkStatus": "LinkDown"})
        await watch.poll()
        engine = watch.engine
        assert isinstance(engine, _Engine)
        faults = [body for verb, body in engine.intents if verb == "report-fault"]
        assert [(f["component"], f["state"]) for f in faults] == [(down_link, "failed")]


async def post_event(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    body = b'{"Context": "trellis", "Events": []}'
    writer.write(
        b"POST %s HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (parts.path.encode(), len(body))
    )
    writer.write(body)
    await writer.drain()
    await reader.read()
    writer.close()


async def test_a_burst_of_events_is_one_poll_not_one_each(fm: FaultyRedfish) -> None:
    async with watching(fm, poll_s=60.0, resync_s=60.0, events_at=("127.0.0.1", 0)) as watch:
        await eventually("the first poll", lambda: watch.polls >= 1)
        assert watch.events_url is not None
        polls, started = watch.polls, time.monotonic()
        for _ in range(40):  # 20 events a second, for 2 seconds
            await post_event(watch.events_url)
            await asyncio.sleep(0.05)
        await asyncio.sleep(EVENT_POLL_GAP_S)
        assert watch.events == 40
        allowed = (time.monotonic() - started) / EVENT_POLL_GAP_S + 1
        assert 1 <= watch.polls - polls <= allowed, (watch.polls - polls, allowed)


async def test_a_subscription_the_service_forgot_is_made_again(fm: FaultyRedfish) -> None:
    subscriptions = "/redfish/v1/EventService/Subscriptions"
    async with watching(fm, poll_s=60.0, resync_s=0.2, events_at=("127.0.0.1", 0)):
        await eventually("subscribed", lambda: len(fm.members(subscriptions)) == 1)
        (first,) = fm.members(subscriptions)
        fm.delete(first)  # the fabric manager restarted and lost its state
        await eventually("subscribed again", lambda: len(fm.members(subscriptions)) == 1)


async def test_systems_whose_ids_differ_only_outside_the_id_alphabet_stay_apart() -> None:
    resources = tree(EXAMPLE)
    for host, system in (("host-01", "h.1"), ("host-02", "h_1")):
        entity = resources[f"{F}/Endpoints/I-{host}"]["ConnectedEntities"][0]
        entity["EntityLink"] = {"@odata.id": f"/redfish/v1/Systems/{system}"}
    with FaultyRedfish(resources) as fm:
        client = RedfishClient(fm.url)
        try:
            fmap = await discover(client)
        finally:
            await client.close()
    hosts = [n["id"] for n in fmap.document["nodes"] if n["kind"] == "host"]
    assert len(hosts) == len(set(hosts)) == 4, hosts
    assert [h for h in hosts if h.startswith("Systems-h_1-")] == sorted(hosts)[:2]


async def test_two_zones_tagged_for_one_composition_are_a_finding(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    await driver.bind(D, gpu(), fence=1)
    (first,) = fm.members(ZONES)
    fm.put(f"{ZONES}/51", {**fm.body(first), "@odata.id": f"{ZONES}/51"}, member=True)
    snapshot = await driver.snapshot(D, fence=1)
    assert snapshot.bindings == [gpu()]
    assert f"zones {first} and {ZONES}/51 are both tagged for c-1" in snapshot.findings


async def test_a_port_left_half_in_a_circuit_can_join_another(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    await driver.create_circuit(D, FabricCircuit(ocs="ocs-1", a_port=0, b_port=2), fence=1)
    port = f"{F}/Switches/ocs-1/Ports/0"
    body = fm.body(port)
    body["Oem"]["Trellis"]["CircuitTo"] = None  # port 2 still names port 0: half a circuit
    fm.put(port, body)
    other = FabricCircuit(ocs="ocs-1", a_port=2, b_port=3)
    await driver.create_circuit(D, other, fence=1)
    assert (await driver.snapshot(D, fence=1)).circuits == [other]
    with pytest.raises(FabricError, match="port 3 is already in circuit with port 2"):
        await driver.create_circuit(D, FabricCircuit(ocs="ocs-1", a_port=3, b_port=4), fence=1)


async def test_circuits_of_another_domain_or_of_no_one_are_not_ours_and_stay(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    ports = f"{F}/Switches/ocs-1/Ports"

    def cross(a: int, b: int, tags: dict[str, object]) -> None:  # made at the fabric manager
        for this, other in ((a, b), (b, a)):
            body = fm.body(f"{ports}/{this}")
            body["Oem"] = {"Trellis": {"CircuitTo": {"@odata.id": f"{ports}/{other}"}, **tags}}
            fm.put(f"{ports}/{this}", body)

    cross(0, 1, {"Domain": "hall-9"})  # another domain's (another engine on this OCS)
    cross(2, 3, {})  # tagged with no domain: not Trellis's
    ours = FabricCircuit(ocs="ocs-1", a_port=4, b_port=5)
    await driver.create_circuit(D, ours, fence=1)
    before = {p: fm.body(f"{ports}/{p}") for p in range(4)}
    snapshot = await driver.snapshot(D, fence=1)  # the first of the domain: a deep read
    assert snapshot.circuits == [ours]
    assert [f for f in snapshot.findings if f"{ports}/2 is in a circuit that is not" in f]
    assert not [f for f in snapshot.findings if f"{ports}/0 " in f], snapshot.findings
    for a, b in ((0, 1), (2, 3)):  # what reconciliation would send, were they reported
        await driver.remove_circuit(D, FabricCircuit(ocs="ocs-1", a_port=a, b_port=b), fence=1)
    assert {p: fm.body(f"{ports}/{p}") for p in range(4)} == before
    assert (await driver.snapshot(D, fence=1)).circuits == [ours]
    with pytest.raises(FabricError, match="port 1 is already in circuit with port 0"):
        await driver.create_circuit(D, FabricCircuit(ocs="ocs-1", a_port=1, b_port=6), fence=1)


async def test_subscriptions_killed_engines_left_are_replaced_and_no_one_elses(
    fm: FaultyRedfish,
) -> None:
    subscriptions = "/redfish/v1/EventService/Subscriptions"
    gone = [free_port(), free_port()]  # where killed engines listened: nothing does now

    def subscription(n: int, destination: str, context: str) -> str:
        uri = f"{subscriptions}/{n}"
        body = {"@odata.id": uri, "Destination": destination, "Context": context,
                "Protocol": "Redfish"}  # fmt: skip
        fm.put(uri, body, member=True)
        return uri

    subscription(91, f"http://127.0.0.1:{gone[0]}/trellis/events", "trellis")
    subscription(92, f"http://127.0.0.1:{gone[1]}/trellis/events", "trellis")
    kept = [
        subscription(93, f"http://127.0.0.1:{gone[0]}/listener", "someone else"),
        subscription(94, f"http://127.0.0.1:{gone[1]}/trellis/events", "another client"),
    ]
    options: dict[str, Any] = {"poll_s": 60.0, "resync_s": 60.0, "events_at": ("127.0.0.1", 0)}
    async with watching(fm, **options) as first:
        await eventually("subscribed", lambda: first._subscription is not None)
        assert sorted(fm.members(subscriptions)) == sorted([*kept, first._subscription])
        async with watching(fm, **options) as second:  # another engine, beside a live one
            await eventually("subscribed", lambda: second._subscription is not None)
            assert sorted(fm.members(subscriptions)) == sorted(
                [*kept, first._subscription, second._subscription]
            )
    assert sorted(fm.members(subscriptions)) == sorted(kept)  # clean stops delete their own


@pytest.mark.parametrize(
    ("url", "options", "fault", "exit_code", "code"),
    [
        ("127.0.0.1:8000", [], None, 2, "usage"),  # no scheme: the command line is wrong
        ("ftp://127.0.0.1", [], None, 2, "usage"),
        ("{url}", ["--fabric", "Nope"], None, 1, "not_found"),
        ("{url}", [], 401, 1, "refused"),
        ("{url}", [], 403, 1, "forbidden"),
        ("{url}", [], 503, 3, "unavailable"),
        ("http://127.0.0.1:{gone}", [], None, 3, "unavailable"),  # nothing listens
    ],
)
def test_an_import_the_service_refuses_exits_with_the_code_of_why(
    fm: FaultyRedfish,
    capsys: pytest.CaptureFixture[str],
    url: str,
    options: list[str],
    fault: int | None,
    exit_code: int,
    code: str,
) -> None:
    if fault is not None:
        fm.fail("GET", "/redfish/v1", fault, times=100)
    url = url.format(url=fm.url, gone=free_port())
    argv = ["topology", "import", "--domain", D, "--from-redfish", url, "--dry-run", *options]
    assert cli_main(argv) == exit_code, capsys.readouterr().err
    assert capsys.readouterr().err.startswith(f"trellis: {code}: ")


def test_an_import_from_a_service_that_answers_prints_the_document(
    fm: FaultyRedfish, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["topology", "import", "--domain", D, "--from-redfish", fm.url, "--dry-run"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["nodes"]


async def test_a_slice_left_without_its_chunk_reads_as_over_no_path(
    fm: FaultyRedfish, driver: RedfishFabric
) -> None:
    await bound_slice(driver)
    fm.delete(fm.members(MEM_01_CHUNKS)[0])  # the connection joins nothing now
    (held,) = (await driver.snapshot(D, fence=1)).bindings
    (line,) = render.fabric_differences(Reconciliation(unbind=[held]))
    assert line == "holds mem-01 bound to host-01 for c-m over no path, which the log does not"


async def test_retry_after_0_on_a_task_is_no_poll_loop(fm: FaultyRedfish) -> None:
    """The re-check probe: `Retry-After: 0` made the client poll a task 24,000 times in 3 s."""
    client = RedfishClient(fm.url, timeout=2.0, task_timeout=0.4)
    try:
        fm.as_task("POST", "/Zones", ends="never", retry_after=0)
        with pytest.raises(Unreachable, match=r"did not end within 0\.4 s"):
            await client.post(ZONES, {"ZoneType": "ZoneOfEndpoints"})
    finally:
        await client.close()
    assert fm.count("GET", "/TaskService/") < 20  # from 50 ms, doubling: a handful
