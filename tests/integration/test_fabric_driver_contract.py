"""The FabricDriver contract (engine/service/ports.py), run against every driver it applies to: the
simulated fabric, and the Redfish driver on DMTF's Mockup Server serving a tree made from a
small fabric, both as DMTF wrote it (no ETags) and under the wrapper that adds ETags and
answers 428 to a change without `If-Match` (tests/etag_mockup_server.py).

One Mockup Server per module and kind, shared: each test works in a domain of its own, and what
Trellis left on the server is wiped after each test. The simulator's own behaviour (seeded
faults, state files) is tests/adapters/test_fabric_sim.py's.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from mockup_server import MockupServer, at, wipe
from redfish_trees import write_tree

from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.engine.core.errors import FabricError, WriterFenced
from trellis.engine.core.fabric import FabricBinding, FabricCircuit, FabricSnapshot
from trellis.engine.service.ports import FabricDriver

DRIVERS = ["sim", "redfish", "redfish-if-match"]
FABRIC_URI = "/redfish/v1/Fabrics/Trellis"
FABRIC = {
    "nodes": [
        {"id": "host-1", "kind": "host"},
        {"id": "host-2", "kind": "host"},
        {"id": "sw-1", "kind": "switch", "latency_ns": 150},
        {"id": "ocs-1", "kind": "ocs", "ports": 8, "latency_ns": 30},
        {"id": "ocs-2", "kind": "ocs", "ports": 8, "latency_ns": 30},
        {"id": "gpu-1", "kind": "device", "device_kind": "gpu", "model": "H100"},
        {"id": "gpu-2", "kind": "device", "device_kind": "gpu", "model": "H100"},
        {"id": "mem-1", "kind": "device", "device_kind": "memory", "capacity_gib": 512},
    ],
    "links": [
        {"id": "l-h1", "a": "host-1", "b": "sw-1", "capacity_gbps": 256},
        {"id": "l-h2", "a": "host-2", "b": "sw-1", "capacity_gbps": 256},
        {"id": "l-g1", "a": "sw-1", "b": "gpu-1", "capacity_gbps": 128},
        {"id": "l-g2", "a": "sw-1", "b": "gpu-2", "capacity_gbps": 128},
        {"id": "l-m1", "a": "sw-1", "b": "mem-1", "capacity_gbps": 128},
        {"id": "l-o1", "a": "sw-1", "b": "ocs-1", "b_port": 0, "capacity_gbps": 256},
        {"id": "l-o2", "a": "sw-1", "b": "ocs-2", "b_port": 0, "capacity_gbps": 256},
    ],
}


def circuit(a: int, b: int, ocs: str = "ocs-1") -> FabricCircuit:
    return FabricCircuit(ocs=ocs, a_port=a, b_port=b)


def binding(
    device: str = "gpu-1",
    host: str = "host-1",
    composition: str = "c-1",
    via: tuple[str, ...] = ("sw-1",),
    capacity_gib: float | None = None,
) -> FabricBinding:
    return FabricBinding(
        host=host,
        device=device,
        path=[host, *via, device],
        composition_id=composition,
        capacity_gib=capacity_gib,
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, MockupServer]]:
    tree = write_tree(FABRIC, tmp_path_factory.mktemp("contract-tree"))
    with (
        MockupServer(tree) as plain,
        MockupServer(tree, etag=True, strict=True, created=True) as strict,
    ):
        yield {"redfish": plain, "redfish-if-match": strict}


@pytest_asyncio.fixture(params=DRIVERS)
async def driver(
    request: pytest.FixtureRequest, servers: dict[str, MockupServer]
) -> AsyncIterator[FabricDriver]:
    if request.param == "sim":
        yield SimulatedFabric()
        return
    server = servers[request.param]
    fabric = RedfishFabric(RedfishClient(server.url, timeout=5.0))
    try:
        yield fabric
    finally:
        await fabric.close()
        await asyncio.to_thread(wipe, server)


@pytest.fixture
def d() -> str:
    """A domain of the test's own (the Redfish tests share a server)."""
    return f"d{uuid.uuid4().hex[:10]}"


# -- circuits ----------------------------------------------------------------------------------


async def test_a_created_circuit_appears_in_the_snapshot_once(driver: FabricDriver, d: str) -> None:
    await driver.create_circuit(d, circuit(1, 5))
    await driver.create_circuit(d, circuit(1, 5))
    assert (await driver.snapshot(d)).circuits == [circuit(1, 5)]


