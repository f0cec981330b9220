"""A SIGKILLed `trellis up` leaves no embedded server behind; the next one starts clean.

Issue 12 item 3. A real `trellis up` with the embedded NATS and PostgreSQL (no TRELLIS_*
URLs) runs in a subprocess on a data dir of the test's own, on pinned ports, in a process
group of its own as a shell runs it; its whole group is killed with SIGKILL (no handler, no
atexit), and the servers it started must be gone within the watchdog's grace. A second
`trellis up` on the same data dir and ports then serves, and a terminal's Ctrl-C (SIGINT to
the whole group) stops it cleanly: exit 0, no traceback, its servers stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from harness import run_cli

from trellis.adapters.bootstrap import embedded_or_configured
from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.embedded.process import (
    DataDirInUse,
    EmbeddedServerDied,
    free_port,
    hold_data_dir,
)
from trellis.adapters.embedded.watchdog import alive
from trellis.adapters.settings import Settings

pytestmark = pytest.mark.slow  # two embedded PostgreSQL starts

UP_WITHIN_S = 120.0
GONE_WITHIN_S = 20.0


def environment(data: Path, ports: dict[str, int]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
    return {
        **env,
        "TRELLIS_DATA_DIR": str(data),
        "TRELLIS_NATS_PORT": str(ports["nats"]),
        "TRELLIS_NATS_MONITOR_PORT": str(ports["monitor"]),
        "TRELLIS_PG_PORT": str(ports["pg"]),
    }


class PortsTaken(Exception):
    """`trellis up` exited because another process had bound one of its pinned ports."""


async def start_up(env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    """`trellis up` with `env`, once it serves (its endpoints name its pid).

    Raises:
        PortsTaken: it exited saying a port was already in use.
    """
    with log.open("ab") as out:
        since = out.tell()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trellis.adapters.entrypoints.cli", "up", env=env,
            stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    endpoints = Path(env["TRELLIS_DATA_DIR"]) / "endpoints.json"
    deadline = time.monotonic() + UP_WITHIN_S
    while True:
        if proc.returncode is not None:
            said = log.read_bytes()[since:]
            if b"already in use" in said:
                raise PortsTaken(said.decode(errors="replace"))
            pytest.fail(f"trellis up exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if json.loads(endpoints.read_text()).get("pid") == proc.pid:
                return proc
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"trellis up did not serve within {UP_WITHIN_S}s:\n{log.read_text()}")
        await asyncio.sleep(0.2)


async def first_start_on_offered_ports(
    data: Path, log: Path
) -> tuple[asyncio.subprocess.Process, dict[str, int], dict[str, str]]:
    """The first `trellis up`, on ports the OS offered, pinned by its environment. Another
    process may bind one before the servers do; they never served there, so other ports are
    chosen (what the test checks is that the second start keeps the first one's ports)."""
    for _ in range(2):
        with contextlib.suppress(PortsTaken):
            return await start_on_offered_ports(data, log)
    return await start_on_offered_ports(data, log)


async def start_on_offered_ports(
    data: Path, log: Path
) -> tuple[asyncio.subprocess.Process, dict[str, int], dict[str, str]]:
    ports = {"nats": free_port(), "monitor": free_port(), "pg": free_port()}
    env = environment(data, ports)
    return await start_up(env, log), ports, env


async def exit_code(up: asyncio.subprocess.Process, within: float = 60) -> int:
    """How `up` exits, within `within` seconds; its group killed if it has not by then."""
    try:
        return await asyncio.wait_for(up.wait(), within)
    finally:
        if up.returncode is None:
            os.killpg(up.pid, signal.SIGKILL)


def server_pids(data: Path) -> dict[str, int]:
    return {
        "nats-server": int((data / "nats.pid").read_text().split()[0]),
        "postgres": int((data / "postgres" / "postmaster.pid").read_text().split("\n", 1)[0]),
    }


async def test_a_killed_trellis_up_takes_its_servers_with_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first, ports, env = await first_start_on_offered_ports(data, tmp_path / "first.log")
    pids = server_pids(data)
    assert all(alive(pid) for pid in pids.values()), pids
    # Pinned ports, and the NATS monitoring endpoint NATS tooling reads.
    out = (tmp_path / "first.log").read_text()
    assert f"nats://127.0.0.1:{ports['nats']}" in out and f":{ports['pg']}/" in out, out
    assert f"NATS monitoring: http://127.0.0.1:{ports['monitor']}" in out, out
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['monitor']}/healthz", timeout=5) as r:
        assert r.status == 200
    # Every port nats-server listens on, monitoring included, is on loopback only.
    loopback = {("127.0.0.1", ports["nats"]), ("127.0.0.1", ports["monitor"])}
    assert listening(pids["nats-server"]) == loopback

    os.killpg(first.pid, signal.SIGKILL)  # its whole group: the watchdog is not in it
    await first.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    assert not left, f"orphaned after SIGKILL: {left}"

    # The endpoints it left name a dead pid: the CLI does not dial its old ports.
    code, _, err = await run_cli(env, "free")
    assert code == 3 and "no engine found" in err, err

    # The next start on the same data dir and ports serves (no postmaster.pid in the way).
    second = await start_up(env, tmp_path / "second.log")
    pids = server_pids(data)
    try:
        code, out, err = await run_cli(env, "free", "--domain", "nowhere")
        assert code == 1 and "error [not_found]" in err, (code, out, err)
    finally:
        # A terminal's Ctrl-C: the servers, in the group too, stopped under the engine's
        # feet, and its own stop failed (exit 70, tracebacks).
        os.killpg(second.pid, signal.SIGINT)
        assert await asyncio.wait_for(second.wait(), 60) == 0
    said = (tmp_path / "second.log").read_text()
    assert "Traceback" not in said and "trellis engine stopped" in said, said
    assert not any(alive(pid) for pid in pids.values())  # a clean stop stops them too


