"""The built wheel works without the source tree: `trellis up` and a compose (issue 12 item 1).

The repository is copied (without its venv and build products), built into a wheel with pip,
and the wheel installed into a fresh venv. From a directory outside the source tree, with no
TRELLIS_* URLs (so the embedded NATS and PostgreSQL start from the installed packages), that
venv's `trellis up` serves, and its CLI imports a fabric and composes a GPU on it: the
migrations come from inside the wheel. The wheel installs one import name, `trellis`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel build, a venv install, an embedded PostgreSQL start

REPO = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "*.so", "_paths_c.c")


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


async def test_the_wheel_installs_into_a_fresh_venv_and_serves_a_compose(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=SKIP)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "wheel", ".",
        cwd=source)  # fmt: skip
    (wheel,) = (tmp_path / "wheel").glob("trellis_fabric-*.whl")
    with zipfile.ZipFile(wheel) as built:
        names = set(built.namelist())
        top_level = {name.split("/")[0] for name in names}
    # The fabric page's files are package data: `trellis up --http` serves them from the wheel.
    web = "trellis/adapters/entrypoints/web"
    assert {f"{web}/index.html", f"{web}/page.js", f"{web}/page.css"} <= names
    # One import name, the namespace; engine/, adapters/ ... are not installed at the top level.
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"trellis"}
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    run(venv / "bin" / "pip", "install", "-q", wheel, cwd=tmp_path)
    shutil.rmtree(source)  # nothing of the source tree is left to lean on

    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRELLIS_", "PYTHON"))}
    env["TRELLIS_DATA_DIR"] = str(tmp_path / "data")
    where = run(venv / "bin" / "python", "-c",
                "import trellis.adapters.postgres.migrations as m; print(m.SCHEMA_DIR)",
                cwd=away, env=env)  # fmt: skip
    assert "site-packages" in where and (Path(where.strip()) / "001_event_log.sql").exists()

    trellis = venv / "bin" / "trellis"
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen([trellis, "up"], cwd=away, env=env, stdout=log, stderr=log)
    try:
        endpoints = tmp_path / "data" / "endpoints.json"
        deadline = time.monotonic() + 120
        while not (endpoints.exists() and json.loads(endpoints.read_text()).get("pid") == up.pid):
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            await asyncio.sleep(0.2)
        shutil.copy(REPO / "examples" / "fabric.json", away / "fabric.json")
        out = run(trellis, "topology", "import", "fabric.json", cwd=away, env=env)
        assert "imported 26 nodes, 28 links" in out, out
        out = run(trellis, "compose", "--host", "host-01", "--gpu", "1", "--tenant", "acme",
                  cwd=away, env=env)  # fmt: skip
        assert "on host-01: active" in out, out
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
        log.close()
    assert code == 0, (tmp_path / "up.log").read_text()
