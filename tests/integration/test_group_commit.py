"""Group commit: intents that arrive together share one transaction, and nobody hears back
before their event is committed (ARCHITECTURE §2 and §6)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric, gpu
from harness import Harness, serving

from trellis.engine.core.records import verify_chain

DOMAIN = "hall-1"
N = 200


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest_asyncio.fixture
async def pool(database_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Pool]:
    """Connections of the test's own, to look at the log while replies come in."""
    async with asyncpg.create_pool(
        database_url, min_size=16, max_size=16, server_settings={"search_path": pg_schema}
    ) as p:
        yield p


async def test_concurrent_intents_are_committed_in_batches_and_answered_after_commit(
    h: Harness, pool: asyncpg.Pool
) -> None:
    # Given: an imported fabric.
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    unseen: list[int] = []

    async def add(i: int) -> dict[str, Any]:
        reply = await h.client.admin(
            DOMAIN, "add-node", {"request_id": f"add-{i}", "node": gpu(f"gpu-n{i:03}")}
        )
        # The moment the reply is here, its event must be visible to anybody.
        if reply.get("ok"):
            seen = await pool.fetchval(
                "SELECT count(*) FROM trellis_events WHERE position = $1", reply["position"]
            )
            if seen != 1:
                unseen.append(i)
        return reply

    # When: N add-node intents are in flight together.
    replies = await asyncio.gather(*(add(i) for i in range(N)))

    # Then: all ok, each with its own position, and each visible when its reply arrived.
    for reply in replies:
        expect_ok(reply)
    assert unseen == []
    positions = [r["position"] for r in replies]
    assert len(set(positions)) == N
    rows = await pool.fetch(
        "SELECT version, position, causation_id, xmin::text::bigint AS tx FROM trellis_events "
        "WHERE domain = $1 ORDER BY version",
        DOMAIN,
    )
    assert [r["version"] for r in rows] == list(range(1, N + 2))
    assert [r["position"] for r in rows] == sorted(r["position"] for r in rows)
    by_request = {r["causation_id"]: r["position"] for r in rows[1:]}
    assert by_request == {f"add-{i}": positions[i] for i in range(N)}
    transactions = {r["tx"] for r in rows[1:]}
    assert len(transactions) < N, "every intent had a transaction of its own: no batching"
    assert await pool.fetchval("SELECT count(*) FROM trellis_requests") == N + 1
    assert verify_chain([e async for e in h.store.read(DOMAIN)]) is None


async def test_rejections_inside_a_batch_do_not_spoil_the_others(
    h: Harness, pool: asyncpg.Pool
) -> None:
    # Given: an imported fabric.
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))

    # When: good intents, intents for existing ids and pairs racing for one new id arrive together.
    good = [{"node": gpu(f"gpu-g{i:02}")} for i in range(40)]
    taken = [{"node": gpu("gpu-01")} for _ in range(40)]
    racing = [{"node": gpu(f"gpu-r{i % 10}")} for i in range(40)]  # four requests per id
    bodies = [body for trio in zip(good, taken, racing, strict=True) for body in trio]
    replies = await asyncio.gather(*(h.client.admin(DOMAIN, "add-node", b) for b in bodies))

    # Then: each new id was added exactly once, by exactly one request; the rest are conflicts.
    winners: dict[str, int] = {}
    for body, reply in zip(bodies, replies, strict=True):
        node = body["node"]["id"]
        if reply["ok"]:
            assert node not in winners, f"{node} was added twice"
            winners[node] = reply["position"]
        else:
            assert node in {"gpu-01"} | {f"gpu-r{i}" for i in range(10)}, reply
            expect_error(reply, "conflict")
    assert set(winners) == {b["node"]["id"] for b in good + racing}
    added = await pool.fetch(
        "SELECT data->'node'->>'id' AS node, position FROM trellis_events "
        "WHERE domain = $1 AND type = 'NodeAdded'",
        DOMAIN,
    )
    assert {r["node"]: r["position"] for r in added} == winners
