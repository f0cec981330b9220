"""What the compose saga logs when the fabric fails it, over real NATS and Postgres with the
simulated fabric: every line says why, a deadline's TimeoutError (which has no message of its
own) included."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric
from harness import Harness, serving

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.engine.core.fabric import FabricBinding

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


async def test_a_release_whose_letting_go_runs_out_of_time_says_so(
    h: Harness, sim: SimulatedFabric, caplog: pytest.LogCaptureFixture
) -> None:
    cid = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", A100))["composition_id"]
    sim.hang_next("unbind")  # the release's letting go hangs past its deadline

    def letting_go() -> list[str]:
        return [r.getMessage() for r in caplog.records if "letting go failed" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="trellis.engine.service.saga"):
        expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid}))
        for _ in range(200):  # the deadline is 0.5 s; the warning follows it
            if letting_go():
                break
            await asyncio.sleep(0.05)
    assert letting_go() == [
        f"domain {DOMAIN}: letting go failed (no answer in time); a pass retries"
    ], caplog.text


async def test_each_repair_of_the_fabric_is_one_line_and_routine_work_none(
    h: Harness, sim: SimulatedFabric, caplog: pytest.LogCaptureFixture
) -> None:
    sync = h.engine.fabric_sync(DOMAIN)
    assert sync is not None

    async def a_pass() -> None:
        sync.kick()
        await h.fabric_idle(DOMAIN)

    with caplog.at_level(logging.INFO, logger="trellis.engine.service.saga"):
        first = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", A100))
        release = {"composition_id": first["composition_id"]}
        expect_ok(await h.client.intent(DOMAIN, "acme", "release", release))
        cid = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", A100))["composition_id"]
        await a_pass()
        routine = [r.getMessage() for r in caplog.records if "repairing" in r.getMessage()]
        assert routine == []
        snapshot = await sim.snapshot(DOMAIN)
        (bound,) = snapshot.bindings
        (circuit,) = snapshot.circuits
        # Behind the engine's back: its binding and circuit taken away, a stray one made.
        await sim.unbind(DOMAIN, bound)
        await sim.remove_circuit(DOMAIN, circuit)
        stray = FabricBinding(
            host="host-01", device="gpu-01", path=["host-01", "sw-1", "ocs-1", "gpu-01"],
            composition_id="c-stray",
        )  # fmt: skip
        await sim.bind(DOMAIN, stray)
        await a_pass()
        await a_pass()  # in step: nothing more to say
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "repairing" in r.getMessage()]
    over = " > ".join(bound.path)
    prefix = f"domain {DOMAIN}: repairing the fabric: "
    assert sorted(said) == sorted(
        [
            ("WARNING", f"{prefix}removing gpu-01 bound to host-01 for c-stray over "
                        "host-01 > sw-1 > ocs-1 > gpu-01: the log does not hold it"),
            ("INFO", f"{prefix}making circuit ocs-1:0-2 again: the log holds it"),
            ("INFO", f"{prefix}making gpu-02 bound to host-01 for {cid} over {over} again: "
                     "the log holds it"),
        ]
    )  # fmt: skip
    assert await sim.snapshot(DOMAIN) == snapshot


async def test_a_repair_that_fails_names_what_it_was_in_words(
    h: Harness, sim: SimulatedFabric, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning printed the binding's Python repr (`FabricBinding(host='host-01', ...)`;
    the southbound probe)."""
    sync = h.engine.fabric_sync(DOMAIN)
    assert sync is not None
    cid = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", A100))["composition_id"]
    (bound,) = (await sim.snapshot(DOMAIN)).bindings
    await sim.unbind(DOMAIN, bound)  # behind the engine's back
    sim.fail_next("bind")
    with caplog.at_level(logging.WARNING, logger="trellis.engine.service.saga"):
        sync.kick()
        await h.fabric_idle(DOMAIN)
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    over = " > ".join(bound.path)
    assert failed and failed[0].startswith(
        f"domain {DOMAIN}: bind failed ({bound.device} bound to host-01 for {cid} over {over}): "
    ), failed