async def test_a_circuit_on_a_port_of_another_circuit_is_refused_naming_the_port(
    driver: FabricDriver, d: str
) -> None:
    await driver.create_circuit(d, circuit(1, 5))
    with pytest.raises(FabricError, match=r"ocs-1 port 5 is already in circuit") as err:
        await driver.create_circuit(d, circuit(5, 7))
    assert err.value.component == "ocs-1"
    assert (await driver.snapshot(d)).circuits == [circuit(1, 5)]
    await driver.create_circuit(d, circuit(6, 7))  # the refused circuit's other port stayed free


async def test_circuits_sharing_one_port_number_on_two_switches_do_not_conflict(
    driver: FabricDriver, d: str
) -> None:
    await driver.create_circuit(d, circuit(1, 5, ocs="ocs-1"))
    await driver.create_circuit(d, circuit(1, 5, ocs="ocs-2"))
    assert len((await driver.snapshot(d)).circuits) == 2


async def test_a_circuit_must_join_two_ports_given_in_ascending_order(
    driver: FabricDriver, d: str
) -> None:
    for a, b in [(3, 3), (5, 1)]:
        with pytest.raises(FabricError, match="a_port < b_port") as err:
            await driver.create_circuit(d, circuit(a, b))
        assert err.value.component == "ocs-1"
    assert (await driver.snapshot(d)).circuits == []


async def test_removing_a_circuit_frees_both_its_ports_and_an_absent_one_is_a_no_op(
    driver: FabricDriver, d: str
) -> None:
    await driver.remove_circuit(d, circuit(1, 5))
    await driver.create_circuit(d, circuit(1, 5))
    await driver.remove_circuit(d, circuit(1, 6))  # shares port 1, but is not what is held
    assert (await driver.snapshot(d)).circuits == [circuit(1, 5)]
    await driver.remove_circuit(d, circuit(1, 5))
    assert (await driver.snapshot(d)).circuits == []
    await driver.create_circuit(d, circuit(1, 2))
    await driver.create_circuit(d, circuit(5, 6))


async def test_of_two_concurrent_circuits_on_one_port_exactly_one_is_programmed(
    driver: FabricDriver, d: str
) -> None:
    results = await asyncio.gather(
        driver.create_circuit(d, circuit(1, 5)),
        driver.create_circuit(d, circuit(1, 6)),
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], FabricError) and "port 1" in str(results[1])
    assert (await driver.snapshot(d)).circuits == [circuit(1, 5)]


# -- bindings ----------------------------------------------------------------------------------


async def test_a_bound_device_appears_in_the_snapshot_once(driver: FabricDriver, d: str) -> None:
    await driver.bind(d, binding())
    await driver.bind(d, binding())
    assert (await driver.snapshot(d)).bindings == [binding()]


async def test_domains_are_separate(driver: FabricDriver, d: str) -> None:
    await driver.bind(d, binding(host="host-1"))
    await driver.bind(f"{d}-2", binding(device="gpu-2", host="host-2"))
    assert (await driver.snapshot(d)).bindings == [binding(host="host-1")]
    assert (await driver.snapshot(f"{d}-2")).bindings == [binding(device="gpu-2", host="host-2")]
    assert (await driver.snapshot(f"{d}-3")).bindings == []


async def test_binding_a_device_held_by_another_host_is_refused(
    driver: FabricDriver, d: str
) -> None:
    await driver.bind(d, binding(host="host-1"))
    with pytest.raises(FabricError, match="gpu-1 is already bound to host host-1") as err:
        await driver.bind(d, binding(host="host-2", composition="c-2"))
    assert err.value.component == "gpu-1"
    assert (await driver.snapshot(d)).bindings == [binding(host="host-1")]


async def test_rebinding_over_another_path_without_unbinding_is_refused(
    driver: FabricDriver, d: str
) -> None:
    await driver.bind(d, binding(via=("sw-1",)))
    with pytest.raises(FabricError, match="over host-1>sw-1>gpu-1"):
        await driver.bind(d, binding(via=("sw-2",)))
    await driver.unbind(d, binding(via=("sw-1",)))
    await driver.bind(d, binding(via=("sw-2",)))
    assert (await driver.snapshot(d)).bindings == [binding(via=("sw-2",))]


async def test_one_host_may_hold_a_device_for_two_compositions(
    driver: FabricDriver, d: str
) -> None:
    await driver.bind(d, binding(device="mem-1", composition="c-1"))
    await driver.bind(d, binding(device="mem-1", composition="c-2"))
    assert len((await driver.snapshot(d)).bindings) == 2


