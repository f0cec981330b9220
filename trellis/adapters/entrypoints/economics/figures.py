"""One economics run's figures, computed from its log and not from the run's own counters.

The `history` query (who held which device when, at what price) gives what was held (GPUs and
pooled memory held over time, a share of the hall's: not how busy the work kept them), GPU-seconds
and cost; the log's CompositionRequested events (their labels name the trace request) give
requests served; CompositionRejected (code, and the request entry its funnel stopped at) gives
refusals by reason; CompositionImpaired, then DeviceReplaced or PathRerouted and a later
CompositionActivated, give impaired and repaired (an impaired composition activated again with
no such move came back when its fault healed: recovered). Compose latency is the exception:
the reply time the client measured.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trellis.adapters.entrypoints.render import table


@dataclass
class Figures:
    """One run's figures, all but latency computed from the log."""

    requests: int
    served: int
    refused: Counter[str]
    gpu_util: list[float]  # per second of the run, held / all GPUs
    memory_util: list[float]  # per second, held / all pooled GiB
    gpu_seconds: float
    idle_gpu_seconds: float  # held, but not needed by the work
    free_gpus_memory_full: float  # mean free GPUs while pooled memory was >= 90% held
    free_gib_gpus_full: float  # mean free GiB while GPUs were >= 90% held
    billed: float  # dollars: held device-hours x cost_per_hour
    hall_cost: float  # dollars: every device of the hall for the run
    impaired: int
    repaired: int  # the engine moved them off the fault, and they were active again
    recovered: int  # active again only once the fault healed
    p99_ms: float | None  # None: too few composes to tell a p99 (supported())
    # Compose latency percentiles, "p50" .. "p99.9": only those the sample count supports.
    latency_ms: dict[str, float]


# ---- the figures, from the log ----


PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank `q`th percentile of sorted seconds, in milliseconds (0 for none)."""
    if not ordered:
        return 0.0
    return 1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def supported(q: float, samples: int) -> bool:
    """Whether `samples` values can tell a `q`th percentile from their maximum: at least one
    value above it (p99 wants 100 samples, p99.9 wants 1,000)."""
    return q < 100 and samples >= math.ceil(round(100 / (100 - q), 6))


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def request_of(labels: dict[str, str]) -> int:
    """The trace request a compose served: pooled phases are 2n and 2n+1, fixed ones n."""
    number = int(labels["demand"])
    return number if labels.get("scheduler") == "fixed-pods" else number // 2


def figures(
    hall: dict[str, Any],
    events: Sequence[dict[str, Any]],
    intervals: Sequence[dict[str, Any]],
    requests: int,
    latencies: Sequence[float],
) -> Figures:
    """One run's figures from its log's events and its `history` intervals."""
    devices = [n for n in hall["nodes"] if n["kind"] == "device"]
    gpus = sum(d["device_kind"] == "gpu" for d in devices)
    pool_gib = sum(d.get("capacity_gib") or 0.0 for d in devices if d["device_kind"] == "memory")
    asked = [e for e in events if e["type"] in ("CompositionRequested", "CompositionRejected")]
    begin = min(e["at"] for e in asked)
    spans = [(_time(i["start"]), _time(i["end"]) if i["end"] else None, i) for i in intervals]
    end = max([begin, *(e for _, e, _ in spans if e is not None)])
    seconds = max(1.0, (end - begin).total_seconds())

    phases: dict[int, set[int]] = {}  # request -> its composed phases
    need = 0.0
    for e in events:
        if e["type"] == "CompositionRequested":
            labels = e["data"]["request"]["labels"]
            phases.setdefault(request_of(labels), set()).add(int(labels["demand"]))
            need += float(labels.get("need_gpu_seconds", 0))
    pooled_run = any(
        e["data"]["request"]["labels"].get("scheduler") == "example"
        for e in events
        if e["type"] == "CompositionRequested"
    )
    served = {r for r, got in phases.items() if not pooled_run or len(got) == 2}
    refused: Counter[str] = Counter()
    seen: set[int] = set()
    for e in events:
        if e["type"] != "CompositionRejected" or not e["data"].get("request"):
            continue
        request = request_of(e["data"]["request"]["labels"])
        if request in served or request in seen:
            continue
        seen.add(request)
        entry = e["data"].get("details", {}).get("entry")
        wanted = e["data"]["request"]["devices"]
        kind = wanted[entry]["kind"] if isinstance(entry, int) and entry < len(wanted) else "-"
        refused[f"{e['data']['code']} ({kind})"] += 1

    def held(kind: str, at: datetime) -> float:
        return sum(
            (i["capacity_gib"] or 0.0) if kind == "memory" else 1.0
            for s, e, i in spans
            if i["kind"] == kind and s <= at and (e is None or e > at)
        )

    moments = [begin + (end - begin) * (k / math.ceil(seconds)) for k in range(math.ceil(seconds))]
    gpu_util = [held("gpu", t) / gpus for t in moments]
    memory_util = [held("memory", t) / pool_gib if pool_gib else 0.0 for t in moments]
    memory_full = [(1 - g) * gpus for g, m in zip(gpu_util, memory_util, strict=True) if m >= 0.9]
    gpus_full = [(1 - m) * pool_gib for g, m in zip(gpu_util, memory_util, strict=True) if g >= 0.9]

    def length(s: datetime, e: datetime | None) -> float:
        return ((e or end) - s).total_seconds()

    gpu_seconds = sum(length(s, e) for s, e, i in spans if i["kind"] == "gpu")
    billed = sum(length(s, e) / 3600 * (i["cost_per_hour"] or 0.0) for s, e, i in spans)
    if pooled_run:  # the pools hand out what the work needs: all of it is needed
        need = gpu_seconds
    impaired = {e["data"]["composition_id"] for e in events if e["type"] == "CompositionImpaired"}
    repaired, recovered = mended(events)
    ordered = sorted(latencies)
    return Figures(
        requests=requests,
        served=len(served),
        refused=refused,
        gpu_util=gpu_util,
        memory_util=memory_util,
        gpu_seconds=gpu_seconds,
        idle_gpu_seconds=max(0.0, gpu_seconds - need),
        free_gpus_memory_full=sum(memory_full) / len(memory_full) if memory_full else 0.0,
        free_gib_gpus_full=sum(gpus_full) / len(gpus_full) if gpus_full else 0.0,
        billed=billed,
        hall_cost=sum(d.get("cost_per_hour") or 0.0 for d in devices) * seconds / 3600,
        impaired=len(impaired),
        repaired=len(repaired),
        recovered=len(recovered),
        p99_ms=percentile(ordered, 99.0) if supported(99.0, len(ordered)) else None,
        latency_ms={
            f"p{q:g}": percentile(ordered, q) for q in PERCENTILES if supported(q, len(ordered))
        },
    )


def mended(events: Sequence[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """Impaired compositions activated again: repaired (a device or path of theirs was moved
    after the impairment) and recovered (none was: the fault healed under them)."""
    impaired: set[str] = set()
    moved: set[str] = set()
    repaired: set[str] = set()
    recovered: set[str] = set()
    for e in events:
        cid = e["data"].get("composition_id")
        if e["type"] == "CompositionImpaired":
            impaired.add(cid)
        elif e["type"] in ("DeviceReplaced", "PathRerouted") and cid in impaired:
            moved.add(cid)
        elif e["type"] == "CompositionActivated" and cid in impaired:
            (repaired if cid in moved else recovered).add(cid)
    return repaired, recovered - repaired


def storm_refusal(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The log's first refusal recorded while a component was faulted: the why-not of a
    request in the storm (its code, message and funnel), or None."""
    faulted: set[str] = set()
    for e in events:
        if e["type"] == "ComponentFaulted":
            faulted.add(e["data"]["component"])
        elif e["type"] == "ComponentRecovered":
            faulted.discard(e["data"]["component"])
        elif e["type"] == "CompositionRejected" and faulted:
            details = e["data"].get("details") or {}
            return {
                "position": e["position"],
                "code": e["data"]["code"],
                "message": e["data"]["message"],
                "funnel": details.get("funnel"),
            }
    return None


