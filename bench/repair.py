"""Repair at hall scale: what a fault, a drain and a release cost the engine's decision when
many compositions are impaired (issue 26, the intent path; ARCHITECTURE section 8).

A 4,096-device hall (bench/placement.py's) is filled with live compositions; then, decided
purely and never applied, so each starts from the same state:
- a fault and a forced drain of each of the busiest switches (the compositions they touch,
  leave impaired, the events and the decision's time);
- releases of live compositions in the state the busiest switch's fault leaves, where many are
  impaired, against the same releases before that fault (the baseline, none impaired): what
  the retry of impaired compositions a release makes costs it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import Counter
from functools import reduce
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.placement import DOMAIN, SIZES, Hall, percentile
from trellis.engine.core.context import Context
from trellis.engine.core.decide import decide
from trellis.engine.core.intents import Drain, Intent, Release, ReportFault
from trellis.engine.core.state import DomainState, evolve
from trellis.ext import IMPLEMENTATION


def timed(state: DomainState, actor: str, verb: str, intent: Intent, at: Any) -> Any:
    """The decision and its milliseconds."""
    ctx = Context(domain=DOMAIN, actor=actor, verb=verb, now=at)
    started = time.perf_counter()
    decision = decide(state, intent, ctx)
    return decision, (time.perf_counter() - started) * 1000


def busiest_switches(state: DomainState, n: int) -> list[str]:
    used = Counter(
        node
        for c in state.compositions.values()
        for b in c.bindings
        for node in b.path
        if state.nodes[node].spec.kind == "switch"
    )
    return [switch for switch, _ in used.most_common(n)]


def releases(state: DomainState, at: Any, n: int) -> list[float]:
    """The milliseconds of releasing each of the first `n` active compositions of `state`."""
    active = sorted((c.id, c.tenant) for c in state.compositions.values() if c.state == "active")
    out = []
    for k, (cid, tenant) in enumerate(active[:n]):
        intent = Release(request_id=f"release-{k}", composition_id=cid)
        out.append(timed(state, tenant, "release", intent, at)[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--live", type=int, default=1500, help="compositions held")
    parser.add_argument("--switches", type=int, default=8, help="the busiest, faulted each")
    parser.add_argument("--releases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    print("filling the hall ...", file=sys.stderr, flush=True)
    hall = Hall(SIZES[4096])
    draw = random.Random(args.seed)
    while len(hall.live) < args.live:
        hall.compose(draw)
    state, at = hall.state, hall.at
    rows = []
    for switch in busiest_switches(state, args.switches):
        for verb, intent in (
            ("report-fault", ReportFault(request_id="f", component=switch, state="failed")),
            ("drain", Drain(request_id="d", id=switch, force=True)),
        ):
            decision, ms = timed(state, "operator", verb, intent, at)
            rows.append(
                {
                    "switch": switch,
                    "verb": verb,
                    "touched": len(decision.result.compositions),
                    "left_impaired": len(decision.result.impaired),
                    "events": len(decision.events),
                    "ms": round(ms, 1),
                }
            )
    worst = busiest_switches(state, 1)[0]
    fault = ReportFault(request_id="g", component=worst, state="failed")
    after = reduce(evolve, timed(state, "operator", "report-fault", fault, at)[0].events, state)
    calm = releases(state, at, args.releases)
    outage = releases(after, at, args.releases)
    result: dict[str, Any] = {
        "bench": "repair",
        "machine": {"python": platform.python_version(), "core": IMPLEMENTATION},
        "devices": hall.world.device_count,
        "live": len(state.compositions),
        "steps": rows,
        "steps_ms_total": round(sum(r["ms"] for r in rows), 1),
        "release": {
            "impaired_before": len(state.impaired),
            "impaired_after_fault": len(after.impaired),
            "calm_p50_ms": round(percentile(calm, 50), 3),
            "outage_p50_ms": round(percentile(outage, 50), 3),
            "calm_p99_ms": round(percentile(calm, 99), 3),
            "outage_p99_ms": round(percentile(outage, 99), 3),
        },
    }
    print("| switch | step | touched | left impaired | events | ms |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        cells = [r["switch"], r["verb"], r["touched"], r["left_impaired"], r["events"], r["ms"]]
        print("| " + " | ".join(map(str, cells)) + " |")
    print(f"| all | | | | | {result['steps_ms_total']} |")
    rel = result["release"]
    print()
    print("| release | impaired | p50 ms | p99 ms | p50 ratio |")
    print("|---|---:|---:|---:|---:|")
    print(f"| calm (baseline) | {rel['impaired_before']} | {rel['calm_p50_ms']} "
          f"| {rel['calm_p99_ms']} | 1.00x |")  # fmt: skip
    ratio = rel["outage_p50_ms"] / rel["calm_p50_ms"]
    print(f"| after the busiest switch's fault | {rel['impaired_after_fault']} "
          f"| {rel['outage_p50_ms']} | {rel['outage_p99_ms']} | {ratio:.2f}x |")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
