"""An export appends only to the chain it holds (adapters/postgres/export.py): when the log's
tail was replaced after an export (a failover to a standby that lacked it: the engine then
writes other events under the same versions), the next export into that directory refuses the
domain, names the exported head and what the log holds now, and writes nothing, where it used
to append the fork (two different events for one version). Real NATS and Postgres, the day of
history_day.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pyarrow.parquet as pq
import pytest_asyncio
from fabrics import expect_ok
from harness import Harness, ManualClock, cli_env, run_cli
from history_day import DOMAIN, T0, day_served, play
from lost_tail import lose_tail

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.postgres.export import MANIFEST, export_parquet

LOST = 2  # events of the exported tail the failover loses


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    clock, sim = ManualClock(T0), SimulatedFabric(seed=3)
    async with day_served(nats_url, database_url, pg_schema, subject_prefix, clock, sim) as h:
        await play(h, clock, sim)
        await h.projected(DOMAIN)
        yield h


async def lose_the_tail(h: Harness, owner_url: str, pg_schema: str, versions: int) -> None:
    """The domain's last `versions` events lost, as on a standby that lacked them."""
    head = await h.store.head(DOMAIN)
    await lose_tail(owner_url, pg_schema, DOMAIN, head.version - versions)


async def write_past_the_lost_tail(h: Harness) -> None:
    """The engine goes on writing on the log as it stands: more events than were lost, so the
    versions the export holds are taken by other events, at higher positions."""
    for component in ("gpu-3", "mem-1", "gpu-2"):
        fault = {"component": component, "state": "degraded", "detail": "ecc"}
        expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))
    await h.projected(DOMAIN)


def chain_head(out: Path, file: str) -> tuple[int, str]:
    """The chain head an export's file says it ends at (its key-value metadata)."""
    meta = pq.read_schema(out / file).metadata
    return int(meta[b"trellis.chain_head_version"]), meta[b"trellis.chain_head_hash"].decode()


def listing(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


async def test_an_export_refuses_a_log_whose_exported_tail_was_replaced(
    h: Harness, pool: asyncpg.Pool, owner_url: str, pg_schema: str, tmp_path: Path
) -> None:
    (first,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])
    exported_head, exported_hash = chain_head(tmp_path, first.files[0])
    await lose_the_tail(h, owner_url, pg_schema, LOST)
    await write_past_the_lost_tail(h)
    replaced = await pool.fetchrow(
        "SELECT position, hash FROM trellis_events WHERE domain = $1 AND version = $2",
        DOMAIN,
        exported_head,
    )
    assert replaced["hash"] != exported_hash  # the fork the export must not take
    before = listing(tmp_path)

    (again,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])

    assert listing(tmp_path) == before  # no file, no manifest change
    assert again.events == 0 and again.files == []
    assert again.diverged == (
        f"{DOMAIN}: the export ends at version {exported_head} (position {first.last_position},"
        f" hash {exported_hash[:16]}…), but the log's version {exported_head} is another"
        f" event (position {replaced['position']}, hash {replaced['hash'][:16]}…)"
    )

    # A manifest written before it recorded the chain head: the files' metadata says it.
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    for entry in manifest["domains"][DOMAIN]["exports"]:
        del entry["chain_head_version"], entry["chain_head_hash"]
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    (old,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])
    assert old.diverged == again.diverged and old.files == []


async def test_an_export_refuses_a_log_that_lost_the_exported_tail_before_anything_new(
    h: Harness, pool: asyncpg.Pool, owner_url: str, pg_schema: str, tmp_path: Path
) -> None:
    (first,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])
    exported_head, _ = chain_head(tmp_path, first.files[0])
    await lose_the_tail(h, owner_url, pg_schema, LOST)
    kept = await pool.fetchrow(
        "SELECT version, position FROM trellis_streams WHERE domain = $1", DOMAIN
    )

    before = listing(tmp_path)

    (again,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])

    # Nothing new to export, but the export holds versions the log does not: said, not
    # "nothing new".
    assert listing(tmp_path) == before
    assert again.diverged is not None and again.diverged.endswith(
        f"but the log holds no version {exported_head}: it ends at version"
        f" {kept['version']} (position {kept['position']})"
    )


async def test_the_cli_refuses_the_forked_domain_and_exits_1(
    h: Harness,
    owner_url: str,
    database_url: str,
    pg_schema: str,
    nats_url: str,
    subject_prefix: str,
    tmp_path: Path,
) -> None:
    env = cli_env(tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix)
    out = tmp_path / "export"
    code, stdout, stderr = await run_cli(env, "export", "--parquet", str(out))
    assert code == 0 and f"{DOMAIN}: exported positions 1-" in stdout, stdout + stderr
    await lose_the_tail(h, owner_url, pg_schema, LOST)
    await write_past_the_lost_tail(h)

    code, stdout, stderr = await run_cli(env, "export", "--parquet", str(out))

    assert code == 1 and stdout == "", stdout + stderr
    assert stderr.startswith(f"trellis: diverged: {DOMAIN}: the export ends at version "), stderr
    assert "is another event" in stderr and "nothing was exported for it" in stderr
    assert "export into a new directory" in stderr and "Traceback" not in stderr
    # The log itself exports whole into a new directory.
    code, stdout, stderr = await run_cli(env, "export", "--parquet", str(tmp_path / "new"))
    assert code == 0 and f"{DOMAIN}: exported positions 1-" in stdout, stdout + stderr


async def test_an_export_refuses_a_log_whose_next_event_does_not_follow_the_exported_head(
    h: Harness, pool: asyncpg.Pool, owner_url: str, pg_schema: str, tmp_path: Path
) -> None:
    (first,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])
    exported_head, exported_hash = chain_head(tmp_path, first.files[0])
    # A restore that put the head event back at a new position: its hash is the exported
    # one, but the export would hold it twice.
    sql = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    try:
        async with sql.transaction():
            await sql.execute("ALTER TABLE trellis_events DISABLE TRIGGER USER")
            moved = await sql.fetchrow(
                "UPDATE trellis_events SET position = DEFAULT WHERE domain = $1 AND version = $2"
                " RETURNING position, prev_hash",
                DOMAIN,
                exported_head,
            )
            await sql.execute("ALTER TABLE trellis_events ENABLE TRIGGER USER")
    finally:
        await sql.close()
    before = listing(tmp_path)

    (again,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])

    assert listing(tmp_path) == before
    assert again.diverged == (
        f"{DOMAIN}: the export ends at version {exported_head} (position {first.last_position},"
        f" hash {exported_hash[:16]}…), but the log's next event is version {exported_head}"
        f" (position {moved['position']}), which follows hash {moved['prev_hash'][:16]}…"
    )
