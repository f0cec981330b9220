"""A scripted day on a small fabric, for the connection history and export tests: composes,
a replacement after a fault, a release, a fabric failure and a lease expiry, at times a
ManualClock sets."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from fabrics import expect_error, expect_ok
from harness import Harness, ManualClock, serving

from trellis.adapters.fabric.sim import SimulatedFabric

DOMAIN = "hall-1"
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def gpu(id: str, model: str, cost: float) -> dict[str, Any]:
    return {
        "id": id,
        "kind": "device",
        "device_kind": "gpu",
        "model": model,
        "generation": 8,
        "cost_per_hour": cost,
    }


FABRIC: dict[str, Any] = {
    "nodes": [
        {"id": "host-1", "kind": "host"},
        {"id": "host-2", "kind": "host"},
        {"id": "sw-a", "kind": "switch"},
        {"id": "sw-b", "kind": "switch"},
        gpu("gpu-1", "A100", 1.1),
        gpu("gpu-2", "H100", 2.5),
        gpu("gpu-3", "A100", 1.2),
        {
            "id": "mem-1",
            "kind": "device",
            "device_kind": "memory",
            "capacity_gib": 1024,
            "cost_per_hour": 0.8,
        },
    ],
    "links": [
        {"id": "l-1a", "a": "host-1", "b": "sw-a", "capacity_gbps": 400},
        {"id": "l-2a", "a": "host-2", "b": "sw-a", "capacity_gbps": 400},
        {"id": "l-1b", "a": "host-1", "b": "sw-b", "capacity_gbps": 400},
        {"id": "l-a1", "a": "sw-a", "b": "gpu-1", "capacity_gbps": 100},
        {"id": "l-a2", "a": "sw-a", "b": "gpu-2", "capacity_gbps": 100},
        {"id": "l-am", "a": "sw-a", "b": "mem-1", "capacity_gbps": 200},
        {"id": "l-b3", "a": "sw-b", "b": "gpu-3", "capacity_gbps": 100},
    ],
}


@contextlib.asynccontextmanager
async def day_served(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    clock: ManualClock,
    sim: SimulatedFabric,
) -> AsyncIterator[Harness]:
    """The engine on the test's servers, with the day's clock and fabric and FABRIC imported."""
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, clock=clock, fabric=sim
    ) as harness:
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", FABRIC))
        yield harness


async def compose(h: Harness, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    return await h.client.intent(DOMAIN, tenant, "compose", body)


async def history(h: Harness, body: dict[str, Any], view: str | None = None) -> list[Any]:
    await h.projected(DOMAIN)
    if view is None:
        reply = await h.client.query(DOMAIN, "history", body)
    else:
        reply = await h.client.view(DOMAIN, view, "history", body)
    rows: list[dict[str, Any]] = expect_ok(reply)["intervals"]
    return rows


def at(seconds: float) -> str:
    return str(msgspec.to_builtins(T0 + timedelta(seconds=seconds)))


def brief(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["device"], row["tenant"], row["start"], row["end"], row["end_reason"])


class Day(msgspec.Struct):
    acme: str
    globex: str
    failed: str


async def play(h: Harness, clock: ManualClock, sim: SimulatedFabric) -> Day:
    """acme takes an A100 at 0 s with a one-hour lease; globex an H100 and a memory slice at
    600 s; acme's A100 fails at 1800 s and is replaced by the other A100; globex releases at
    2400 s; at 3000 s a compose of initech fails in the fabric; acme's lease ends at 3600 s."""
    acme = expect_ok(
        await compose(
            h,
            "acme",
            {
                "host": "host-1",
                "devices": [{"kind": "gpu", "models": ["A100"]}],
                "lease_seconds": 3600,
            },
        )
    )
    clock.advance(600)
    globex = expect_ok(
        await compose(
            h,
            "globex",
            {
                "host": "host-2",
                "devices": [
                    {"kind": "gpu", "models": ["H100"]},
                    {"kind": "memory", "capacity_gib": 256, "bandwidth_gbps": 50},
                ],
            },
        )
    )
    clock.advance(1200)
    fault = {"component": "gpu-1", "state": "failed", "detail": "xid 79"}
    assert expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))["compositions"] == [
        acme["composition_id"]
    ]
    clock.advance(600)
    release = {"composition_id": globex["composition_id"]}
    expect_ok(await h.client.intent(DOMAIN, "globex", "release", release))
    clock.advance(600)
    sim.fail_next("bind")
    error = expect_error(
        await compose(h, "initech", {"host": "host-2", "devices": [{"kind": "gpu"}]}), "failed"
    )
    clock.advance(600)
    assert len(await h.engine.expire_due_leases()) <= 1  # the keeper's own tick may be first
    return Day(acme["composition_id"], globex["composition_id"], error["details"]["composition_id"])
