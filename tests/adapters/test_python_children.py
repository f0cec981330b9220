"""Trellis's own Python children import Trellis, whatever directory `trellis up` runs in.

`python -m` puts the working directory first on sys.path: a `trellis up` run from a directory
holding a `trellis/` folder (the parent of a clone) started a follower process that imported
that folder instead, failed (`cannot import name 'DISTRIBUTION' from 'trellis'`) and was
restarted for ever, and the read models stopped following; the embedded servers' watchdog died
the same way, unseen. Every child is started with `python -P`, which leaves the working
directory off sys.path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from follower_rig import unreachable_follower_env, until

from trellis.adapters.follow_process import FollowerProcess

BOGUS = """\
from pathlib import Path
Path(__file__).with_name("imported").write_text("the bogus trellis was imported")
raise SystemExit(3)
"""


def bogus_cwd(tmp_path: Path) -> Path:
    """A working directory whose `trellis/` is not Trellis: it leaves `imported` if imported."""
    cwd = tmp_path / "cwd"
    (cwd / "trellis").mkdir(parents=True)
    (cwd / "trellis" / "__init__.py").write_text(BOGUS)
    return cwd


def imported(cwd: Path) -> bool:
    return (cwd / "trellis" / "imported").exists()


def batch(pid: int | None) -> bool:
    """Whether `pid` made itself batch work, as the real follower's main does first thing."""
    try:
        return pid is not None and os.sched_getscheduler(pid) == os.SCHED_BATCH
    except (ProcessLookupError, PermissionError):
        return False


async def test_the_follower_process_imports_trellis_not_the_trellis_in_its_working_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = bogus_cwd(tmp_path)
    env = unreachable_follower_env(tmp_path)  # the real follower waits for them
    monkeypatch.chdir(cwd)  # the engine's, and so its follower process's
    async with FollowerProcess(env) as keeper:
        await until(
            "the follower process never ran Trellis's follower",
            lambda: imported(cwd) or batch(keeper.pid),
        )
        assert not imported(cwd), "the follower process imported the working dir's trellis/"
        assert keeper.restarts == 0


# The engine's side of a watchdog: started from a directory with a bogus trellis/, it starts
# the watchdog for one server and dies; the watchdog is to stop that server.
ENGINE_WITH_A_WATCHDOG = """
import os, sys
from trellis.adapters.embedded.watchdog import Watchdog
os.chdir(sys.argv[1])
Watchdog([(int(sys.argv[2]), 15)])
os._exit(0)
"""


def test_the_watchdog_imports_trellis_not_the_trellis_in_its_working_dir(tmp_path: Path) -> None:
    cwd = bogus_cwd(tmp_path)
    server = subprocess.Popen(["sleep", "600"])
    try:
        engine = subprocess.run(
            [sys.executable, "-P", "-c", ENGINE_WITH_A_WATCHDOG, str(cwd), str(server.pid)],
            cwd=tmp_path,  # no trellis/ here: the engine itself imports the real one
            timeout=30,
        )
        assert engine.returncode == 0
        try:
            code = server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
        assert not imported(cwd), "the watchdog imported the working dir's trellis/"
        assert code == -signal.SIGTERM, "the watchdog did not stop the server of a dead engine"
    finally:
        server.kill()
        server.wait()
