"""Stops the embedded servers when the `trellis up` that started them dies, even by SIGKILL.

A process of its own, started beside the servers:

    python -P -m trellis.adapters.embedded.watchdog PARENT_PID [SERVER_PID:SIGNAL ...]

It is started before the first server, and told each server's pid the moment that server is
spawned (a `PID:SIGNAL` line on its stdin, `Watchdog.add`), so a `trellis up` killed while a
server starts (nats-server up, PostgreSQL still in initdb) orphans nothing either. It polls
its parent. A clean stop ends the watchdog first (SIGTERM) and stops the servers in
order; if the parent vanishes instead (SIGKILL, a crash, the OOM killer), the watchdog sends
each server its shutdown signal, waits, and kills what is left, so nothing is orphaned and
the next `trellis up` finds its data dir free. A parent-death signal (prctl) would follow the
thread that forked the server, not the process, and the servers are started from a worker
thread; a watchdog process follows the process.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

POLL_S = 0.2
GRACE_S = 10.0  # for each server's own shutdown before it is killed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def started_at(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat's 22nd field; Linux), or
    None when no such process runs (a zombie has exited). A pid with another start time is
    another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] == "Z" else int(fields[19])


class Server(NamedTuple):
    """A server to stop: its pid, its shutdown signal, and when it started (its identity)."""

    pid: int
    sig: int
    started: int | None

    @classmethod
    def seen_now(cls, pid: int, sig: int) -> Server:
        return cls(pid, sig, started_at(pid))

    def running(self) -> bool:
        # A server stopped already may have left its pid to another process (pids wrap within
        # minutes where pid_max is 32768): that one is not ours to signal.
        return self.started is not None and started_at(self.pid) == self.started


def stop_servers(targets: Sequence[Server], grace_s: float = GRACE_S) -> None:
    """Signal each server still running; after `grace_s`, SIGKILL those still running."""
    for server in targets:
        if server.running():
            os.kill(server.pid, server.sig)
    deadline = time.monotonic() + grace_s
    while any(server.running() for server in targets) and time.monotonic() < deadline:
        time.sleep(0.05)
    for server in targets:
        if server.running():
            os.kill(server.pid, signal.SIGKILL)


class Watchdog:
    """The watchdog process of this one, told each server to stop as servers start."""

    def __init__(self, targets: Sequence[tuple[int, int]] = ()) -> None:
        args = [str(os.getpid()), *(f"{pid}:{int(sig)}" for pid, sig in targets)]
        self.process = subprocess.Popen(
            # -P: not the working dir first on sys.path (its trellis/ would be imported).
            [sys.executable, "-P", "-m", "trellis.adapters.embedded.watchdog", *args],
            stdin=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,  # a kill of the engine's whole group leaves it to clean up
        )

    def add(self, pid: int, sig: int) -> None:
        """Stop `pid` with `sig` too should this process die (written at once, unbuffered)."""
        stdin = self.process.stdin
        if stdin is None:
            return
        try:
            stdin.write(f"{pid}:{int(sig)}\n".encode())
            stdin.flush()
        except (BrokenPipeError, ValueError):  # the watchdog is gone, or being ended
            pass

    def end(self) -> None:
        """A clean stop: end the watchdog (the servers are stopped in order by the caller)."""
        self.process.terminate()
        self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()


def _parse(lines: bytes) -> list[Server]:
    targets = []
    for line in lines.split(b"\n"):
        pid, _, sig = line.strip().partition(b":")
        if pid.isdigit() and sig.isdigit():
            targets.append(Server.seen_now(int(pid), int(sig)))
    return targets


def main(argv: Sequence[str]) -> int:
    parent = int(argv[0])
    targets = [Server.seen_now(int(pid), int(sig)) for pid, sig in (a.split(":") for a in argv[1:])]
    # A Ctrl-C is the parent's to act on (it stops the servers in order); this process has a
    # session of its own, and ignores one sent to it all the same.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    stdin = sys.stdin.fileno()
    pending = b""
    told = True  # stdin still open: the parent may tell of more servers
    # Reparented (getppid changes) is how a dead parent shows, even if its pid is reused; a
    # stdin at its end (the parent's end of the pipe closed) is another.
    while os.getppid() == parent and alive(parent) and told:
        pending, told = _read(stdin, pending, POLL_S, targets)
    # What the parent wrote before it died is still in the pipe: read it to its end (nothing
    # else holds the pipe's other end, so that end comes once the parent is gone).
    deadline = time.monotonic() + 2.0
    while told and time.monotonic() < deadline:
        pending, told = _read(stdin, pending, 0.1, targets)
    stop_servers(targets)
    return 0


def _read(fd: int, pending: bytes, timeout: float, targets: list[Server]) -> tuple[bytes, bool]:
    """Wait up to `timeout` for lines on `fd`; add the servers they name to `targets`. The
    unfinished line, and whether `fd` may say more."""
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
    except (OSError, ValueError):
        time.sleep(timeout)
        return pending, False
    if not readable:
        return pending, True
    chunk = os.read(fd, 4096)
    if not chunk:
        targets.extend(_parse(pending))
        return b"", False
    pending += chunk
    complete, _, pending = pending.rpartition(b"\n")
    targets.extend(_parse(complete))
    return pending, True


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
