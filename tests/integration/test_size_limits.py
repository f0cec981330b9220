"""No size cliff below a 65,536-device domain (ARCHITECTURE §10, Size; issue 21, finding 5).

NATS refuses a message over 1 MiB. Before, that showed three ways: at about 3,800 devices
`topology show` and the page failed, at about 5,000 the import was accepted but its event could
never be relayed (the domain never reached the bucket or the stream), and above that the CLI
exited 70. Now an import larger than one request goes in parts (engine/core/uploads.py), an event
larger than one message is recorded in parts (TopologyImported.part), and the answers that grow
with a domain come in pages (engine/core/paging.py). One hall of 65,536 GPUs, shared by the module,
goes through the CLI end to end.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, row_counts
from harness import Harness, bucket_values, cli_env, run_cli, serving

from trellis.adapters.nats.jetstream import stream_name
from trellis.engine.core.events import MAX_EVENT_BYTES

pytestmark = pytest.mark.slow
DOMAIN = "hall"
RACKS, HOSTS, GPUS = 256, 4, 256  # 65,536 GPUs


def hall(racks: int = RACKS, hosts: int = HOSTS, gpus: int = GPUS) -> dict[str, Any]:
    """`racks` racks of `hosts` hosts and `gpus` GPUs on one PCIe switch each, the switches
    joined by a spine."""
    nodes: list[dict[str, Any]] = [{"id": "spine", "kind": "switch", "latency_ns": 200}]
    links: list[dict[str, Any]] = []
    for r in range(racks):
        sw = f"sw-{r:03}"
        nodes.append({"id": sw, "kind": "switch", "latency_ns": 150, "labels": {"rack": f"r{r}"}})
        links.append({"id": f"l-{sw}", "a": sw, "b": "spine", "capacity_gbps": 800})
        for h in range(hosts):
            host = f"h-{r:03}-{h}"
            nodes.append({"id": host, "kind": "host", "labels": {"rack": f"r{r}"}})
            links.append({"id": f"l-{host}", "a": host, "b": sw, "capacity_gbps": 256})
        for g in range(gpus):
            gpu = f"g-{r:03}-{g:03}"
            nodes.append(
                {"id": gpu, "kind": "device", "device_kind": "gpu", "vendor": "nvidia",
                 "model": "H100", "generation": 9, "memory_gib": 80}
            )  # fmt: skip
            links.append({"id": f"l-{gpu}", "a": sw, "b": gpu, "capacity_gbps": 64})
    return {"nodes": nodes, "links": links}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    # Deciding and folding a 65,536-device hall holds the engine's event loop for seconds;
    # past a 3 s writer lease on a busy machine the engine loses the domain, loads it again,
    # and never catches up (docs/scale.md, "what breaks first"). Such a hall needs the
    # longer lease docs/configuration.md gives for it.
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, page_at=("127.0.0.1", 0),
        lease_ttl=10.0,
    ) as harness:  # fmt: skip
        yield harness


def env_of(h: Harness, tmp: Path, nats: str, database: str, schema: str) -> dict[str, str]:
    return cli_env(tmp, nats, database, schema, h.client.prefix, TRELLIS_DOMAIN=DOMAIN)


async def imported_by_cli(env: dict[str, str], doc: dict[str, Any], tmp_path: Path) -> str:
    path = tmp_path / "hall.json"
    path.write_text(json.dumps(doc))
    code, out, err = await run_cli(env, "topology", "import", str(path), timeout=600)
    assert code == 0, err
    return out


async def test_a_hall_past_one_message_imports_relays_and_shows_through_the_cli(
    h: Harness, tmp_path: Path, nats_url: str, database_url: str, pg_schema: str
) -> None:
    # 24 racks of 256 GPUs: 6,144, past all three cliffs (3,800 / 5,000 / one request).
    doc = hall(racks=24)
    assert len(json.dumps(doc)) > 1024 * 1024  # more than one NATS message
    env = env_of(h, tmp_path, nats_url, database_url, pg_schema)
    out = await imported_by_cli(env, doc, tmp_path)
    assert out.startswith(f"domain {DOMAIN}: imported {len(doc['nodes'])} nodes")
    assert f"({len(doc['nodes']) + len(doc['links'])} nodes and links in all)" in out

    # The log holds it in parts, each of which the stream carries.
    parts = [e async for e in h.store.read(DOMAIN)]
    assert len(parts) > 1 and all(len(e.data) <= MAX_EVENT_BYTES for e in parts)
    assert {e.type for e in parts} == {"TopologyImported"}
    await h.relayed(DOMAIN, timeout=120)
    await h.projected(DOMAIN, timeout=120)
    js = h.client.nc.jetstream()
    info = await js.stream_info(stream_name(h.client.prefix))
    assert info.state.messages == len(parts)
    keys = await bucket_values(js, h.client.prefix)
    gpus = sum(1 for k in keys if k.startswith(f"{DOMAIN}.device."))
    assert gpus == 24 * GPUS

    # The topology, in pages, whole.
    code, out, err = await run_cli(env, "topology", "show", "-o", "json", timeout=300)
    assert code == 0, err
    shown = json.loads(out)
    assert len(shown["nodes"]) == len(doc["nodes"]) and len(shown["links"]) == len(doc["links"])
    assert "next" not in shown
    code, out, err = await run_cli(env, "free", "-o", "json", timeout=300)
    assert code == 0, err
    assert len(json.loads(out)["devices"]) == 24 * GPUS
    # Again: unchanged, by content, across parts.
    out = await imported_by_cli(env, doc, tmp_path)
    assert "unchanged" in out


async def test_the_page_shows_a_topology_that_came_in_pages(
    h: Harness, tmp_path: Path, nats_url: str, database_url: str, pg_schema: str
) -> None:
    doc = hall(racks=24)
    await imported_by_cli(env_of(h, tmp_path, nats_url, database_url, pg_schema), doc, tmp_path)
    assert h.page_url is not None
    url = f"{h.page_url}/api/topology?domain={DOMAIN}"

    def read() -> dict[str, Any]:
        with urllib.request.urlopen(url, timeout=60) as reply:
            body: dict[str, Any] = json.loads(reply.read())
            return body

    topology = expect_ok(await asyncio.to_thread(read))
    assert len(topology["nodes"]) == len(doc["nodes"]) and "next" not in topology


async def test_an_event_that_cannot_fit_one_message_is_refused_before_commit(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    # 4,096 GPUs behind one spine: a compose of all of them would record their 4,096 paths in
    # one DevicesReserved event, more than one message of the stream can carry.
    expect_ok(await h.client.admin(DOMAIN, "import-topology", hall(racks=16, hosts=1)))
    before = await row_counts(database_url, pg_schema)
    everything = {"host": "h-000-0", "devices": [{"kind": "gpu", "count": 4096}]}
    error = expect_error(await h.client.intent(DOMAIN, "acme", "compose", everything), "invalid")
    assert "an event must fit one message" in error["message"]
    assert error["details"]["event_bytes"] > MAX_EVENT_BYTES
    assert await row_counts(database_url, pg_schema) == before  # nothing recorded
    # Fewer at once are composed as usual, and the domain goes on serving.
    some = {"host": "h-000-0", "devices": [{"kind": "gpu", "count": 256}]}
    assert expect_ok(await h.client.intent(DOMAIN, "acme", "compose", some))["state"] == "active"


@pytest.mark.slow
async def test_a_65536_gpu_hall_imports_shows_and_projects_through_the_cli(
    h: Harness, tmp_path: Path, nats_url: str, database_url: str, pg_schema: str
) -> None:
    doc = hall()
    env = env_of(h, tmp_path, nats_url, database_url, pg_schema)
    started = time.monotonic()
    out = await imported_by_cli(env, doc, tmp_path)
    imported_s = time.monotonic() - started
    assert out.startswith(f"domain {DOMAIN}: imported {len(doc['nodes'])} nodes")
    await h.relayed(DOMAIN, timeout=600)
    await h.projected(DOMAIN, timeout=600)
    projected_s = time.monotonic() - started
    code, out, err = await run_cli(env, "topology", "show", "-o", "json", timeout=600)
    assert code == 0, err
    shown = json.loads(out)
    assert len(shown["nodes"]) == len(doc["nodes"])
    shown_s = time.monotonic() - started - projected_s
    eight = {"host": "h-255-3", "devices": [{"kind": "gpu", "count": 8}]}
    assert expect_ok(await h.client.intent(DOMAIN, "acme", "compose", eight))["state"] == "active"
    print(
        f"65,536 GPUs: imported in {imported_s:.1f} s, projected by {projected_s:.1f} s, "
        f"shown in {shown_s:.1f} s"
    )
