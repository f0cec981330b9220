"""A snapshot is used only when the deployment's checkpoint key vouches for it (docs/auditing.md,
engine/service/snapshots.py): one whose body was altered so that it still decodes, one from
before seals, or one sealed by another key is skipped with one warning, and every answer is the
one the log alone gives. A sealed one is used: the fold reads only the events after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from fabrics import expect_ok
from harness import CountingLog, Harness, ManualClock, serving

from trellis.adapters.postgres.snapshots import PostgresSnapshots
from trellis.engine.core.checkpoints import Signer
from trellis.engine.core.records import Head
from trellis.engine.service.snapshots import state_at
from trellis.engine.service.writer import DomainWriter
from trellis.projections.past import fold_past
from trellis.projections.sink import default_projections

DOMAIN = "hall-1"
FABRIC = json.loads((Path(__file__).parents[2] / "examples" / "fabric.json").read_text())
SNAPSHOT_EVERY = 4
NOT_OURS = " with this deployment's checkpoint key: altered, or sealed under another key"

# What the brief's superuser ran: the value after the first "rack" key (msgpack: the key, then
# a 2-byte string's header, then "r1") becomes "r9", and the body still decodes.
FORGE_RACK = (
    "UPDATE trellis_snapshots SET body = overlay(body placing convert_to('r9', 'UTF8') "
    "from (position(convert_to('rack', 'UTF8') in body) + 5) for 2) WHERE kind = $1"
)
FORGE_MODEL = (
    "UPDATE trellis_snapshots SET body = "
    "overlay(body placing convert_to('H900', 'UTF8') from position(convert_to('H100', 'UTF8') "
    "in body) for 4) WHERE position(convert_to('H100', 'UTF8') in body) > 0"
)


@pytest.fixture
def signer() -> Signer:
    return Signer.generate()


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, signer: Signer
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        clock=ManualClock(),
        snapshot_every=SNAPSHOT_EVERY,
        signer=signer,
    ) as harness:
        yield harness


async def a_day(h: Harness, pool: asyncpg.Pool) -> Head:
    """Composes and a release, until both kinds of snapshot are taken; the log's head."""
    expect_ok(await h.client.admin(DOMAIN, "import-topology", FABRIC))
    cids = []
    for tenant, host in [("acme", "host-01"), ("globex", "host-02"), ("acme", "host-01")]:
        body = {"host": host, "devices": [{"kind": "gpu", "count": 1}]}
        reply = expect_ok(await h.client.intent(DOMAIN, tenant, "compose", body))
        cids.append((tenant, reply["composition_id"]))
    tenant, cid = cids[0]
    expect_ok(await h.client.intent(DOMAIN, tenant, "release", {"composition_id": cid}))
    await h.projected(DOMAIN)
    head = await h.store.head(DOMAIN)
    # The writer saves its state snapshots in the background.
    for _ in range(200):
        kinds = await pool.fetch(
            "SELECT kind, count(*) AS n FROM trellis_snapshots "
            "WHERE signature IS NOT NULL GROUP BY kind"
        )
        if {r["kind"] for r in kinds} == {"state", "read_models"}:
            break
        await asyncio.sleep(0.05)
    assert {r["kind"] for r in kinds} == {"state", "read_models"}, kinds
    return head


async def answers(h: Harness, at: int) -> dict[str, Any]:
    asked = {
        "topology": ("topology", {}),
        "free": ("free", {"kind": "gpu"}),
        "connections": ("connections", {}),
        "why": ("why", {"id": "host-02"}),
    }
    return {
        name: expect_ok(await h.client.query(DOMAIN, what, {**body, "at": at}))
        for name, (what, body) in asked.items()
    }


def host_01_rack(topology: dict[str, Any]) -> str:
    return next(n for n in topology["nodes"] if n["id"] == "host-01")["labels"]["rack"]