def comparison(pooled_figures: Figures, fixed_figures: Figures) -> str:
    """The side-by-side table: pooled, fixed, and pooled / fixed."""

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    def row(what: str, p: float | None, f: float | None, fmt: str = "{:.0f}") -> list[str]:
        """A figure of both runs and their ratio; "-" for a figure too few samples support,
        and for a ratio over nothing (no `inf`)."""
        shown = [fmt.format(x) if x is not None else "-" for x in (p, f)]
        ratio = f"{p / f:.2f}x" if p is not None and f else "-"
        return [what, *shown, ratio]

    def per_served(x: Figures, dollars: float) -> float:
        return dollars / x.served if x.served else 0.0

    p, f = pooled_figures, fixed_figures
    rows = [
        row("requests", p.requests, f.requests),
        row("served", p.served, f.served),
        row("refused", sum(p.refused.values()), sum(f.refused.values())),
    ]
    for reason in sorted(set(p.refused) | set(f.refused)):
        rows.append(row(f"  refused: {reason}", p.refused[reason], f.refused[reason]))
    rows += [
        row(
            "GPUs held, mean % of the hall's",
            100 * mean(p.gpu_util),
            100 * mean(f.gpu_util),
            "{:.1f}",
        ),
        row(
            "GPUs held, peak % of the hall's",
            100 * max(p.gpu_util, default=0),
            100 * max(f.gpu_util, default=0),
            "{:.1f}",
        ),
        row(
            "pooled memory held, mean %",
            100 * mean(p.memory_util),
            100 * mean(f.memory_util),
            "{:.1f}",
        ),
        row("GPU-seconds held", p.gpu_seconds, f.gpu_seconds),
        row("  of which held idle (stranded)", p.idle_gpu_seconds, f.idle_gpu_seconds),
        row(
            "free GPUs while memory >= 90% held",
            p.free_gpus_memory_full,
            f.free_gpus_memory_full,
            "{:.1f}",
        ),
        row("free GiB while GPUs >= 90% held", p.free_gib_gpus_full, f.free_gib_gpus_full),
        row("p99 compose latency, ms (client)", p.p99_ms, f.p99_ms, "{:.1f}"),
        row("billed $ (held x cost_per_hour)", p.billed, f.billed, "{:.2f}"),
        row(
            "billed $ per served request",
            per_served(p, p.billed),
            per_served(f, f.billed),
            "{:.4f}",
        ),
        row(
            "hall $ per served request",
            per_served(p, p.hall_cost),
            per_served(f, f.hall_cost),
            "{:.4f}",
        ),
        row("compositions impaired", p.impaired, f.impaired),
        row("compositions repaired", p.repaired, f.repaired),
        row("  back only once the fault healed", p.recovered, f.recovered),
    ]
    return table(["figure", "pooled", "fixed pods", "pooled / fixed"], rows)


def sparkline(values: Sequence[float]) -> str:
    """Utilization over time in one line of block characters (0 to 1)."""
    blocks = " ▁▂▃▄▅▆▇█"
    return "".join(blocks[min(8, round(max(0.0, v) * 8))] for v in values)
