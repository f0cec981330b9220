"""An export appended to never leaves a gap (docs/auditing.md, adapters/postgres/export.py):
`--since` on a domain the export already holds is refused, before anything is written, when
it would skip events after the manifest's last position (they would be in no file, and every
later export would carry on past them); one that skips nothing is taken. Real NATS and
Postgres, the history day of test_history.py.

The gap it closes: `--until <time of 52>`, then `--since <time of 100>` exported 1-52, then
99-146, and 53-98 were never exported; later runs said "nothing new".
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import asyncpg
import pyarrow.dataset as ds
import pytest
import pytest_asyncio
from harness import Harness, ManualClock, run_cli
from history_day import DOMAIN, T0, at, day_served, play

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.postgres.export import MANIFEST, SinceWouldSkip, export_parquet


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    clock, sim = ManualClock(T0), SimulatedFabric(seed=3)
    async with day_served(nats_url, database_url, pg_schema, subject_prefix, clock, sim) as h:
        await play(h, clock, sim)
        await h.projected(DOMAIN)
        yield h


async def positions(pool: asyncpg.Pool, since: str | None = None) -> list[int]:
    rows = await pool.fetch(
        "SELECT position FROM trellis_events WHERE domain = $1"
        " AND ($2::timestamptz IS NULL OR recorded_at >= $2) ORDER BY position",
        DOMAIN,
        datetime.fromisoformat(since) if since else None,
    )
    return [r["position"] for r in rows]


def exported(out: Path) -> list[int]:
    table = ds.dataset(out / "events", format="parquet", partitioning="hive").to_table()
    return sorted(table.column("position").to_pylist())


def listing(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


async def test_since_that_would_skip_unexported_events_is_refused_and_writes_nothing(
    h: Harness, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    log = await positions(pool)
    (first,) = await export_parquet(
        pool, tmp_path, domains=[DOMAIN], until=datetime.fromisoformat(at(1000))
    )
    held = first.last_position
    later = await positions(pool, since=at(2000))
    assert held < log[-1] and log.index(later[0]) > log.index(held) + 1  # a gap to skip
    before = listing(tmp_path)

    with pytest.raises(SinceWouldSkip) as refused:
        await export_parquet(
            pool, tmp_path, domains=[DOMAIN], since=datetime.fromisoformat(at(2000))
        )
    skipped = [p for p in log if held < p < later[0]]
    assert f"positions {skipped[0]}-{skipped[-1]} of {DOMAIN}" in str(refused.value)
    assert f"(the export holds up to {held})" in str(refused.value)
    assert listing(tmp_path) == before  # no file, no manifest change

    # Without --since the export carries on after its last position: every event, once.
    (rest,) = await export_parquet(pool, tmp_path, domains=[DOMAIN])
    assert rest.first_position == held + 1 and rest.last_position == log[-1]
    assert exported(tmp_path) == log
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["domains"][DOMAIN]["last_position"] == log[-1]


async def test_since_that_skips_nothing_unexported_is_taken(
    h: Harness, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    log = await positions(pool)
    (first,) = await export_parquet(
        pool, tmp_path, domains=[DOMAIN], until=datetime.fromisoformat(at(1000))
    )
    # A --since before the export's end (a fixed start date in a nightly job, say) skips
    # nothing that is not already exported.
    (rest,) = await export_parquet(
        pool, tmp_path, domains=[DOMAIN], since=datetime.fromisoformat(at(0))
    )
    assert rest.first_position == first.last_position + 1
    assert exported(tmp_path) == log
    # A domain's first export still starts at --since, as documented.
    fresh = tmp_path / "fresh"
    (started,) = await export_parquet(
        pool, fresh, domains=[DOMAIN], since=datetime.fromisoformat(at(2000))
    )
    assert exported(fresh) == await positions(pool, since=at(2000))
    assert started.first_position <= (await positions(pool, since=at(2000)))[0]


async def test_the_cli_refuses_a_gap_with_a_usage_error_and_then_continues(
    h: Harness, pool: asyncpg.Pool, tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
        "TRELLIS_DATA_DIR": str(tmp_path / "data"),
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DB_SCHEMA": pg_schema,
    }
    out = str(tmp_path / "export")
    log = await positions(pool)
    cli = ("export", "--parquet", out, "--domain", DOMAIN)
    code, stdout, stderr = await run_cli(env, *cli, "--until", at(1000))
    assert code == 0 and f"{DOMAIN}: exported positions 1-" in stdout, stdout + stderr
    held = int(stdout.split("exported positions 1-")[1].split(":")[0])

    code, stdout, stderr = await run_cli(env, *cli, "--since", at(2000))
    assert code == 2, stdout + stderr
    assert stderr.startswith("trellis: usage: --since would skip positions ")
    assert "drop --since" in stderr and "Traceback" not in stderr and stdout == ""

    code, stdout, stderr = await run_cli(env, *cli)
    assert code == 0, stdout + stderr
    assert f"{DOMAIN}: exported positions {held + 1}-{log[-1]}:" in stdout
    assert exported(Path(out)) == log