async def test_an_altered_snapshot_is_not_trusted_and_answers_come_from_the_log(
    h: Harness, pool: asyncpg.Pool, signer: Signer, caplog: pytest.LogCaptureFixture
) -> None:
    head = await a_day(h, pool)
    # A moment in the past (at the head, the live state answers, no fold).
    body = {"host": "host-02", "devices": [{"kind": "gpu", "count": 1}]}
    expect_ok(await h.client.intent(DOMAIN, "globex", "compose", body))
    sealed = await answers(h, head.position)
    assert host_01_rack(sealed["topology"]) == "r1"

    caplog.set_level(logging.WARNING)
    await pool.execute(FORGE_RACK, "state")
    forged = await pool.execute(FORGE_MODEL)
    assert forged != "UPDATE 0"
    # The forgery decodes: without the seal it would be believed.
    body = await pool.fetchval(
        "SELECT body FROM trellis_snapshots WHERE kind = 'state' ORDER BY version DESC LIMIT 1"
    )
    assert b"r9" in body and b"H900" in body
    first, again = await answers(h, head.position), await answers(h, head.position)
    assert first == again == sealed
    assert host_01_rack(first["topology"]) == "r1"
    assert "H900" not in json.dumps(first)

    # Warned once per altered snapshot, however often it is passed over.
    newest = await pool.fetchval(
        "SELECT max(version) FROM trellis_snapshots WHERE kind = 'state' AND version <= $1",
        head.version,
    )
    line = f"state snapshot of {DOMAIN} at version {newest} ignored: its seal does not verify"
    assert [r.getMessage() for r in caplog.records].count(line + NOT_OURS) == 1, caplog.text

    # The same answers as with no snapshot at all.
    await pool.execute("DELETE FROM trellis_snapshots")
    assert await answers(h, head.position) == sealed


async def test_a_sealed_snapshot_is_used_and_an_altered_one_is_not(
    h: Harness, pool: asyncpg.Pool, signer: Signer
) -> None:
    head = await a_day(h, pool)
    snaps = PostgresSnapshots(pool, signer)
    newest = await pool.fetchval(
        "SELECT max(version) FROM trellis_snapshots WHERE kind = 'state' AND version <= $1",
        head.version,
    )
    full = CountingLog(h.store)
    from_log = await state_at(full, None, DOMAIN, head)
    used = CountingLog(h.store)
    assert await state_at(used, snaps, DOMAIN, head) == from_log
    assert used.read_events == head.version - newest < full.read_events == head.version

    await pool.execute(FORGE_RACK, "state")
    forged = CountingLog(h.store)
    assert await state_at(forged, snaps, DOMAIN, head) == from_log
    assert forged.read_events == head.version  # every snapshot altered: the whole log

    # An engine starting from the altered snapshots folds the log instead.
    starting = CountingLog(h.store)
    writer = DomainWriter(DOMAIN, starting, ManualClock(), 1, snapshots=snaps)  # type: ignore[arg-type]
    await writer.catch_up()
    assert writer.state == h.engine.state(DOMAIN) and writer.head == head
    assert starting.read_events == head.version


async def test_read_model_snapshots_are_sealed_too(
    h: Harness, pool: asyncpg.Pool, signer: Signer
) -> None:
    head = await a_day(h, pool)
    snaps = PostgresSnapshots(pool, signer)
    projections = default_projections()
    used = CountingLog(h.store)
    honest = await fold_past(pool, used, snaps, projections, DOMAIN, head)
    assert honest.since > 0 and used.read_events < head.version

    await pool.execute(FORGE_MODEL)
    forged = CountingLog(h.store)
    reader = await fold_past(pool, forged, snaps, projections, DOMAIN, head)
    assert reader.since == 0 and forged.read_events == head.version
    assert reader.memory.rows("proj_connections") == honest.memory.rows("proj_connections")


@pytest.mark.parametrize("how", ["unsealed", "another key"])
async def test_a_snapshot_without_this_deployments_seal_is_skipped(
    h: Harness,
    pool: asyncpg.Pool,
    signer: Signer,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    head = await a_day(h, pool)
    if how == "unsealed":  # as every row written before schema/019
        await pool.execute("UPDATE trellis_snapshots SET signature = NULL")
        reader, why = PostgresSnapshots(pool, signer), "it is not sealed"
    else:  # another deployment's key, or a key of an earlier run only
        reader, why = PostgresSnapshots(pool, Signer.generate()), "sealed under another key"
    caplog.set_level(logging.WARNING)
    full = CountingLog(h.store)
    assert await state_at(full, reader, DOMAIN, head) == await state_at(h.store, None, DOMAIN, head)
    assert full.read_events == head.version
    said = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    count = await pool.fetchval("SELECT count(*) FROM trellis_snapshots WHERE kind = 'state'")
    assert len(said) == count
    await state_at(h.store, reader, DOMAIN, head)  # again: no new warning
    assert len([r for r in caplog.records if why in r.getMessage()]) == count