async def test_slices_of_one_memory_pool_go_to_several_hosts(
    driver: FabricDriver, d: str, servers: dict[str, MockupServer]
) -> None:
    one = binding(device="mem-1", host="host-1", composition="c-1", capacity_gib=64)
    two = binding(device="mem-1", host="host-2", composition="c-2", capacity_gib=1.5)
    await driver.bind(d, one)
    await driver.bind(d, two)
    await driver.bind(d, one)
    assert (await driver.snapshot(d)).bindings == [one, two]
    if isinstance(driver, RedfishFabric):  # chunks come in the pool's steps (1 GiB here)
        pool = "/redfish/v1/Chassis/mem-1/MemoryDomains/mem-1/MemoryChunks"
        server = next(s for s in servers.values() if s.url == driver.client.origin)
        sizes = [
            (await at(server).get(c))["MemoryChunkSizeMiB"] for c in await at(server).members(pool)
        ]
        assert sorted(sizes) == [2048, 64 * 1024]
    await driver.unbind(d, one)
    assert (await driver.snapshot(d)).bindings == [two]


async def test_a_binding_path_must_run_from_its_host_to_its_device(
    driver: FabricDriver, d: str
) -> None:
    bad = [
        FabricBinding(host="host-1", device="gpu-1", path=[], composition_id="c-1"),
        FabricBinding(host="host-1", device="gpu-1", path=["sw-1", "gpu-1"], composition_id="c"),
        FabricBinding(host="host-1", device="gpu-1", path=["host-1", "sw-1"], composition_id="c"),
    ]
    for b in bad:
        with pytest.raises(FabricError) as err:
            await driver.bind(d, b)
        assert err.value.component == "gpu-1"
    assert (await driver.snapshot(d)).bindings == []


async def test_unbinding_releases_the_device_for_another_host(driver: FabricDriver, d: str) -> None:
    await driver.bind(d, binding(host="host-1"))
    await driver.unbind(d, binding(host="host-1", via=("sw-9", "ocs-1")))  # the path is not asked
    assert (await driver.snapshot(d)).bindings == []
    await driver.bind(d, binding(host="host-2"))


async def test_unbinding_what_is_not_held_does_nothing(driver: FabricDriver, d: str) -> None:
    await driver.unbind(d, binding())  # nothing bound at all
    await driver.bind(d, binding(host="host-1", composition="c-1"))
    await driver.unbind(d, binding(host="host-2", composition="c-1"))  # another host's
    await driver.unbind(d, binding(host="host-1", composition="c-9"))  # another composition's
    assert (await driver.snapshot(d)).bindings == [binding(host="host-1", composition="c-1")]


async def test_the_snapshot_is_a_copy_in_a_stable_order(driver: FabricDriver, d: str) -> None:
    mine = binding(device="gpu-2")
    await driver.bind(d, mine)
    await driver.bind(d, binding(device="gpu-1"))
    await driver.create_circuit(d, circuit(6, 7))
    await driver.create_circuit(d, circuit(1, 2))
    mine.path.append("elsewhere")  # the caller's list is not the hardware's
    snap = await driver.snapshot(d)
    snap.bindings[0].path.clear()
    again = await driver.snapshot(d)
    assert [b.device for b in again.bindings] == ["gpu-1", "gpu-2"]
    assert again.bindings[1].path == ["host-1", "sw-1", "gpu-2"]
    assert again.circuits == [circuit(1, 2), circuit(6, 7)]


# -- fencing -----------------------------------------------------------------------------------


async def test_a_call_under_an_older_writer_epoch_is_refused_once_a_newer_one_called(
    driver: FabricDriver, d: str
) -> None:
    await driver.bind(d, binding(), fence=1)
    await driver.snapshot(d, fence=2)  # the successor's first call
    for stale in (
        driver.bind(d, binding(device="gpu-2"), fence=1),
        driver.unbind(d, binding(), fence=1),
        driver.create_circuit(d, circuit(1, 2), fence=1),
        driver.snapshot(d, fence=1),
    ):
        with pytest.raises(WriterFenced):
            await stale
    assert await driver.snapshot(d) == FabricSnapshot(circuits=[], bindings=[binding()])
    await driver.unbind(d, binding(), fence=2)


@pytest.mark.parametrize("kind", ["redfish", "redfish-if-match"])
async def test_the_redfish_fence_holds_across_drivers_as_across_processes(
    servers: dict[str, MockupServer], kind: str, d: str
) -> None:
    # Two engines' drivers on one fabric manager: the epoch lives on the Fabric resource.
    old, new = (RedfishFabric(RedfishClient(servers[kind].url)) for _ in range(2))
    try:
        await old.bind(d, binding(), fence=3)
        await new.snapshot(d, fence=4)
        with pytest.raises(WriterFenced, match="seen writer epoch 4"):
            await old.bind(d, binding(device="gpu-2"), fence=3)
        held = await new.snapshot(d)
        assert held.bindings == [binding()]
        fabric = servers[kind].get(FABRIC_URI)
        assert fabric["Oem"]["Trellis"]["WriterEpochs"][d] == 4
    finally:
        await old.close()
        await new.close()
        await asyncio.to_thread(wipe, servers[kind])


