"""The watchdog signals only the servers it was told of, never a process that took a pid over.

Where pid_max is 32768 a busy machine reuses pids within minutes: a server its engine already
stopped may have left its pid to any other process by the time the engine dies.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from trellis.adapters.embedded.watchdog import Server, started_at, stop_servers


def test_a_pid_that_another_process_took_over_is_left_alone() -> None:
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        started = started_at(bystander.pid)
        assert started is not None
        # The server that had this pid started a tick earlier: it is gone, this is not it.
        stop_servers([Server(bystander.pid, signal.SIGTERM, started - 1)], grace_s=0.5)
        assert bystander.poll() is None, "the watchdog signalled a process that was not its own"
        stop_servers([Server.seen_now(bystander.pid, signal.SIGTERM)], grace_s=10)
        assert bystander.wait(timeout=10) == -signal.SIGTERM
    finally:
        bystander.kill()
        bystander.wait()


def test_a_server_gone_before_the_watchdog_heard_of_it_is_not_signalled() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    server = Server.seen_now(gone.pid, signal.SIGTERM)
    assert server.started is None and not server.running()


def test_a_server_that_exited_unreaped_is_not_waited_for() -> None:
    """A zombie has exited: the grace is not spent on it, nor a SIGKILL."""
    exited = subprocess.Popen(["true"])
    stat = Path(f"/proc/{exited.pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rpartition(")")[2].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert not Server(exited.pid, signal.SIGTERM, 1).running()
        assert started_at(exited.pid) is None
    finally:
        exited.wait()
