"""`make demo`'s scripted session (adapters/entrypoints/demo.py) runs to its end from a
checkout: it reads examples/fabric.json through the package `trellis.examples`, as a wheel
does (before, it looked for trellis/examples/, which only a wheel has)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from harness import cli_env


async def test_the_scripted_demo_session_runs_to_its_end(
    tmp_path: Path, nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    env = cli_env(tmp_path, nats_url, database_url, pg_schema, subject_prefix)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.demo", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()[-3000:]
    said = out.decode()
    assert said.startswith("engine up: ") and "engine stopped" in said, said[-3000:]
