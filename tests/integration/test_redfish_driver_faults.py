"""The Redfish driver against a fabric manager that answers what DMTF's Mockup Server never
does (tests/redfish_fault_server.py, serving the tree of examples/fabric.json in the test's
own process): every failure is a FabricError naming what failed, and what the hardware holds
is what the snapshot says."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from redfish_fault_server import FaultyRedfish
from redfish_trees import tree

from trellis.adapters.fabric.redfish.client import HttpError, RedfishClient
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.engine.core.errors import FabricError
from trellis.engine.core.fabric import FabricBinding

EXAMPLE = json.loads((Path(__file__).resolve().parents[2] / "examples/fabric.json").read_text())
F = "/redfish/v1/Fabrics/Trellis"
ZONES, CONNECTIONS = f"{F}/Zones", f"{F}/Connections"
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


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (202, {"Location": "/redfish/v1/TaskService/TaskMonitors/7"}),
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
