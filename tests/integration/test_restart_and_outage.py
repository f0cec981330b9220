"""Restarts and outages: the log is the truth, so a new engine rebuilds the same state, and an
engine whose database goes away answers `unavailable` and recovers by itself when it is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from fabrics import expect_error, expect_ok, fabric, gpu, link
from harness import Harness, serving
from isolation import Database, create_schema, unique_schema_name

from trellis.adapters.embedded.postgres_server import (
    PG_ENGINE_ROLE,
    PG_OWNER_ROLE,
    EmbeddedPostgres,
)
from trellis.engine.core.records import verify_chain

DOMAIN = "hall-1"


Sent = dict[str, tuple[str, dict[str, Any], dict[str, Any]]]


async def history(h: Harness) -> Sent:
    """Given: a domain with a bit of everything in its log; returns, by request_id, each
    intent's verb, body and reply."""
    steps: list[tuple[str, dict[str, Any]]] = [
        ("import-topology", fabric()),
        ("drain", {"id": "sw-1", "reason": "firmware"}),
        ("report-fault", {"component": "l-gpu-01", "state": "degraded", "detail": "ber"}),
        ("add-node", {"node": gpu("gpu-03", model="H200", generation=10)}),
        ("add-link", {"link": link("l-gpu-03", "gpu-03", "ocs-1", b_port=5)}),
        ("remove", {"id": "nic-01"}),
        ("report-fault", {"component": "gpu-02", "state": "failed"}),
        ("report-fault", {"component": "gpu-02", "state": "healthy"}),
        ("drain", {"id": "sw-1"}),  # a no-op: answered and stored, no event
    ]
    sent: Sent = {}
    for i, (verb, body) in enumerate(steps):
        rid = f"step-{i}"
        body = {"request_id": rid, **body}
        sent[rid] = (verb, body, await h.client.admin(DOMAIN, verb, body))
        expect_ok(sent[rid][2])
    return sent


async def test_a_restarted_engine_rebuilds_the_same_state_and_still_replays_old_answers(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    # Given: an engine that took a series of intents, then stopped.
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        sent = await history(h)
        before = await h.client.query(DOMAIN, "topology")
        head = await h.store.head(DOMAIN)

    # When: a new engine starts on the same schema.
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        # Then: the same state, at the same position, before anybody asked about the domain...
        assert h.engine.domains == [DOMAIN]
        assert await h.client.query(DOMAIN, "topology") == before
        # ...old request ids still get their first answers...
        for verb, body, first in sent.values():
            assert await h.client.admin(DOMAIN, verb, body) == {**first, "replayed": True}
        # ...and new intents continue the same stream.
        reply = await h.client.admin(DOMAIN, "undrain", {"id": "sw-1"})
        assert expect_ok(reply)["changed"] is True
        events = [e async for e in h.store.read(DOMAIN)]
        assert [e.version for e in events] == list(range(1, head.version + 2))
        assert events[-1].position == reply["position"] > head.position
        assert verify_chain(events) is None


# ---- Postgres goes away mid-run ----


async def fresh_schema(server: EmbeddedPostgres) -> str:
    name = unique_schema_name()
    await create_schema(Database(server.url, server.owner_url, PG_ENGINE_ROLE, PG_OWNER_ROLE), name)
    return name


async def log_rows(url: str, schema: str) -> tuple[list[str], list[str]]:
    """(event causation ids in version order, stored request ids)."""
    conn = await asyncpg.connect(url, server_settings={"search_path": schema})
    try:
        events = await conn.fetch(
            "SELECT causation_id FROM trellis_events WHERE domain = $1 ORDER BY version", DOMAIN
        )
        stored = await conn.fetch("SELECT request_id FROM trellis_requests ORDER BY position")
    finally:
        await conn.close()
    return [r[0] for r in events], [r[0] for r in stored]


async def until_ok(h: Harness, deadline_s: float) -> tuple[dict[str, Any], int]:
    """Poll with a harmless intent until the engine commits again; (reply, attempts)."""
    deadline = time.monotonic() + deadline_s
    attempts = 0
    while True:
        attempts += 1
        reply = await h.client.admin(
            DOMAIN, "drain", {"request_id": f"poll-{attempts}", "id": "l-nic"}
        )
        if reply["ok"]:
            return reply, attempts
        expect_error(reply, "unavailable")
        assert time.monotonic() < deadline, f"engine did not recover within {deadline_s}s: {reply}"
        await asyncio.sleep(0.1)


async def test_a_postgres_restart_gives_unavailable_then_the_engine_recovers_by_itself(
    nats_url: str, subject_prefix: str, own_postgres: EmbeddedPostgres
) -> None:
    url = own_postgres.url
    schema = await fresh_schema(own_postgres)
    async with serving(nats_url, url, schema, subject_prefix) as h:
        # Given: a serving engine with an imported fabric.
        expect_ok(
            await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp", **fabric()})
        )

        # When: Postgres stops, and an intent arrives.
        await asyncio.to_thread(own_postgres.stop)
        lost = {"request_id": "during-outage", "node": gpu("gpu-07")}
        started = time.monotonic()
        reply = await h.client.admin(DOMAIN, "add-node", lost)
        took = time.monotonic() - started

        # Then: a prompt `unavailable` (well within the client's timeout); reads still answer.
        assert "unavailable" in expect_error(reply, "unavailable")["message"]
        assert took < 5, f"`unavailable` took {took:.1f}s"
        topo = expect_ok(await h.client.query(DOMAIN, "topology"))
        assert "gpu-07" not in {n["id"] for n in topo["nodes"]}

        # When: Postgres comes back on the same port with the same data.
        await asyncio.to_thread(own_postgres.start)
        # Then: nothing of the refused intent was written...
        assert await log_rows(url, schema) == (["imp"], ["imp"])
        # ...the same engine commits again without a restart...
        polled, attempts = await until_ok(h, deadline_s=20)
        assert expect_ok(polled)["changed"] is True
        # ...and the intent that got `unavailable` succeeds on its first real execution.
        retried = await h.client.admin(DOMAIN, "add-node", lost)
        assert expect_ok(retried)["component"] == "gpu-07"
        assert retried["replayed"] is False

        events = [e async for e in h.store.read(DOMAIN)]
        assert [e.version for e in events] == [1, 2, 3]
        assert [e.causation_id for e in events] == ["imp", f"poll-{attempts}", "during-outage"]
        assert verify_chain(events) is None
        topo = expect_ok(await h.client.query(DOMAIN, "topology"))
        assert "gpu-07" in {n["id"] for n in topo["nodes"]}
        assert await h.client.admin(DOMAIN, "add-node", lost) == {**retried, "replayed": True}


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (the postmaster and its backends), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


async def test_a_hung_postgres_gives_unavailable_within_the_client_timeout(
    nats_url: str, subject_prefix: str, own_postgres: EmbeddedPostgres
) -> None:
    url = own_postgres.url
    schema = await fresh_schema(own_postgres)
    async with serving(nats_url, url, schema, subject_prefix) as h:
        expect_ok(
            await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp", **fabric()})
        )
        assert own_postgres.pid is not None
        frozen = process_tree(own_postgres.pid)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)  # a network partition, seen from the engine
        try:
            started = time.monotonic()
            try:
                reply = await h.client.admin(DOMAIN, "drain", {"request_id": "hung", "id": "sw-1"})
            except TimeoutError:
                pytest.fail(f"no answer within the client's {h.client.timeout}s timeout")
            took = time.monotonic() - started
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        expect_error(reply, "unavailable")
        assert took < h.client.timeout
