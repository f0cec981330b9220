"""Fabric driver benchmark (issue 24): compose and release latency with the Redfish driver
against the simulated fabric, in one run, on the same fabric.

- The fabric: DMTF's public-cxl-multiswitch mockup (third_party/dmtf/), discovered once
  (adapters/fabric/redfish/discovery.py) and imported into two domains.
- simulator: an engine (`adapters.bootstrap.engine_on`: Postgres log, projections, NATS
  intake) driving the in-memory simulated fabric, zero latency.
- redfish: the same engine wiring driving DMTF's Mockup Server serving that mockup, no added
  latency (its default), through the Redfish driver: each compose makes a Zone, a MemoryChunk
  and a Memory Connection on the server, each release deletes them. The driver's health poll
  runs as in production (every 5 s).
- Serially, one client composes (Host2: the GPU and a 16 GiB memory slice) and releases, one
  pair after another (a compose is answered once its saga has programmed the fabric, a
  release once committed: the fabric pass takes the composition away right after); the two
  engines take turns in chunks of `--chunk` pairs (ABAB...), so drift on a shared machine
  falls on both alike. p50 / p99 of each intent's round trip, the Redfish figures as ratios
  to the simulator's, and the HTTP requests the Redfish driver sent per pair.
Every reply is checked (compose ok and `active` with both devices, release ok), and at the
end both fabrics must hold nothing. Uses TRELLIS_NATS_URL / TRELLIS_DATABASE_URL when set,
else embedded servers; fresh schemas (dropped afterwards) and subject prefixes. The last line
printed is one JSON object with every figure.

    python bench/fabric_drivers.py            # ~1 minute on 2 cores
    python bench/fabric_drivers.py --pairs 40 # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mockup_server import MOCKUPS, MockupServer  # noqa: E402  (tests/ on the path)

from bench.intents import fresh_schema, percentile, servers  # noqa: E402  (the root on the path)
from trellis.adapters.bootstrap import engine_on  # noqa: E402
from trellis.adapters.fabric.redfish.client import RedfishClient  # noqa: E402
from trellis.adapters.fabric.redfish.discovery import discover  # noqa: E402
from trellis.adapters.fabric.redfish.driver import RedfishFabric  # noqa: E402
from trellis.adapters.fabric.sim import SimulatedFabric  # noqa: E402
from trellis.adapters.nats.client import TrellisClient  # noqa: E402
from trellis.adapters.nats.connect import connect_nats  # noqa: E402
from trellis.adapters.settings import Settings  # noqa: E402
from trellis.engine.service.ports import FabricDriver  # noqa: E402

DOMAIN = "cxl"
COMPOSE = {
    "host": "Host2",
    "devices": [{"kind": "gpu"}, {"kind": "memory", "capacity_gib": 16}],
    "reason": "bench",
}


class Side:
    """One driver's engine and client, and its samples."""

    def __init__(self, name: str, fabric: FabricDriver, client: TrellisClient, idle: Any) -> None:
        self.name = name
        self.fabric = fabric
        self.client = client
        self.idle = idle  # until the engine's fabric holds what its log says
        self.compose_ms: list[float] = []
        self.release_ms: list[float] = []

    async def pair(self) -> None:
        started = time.perf_counter()
        reply = await self.client.intent(DOMAIN, "bench", "compose", COMPOSE)
        composed = time.perf_counter()
        result = reply.get("result") or {}
        if not reply.get("ok") or result.get("state") != "active" or len(result["devices"]) != 2:
            raise SystemExit(f"{self.name}: compose did not succeed: {reply}")
        cid = result["composition_id"]
        reply = await self.client.intent(DOMAIN, "bench", "release", {"composition_id": cid})
        released = time.perf_counter()
        if not reply.get("ok"):
            raise SystemExit(f"{self.name}: release did not succeed: {reply}")
        self.compose_ms.append((composed - started) * 1000)
        self.release_ms.append((released - composed) * 1000)