def listening(pid: int) -> set[tuple[str, int]]:
    """The addresses a process listens on (TCP)."""
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


# -- an embedded server that dies under a serving engine ------------------------------------


@pytest.mark.parametrize("dead", ["nats-server", "postgres"])
async def test_an_embedded_server_that_dies_stops_trellis_up(tmp_path: Path, dead: str) -> None:
    """Killed under a serving engine, an embedded server is reaped, named in one line with its
    log, and `trellis up` stops the other one and exits 1 (it ran on for ever, a zombie beside
    it, /healthz naming nothing)."""
    data = tmp_path / "data"
    up, _, _ = await first_start_on_offered_ports(data, tmp_path / "up.log")
    pids = server_pids(data)
    os.kill(pids[dead], signal.SIGKILL)
    code = await exit_code(up)
    said = (tmp_path / "up.log").read_text()
    assert code == 1, said
    log = data / ("nats.log" if dead == "nats-server" else "postgres.log")
    line = (
        f"trellis: error: embedded {dead} exited (signal 9, SIGKILL); its log: {log}, last lines:"
    )
    assert line in said, said
    assert said.count(f"embedded {dead} exited") == 2, said  # when it died, and the exit's line
    if dead == "nats-server":
        assert "Traceback" not in said, said
    else:  # asyncpg's pools: one line per process, not a traceback per connection and retry
        assert "_maintain_min_size" not in said, said
        assert said.count("Failed to restore the pool connection floor") <= 2, said
    deadline = time.monotonic() + GONE_WITHIN_S
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not any(alive(pid) for pid in pids.values()), pids  # nor left as a zombie


async def test_a_dead_server_is_named_in_problems_then_ends_the_context(tmp_path: Path) -> None:
    """/healthz's problems name a dead embedded server; the task inside the context is ended
    and leaving it raises EmbeddedServerDied with the server's log."""
    settings = Settings(
        data_dir=tmp_path,
        database_url="postgresql://nobody@127.0.0.1:1/none",  # only nats-server is embedded
        nats_port=free_port(),
    )
    with pytest.raises(EmbeddedServerDied) as died:
        async with embedded_or_configured(settings) as endpoints:
            assert endpoints.problems() == []
            os.kill(int((tmp_path / "nats.pid").read_text()), signal.SIGKILL)
            deadline = time.monotonic() + 5
            while not endpoints.problems() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert endpoints.problems() == ["embedded nats-server exited (signal 9, SIGKILL)"]
            await asyncio.sleep(30)  # cancelled within a poll
    assert str(died.value).startswith(
        f"embedded nats-server exited (signal 9, SIGKILL); its log: {tmp_path / 'nats.log'}"
    )


