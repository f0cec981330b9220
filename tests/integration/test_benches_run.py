"""Benches that no other test drives run end to end, small, on the session's servers: a
bench that no longer runs is found here, not by the next person who measures with it.
Not here: scale.py (its own test, and minutes of fleet), burst.py (it reads the Azure trace
from outside the repository), rx_paths.py (it needs rustworkx, which is not installed)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

ROOT = Path(__file__).resolve().parents[2]

SMALL_RUNS = {
    "fabric_drivers.py": "--pairs 20 --chunk 10",
    "fabric_state.py": "--rounds 2 --generations 50",
    "flood.py": "--quick",
    "intents.py": "--quick --no-diagnose --floor-samples 100 --serial-pairs 50 --seconds 1",
    "log_checks.py": "--pairs 20 --rounds 1 --imports 2",
    "merkle.py": "--max 4096",
    "pathcheck.py": "--quick",
    "placement.py": "--steps 50",
    "redfish_service.py": "--pairs 20 --chunk 10",
    "relay.py": "--events 300 --runs 1 --workers 8",
    "repair.py": "--live 200 --switches 2 --releases 10",
    "replay.py": "--events 2999 --fresh",  # its log is kept in schema bench_replay_2999
    "snapshots.py": "--events 2000 --samples 5 --slow-samples 2",
}


@pytest.mark.slow
@pytest.mark.parametrize("bench", sorted(SMALL_RUNS))
def test_the_bench_runs_and_prints_its_figures(
    bench: str, nats_url: str, database_url: str, owner_url: str
) -> None:
    env = {
        **os.environ,
        "TRELLIS_NATS_URL": nats_url,
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DATABASE_OWNER_URL": owner_url,
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / bench), *SMALL_RUNS[bench].split()],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if bench == "replay.py":
        asyncio.run(_drop_schema(owner_url, "bench_replay_2999"))
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures  # the last line is the bench's figures, one JSON object


async def _drop_schema(owner_url: str, schema: str) -> None:
    conn = await asyncpg.connect(owner_url)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await conn.close()