@pytest.mark.parametrize("kind", ["redfish", "redfish-if-match"])
async def test_another_deployments_engine_is_refused_whatever_its_epoch(
    servers: dict[str, MockupServer], kind: str, d: str
) -> None:
    """Two deployments (two logs) on one fabric manager took the domain from each other in
    turn, each drawing an epoch above the other's and undoing its work (the southbound probe).
    Another deployment is refused with no epoch to draw above, until the operator removes the
    domain's entries; a successor of the same deployment is not."""
    ours, successor, other = (
        RedfishFabric(RedfishClient(servers[kind].url), deployment=name)
        for name in ("dep-a", "dep-a", "dep-b")
    )
    try:
        await ours.bind(d, binding(), fence=3)
        with pytest.raises(
            WriterFenced, match="another deployment of Trellis \\(dep-a\\)"
        ) as refused:
            await other.bind(d, binding(device="gpu-2"), fence=99)
        assert refused.value.seen == 0
        fabric = servers[kind].get(FABRIC_URI)
        assert fabric["Oem"]["Trellis"]["WriterEpochs"][d] == 3
        assert fabric["Oem"]["Trellis"]["WriterDeployments"][d] == "dep-a"
        await successor.snapshot(d, fence=4)  # the same log's next writer: as before
        with pytest.raises(WriterFenced, match="seen writer epoch 4"):
            await ours.bind(d, binding(device="gpu-2"), fence=3)

        # The operator moves the domain: the entries removed, the other deployment takes it.
        def forget(body: dict[str, object]) -> dict[str, object]:
            return {"Oem": {"Trellis": {"WriterEpochs": {d: None}, "WriterDeployments": {d: None}}}}

        await other.client.update(FABRIC_URI, forget)
        await other.snapshot(d, fence=1)
        assert servers[kind].get(FABRIC_URI)["Oem"]["Trellis"]["WriterDeployments"][d] == "dep-b"
    finally:
        for driver in (ours, successor, other):
            await driver.close()
        await asyncio.to_thread(wipe, servers[kind])


def test_the_contract_fabric_is_the_tree_the_driver_discovers(tmp_path: Path) -> None:
    # The ids the tests use are the ones discovery gives this tree (no kind prefixes).
    tree = write_tree(FABRIC, tmp_path)
    assert (tree / "Fabrics/Trellis/Switches/ocs-1/Ports/7/index.json").exists()
    assert msgspec.json.decode((tree / "Systems/host-1/index.json").read_bytes())["Id"] == "host-1"


@pytest.mark.parametrize("kind", ["redfish", "redfish-if-match"])
async def test_a_read_overlapping_its_own_changes_never_makes_the_driver_forget_them(
    servers: dict[str, MockupServer], kind: str, d: str
) -> None:
    # A pass's snapshot and a saga's binds run at once; a read that began before a zone was
    # made must not make the driver believe it is gone, or the next bind makes a second one.
    fabric = RedfishFabric(RedfishClient(servers[kind].url))
    try:
        await fabric.snapshot(d)
        reading = asyncio.create_task(fabric.snapshot(d))
        await asyncio.sleep(0.001)  # its first request, the Zones collection, is on its way
        await fabric.bind(d, binding(device="gpu-1", composition="c-1"))
        await reading  # it read no zone, and ends after the bind made one
        await fabric.bind(d, binding(device="gpu-2", composition="c-1"))
        zones = [
            z
            for z in await asyncio.to_thread(servers[kind].members, f"{FABRIC_URI}/Zones")
            if (await asyncio.to_thread(servers[kind].get, z)).get("Oem", {}).get("Trellis")
        ]
        assert len(zones) == 1, zones
        assert [b.device for b in (await fabric.snapshot(d)).bindings] == ["gpu-1", "gpu-2"]
    finally:
        await fabric.close()
        await asyncio.to_thread(wipe, servers[kind])


async def test_a_fabric_manager_slower_than_the_deadline_is_still_read(
    tmp_path: Path, d: str
) -> None:
    # Every answer takes 50 ms: discovering the fabric takes seconds, each call is given
    # 0.3 s (as the engine's deadline would), and the next call goes on from where the last
    # one was given up, instead of starting over for ever.
    with MockupServer(write_tree(FABRIC, tmp_path), latency=0.05) as server:
        fabric = RedfishFabric(RedfishClient(server.url))
        try:
            for _ in range(200):
                try:
                    snapshot = await asyncio.wait_for(fabric.snapshot(d), 0.3)
                    break
                except TimeoutError:
                    continue
            else:
                pytest.fail("never read within 60 s of 0.3 s tries")
            assert snapshot == FabricSnapshot(circuits=[], bindings=[])
        finally:
            await fabric.close()
