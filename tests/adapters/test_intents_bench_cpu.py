"""The intents bench tells the simulated hardware's CPU from the engine's: its state thread's
time is counted apart (by thread name), and no other thread's is. PostgreSQL's processes and the
whole machine are counted apart too."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.intents import POSTGRES_COMM, CpuMeter
from trellis.adapters.fabric.sim import STATE_THREAD
from trellis.adapters.postgres import sessions


def burn(seconds: float, then: threading.Event | None = None) -> None:
    """Spend `seconds` of this thread's CPU, then wait for `then`."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    if then is not None:
        then.wait()


def test_the_state_threads_cpu_is_counted_apart_from_the_rest() -> None:
    meter = CpuMeter()
    read = threading.Event()
    hardware = threading.Thread(target=burn, args=(0.2, read), name=f"{STATE_THREAD}_0")
    other = threading.Thread(target=burn, args=(0.3,), name="engine-helper")
    for thread in (hardware, other):
        thread.start()
    other.join()
    # The meter finds the state thread among live threads: it waits to be read before it ends.
    deadline = time.monotonic() + 30
    figures = meter.read()
    while figures["hardware_cpu_s"] < 0.19 and time.monotonic() < deadline:
        time.sleep(0.01)
        figures = meter.read()
    read.set()
    hardware.join()
    # Ticks are 10 ms: the state thread's 0.2 s is there, the other thread's 0.3 s is not.
    assert 0.19 <= figures["hardware_cpu_s"] <= 0.25, figures
    assert figures["process_cpu_s"] >= figures["hardware_cpu_s"] + 0.25, figures


def test_postgres_processes_and_the_whole_machine_are_counted_apart(tmp_path: Path) -> None:
    """A process named as PostgreSQL's are counts as Postgres's; any other as the machine's
    only (a link's name is the process's name, as for a server's backends)."""
    meter = CpuMeter()
    postgres = tmp_path / POSTGRES_COMM
    postgres.symlink_to(sys.executable)
    # Spends 0.3 s of CPU, then waits to be read: the meter sees only live processes.
    spin = (
        "import sys, time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\nsys.stdin.read()"
    )
    spinners = [
        subprocess.Popen([program, "-c", spin], stdin=subprocess.PIPE)
        for program in (str(postgres), sys.executable)
    ]
    deadline = time.monotonic() + 30
    figures = meter.read()
    while figures["postgres_cpu_s"] < 0.29 and time.monotonic() < deadline:
        time.sleep(0.01)
        figures = meter.read()
    for spinner in spinners:
        spinner.communicate(b"")
    machine = meter.read()["machine_cpu_s"]  # ended processes stay in the machine's count
    # Ticks are 10 ms; each interpreter also spends a little starting up.
    assert 0.29 <= figures["postgres_cpu_s"] < 0.5, figures
    assert machine >= figures["postgres_cpu_s"] + 0.29, (machine, figures)


def test_postgres_sessions_are_told_apart_by_what_they_are_for(tmp_path: Path) -> None:
    """Of PostgreSQL's processes, a session named as the engine's counts as the engine's, one
    named as a follower's as the followers', and one named otherwise as neither."""
    meter = CpuMeter()
    postgres = tmp_path / POSTGRES_COMM
    postgres.symlink_to(sys.executable)
    spin = (
        "import sys, time\nend = time.process_time() + {s}\n"
        "while time.process_time() < end: pass\nsys.stdin.read()"
    )
    spinners = {
        name: subprocess.Popen([str(postgres), "-c", spin.format(s=seconds)], stdin=subprocess.PIPE)
        for name, seconds in (
            (sessions.ENGINE, 0.2),
            (sessions.PROJECTIONS, 0.3),
            (sessions.COMMAND, 0.1),
        )
    }
    named = {spinner.pid: name for name, spinner in spinners.items()}
    deadline = time.monotonic() + 30
    figures = meter.read(named)
    done = {"postgres_engine_cpu_s": 0.19, "postgres_followers_cpu_s": 0.29, "postgres_cpu_s": 0.59}
    while any(figures[k] < v for k, v in done.items()) and time.monotonic() < deadline:
        time.sleep(0.01)
        figures = meter.read(named)
    for spinner in spinners.values():
        spinner.communicate(b"")
    # Ticks are 10 ms; each interpreter also spends a little starting up.
    assert 0.19 <= figures["postgres_engine_cpu_s"] < 0.3, figures
    assert 0.29 <= figures["postgres_followers_cpu_s"] < 0.4, figures
    assert figures["postgres_cpu_s"] >= 0.59, figures
