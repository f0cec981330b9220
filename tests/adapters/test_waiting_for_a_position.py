"""Read-your-writes from the domain's state: a query with `min_position` waits, bounded, for
the writer's head to include it, or answers `unavailable` (ARCHITECTURE §4). On the in-memory
log; the read models' wait is tests/integration/test_read_your_writes.py's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from integration.fabrics import expect_error, expect_ok, fabric
from memory_rig import Rig, in_memory

DOMAIN = "hall-1"
COMPOSE = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["H100"]}]}
PATIENT_S, IMPATIENT_S = 10.0, 0.2
# Queries answered from the writer's state, each with a body that looks at gpu-01, and whether
# the answer shows it composed.
QUERIES: dict[str, tuple[dict[str, Any], Any]] = {
    "free": ({"kind": "gpu"}, lambda r: "gpu-01" not in {d["id"] for d in r["devices"]}),
    "blast-radius": ({"id": "gpu-01"}, lambda r: bool(r["compositions"])),
    "topology": ({}, lambda r: bool(r["circuits"])),  # gpu-01 is reached over the OCS
}


async def _rig(read_wait: float) -> AsyncIterator[Rig]:
    async with in_memory(read_wait=read_wait) as rig:
        expect_ok(await rig.client.admin(DOMAIN, "import-topology", fabric()))
        yield rig


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    async for r in _rig(PATIENT_S):
        yield r


@pytest_asyncio.fixture
async def impatient() -> AsyncIterator[Rig]:
    async for r in _rig(IMPATIENT_S):
        yield r


@pytest.mark.parametrize("verb", sorted(QUERIES))
async def test_a_query_at_the_position_a_compose_returned_sees_the_composition(
    rig: Rig, verb: str
) -> None:
    reply = await rig.client.intent(DOMAIN, "acme", "compose", COMPOSE)
    expect_ok(reply)
    body, sees = QUERIES[verb]

    answer = await rig.client.query(DOMAIN, verb, {**body, "min_position": reply["position"]})

    assert answer["position"] >= reply["position"]
    assert sees(expect_ok(answer)), answer


async def test_a_query_ahead_of_the_log_waits_for_the_write_that_reaches_it(rig: Rig) -> None:
    head = (await rig.log.head(DOMAIN)).position
    body, sees = QUERIES["free"]
    waiting = asyncio.create_task(
        rig.client.query(DOMAIN, "free", {**body, "min_position": head + 1})
    )
    await asyncio.sleep(0.05)
    assert not waiting.done()  # asked before the compose that writes past the head

    expect_ok(await rig.client.intent(DOMAIN, "acme", "compose", COMPOSE))

    answer = await waiting
    assert answer["position"] > head
    assert sees(expect_ok(answer)), answer


@pytest.mark.parametrize("verb", [*sorted(QUERIES), "fabric"])
async def test_a_position_the_log_never_reaches_is_unavailable_and_writes_nothing(
    impatient: Rig, verb: str
) -> None:
    expect_ok(await impatient.client.intent(DOMAIN, "acme", "compose", COMPOSE))
    before = impatient.log.counts()
    head = (await impatient.log.head(DOMAIN)).position
    far = head + 1_000_000
    body = QUERIES[verb][0] if verb in QUERIES else {}

    error = expect_error(
        await impatient.client.query(DOMAIN, verb, {**body, "min_position": far}), "unavailable"
    )

    assert error["details"] == {"domain": DOMAIN, "min_position": far, "head": head}
    assert str(far) in error["message"] and DOMAIN in error["message"]
    assert impatient.log.counts() == before
