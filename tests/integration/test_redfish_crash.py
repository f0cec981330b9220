"""kill -9 of an engine driving a Redfish fabric manager, anywhere in a compose: after a restart,
the fabric manager holds exactly what the log says.

A real `trellis up` (TRELLIS_FABRIC=redfish) drives DMTF's Mockup Server, which keeps what it
was told in memory and so outlives the engine, as a fabric manager would. Every answer takes a
little while (its `-t`), so a compose of two GPUs and a memory slice (an OCS circuit, a zone, a
chunk and a connection) spans a few hundred milliseconds; each round sends one and kills the
engine with SIGKILL at a different moment of it, then starts another engine. That engine's
first pass, and its reconciliation, finish or undo the saga and remove what the log does not
hold. The check is independent of the engine: a fresh driver reads the server, and its
snapshot is reconciled with the domain folded from the log (the engine's own `evolve`).
What each restart found (resources left by the killed engine, kept, removed, made) is counted in
the run's summary table.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from functools import reduce
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from engines import Fleet
from harness import cli_env
from mockup_server import MockupServer, at
from nats.errors import NoRespondersError
from redfish_trees import write_tree
from zeros import zeros

from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.discovery import discover
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.fabric_plan import reconcile
from trellis.engine.core.state import DomainState, evolve

EXAMPLE = json.loads((Path(__file__).resolve().parents[2] / "examples/fabric.json").read_text())
DOMAIN = "hall"
F = "/redfish/v1/Fabrics/Trellis"
COMPOSE = {
    "host": "host-01",
    "devices": [{"kind": "gpu", "count": 2}, {"kind": "memory", "capacity_gib": 64}],
}
#: Seconds after the compose is sent that the engine is killed, one round each.
KILL_AFTER_S = [0.05, 0.15, 0.3, 0.5, 0.9]
TABLE = "redfish: kill -9 mid-compose, then reconciliation"

pytestmark = pytest.mark.slow


@pytest_asyncio.fixture
async def client(nats_url: str, subject_prefix: str) -> AsyncIterator[TrellisClient]:
    async with TrellisClient.connected(
        nats_url, prefix=subject_prefix, timeout=10.0, name="crash-client"
    ) as client:
        yield client


async def log_state(database_url: str, schema: str) -> DomainState:
    store = await PostgresEventStore.open(database_url, schema=schema)
    try:
        events = [recorded.event() async for recorded in store.read(DOMAIN)]
    finally:
        await store.close()
    return reduce(evolve, events, DomainState(domain=DOMAIN))


async def held_on(server: MockupServer) -> set[str]:
    """The URIs of everything Trellis tagged on the server, and its circuit ports."""
    held = set()
    for collection in (f"{F}/Zones", f"{F}/Connections", *_chunk_collections()):
        for uri in await at(server).members(collection):
            if (await at(server).get(uri)).get("Oem", {}).get("Trellis"):
                held.add(uri)
    for port in await at(server).members(f"{F}/Switches/ocs-1/Ports"):
        if ((await at(server).get(port)).get("Oem") or {}).get("Trellis", {}).get("CircuitTo"):
            held.add(port)
    return held


def _chunk_collections() -> list[str]:
    pools = [n["id"] for n in EXAMPLE["nodes"] if n.get("device_kind") == "memory"]
    return [f"/redfish/v1/Chassis/{p}/MemoryDomains/{p}/MemoryChunks" for p in pools]


async def settled(client: TrellisClient) -> bool:
    try:
        reply = await asyncio.wait_for(client.query(DOMAIN, "fabric"), 5.0)
    except (TimeoutError, NoRespondersError):
        return False
    result: dict[str, Any] = reply.get("result") or {}
    return bool(result.get("in_step")) and not result["differences"]["pending"]


async def until(what: str, check: Any, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within} s: {what}")
        await asyncio.sleep(0.2)


async def test_a_killed_engine_leaves_the_fabric_manager_equal_to_the_log_after_a_restart(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    client: TrellisClient,
    tmp_path: Path,
) -> None:
    table = zeros(TABLE)
    table.promise("fabric manager and log differ after the restart")
    with MockupServer(write_tree(EXAMPLE, tmp_path / "tree"), latency=0.01) as server:
        env = cli_env(
            tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix,
            TRELLIS_FABRIC="redfish", TRELLIS_REDFISH_URL=server.url,
            TRELLIS_SAGA_DEADLINE="5", TRELLIS_LEASE_TTL="1",
        )  # fmt: skip
        fleet = Fleet(env, tmp_path, DOMAIN)
        try:
            engine = await fleet.start_one()
            reader = RedfishClient(server.url)
            document = (await discover(reader)).document
            await reader.close()
            assert (await client.admin(DOMAIN, "import-topology", document))["ok"]
            await until("the first engine's fabric in step", lambda: settled(client))
            for kill_after in KILL_AFTER_S:
                composing = asyncio.ensure_future(client.intent(DOMAIN, "acme", "compose", COMPOSE))
                await asyncio.sleep(kill_after)
                await engine.kill()
                composing.cancel()
                left = await held_on(server)
                engine = await fleet.start_one()
                await until("the restarted engine's fabric in step", lambda: settled(client))
                after = await held_on(server)
                table.tried("kills")
                table.tried("resources left by the killed engine", len(left))
                table.tried("resources left, kept (the log holds them)", len(left & after))
                table.tried("resources left, removed (the log does not)", len(left - after))
                table.tried("resources made after the restart", len(after - left))
                # Independent of the engine: a fresh driver's reading against the log.
                fresh = RedfishFabric(RedfishClient(server.url))
                try:
                    snapshot = await fresh.snapshot(DOMAIN)
                finally:
                    await fresh.close()
                state = await log_state(database_url, pg_schema)
                plan = reconcile(snapshot, state)
                differs = not plan.in_step or bool(plan.pending)
                table.add("fabric manager and log differ after the restart", int(differs))
                assert not differs, (kill_after, plan)
                live = {c.id for c in state.compositions.values()}
                assert {b.composition_id for b in snapshot.bindings} == live
                for cid in sorted(live):  # make room for the next round
                    reply = await client.intent(DOMAIN, "acme", "release", {"composition_id": cid})
                    assert reply["ok"], reply
                await until("released", lambda: settled(client))
                assert await held_on(server) == set()
        finally:
            await fleet.stop()