@contextlib.asynccontextmanager
async def side(
    name: str, fabric: FabricDriver, document: dict[str, Any], urls: Any, keep: bool
) -> Any:
    async with fresh_schema(urls.database_owner_url, keep) as schema:
        prefix = f"b{uuid.uuid4().hex[:10]}"
        settings = Settings(
            nats_url=urls.nats_url, database_url=urls.database_url,
            database_owner_url=urls.database_owner_url, db_schema=schema, subject_prefix=prefix,
        )  # fmt: skip
        async with engine_on(settings, fabric=fabric) as running:
            nc = await connect_nats(urls.nats_url, name=f"bench-{name}")
            try:
                client = TrellisClient(nc, prefix=prefix, timeout=30.0)
                reply = await client.admin(DOMAIN, "import-topology", document)
                if not reply.get("ok"):
                    raise SystemExit(f"{name}: import failed: {reply}")
                sync = running.engine.fabric_sync(DOMAIN)
                assert sync is not None
                await asyncio.wait_for(sync.wait_idle(), 60)
                yield Side(name, fabric, client, sync.wait_idle)
            finally:
                await nc.close()


def figures(samples: list[float]) -> dict[str, float]:
    return {"n": len(samples), "p50_ms": percentile(samples, 50), "p99_ms": percentile(samples, 99)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.from_env()
    with MockupServer(MOCKUPS / "public-cxl-multiswitch") as server:
        reader = RedfishClient(server.url)
        document = (await discover(reader)).document
        await reader.close()
        redfish = RedfishFabric(RedfishClient(server.url))
        sim = SimulatedFabric()
        async with (
            servers(settings) as urls,
            side("simulator", sim, document, urls, args.keep) as a,
            side("redfish", redfish, document, urls, args.keep) as b,
        ):
            for warm in (a, b):  # connections, caches, the first pass: not measured
                for _ in range(3):
                    await warm.pair()
                warm.compose_ms.clear()
                warm.release_ms.clear()
            requests_before = redfish.client.requests
            started = time.perf_counter()
            done = 0
            while done < args.pairs:
                chunk = min(args.chunk, args.pairs - done)
                for s in (a, b):
                    for _ in range(chunk):
                        await s.pair()
                done += chunk
            seconds = time.perf_counter() - started
            requests = redfish.client.requests - requests_before
            # A release is answered once committed; the fabric pass unbinds right after.
            await asyncio.wait_for(asyncio.gather(a.idle(), b.idle()), 60)
            held = [await sim.snapshot(DOMAIN), await redfish.snapshot(DOMAIN)]
            if any(h.bindings or h.circuits for h in held):
                raise SystemExit(f"a fabric holds something after the last release: {held}")
    result: dict[str, Any] = {"pairs": args.pairs, "chunk": args.chunk, "seconds": seconds}
    for s in (a, b):
        result[s.name] = {"compose": figures(s.compose_ms), "release": figures(s.release_ms)}
    result["redfish_http_requests_per_pair"] = requests / args.pairs
    return result


def table(result: dict[str, Any]) -> str:
    rows = [
        "| intent | driver | n | p50 ms | p99 ms | ratio p50 | ratio p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for intent in ("compose", "release"):
        base = result["simulator"][intent]
        for name in ("simulator", "redfish"):
            f = result[name][intent]
            rows.append(
                f"| {intent} | {name} | {f['n']} | {f['p50_ms']:.1f} | {f['p99_ms']:.1f} "
                f"| {f['p50_ms'] / base['p50_ms']:.2f} | {f['p99_ms'] / base['p99_ms']:.2f} |"
            )
    per_pair = result["redfish_http_requests_per_pair"]
    rows.append("")
    rows.append(f"Redfish driver: {per_pair:.1f} HTTP requests per compose+release pair.")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200, help="measured pairs per driver")
    parser.add_argument("--chunk", type=int, default=25, help="pairs per turn")
    parser.add_argument("--keep", action="store_true", help="keep the schemas")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(bench(args))
    print(table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
