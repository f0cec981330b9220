"""`make demo`'s scripted session (adapters/entrypoints/demo.py) runs to its end from a
checkout: it reads examples/fabric.json through the package `trellis.examples`, as a wheel
does (before, it looked for trellis/examples/, which only a wheel has). Beside an engine on
its data dir it says so in one line and exits 1, as `trellis demo economics` does (it ended
in a DataDirInUse traceback)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from harness import cli_env

from trellis.adapters.embedded.process import hold_data_dir


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
    # Counted in the noun's number (the first-time user read "1 circuits").
    assert "hardware: 1 circuit, " in said and "1 circuits" not in said, said[-3000:]


@pytest.mark.parametrize("engine", ["serving", "starting"])
async def test_the_scripted_demo_beside_an_engine_on_its_data_dir_is_one_line(
    tmp_path: Path, engine: str
) -> None:
    """An engine that serves there (its endpoints.json names a live pid: this process's) or
    that is starting there (it holds servers.lock): one line, exit 1, nothing started."""
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
    env["TRELLIS_DATA_DIR"] = str(data)
    release = hold_data_dir(data)
    if engine == "serving":
        (data / "endpoints.json").write_text(json.dumps({"pid": os.getpid()}))
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trellis.adapters.entrypoints.demo", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        release()
    said = err.decode()
    assert proc.returncode == 1 and "Traceback" not in said, said
    (line,) = [line for line in said.splitlines() if line.startswith("demo: ")]
    if engine == "serving":
        assert line == (
            f"demo: an engine already runs on {data} (pid {os.getpid()}) "
            "(stop it first, or give this one its own TRELLIS_DATA_DIR)"
        ), line
    else:
        assert line.startswith(f"demo: another process (pid {os.getpid()}) runs or is starting")
    assert out == b"" and not (data / "nats.pid").exists()
