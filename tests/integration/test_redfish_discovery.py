"""Discovery (adapters/fabric/redfish/discovery.py) and `trellis topology import --from-redfish`:
DMTF's public-cxl and public-cxl-multiswitch mockups import as they are, quirks and all; a
tree made from examples/fabric.json comes back as that fabric; the import goes through the
normal intent, so a second run is `unchanged` and a change on the fabric manager is a diff."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import cli_env, run_cli, serving
from mockup_server import MOCKUPS, MockupServer
from redfish_trees import write_tree

from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.discovery import (
    DEFAULT_LATENCY_NS,
    DiscoveryError,
    FabricMap,
    assign_ids,
    discover,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/fabric.json"
P3 = "Chassis-PooledCXLType3"  # ids of colliding memory domains are their paths


async def read(url: str, **options: Any) -> FabricMap:
    client = RedfishClient(url)
    try:
        return await discover(client, **options)
    finally:
        await client.close()


def links_of(fmap: FabricMap) -> set[tuple[str, str, str, float]]:
    return {(k["id"], k["a"], k["b"], k["capacity_gbps"]) for k in fmap.document["links"]}


def nodes_of(fmap: FabricMap) -> dict[str, tuple[str, ...]]:
    return {
        n["id"]: (n.get("device_kind") or n["kind"], *(f"{k}={n[k]}" for k in sorted(n) if k in (
            "capacity_gib", "memory_gib", "latency_ns", "ports")))
        for n in fmap.document["nodes"]
    }  # fmt: skip


@pytest.fixture(scope="module")
def cxl() -> Iterator[MockupServer]:
    with MockupServer(MOCKUPS / "public-cxl") as server:
        yield server


@pytest.fixture(scope="module")
def multiswitch() -> Iterator[MockupServer]:
    with MockupServer(MOCKUPS / "public-cxl-multiswitch") as server:
        yield server


async def test_public_cxl_imports_as_it_is(cxl: MockupServer) -> None:
    fmap = await read(cxl.url)
    assert nodes_of(fmap) == {
        "CXL-System": ("host",),
        "CXL": ("switch", "latency_ns=150"),
        "FPGA": ("accelerator",),  # Type 1: CXLDevice + Processor FPGA
        "GPU": ("gpu", "memory_gib=16.0"),  # Type 2: its memory chunk is the GPU's HBM
        "6": ("memory", "capacity_gib=256.0"),
        "Chassis-PooledCXLType3-MemoryDomains-1": ("memory", "capacity_gib=16.0"),
        "Chassis-CXLType3-MemoryDomains-1": ("memory", "capacity_gib=16.0"),
    }
    assert links_of(fmap) == {
        # Three cables from the host's CPU ports; U3 is missing from the Ports collection and
        # found through the CPU's port 4, which names it.
        ("CXL-U1", "CXL", "CXL-System", 512.0),
        ("CXL-U2", "CXL", "CXL-System", 512.0),
        ("CXL-U3", "CXL", "CXL-System", 512.0),
        ("CXL-D1", "CXL", "FPGA", 256.0),
        ("CXL-D2", "CXL", "GPU", 256.0),
        # One cable to a chassis with two memory domains (endpoints T3 and T4): a link each.
        ("CXL-D3-6", "CXL", "6", 256.0),
        (f"CXL-D3-{P3}-MemoryDomains-1", "CXL", f"{P3}-MemoryDomains-1", 256.0),
        ("CXL-D4", "CXL", "Chassis-CXLType3-MemoryDomains-1", 256.0),
    }
    # One host behind four initiator endpoints: zones name it by the first, I1.
    assert fmap.host_endpoints == {"CXL-System": "/redfish/v1/Fabrics/CXL/Endpoints/I1"}
    assert fmap.memory_domains["6"] == "/redfish/v1/Chassis/PooledCXLType3/MemoryDomains/6"
    assert fmap.cables["CXL-U3"] == ["/redfish/v1/Fabrics/CXL/Switches/CXL/Ports/U3"]
    assert fmap.notes == []


async def test_public_cxl_multiswitch_imports_as_it_is(multiswitch: MockupServer) -> None:
    fmap = await read(multiswitch.url)
    assert {n for n, kind in nodes_of(fmap).items() if kind[0] == "host"} == {
        "Host1", "Host2", "Host5"  # Host5's endpoint I5 is missing from the collection
    }  # fmt: skip
    assert {n for n, kind in nodes_of(fmap).items() if kind[0] == "switch"} == {"CXL1", "CXL2"}
    # CXL2's Id says "CXL": ids come from the URI, never from Id.
    assert ("CXL1-F1", "CXL1", "CXL2", 256.0) in links_of(fmap)  # the optical ISL, once
    assert fmap.cables["CXL1-F1"] == [
        "/redfish/v1/Fabrics/CXL/Switches/CXL1/Ports/F1",
        "/redfish/v1/Fabrics/CXL/Switches/CXL2/Ports/F1",
    ]
    assert {lk for lk in links_of(fmap) if lk[2] == "Host2"} == {
        ("CXL1-U2", "CXL1", "Host2", 512.0),
        ("CXL1-U3", "CXL1", "Host2", 512.0),
    }
    pools = sorted(n for n, kind in nodes_of(fmap).items() if kind[0] == "memory")
    assert pools == [f"{P3}{chassis}-MemoryDomains-{d}" for chassis in ("-2", "") for d in (1, 6)]
    assert len(fmap.document["links"]) == 11


async def test_the_example_fabric_comes_back_from_its_redfish_tree(tmp_path: Path) -> None:
    doc = json.loads(EXAMPLE.read_text())
    with MockupServer(write_tree(doc, tmp_path / "tree")) as server:
        fmap = await read(server.url, latency={"link": 7, "sw-pool": 99})
    got = {n["id"]: n for n in fmap.document["nodes"]}
    for node in doc["nodes"]:
        expected = dict(node)
        if node["kind"] in ("switch", "ocs"):  # latency has no Redfish source: the default
            expected["latency_ns"] = (
                99 if node["id"] == "sw-pool" else DEFAULT_LATENCY_NS[node["kind"]]
            )
        assert got.pop(node["id"]) == expected
    assert got == {}

    def cable(link: dict[str, Any]) -> frozenset[tuple[str, int | None]]:
        return frozenset({(link["a"], link.get("a_port")), (link["b"], link.get("b_port"))})

    want = Counter((cable(k), k["capacity_gbps"]) for k in doc["links"])
    assert Counter((cable(k), k["capacity_gbps"]) for k in fmap.document["links"]) == want
    assert {k["latency_ns"] for k in fmap.document["links"]} == {7}


async def test_a_service_with_several_fabrics_needs_one_named(tmp_path: Path) -> None:
    tree = write_tree(json.loads(EXAMPLE.read_text()), tmp_path / "tree", fabric="A")
    shutil.copytree(tree / "Fabrics/A", tree / "Fabrics/B")
    listing = json.loads((tree / "Fabrics/index.json").read_text())
    listing["Members"].append({"@odata.id": "/redfish/v1/Fabrics/B"})
    (tree / "Fabrics/index.json").write_text(json.dumps(listing))
    with MockupServer(tree) as server:
        with pytest.raises(DiscoveryError, match=r"2 fabrics \(A, B\): name one with --fabric"):
            await read(server.url)
        with pytest.raises(DiscoveryError, match="no fabric 'C'"):
            await read(server.url, fabric="C")
        assert (await read(server.url, fabric="A")).fabric == "/redfish/v1/Fabrics/A"


def test_ids_are_last_segments_prefixed_only_where_two_would_be_equal() -> None:
    ids = assign_ids(
        [
            ("/redfish/v1/Systems/CXL", "host"),
            ("/redfish/v1/Fabrics/F/Switches/CXL", "switch"),
            ("/redfish/v1/Chassis/A/MemoryDomains/1", "memory"),
            ("/redfish/v1/Chassis/B/MemoryDomains/1", "memory"),
            ("/redfish/v1/Chassis/B/Processors/GPU%201", "gpu"),
            ("/redfish/v1/Systems/" + "h" * 80, "host"),
        ]
    )
    assert ids["/redfish/v1/Systems/CXL"] == "host-CXL"
    assert ids["/redfish/v1/Fabrics/F/Switches/CXL"] == "switch-CXL"
    assert ids["/redfish/v1/Chassis/A/MemoryDomains/1"] == "Chassis-A-MemoryDomains-1"
    assert ids["/redfish/v1/Chassis/B/MemoryDomains/1"] == "Chassis-B-MemoryDomains-1"
    assert ids["/redfish/v1/Chassis/B/Processors/GPU%201"] == "GPU_1"
    long = ids["/redfish/v1/Systems/" + "h" * 80]
    assert len(long) == 64 and long.startswith("hhhh")


async def test_the_cli_imports_from_redfish_through_the_intent_and_again_says_unchanged(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    env = cli_env(tmp_path, nats_url, database_url, pg_schema, subject_prefix)
    with MockupServer(MOCKUPS / "public-cxl-multiswitch") as server:
        imports = ("topology", "import", "--domain", "cxl", "--from-redfish", server.url)
        async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
            code, out, err = await run_cli(env, *imports, "--latency", "switch=120")
            assert code == 0, err
            assert "domain cxl: imported 11 nodes, 11 links" in out
            topology = await h.client.query("cxl", "topology")
            switch = next(n for n in topology["result"]["nodes"] if n["id"] == "CXL1")
            assert switch["latency_ns"] == 120

            code, out, err = await run_cli(env, *imports, "--latency", "switch=120")
            assert (code, out.strip()) == (0, "domain cxl: unchanged (11 nodes, 11 links)"), err

            # Someone re-cables at the fabric manager: the next import is the diff.
            port = "/redfish/v1/Fabrics/CXL/Switches/CXL1/Ports/U3"
            server.patch(port, {"CurrentSpeedGbps": 128})
            code, out, err = await run_cli(env, *imports, "--latency", "switch=120")
            assert code == 0, err
            assert "updated: CXL1-U3" in out and "added" not in out and "removed" not in out

            code, out, err = await run_cli(env, *imports, "--dry-run")
            assert code == 0 and json.loads(out)["nodes"][0] == {"id": "Host1", "kind": "host"}

            code, _, err = await run_cli(env, "topology", "import", "--domain", "cxl")
            assert code == 1 and "give a topology file or --from-redfish URL" in err
        server.stop()
        code, _, err = await run_cli(env, *imports)
        assert code == 3 and "cannot read the Redfish service" in err


async def test_an_initiator_linked_to_no_system_is_named_in_a_note(tmp_path: Path) -> None:
    """Hosts whose endpoints linked no ComputerSystem were dropped unsaid: a probe's import of
    another service came back without its four hosts and no note (the southbound probe)."""
    tree = write_tree(json.loads(EXAMPLE.read_text()), tmp_path / "tree")
    for path in sorted((tree / "Fabrics").glob("*/Endpoints/*/index.json")):
        body = json.loads(path.read_text())
        entities = body.get("ConnectedEntities") or []
        if any(e.get("EntityRole") == "Initiator" for e in entities):
            for entity in entities:
                entity.pop("EntityLink", None)
            path.write_text(json.dumps(body))
            uri = body["@odata.id"]
            break
    with MockupServer(tree) as server:
        fmap = await read(server.url)
    assert any(note.startswith(f"endpoint {uri} is an initiator") for note in fmap.notes), (
        fmap.notes
    )
