"""The intents bench tells the simulated hardware's CPU from the engine's: its state thread's
time is counted apart (by thread name), and no other thread's is."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.intents import CpuMeter
from trellis.adapters.fabric.sim import STATE_THREAD


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
