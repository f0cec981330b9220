"""Redfish service benchmark (issue 23): a compose and a release through the northbound Redfish
service (`POST /redfish/v1/Systems`, `DELETE /redfish/v1/Systems/<id>`) against the same
compose and release sent over NATS by a client of the wire contract, in one run, on one engine.

- One engine (`adapters.bootstrap.engine_on`: Postgres log, projections, NATS intake, the
  simulated fabric) with the Redfish service on a free loopback port; examples/fabric.json.
- nats: TrellisClient sends `compose` {host-01, device_ids [gpu-002]} then `release`.
- redfish: an Operator account of the same tenant, logged in once (a session token: Basic
  auth would add one scrypt hash per request, by design), POSTs the same specific composition
  (host-01 and gpu-002 blocks) and DELETEs the system at its Location. The POST's answer is
  the composed system, read back from the projections at the compose's position, as every
  client of the service gets it.
- Serially, pair after pair; the two take turns in chunks of `--chunk` pairs (ABAB...), so
  drift on a shared machine falls on both alike. p50 / p99 of each round trip, Redfish as a
  ratio to NATS. Every answer is checked. The last line printed is one JSON object.

    python bench/redfish_service.py            # ~1 minute on 2 cores
    python bench/redfish_service.py --pairs 40 # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.intents import fresh_schema, percentile, servers  # noqa: E402  (the root on the path)
from trellis.adapters.bootstrap import engine_on  # noqa: E402
from trellis.adapters.http.redfish.serve import RedfishOptions  # noqa: E402
from trellis.adapters.nats.client import TrellisClient  # noqa: E402
from trellis.adapters.nats.connect import connect_nats  # noqa: E402
from trellis.adapters.settings import Settings  # noqa: E402

DOMAIN = "hall-1"
TENANT = "bench"
FABRIC = json.loads((ROOT / "examples" / "fabric.json").read_text())
BLOCKS = "/redfish/v1/CompositionService/ResourceBlocks"
POST_BODY = {
    "Links": {
        "ResourceBlocks": [
            {"@odata.id": f"{BLOCKS}/{DOMAIN}.host-01"},
            {"@odata.id": f"{BLOCKS}/{DOMAIN}.gpu-002"},
        ]
    }
}


async def http(
    url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """One request on a fresh connection (the service closes after each answer)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(data)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    raw = await reader.read()
    writer.close()
    top, _, payload = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    got = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, got, json.loads(payload) if payload else None


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.from_env()
    nats_ms: dict[str, list[float]] = {"compose": [], "release": []}
    redfish_ms: dict[str, list[float]] = {"compose": [], "release": []}
    with tempfile.TemporaryDirectory(prefix="trellis-bench-redfish-") as tmp:
        options = RedfishOptions(
            accounts=Path(tmp) / "accounts.json", admin_password="bench-admin-password"
        )
        async with (
            servers(settings) as urls,
            fresh_schema(urls.database_owner_url, args.keep) as schema,
        ):
            prefix = f"b{uuid.uuid4().hex[:10]}"
            served = Settings(
                nats_url=urls.nats_url,
                database_url=urls.database_url,
                database_owner_url=urls.database_owner_url,
                db_schema=schema,
                subject_prefix=prefix,
            )
            async with engine_on(served, redfish=options) as running:
                nc = await connect_nats(urls.nats_url, name="bench-redfish")
                client = TrellisClient(nc, prefix=prefix, timeout=30.0)
                try:
                    reply = await client.admin(DOMAIN, "import-topology", FABRIC)
                    assert reply.get("ok"), reply
                    url = str(running.redfish_url)
                    token = await login(url)

                    async def over_nats() -> None:
                        t0 = time.perf_counter()
                        reply = await client.intent(
                            DOMAIN, TENANT, "compose",
                            {"host": "host-01", "device_ids": ["gpu-002"]},
                        )  # fmt: skip
                        t1 = time.perf_counter()
                        if not reply.get("ok") or reply["result"]["state"] != "active":
                            raise SystemExit(f"nats compose failed: {reply}")
                        cid = reply["result"]["composition_id"]
                        reply = await client.intent(
                            DOMAIN, TENANT, "release", {"composition_id": cid}
                        )
                        t2 = time.perf_counter()
                        if not reply.get("ok"):
                            raise SystemExit(f"nats release failed: {reply}")
                        nats_ms["compose"].append((t1 - t0) * 1000)
                        nats_ms["release"].append((t2 - t1) * 1000)

                    async def over_redfish() -> None:
                        auth = {"X-Auth-Token": token, "Content-Type": "application/json"}
                        t0 = time.perf_counter()
                        status, headers, body = await http(
                            url, "POST", "/redfish/v1/Systems", POST_BODY, auth
                        )
                        t1 = time.perf_counter()
                        if status != 201:
                            raise SystemExit(f"redfish compose failed: {status} {body}")
                        status, _, body = await http(url, "DELETE", headers["location"], None, auth)
                        t2 = time.perf_counter()
                        if status != 204:
                            raise SystemExit(f"redfish release failed: {status} {body}")
                        redfish_ms["compose"].append((t1 - t0) * 1000)
                        redfish_ms["release"].append((t2 - t1) * 1000)

                    for warm in (over_nats, over_redfish):  # not measured
                        for _ in range(3):
                            await warm()
                    for samples in (*nats_ms.values(), *redfish_ms.values()):
                        samples.clear()
                    done = 0
                    while done < args.pairs:
                        chunk = min(args.chunk, args.pairs - done)
                        for run in (over_nats, over_redfish):
                            for _ in range(chunk):
                                await run()
                        done += chunk
                finally:
                    await nc.close()
    result: dict[str, Any] = {"pairs": args.pairs, "chunk": args.chunk}
    for name, by_intent in (("nats", nats_ms), ("redfish", redfish_ms)):
        result[name] = {
            intent: {
                "n": len(values),
                "p50_ms": percentile(values, 50),
                "p99_ms": percentile(values, 99),
            }
            for intent, values in by_intent.items()
        }
    return result


async def login(url: str) -> str:
    status, _, _ = await http(
        url, "POST", "/redfish/v1/AccountService/Accounts",
        {"UserName": "bench", "Password": "bench-password", "RoleId": "Operator",
         "Oem": {"Trellis": {"Tenant": TENANT}}},
        {"Authorization": "Basic " + _basic("admin", "bench-admin-password"),
         "Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 201, status
    status, headers, _ = await http(
        url, "POST", "/redfish/v1/SessionService/Sessions",
        {"UserName": "bench", "Password": "bench-password"},
        {"Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 201, status
    return headers["x-auth-token"]


def _basic(user: str, password: str) -> str:
    import base64

    return base64.b64encode(f"{user}:{password}".encode()).decode()


def table(result: dict[str, Any]) -> str:
    rows = [
        "| intent | via | n | p50 ms | p99 ms | ratio p50 | ratio p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for intent in ("compose", "release"):
        base = result["nats"][intent]
        for name in ("nats", "redfish"):
            f = result[name][intent]
            rows.append(
                f"| {intent} | {name} | {f['n']} | {f['p50_ms']:.1f} | {f['p99_ms']:.1f} "
                f"| {f['p50_ms'] / base['p50_ms']:.2f} | {f['p99_ms'] / base['p99_ms']:.2f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200, help="measured pairs per path")
    parser.add_argument("--chunk", type=int, default=25, help="pairs per turn")
    parser.add_argument("--keep", action="store_true", help="keep the schema")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(bench(args))
    print(table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
