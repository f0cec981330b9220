"""Stops the embedded servers when the `trellis up` that started them dies, even by SIGKILL.

A process of its own, started beside the servers:

    python -m trellis.adapters.embedded.watchdog PARENT_PID SERVER_PID:SIGNAL ...

It polls its parent. A clean stop ends the watchdog first (SIGTERM) and stops the servers in
order; if the parent vanishes instead (SIGKILL, a crash, the OOM killer), the watchdog sends
each server its shutdown signal, waits, and kills what is left, so nothing is orphaned and
the next `trellis up` finds its data dir free. A parent-death signal (prctl) would follow the
thread that forked the server, not the process, and the servers are started from a worker
thread; a watchdog process follows the process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

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


def stop_servers(targets: Sequence[tuple[int, int]], grace_s: float = GRACE_S) -> None:
    """Signal each (pid, signal); after `grace_s`, SIGKILL those still running."""
    for pid, sig in targets:
        if alive(pid):
            os.kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while any(alive(pid) for pid, _ in targets) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, _ in targets:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def watch(targets: Sequence[tuple[int, int]]) -> subprocess.Popen[bytes]:
    """Start a watchdog over (pid, shutdown signal) servers for this process; terminate it on
    a clean stop."""
    args = [str(os.getpid()), *(f"{pid}:{int(sig)}" for pid, sig in targets)]
    return subprocess.Popen(
        [sys.executable, "-m", "trellis.adapters.embedded.watchdog", *args],
        stdin=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,  # a kill of the engine's whole group leaves it to clean up
    )


def main(argv: Sequence[str]) -> int:
    parent = int(argv[0])
    targets = [(int(pid), int(sig)) for pid, sig in (arg.split(":") for arg in argv[1:])]
    # A Ctrl-C is the parent's to act on (it stops the servers in order); this process has a
    # session of its own, and ignores one sent to it all the same.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Reparented (getppid changes) is how a dead parent shows, even if its pid is reused.
    while os.getppid() == parent and alive(parent):
        time.sleep(POLL_S)
    stop_servers(targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
