"""What the compose saga logs when the fabric fails it, over real NATS and Postgres with the
simulated fabric: every line says why, a deadline's TimeoutError (which has no message of its
own) included."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric
from harness import Harness, serving

from trellis.adapters.fabric.sim import SimulatedFabric

DOMAIN = "hall-1"
A100 = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["A100"]}]}


@pytest_asyncio.fixture
async def sim() -> SimulatedFabric:
    return SimulatedFabric(seed=7)


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, sim: SimulatedFabric
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, fabric=sim, saga_deadline=0.5
    ) as harness:
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", fabric()))
        yield harness


async def test_an_undo_that_runs_out_of_time_says_so(
    h: Harness, sim: SimulatedFabric, caplog: pytest.LogCaptureFixture
) -> None:
    sim.hang_next("bind")
    sim.hang_next("unbind")  # the undo hangs too: its deadline's TimeoutError has no message
    with caplog.at_level(logging.WARNING, logger="trellis.engine.service.saga"):
        expect_error(await h.client.intent(DOMAIN, "acme", "compose", A100), "failed")
    undoing = [r.getMessage() for r in caplog.records if "left work for later" in r.getMessage()]
    assert len(undoing) == 1, undoing
    assert undoing[0].endswith("left work for later: no answer in time"), undoing
