"""Placement benchmark (issue 11 item 3): what a compose costs the engine as the hall grows.

The engine's own pure core decides on the path-core bench's fabrics (bench/fabrics.py): the
4,096-device pod and the 65,536-device hall of 16 pods, with the same ~1% of links reported
failed. Each fabric is first filled with `--live` compositions; then every step composes one
random request and releases a random live composition, so the load stays level and the same
at both sizes. Timed per intent (`perf_counter_ns`, garbage collector off):

- compose: `decide` of the compose and `evolve` of its events, then the saga's `establish`
  (the whole CPU the engine spends on a compose, without the I/O, which does not grow with
  the hall);
- release: `decide` and `evolve`.

Composes are also shown apart by outcome: placed, and refused with the why-not funnel (10% of
the requests ask for exclusive isolation, which the tenants' shared spines rule out).

Requests mix kinds as the path-core bench does (gpu 60%, memory 20%, nic 10%, nvme 10%);
GPUs 1 to 4 at a time, some with a minimum generation, some exclusive, some with bandwidth;
memory as a 64 GiB slice. Both fabrics answer the same sequence of draws (hosts and devices
differ, the shape does not). The table gives p50, p99 and p99.9 per size and the ratio of
the 65,536-device figure to the 4,096-device one (target: ≤ 2x at p50, ≤ 4x for a refused
compose, and ≤ 4x at p99).

    python bench/placement.py                 # 2,000 intents per size
    python bench/placement.py --quick         # 300
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path as FsPath
from typing import Any, Literal

import msgspec

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

from bench.fabrics import TENANTS, build, document
from trellis.engine.core.actors import ENGINE, OPERATOR
from trellis.engine.core.context import Context
from trellis.engine.core.decide import decide
from trellis.engine.core.intents import (
    Compose,
    Constraints,
    DeviceRequest,
    EstablishComposition,
    ImportTopology,
    Intent,
    Release,
    ReportFault,
    settle_request_id,
)
from trellis.engine.core.state import DomainState, evolve
from trellis.ext import IMPLEMENTATION

DOMAIN = "bench"
SIZES = {4096: 1, 65536: 16}  # devices -> pods


class Hall:
    """One fabric's domain state, advanced by the engine's decisions."""

    def __init__(self, pods: int) -> None:
        self.world = build(pods)
        self.state = DomainState(domain=DOMAIN)
        self.at = datetime(2026, 1, 1, tzinfo=UTC)
        self.n = 0
        doc = {**document(self.world), "request_id": "topology"}
        self.apply(OPERATOR, "import-topology", msgspec.convert(doc, ImportTopology))
        for component in sorted(self.world.conditions.unusable):
            self.n += 1
            fault = ReportFault(request_id=f"f{self.n}", component=component, state="failed")
            self.apply(OPERATOR, "report-fault", fault)
        self.hosts = [h for h in self.world.hosts if h not in self.world.conditions.unusable]
        self.live: list[tuple[str, str]] = []

    def apply(self, actor: str, verb: str, intent: Intent) -> Any:
        self.at += timedelta(milliseconds=10)
        decision = decide(
            self.state, intent, Context(domain=DOMAIN, actor=actor, verb=verb, now=self.at)
        )
        for event in decision.events:
            self.state = evolve(self.state, event)
        return decision

    def compose(self, draw: random.Random) -> bool:
        """One compose and, when placed, its establish; False when it was refused."""
        self.n += 1
        tenant = draw.choice(TENANTS)
        intent = Compose(request_id=f"c{self.n}", host=draw.choice(self.hosts), **_shape(draw))
        decision = self.apply(tenant, "compose", intent)
        if decision.error is not None:
            return False
        cid = decision.result.composition_id
        establish = EstablishComposition(request_id=settle_request_id(cid), composition_id=cid)
        self.apply(ENGINE, "establish", establish)
        self.live.append((tenant, cid))
        return True

    def release(self, draw: random.Random) -> None:
        tenant, cid = self.live.pop(draw.randrange(len(self.live)))
        self.n += 1
        self.apply(tenant, "release", Release(request_id=f"r{self.n}", composition_id=cid))


def _shape(draw: random.Random) -> dict[str, Any]:
    kind = draw.choices(["gpu", "memory", "nic", "nvme"], [6, 2, 1, 1])[0]
    entry: dict[str, Any] = {"kind": kind, "bandwidth_gbps": float(draw.choice([0, 0, 16, 32]))}
    if kind == "gpu":
        entry["count"] = draw.choice([1, 1, 2, 4])
        if draw.random() < 0.3:
            entry["min_generation"] = draw.choice([9, 10])
    elif kind == "memory":
        entry["capacity_gib"] = 64.0
    isolation: Literal["shared", "exclusive"] = "exclusive" if draw.random() < 0.1 else "shared"
    return {
        "devices": [msgspec.convert(entry, DeviceRequest)],
        "constraints": Constraints(isolation=isolation),
    }


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def timed(fn: Any, draw: random.Random) -> tuple[float, Any]:
    start = time.perf_counter_ns()
    outcome = fn(draw)
    return (time.perf_counter_ns() - start) / 1e6, outcome


def run_size(devices: int, steps: int, live: int, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    hall = Hall(SIZES[devices])
    built = time.perf_counter() - started
    draw = random.Random(seed)
    while len(hall.live) < live:
        hall.compose(draw)
    filled = time.perf_counter() - started - built
    composes: list[float] = []
    placed: list[float] = []
    refused: list[float] = []
    releases: list[float] = []
    draw = random.Random(seed + 1)  # the measured sequence is the same at every size
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            ms, ok = timed(hall.compose, draw)
            composes.append(ms)
            (placed if ok else refused).append(ms)
            releases.append(timed(hall.release, draw)[0])
    finally:
        gc.enable()
    return {
        "devices": hall.world.device_count,
        "nodes": len(hall.state.nodes),
        "build_s": round(built, 1),
        "fill_s": round(filled, 1),
        "compose_ms": summary(composes),
        "placed_ms": summary(placed),
        "refused_ms": summary(refused),
        "release_ms": summary(releases),
    }


# Every compose; those placed (decide, evolve, establish); those refused, whose answer carries
# the why-not funnel (ARCHITECTURE section 5), counted over every device of the kind.
KINDS = ("compose", "placed", "refused", "release")
# Growth bounds at p50 (65,536 over 4,096 devices): 2x (issue 11), but 4x for a refused
# compose, whose why-not funnel counts over the whole hall (issue 26, as bench/pathcheck.py).
P50_GROWTH = {"refused": 4.0}


def summary(ms: list[float]) -> dict[str, float]:
    return {
        "n": len(ms),
        "p50": round(percentile(ms, 50), 3),
        "p99": round(percentile(ms, 99), 3),
        "p99.9": round(percentile(ms, 99.9), 3),
    }


def table(result: dict[str, Any]) -> str:
    small, large = result["sizes"]["4096"], result["sizes"]["65536"]
    lines = [
        "| intent | devices | n | p50 ms | p99 ms | p99.9 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for what in KINDS:
        for size in (small, large):
            s = size[f"{what}_ms"]
            cells = [what, f"{size['devices']:,}", s["n"], s["p50"], s["p99"], s["p99.9"]]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        a, b = small[f"{what}_ms"], large[f"{what}_ms"]
        lines.append(
            f"| {what} growth | 65,536 / 4,096 | | **{b['p50'] / a['p50']:.2f}x** "
            f"| **{b['p99'] / a['p99']:.2f}x** | {b['p99.9'] / a['p99.9']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="compose+release pairs per size")
    parser.add_argument("--live", type=int, default=256, help="compositions held throughout")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="300 pairs per size")
    args = parser.parse_args()
    steps = 300 if args.quick else args.steps
    result: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "core": IMPLEMENTATION},
        "steps": steps,
        "live": args.live,
        "sizes": {},
    }
    for devices in SIZES:
        print(f"{devices:,} devices ...", file=sys.stderr, flush=True)
        result["sizes"][str(devices)] = run_size(devices, steps, args.live, args.seed)
    small, large = result["sizes"]["4096"], result["sizes"]["65536"]
    checks = {}
    for what in KINDS:
        a, b = small[f"{what}_ms"], large[f"{what}_ms"]
        p50_bound = P50_GROWTH.get(what, 2.0)
        checks[what] = {
            "p50_growth": round(b["p50"] / a["p50"], 2),
            "p99_growth": round(b["p99"] / a["p99"], 2),
            "p50_bound": p50_bound,
            "met": b["p50"] <= p50_bound * a["p50"] and b["p99"] <= 4 * a["p99"],
        }
    result["targets"] = checks
    print(table(result))
    for what, c in checks.items():
        verdict = "met" if c["met"] else "missed"
        bound = f"{c['p50_bound']:g}x"
        growth = f"p50 {c['p50_growth']}x (≤ {bound}), p99 {c['p99_growth']}x (≤ 4x)"
        print(f"{what}: growth {growth}: {verdict}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
