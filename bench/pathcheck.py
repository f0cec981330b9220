"""Path-core benchmark: µs per query for the compiled core, the networkx reference and a
rustworkx-based equivalent, on a 4,096-device and a 65,536-device fabric (bench/fabrics.py).

Two queries per request:
- single path check: the best path from the host to one given device (best_paths, 1 target);
- device choice: the best of all N candidate devices of the kind asked for, by (hops,
  latency, rank, id), from one search (the engine's question per pick). The compiled core
  answers with best_devices given a Selector (kind, minimum generation), as the engine asks;
  the reference as the engine did before it, best_paths over every candidate id and the
  minimum; rustworkx with the same search as the compiled core over the id list.

With both fabrics, the growth from 4,096 to 65,536 devices is printed against its targets
(issues 11 and 26): the compiled core's device choice ≤ 2x at p50 and ≤ 4x at p99, its single
check ≤ 2x at p50 and ≤ 4x at p99, and a refused compose (the engine's decide and evolve,
with the why-not funnel, as bench/placement.py times it over `--steps` compose+release
pairs per size) ≤ 4x at p50.

Every implementation answers the same requests in the same order; the slow ones answer a
prefix of them within a time budget, and each ratio compares the same requests. Answers are
checked equal to the reference's (and the rustworkx search's to the compiled core's) on
every request both answered. The last line printed is one JSON object with every figure.

    python bench/pathcheck.py            # both fabrics, 10,000 requests, 2,000 compose pairs
    python bench/pathcheck.py --quick    # 4,096 devices, 1,000 requests, short budgets
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path as FsPath
from typing import Any

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

from bench import placement
from bench.fabrics import Request, World, build, requests
from bench.placement import percentile
from trellis.adapters.entrypoints.economics.figures import supported
from trellis.ext import _live_py, _paths_py

try:
    from trellis.ext import _live_c, _paths_c
except ImportError as exc:  # pragma: no cover - the bench needs the build
    raise SystemExit(f"the compiled core is not built ({exc}); run `make install`") from exc

try:
    from bench.rx_paths import RxConditions, RxFabric, rx_search
except ImportError:  # rustworkx is the `bench` extra
    RxFabric = None  # type: ignore[assignment,misc]

MODES = ("single", "choice")


def timed(
    fn: Callable[[Request], Any], reqs: list[Request], budget_s: float, limit: int
) -> tuple[list[float], list[Any]]:
    """µs per call and the answers, in request order, until `limit` calls or the budget is
    spent (at least one call)."""
    times: list[float] = []
    answers: list[Any] = []
    deadline = time.perf_counter() + budget_s
    gc.disable()  # a collection inside one timed call would be charged to it
    try:
        for r in reqs[:limit]:
            start = time.perf_counter_ns()
            try:
                answer = fn(r)
            except Exception as exc:  # the same typed errors are part of the comparison
                answer = (type(exc).__name__, str(exc))
            times.append((time.perf_counter_ns() - start) / 1000)
            answers.append(answer)
            if time.perf_counter() > deadline:
                break
    finally:
        gc.enable()
    return times, answers


def tail(samples: list[float], q: float) -> float | None:
    """The `q`th percentile of `samples`, or None when too few of them to tell it from their
    maximum (the economics demo's rule: p99 wants 100, p99.9 wants 1,000)."""
    return percentile(samples, q) if supported(q, len(samples)) else None


def figures_of(times: list[float]) -> dict[str, Any]:
    """One implementation's µs per call: its median, mean and the tails its count supports."""
    return {
        "n": len(times),
        "p50_us": percentile(times, 50),
        "p99_us": tail(times, 99),
        "p999_us": tail(times, 99.9),
        "mean_us": sum(times) / len(times),
    }


def ratios_of(theirs: list[float], mine: list[float]) -> dict[str, Any]:
    """Another implementation's figures over the compiled core's on the same requests (`mine`
    is the compiled core's prefix of as many); no p99 ratio when their count hides the p99."""
    p99, my_p99 = tail(theirs, 99), tail(mine, 99)
    return {
        "n": len(theirs),
        "p50": percentile(theirs, 50) / percentile(mine, 50),
        "p99": None if p99 is None or my_p99 is None else p99 / my_p99,
        "mean": sum(theirs) / sum(mine),
    }


def run_size(
    label: str, pods: int, count: int, budgets: dict[str, float], seed: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    world: World = build(pods, seed=seed)
    built = time.perf_counter() - t0
    cond = world.conditions
    setup: dict[str, float] = {"generate_s": built}

    t0 = time.perf_counter()
    c_fabric = _paths_c.Fabric(world.nodes, world.links, world.device_infos())
    setup["compiled_fabric_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    live = _live_c.LiveConditions(c_fabric, cond)
    setup["compiled_conditions_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    py_fabric = _paths_py.Fabric(world.nodes, world.links)
    setup["reference_fabric_s"] = time.perf_counter() - t0
    impls: dict[str, dict[str, Callable[[Request], Any]]] = {
        "compiled": {
            "single": lambda r: _paths_c.best_paths(c_fabric, live, r.path, {r.device}),
            "choice": lambda r: _live_c.best_devices(c_fabric, live, r.path, r.selector, 1),
        },
        "reference": {
            "single": lambda r: _paths_py.best_paths(py_fabric, cond, r.path, {r.device}),
            "choice": lambda r: _live_py.best_devices(py_fabric, cond, r.path, r.ranked, 1),
        },
    }
    if RxFabric is not None:
        t0 = time.perf_counter()
        rx_fabric = RxFabric(world.nodes, world.links)
        rx_cond = RxConditions(rx_fabric, cond)
        setup["rustworkx_fabric_s"] = time.perf_counter() - t0
        impls["rustworkx"] = {
            "single": lambda r: rx_search(rx_fabric, rx_cond, r.path, {r.device}),
            "choice": lambda r: rx_search(rx_fabric, rx_cond, r.path, r.ranked, 1),
        }

    reqs = requests(world, count, seed=seed + 1)
    result: dict[str, Any] = {
        "devices": world.device_count,
        "nodes": len(world.nodes),
        "links": len(world.links),
        "requests": count,
        "mean_candidates": sum(len(r.ranked) for r in reqs) / len(reqs),
        "setup": setup,
        "modes": {},
    }
    for mode in MODES:
        answers: dict[str, list[Any]] = {}
        times: dict[str, list[float]] = {}
        for name, fns in impls.items():
            budget = budgets[f"{name}.{mode}"]
            times[name], answers[name] = timed(fns[mode], reqs, budget, count)
            print(
                f"  {label} {mode:6s} {name:9s} {len(times[name]):6d} requests "
                f"in {sum(times[name]) / 1e6:6.1f} s",
                file=sys.stderr,
                flush=True,
            )
        figures: dict[str, Any] = {name: figures_of(times[name]) for name in impls}
        # Ratios on the same requests: the compiled core's figures over the other's prefix.
        for other in [name for name in impls if name != "compiled"]:
            mine = times["compiled"][: len(times[other])]
            figures[f"compiled_vs_{other}"] = ratios_of(times[other], mine)
        mismatches = {}
        for other in [name for name in impls if name != "compiled"]:
            n = len(answers[other])
            mismatches[other] = sum(
                a != b for a, b in zip(answers["compiled"][:n], answers[other], strict=True)
            )
        figures["mismatches"] = mismatches
        if mode == "single":
            figures["by_outcome"] = by_outcome(reqs, times["compiled"], answers["compiled"])
        result["modes"][mode] = figures
    return result


def outcome_of(request: Request, answer: Any) -> str:
    """What a single check answered: the path's hops, or which bounds the refused request
    carried (a refusal does not say which of them refused it)."""
    if isinstance(answer, dict) and answer:
        return f"found, {answer[request.device].hops} hops"
    bounds = [
        name
        for name, value in (
            ("max_hops", request.path.max_hops),
            ("latency", request.path.max_latency_ns),
        )
        if value is not None
    ]
    return "none, " + (" and ".join(bounds) if bounds else "no bound")


def by_outcome(reqs: list[Request], times: list[float], answers: list[Any]) -> dict[str, Any]:
    """The compiled core's single checks grouped by outcome: a hall's p50 falls among
    whichever group holds the middle request, so the groups say what the p50 is made of."""
    groups: dict[str, list[float]] = {}
    for request, us, answer in zip(reqs, times, answers, strict=False):
        groups.setdefault(outcome_of(request, answer), []).append(us)
    return {
        name: {"n": len(us), "p50_us": percentile(us, 50), "p90_us": tail(us, 90)}
        for name, us in sorted(groups.items())
    }


def outcome_table(results: dict[str, dict[str, Any]]) -> list[str]:
    labels = list(results)
    groups = sorted({g for res in results.values() for g in res["modes"]["single"]["by_outcome"]})
    lines = ["", "single checks by outcome (compiled core; n, p50 and p90 µs per fabric):"]
    lines.append(f"  {'outcome':28s}" + "".join(f" {label:>30s}" for label in labels))
    for group in groups:
        cells = []
        for label in labels:
            f = results[label]["modes"]["single"]["by_outcome"].get(group)
            cells.append(
                f" {f['n']:>8d} {f['p50_us']:>10.1f} {shown(f['p90_us'], 10)}"
                if f
                else f" {'':>30s}"
            )
        lines.append(f"  {group:28s}" + "".join(cells))
    return lines


def shown(value: float | None, width: int, unit: str = "") -> str:
    """A figure right-aligned in `width` characters, "-" for one its sample count hides."""
    return f"{'-' if value is None else f'{value:.1f}{unit}':>{width}}"


HIDDEN = (
    "-: too few samples to tell that percentile from their maximum (p90 wants 10, p99 100, "
    "p99.9 1,000), and no ratio from it"
)


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    head = (
        f"{'fabric':>14} {'query':>14} {'implementation':>14} {'n':>6} "
        f"{'p50 µs':>12} {'p99 µs':>12} {'p99.9 µs':>12} {'p50 ratio':>10} {'p99 ratio':>10}"
    )
    rows.append(head)
    rows.append("-" * len(head))
    names = {"single": "single check", "choice": "device choice"}
    for label, res in results.items():
        for mode in MODES:
            figures = res["modes"][mode]
            for name in ("compiled", "reference", "rustworkx"):
                if name not in figures:
                    continue
                f = figures[name]
                ratio = figures.get(f"compiled_vs_{name}")
                p50r = shown(ratio["p50"] if ratio else 1.0, 10, "x")
                if ratio:
                    p99r = shown(ratio["p99"], 10, "x")
                else:
                    p99r = shown(None if f["p99_us"] is None else 1.0, 10, "x")
                rows.append(
                    f"{label:>14} {names[mode]:>14} {name:>14} {f['n']:>6} "
                    f"{f['p50_us']:>12.1f} {shown(f['p99_us'], 12)} {shown(f['p999_us'], 12)} "
                    f"{p50r} {p99r}"
                )
            mism = figures["mismatches"]
            rows.append(
                f"{'':>14} {'':>14} {'answers':>14} "
                + ", ".join(f"{k}: {v} differ" for k, v in mism.items())
            )
    rows.append(HIDDEN)
    return "\n".join(rows)


GROWTH_TARGETS = {
    ("choice", "p50"): 2.0,
    ("choice", "p99"): 4.0,
    ("single", "p50"): 2.0,
    ("single", "p99"): 4.0,
    ("refused", "p50"): 4.0,
}


def refused_composes(steps: int, seed: int) -> dict[str, dict[str, Any]]:
    """µs per refused compose (decide and evolve, with the why-not funnel) at each size, from
    bench/placement.py's run: its hall, live compositions and request mix."""
    refused = {}
    for devices in placement.SIZES:
        print(f"{devices:,} devices: composing and releasing ...", file=sys.stderr, flush=True)
        ms = placement.run_size(devices, steps, 256, seed)["refused_ms"]
        refused[f"{devices:,} devices"] = refused_figures(ms)
    return refused


def refused_figures(ms: dict[str, Any]) -> dict[str, Any]:
    """bench/placement.py's summary of refused composes in µs, with only the tails their
    count supports (its percentiles interpolate: p99.9 of 36 refusals is their maximum)."""
    return {
        "n": ms["n"],
        "p50_us": ms["p50"] * 1000,
        "p99_us": ms["p99"] * 1000 if supported(99, ms["n"]) else None,
        "p999_us": ms["p99.9"] * 1000 if supported(99.9, ms["n"]) else None,
    }


def growth_of(
    results: dict[str, dict[str, Any]], refused: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The compiled core's figures at 65,536 devices over its figures at 4,096, and a refused
    compose's."""
    small, large = results.get("4,096 devices"), results.get("65,536 devices")
    if small is None or large is None:
        return {}
    rows = {
        mode: (small["modes"][mode]["compiled"], large["modes"][mode]["compiled"]) for mode in MODES
    }
    rows["refused"] = (refused["4,096 devices"], refused["65,536 devices"])
    names = {
        "single": "single check",
        "choice": "device choice",
        "refused": "refused compose (why-not)",
    }
    figures: dict[str, Any] = {}
    lines = ["", "growth, 65,536 / 4,096 devices (compiled core; a refused compose in the engine):"]
    for mode, (a_figures, b_figures) in rows.items():
        for q in ("p50", "p99", "p999"):
            a, b = a_figures[f"{q}_us"], b_figures[f"{q}_us"]
            ratio = None if a is None or b is None else b / a
            target = GROWTH_TARGETS.get((mode, q))
            figures[f"{mode}_{q}"] = {"ratio": ratio, "target": target}
            if target is None:
                verdict = ""
            elif ratio is None:
                verdict = f" (target ≤ {target:g}x: not judged, too few samples)"
            else:
                verdict = f" (target ≤ {target:g}x: {'met' if ratio <= target else 'missed'})"
            growth = "-" if ratio is None else f"{ratio:.2f}x"
            lines.append(
                f"  {names[mode]:26s} {q:5s} {shown(a, 9)} -> {shown(b, 9)} µs  "
                f"{growth:>6}{verdict}"
            )
    n = {label: f["n"] for label, f in refused.items()}
    lines.append(f"  (refused composes timed: {n['4,096 devices']} and {n['65,536 devices']})")
    return {"figures": figures, "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--sizes", default="4096,65536", help="4096 and/or 65536")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--steps", type=int, default=2000, help="compose+release pairs per size (refusals)"
    )
    parser.add_argument("--quick", action="store_true", help="4,096 devices, short budgets")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every time budget by this"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    count = args.requests
    if args.quick:
        sizes, count = [4096], min(count, 1000)
    scale = args.scale * (0.2 if args.quick else 1.0)
    # Seconds per implementation and query; the compiled core answers all requests on the
    # small fabric. The reference takes seconds to minutes per query on the large one.
    budgets = {
        4096: {
            "compiled.single": 120.0,
            "compiled.choice": 120.0,
            "reference.single": 15.0,
            "reference.choice": 15.0,
            "rustworkx.single": 8.0,
            "rustworkx.choice": 8.0,
        },
        # The reference needs seconds to minutes per query here (one device choice alone
        # takes over a minute), so it answers one or two requests.
        65536: {
            "compiled.single": 15.0,
            "compiled.choice": 12.0,
            "reference.single": 15.0,
            "reference.choice": 1.0,
            "rustworkx.single": 10.0,
            "rustworkx.choice": 8.0,
        },
    }
    pods = {4096: 1, 65536: 16}
    results = {}
    started = time.perf_counter()
    for size in sizes:
        label = f"{size:,} devices"
        print(f"{label}: generating and timing ...", file=sys.stderr, flush=True)
        b = {k: v * scale for k, v in budgets[size].items()}
        results[label] = run_size(label, pods[size], count, b, args.seed)
    print(table(results))
    print()
    for label, res in results.items():
        short = [
            f"{name} {res['modes'][m][name]['n']}/{res['requests']} ({m})"
            for m in MODES
            for name in ("compiled", "reference", "rustworkx")
            if name in res["modes"][m] and res["modes"][m][name]["n"] < res["requests"]
        ]
        if short:
            print(f"{label}: within the time budget, answered only " + ", ".join(short) + ";")
            print("  ratios compare the compiled core on the same requests.")
        print(f"{label}: mean candidates per device choice {res['mean_candidates']:.0f}")
    for line in outcome_table(results):
        print(line)
    refused = refused_composes(args.steps, args.seed) if len(results) == 2 else {}
    growth = growth_of(results, refused)
    for line in growth.get("lines", []):
        print(line)
    summary: dict[str, Any] = {
        "bench": "pathcheck",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "seconds": time.perf_counter() - started,
        "rustworkx": RxFabric is not None,
        "results": results,
        "targets": {},
        "refused_composes": refused,
        "growth": growth.get("figures", {}),
    }
    for label, res in results.items():
        modes = res["modes"]
        target = {
            "choice_vs_reference_p50_ge_100": modes["choice"]["compiled_vs_reference"]["p50"]
            >= 100,
            "single_vs_reference_p50_ge_30": modes["single"]["compiled_vs_reference"]["p50"] >= 30,
        }
        if RxFabric is not None:
            target["faster_than_rustworkx"] = all(
                modes[m]["compiled_vs_rustworkx"]["p50"] > 1 for m in MODES
            )
        summary["targets"][label] = target
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()
