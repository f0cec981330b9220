"""Many clients composing and releasing at once, as an outside load test drives the engine.

Served one at a time these intents all work. Served together they once collapsed the engine:
a fabric pass that had read the state before a saga settled started a second saga for the
same composition, which then ran for a composition already released (a KeyError per saga),
and compose replies waited out their timeout for settlements that never came.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from fabrics import expect_ok, hall
from harness import Harness, serving

from trellis.adapters.fabric.sim import SimulatedFabric

DOMAIN = "hall"
TENANTS = [f"tenant-{i}" for i in range(8)]
CLIENTS = 32
ROUNDS = 4


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[Harness]:
    # As `trellis up` runs it: the simulated hardware on disk, so every fabric call takes a
    # write and an fsync, and passes and sagas overlap as they do on real hardware.
    sim = SimulatedFabric(seed=3, state_file=tmp_path / "fabric-sim.json")
    async with serving(nats_url, database_url, pg_schema, subject_prefix, fabric=sim) as harness:
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", hall()))
        yield harness


async def _client(h: Harness, number: int, answers: list[str]) -> None:
    rng = random.Random(number)
    tenant = TENANTS[number % len(TENANTS)]
    for _ in range(ROUNDS):
        body: dict[str, Any] = {
            "host": f"r{rng.randrange(8)}-h{rng.randrange(4)}",
            "devices": [{"kind": "gpu", "count": rng.choice([1, 2]), "bandwidth_gbps": 8}],
        }
        reply = await h.client.intent(DOMAIN, tenant, "compose", body)
        if not reply["ok"]:
            answers.append(reply["error"]["code"])
            continue
        answers.append(reply["result"]["state"])
        cid = reply["result"]["composition_id"]
        released = await h.client.intent(DOMAIN, tenant, "release", {"composition_id": cid})
        answers.append("released" if released["ok"] else released["error"]["code"])


async def test_concurrent_composes_all_settle_and_release(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="engine")
    answers: list[str] = []
    await asyncio.gather(*(_client(h, n, answers) for n in range(CLIENTS)))

    # Every compose was answered with a settlement (no timeouts, nothing left unavailable),
    # and every composition it made was released again.
    composed = answers.count("active")
    assert composed > 0
    assert set(answers) <= {"active", "released", "no_capacity", "no_path"}, answers
    assert answers.count("released") == composed
    saga_errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not saga_errors, [r.getMessage() for r in saga_errors[:5]]
    await h.fabric_idle(DOMAIN, timeout=10)
    state = h.engine.state(DOMAIN)
    assert state is not None
    assert not state.compositions and not state.device_owner and not state.reserved_gbps
    held = await h.fabric.snapshot(DOMAIN)
    assert not held.bindings and not held.circuits
