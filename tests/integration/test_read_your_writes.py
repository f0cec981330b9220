"""Read-your-writes: every query takes `min_position` (ARCHITECTURE §4) and waits, bounded, for
the domain's log (and its read models) to include it, or answers `unavailable`.

Issue 13 item 1, over a real engine on real NATS and Postgres, for the queries the read models
(the projections in PostgreSQL) answer; those answered from the writer's state wait the same
way on the in-memory log (tests/adapters/test_waiting_for_a_position.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric, row_counts
from harness import Harness, serving

DOMAIN = "hall-1"
COMPOSE = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["H100"]}]}
# Long enough for a commit on a loaded machine; the "never reached" case waits far less.
PATIENT_S, IMPATIENT_S = 10.0, 0.2


async def _serving(
    nats_url: str, database_url: str, schema: str, prefix: str, read_wait: float
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, schema, prefix, read_wait=read_wait) as harness:
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", fabric()))
        yield harness


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async for harness in _serving(nats_url, database_url, pg_schema, subject_prefix, PATIENT_S):
        yield harness


@pytest_asyncio.fixture
async def impatient(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async for harness in _serving(nats_url, database_url, pg_schema, subject_prefix, IMPATIENT_S):
        yield harness


def sees(verb: str, result: dict[str, Any], cid: str) -> bool:
    """Whether a query's result shows composition `cid` (holding gpu-01)."""
    match verb:
        case "composition":
            return bool(result["composition_id"] == cid and result["state"] == "active")
        case "connections":
            return any(row["composition_id"] == cid for row in result["connections"])
        case "why":
            return "CompositionActivated" in {link["type"] for link in result["chain"]}
        case "history":
            return any(i["composition_id"] == cid for i in result["intervals"])
    raise AssertionError(verb)


QUERIES = {
    "composition": lambda cid: {"id": cid},
    "connections": lambda cid: {"device": "gpu-01"},
    "why": lambda cid: {"id": cid},
    "history": lambda cid: {"id": "gpu-01"},
}


@pytest.mark.parametrize("verb", sorted(QUERIES))
async def test_a_query_at_the_position_a_compose_returned_sees_the_composition(
    h: Harness, verb: str
) -> None:
    reply = await h.client.intent(DOMAIN, "acme", "compose", COMPOSE)
    cid = expect_ok(reply)["composition_id"]

    answer = await h.client.query(
        DOMAIN, verb, {**QUERIES[verb](cid), "min_position": reply["position"]}
    )

    assert answer["position"] >= reply["position"]
    assert sees(verb, expect_ok(answer), cid)


async def test_a_query_ahead_of_the_log_waits_for_the_write_that_reaches_it(h: Harness) -> None:
    head = (await h.store.head(DOMAIN)).position
    # Asked before the compose that writes past the head, of the read models: it answers once
    # the compose is in.
    waiting = [
        asyncio.create_task(
            h.client.query(DOMAIN, verb, {**QUERIES[verb](""), "min_position": head + 1})
        )
        for verb in ("connections",)
    ]
    reply = await h.client.intent(DOMAIN, "acme", "compose", COMPOSE)
    cid = expect_ok(reply)["composition_id"]

    for verb, task in zip(("connections",), waiting, strict=True):
        answer = await task
        assert answer["position"] > head
        assert sees(verb, expect_ok(answer), cid), answer


@pytest.mark.parametrize("verb", [*sorted(QUERIES), "checkpoint-key"])
async def test_a_position_the_log_never_reaches_is_unavailable_and_writes_nothing(
    impatient: Harness, database_url: str, pg_schema: str, verb: str
) -> None:
    reply = await impatient.client.intent(DOMAIN, "acme", "compose", COMPOSE)
    cid = expect_ok(reply)["composition_id"]
    before = await row_counts(database_url, pg_schema)
    head = (await impatient.store.head(DOMAIN)).position
    far = head + 1_000_000
    body = QUERIES[verb](cid) if verb in QUERIES else {}

    error = expect_error(
        await impatient.client.query(DOMAIN, verb, {**body, "min_position": far}), "unavailable"
    )

    assert error["details"] == {"domain": DOMAIN, "min_position": far, "head": head}
    assert str(far) in error["message"] and DOMAIN in error["message"]
    assert await row_counts(database_url, pg_schema) == before


async def test_a_position_another_domain_was_given_is_one_an_idle_domain_includes(
    impatient: Harness,
) -> None:
    """Positions are global, and a scheduler passes a condition's `observed_position` as
    `min_position` whatever the domain (docs/integrations.md): an idle domain's log includes
    every position the log has given out. It was `unavailable` (scheduler-author probe)."""
    reply = await impatient.client.intent(DOMAIN, "acme", "compose", COMPOSE)
    cid = expect_ok(reply)["composition_id"]
    elsewhere = await impatient.client.admin("hall-2", "import-topology", fabric())
    later = expect_ok(elsewhere) and elsewhere["position"]
    head = (await impatient.store.head(DOMAIN)).position
    assert later > head

    answer = await impatient.client.query(DOMAIN, "composition", {"id": cid, "min_position": later})

    assert expect_ok(answer)["composition_id"] == cid and answer["position"] == head
