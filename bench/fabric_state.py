"""The simulated fabric's durable write (issue 26): what one generation of its state file costs,
written into an old generation's file (as `SimulatedFabric` does) against a new file per
generation (as it did before), in one run.

Each generation is the I/O `SimulatedFabric._publish` does: the state's bytes written and
fsynced under a temporary name (`adapters.fabric.sim._write_durably`, given an old generation
to reuse or not), linked as the next generation, the temporary name removed, the folder
fsynced, and the generations older than the kept ones either left for reuse (one) or deleted.
The two ways alternate in rounds, each in a folder of its own, so the machine's drift falls on
both. Floor: the same bytes written over one file in place and fsynced, the least a durable
write can do (no name made, no folder to sync).

Per generation: this thread's CPU (user + system, `RUSAGE_THREAD`) and wall time, medians of
the rounds, and each as a ratio to the floor. On ext4 without a journal, making a file scans
past every inode freed in the last seconds, so the new-file way costs more the faster
generations come: the bench writes them back to back, as a busy engine's state thread does.

    python bench/fabric_state.py                    # in a temporary folder under /tmp
    python bench/fabric_state.py --dir /var/tmp/x   # on another filesystem
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trellis.adapters.fabric.sim import KEPT_GENERATIONS, _fsync_directory, _write_durably

STATE_BYTES = 6_000  # a state file at 8 clients is 4-10 KB


def thread_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def publisher(folder: Path, reuse: bool) -> Callable[[int, bytes], None]:
    """One generation's I/O, numbered from 1, as `SimulatedFabric._publish` does it."""
    folder.mkdir()
    state = folder / "fabric.json"

    def generation(number: int) -> Path:
        return state.with_name(f"{state.name}.g{number}")

    def publish(number: int, data: bytes) -> None:
        temp = state.with_name(f"{state.name}.{os.getpid()}-{secrets.token_hex(8)}.tmp")
        spare = number - KEPT_GENERATIONS - 1
        _write_durably(temp, data, generation(spare) if reuse and spare > 0 else None)
        os.link(temp, generation(number))
        temp.unlink()
        _fsync_directory(folder)
        old = number - KEPT_GENERATIONS
        if old > 0 and not reuse:
            generation(old).unlink()

    return publish


def in_place(folder: Path) -> Callable[[int, bytes], None]:
    """The floor: the bytes written over one file and fsynced."""
    folder.mkdir()
    fd = os.open(folder / "fabric.json", os.O_WRONLY | os.O_CREAT, 0o666)

    def write(number: int, data: bytes) -> None:
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    return write


def timed(write: Callable[[int, bytes], None], start: int, count: int) -> tuple[float, float]:
    """CPU and wall µs per generation over `count` generations numbered from `start`."""
    data = [secrets.token_bytes(STATE_BYTES // 2).hex().encode() for _ in range(4)]
    cpu, wall = thread_cpu_s(), time.perf_counter()
    for number in range(start, start + count):
        write(number, data[number % 4])
    return (
        (thread_cpu_s() - cpu) / count * 1e6,
        (time.perf_counter() - wall) / count * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--generations", type=int, default=2_000, help="per way and round")
    parser.add_argument("--dir", type=Path, default=None, help="where (default: under /tmp)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trellis-fabric-state-", dir=args.dir) as tmp:
        ways = {
            "in place (floor)": in_place(Path(tmp, "floor")),
            "new file per generation (before)": publisher(Path(tmp, "new"), reuse=False),
            "an old generation's file reused": publisher(Path(tmp, "reuse"), reuse=True),
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for round_ in range(args.rounds):
            order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
            for name in order:
                start = 1 + round_ * args.generations
                samples[name].append(timed(ways[name], start, args.generations))
            print(f"  round {round_ + 1} of {args.rounds}", file=sys.stderr)

    medians = {
        name: (statistics.median(c for c, _ in s), statistics.median(w for _, w in s))
        for name, s in samples.items()
    }
    floor_cpu, floor_wall = medians["in place (floor)"]
    print(f"\n{args.rounds} rounds of {args.generations:,} generations of {STATE_BYTES:,} bytes")
    print(f"{'way':34} {'cpu µs':>8} {'÷ floor':>8} {'wall µs':>8} {'÷ floor':>8}")
    for name, (cpu, wall) in medians.items():
        print(f"{name:34} {cpu:8.1f} {cpu / floor_cpu:7.2f}x {wall:8.1f} {wall / floor_wall:7.2f}x")
    print("cpu: this thread's user + system time; medians of the rounds")
    print(
        json.dumps(
            {
                "bench": "fabric_state",
                "rounds": args.rounds,
                "generations": args.generations,
                "bytes": STATE_BYTES,
                "ways": {
                    name: {"cpu_us": cpu, "wall_us": wall, "rounds": samples[name]}
                    for name, (cpu, wall) in medians.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