# -- a `trellis up` killed while its servers start ------------------------------------------


async def test_a_trellis_up_killed_while_starting_orphans_no_server(tmp_path: Path) -> None:
    """`trellis up & sleep 0.8; kill -9 $!`: nats-server is up, PostgreSQL still in initdb.
    The watchdog covers each server from its spawn (it was started once both were up, and
    nats-server ran on with ppid 1)."""
    data = tmp_path / "data"
    env = environment(data, {"nats": free_port(), "monitor": free_port(), "pg": free_port()})
    with (tmp_path / "up.log").open("ab") as out:
        up = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trellis.adapters.entrypoints.cli", "up", env=env,
            stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + UP_WITHIN_S
        nats_pid = None
        while nats_pid is None:
            assert up.returncode is None and time.monotonic() < deadline
            with contextlib.suppress(OSError, ValueError):
                nats_pid = int((data / "nats.pid").read_text())
            await asyncio.sleep(0.02)
        assert not (data / "postgres" / "postmaster.pid").exists()  # still starting
        os.kill(up.pid, signal.SIGKILL)  # the engine alone, as `kill -9 $!`
        await up.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while alive(nats_pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not alive(nats_pid), "nats-server orphaned by a kill during the start"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)  # initdb, if it still runs


async def test_a_start_refuses_a_nats_server_left_on_the_store(tmp_path: Path) -> None:
    """A nats-server still running on the data dir's JetStream store (left by an earlier
    `trellis up`) is named and refused, not joined by a second one on the same store."""
    data = tmp_path / "data"
    left = EmbeddedNats(data)
    left.start()
    try:
        env = environment(data, {"nats": free_port(), "monitor": free_port(), "pg": free_port()})
        code, _, err = await run_cli(env, "up")
        assert code == 1, err
        assert f"nats-server: pid {left.pid} still runs on {data / 'nats'}" in err, err
        assert left.running
        assert (data / "nats.pid").read_text().strip() == str(left.pid)
    finally:
        left.stop()


async def test_a_start_on_a_data_dir_another_process_is_starting_is_refused(
    tmp_path: Path,
) -> None:
    """Two `trellis up` started at once on a new data dir: the second met the first one's
    nats-server on the store and told the operator to kill it as a leftover. Whoever runs
    the embedded servers holds the data dir from before the first one starts."""
    data = tmp_path / "data"
    release = hold_data_dir(data)  # as a `trellis up` that has not yet written its endpoints
    try:
        env = environment(data, {"nats": free_port(), "monitor": free_port(), "pg": free_port()})
        code, _, err = await run_cli(env, "up")
        assert code == 1, err
        assert f"another process (pid {os.getpid()}) runs or is starting" in err, err
        assert not (data / "nats.pid").exists()  # it started nothing
        with pytest.raises(DataDirInUse):  # nor may another holder in this process
            hold_data_dir(data)
    finally:
        release()
    hold_data_dir(data)()  # let go, it may be had again


async def test_a_stop_that_reaches_the_servers_too_is_no_internal_error(tmp_path: Path) -> None:
    """SIGTERM to `trellis up` and its servers at once (systemd's default KillMode stops the
    whole cgroup so): the engine's stop meets a nats-server already gone. It exited 70, an
    internal error naming a closed transport; the server's exit is what it says now."""
    data = tmp_path / "data"
    up, _, _ = await first_start_on_offered_ports(data, tmp_path / "up.log")
    pids = server_pids(data)
    for pid in (up.pid, *pids.values()):
        os.kill(pid, signal.SIGTERM)
    code = await exit_code(up)
    said = (tmp_path / "up.log").read_text()
    assert "internal" not in said and "Traceback" not in said, said
    assert code == 0 or (code == 1 and "trellis: error: embedded" in said), said
