"""One economics run's figures, computed from its log and not from the run's own counters.

The `history` query (who held which device when, at what price) gives what was held (GPUs and
pooled memory held over time, a share of the hall's: not how busy the work kept them), GPU-seconds
and cost; the log's CompositionRequested events (their labels name the trace request) give
requests served (and, with the trace's token counts, tokens served) and the GPUs each phase
got; CompositionRejected (code, and the request entry its funnel stopped at) gives refusals by
reason; CompositionImpaired, then DeviceReplaced or PathRerouted and a later
CompositionActivated, give impaired and repaired (an impaired composition activated again with
no such move came back when its fault healed: recovered). Compose latency and the wait for
GPUs are the exception: the reply times the client measured; TTFT and TPOT come from them
through the serving model (serving.py). Every figure is computed here once; the table, the JSON
and the plots only show it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from trellis.adapters.entrypoints.economics.serving import (
    SECONDS_PER_HOUR,
    Served,
    per_million_tokens,
    tpot,
    ttft,
)
from trellis.adapters.entrypoints.economics.workload import Request
from trellis.adapters.entrypoints.render import table


@dataclass
class Figures:
    """One run's figures, all but latency computed from the log."""

    requests: int
    served: int
    # Served, but a composition of theirs was released before its lease ran out (the pooled
    # scheduler's policy, impaired and not repaired): counted in full, GPU time and all tokens.
    served_cut_short: int
    refused: Counter[str]
    tokens_served: int  # context + generated tokens of the served requests
    tokens_cut_short: int  # of them, the served_cut_short requests'
    # The serving model's TTFT and TPOT of the served requests, "p50" and "p99": only those
    # their count supports (supported()).
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    span_s: float  # the log's span sampled: first compose to the last lease's end
    last_arrival_s: float  # the last request's arrival, seconds from the run's start
    times: list[float]  # each sample's seconds since the first compose
    gpus_held_share: list[float]  # per sample (at most a second apart), held / all GPUs
    memory_held_share: list[float]  # per sample, held / all pooled GiB
    # The same shares exactly, as steps: (seconds since the first compose, GPU share, memory
    # share) at each moment they change, the last at the span's end (0 when every lease ran
    # out by then).
    held_steps: list[tuple[float, float, float]]
    gpu_held_mean: float  # % of the hall's GPUs, time-weighted over the span (exact)
    gpu_held_peak: float  # the most held at any moment (exact, not sampled)
    memory_held_mean: float  # % of the hall's pooled GiB
    gpu_seconds: float
    gpu_hours: float  # held, not busy
    idle_gpu_seconds: float  # held, but not needed by the work
    # Mean free GPUs while pooled memory was >= 90% held, and mean free GiB while GPUs were,
    # time-weighted; None when it never was (a mean over nothing is no figure).
    free_gpus_memory_full: float | None
    free_gib_gpus_full: float | None
    billed: float  # dollars: held device-hours x cost_per_hour (a memory slice: its share)
    hall_cost: float  # dollars: every device of the hall for the run's span
    # The two by device kind ("gpu", "memory", ...): what was held never costs more than the
    # hall's devices of its kind over the same span.
    billed_by_kind: dict[str, float]
    hall_cost_by_kind: dict[str, float]
    billed_per_served: float | None  # None: nothing served
    hall_per_served: float | None
    billed_per_million_tokens: float | None
    hall_per_million_tokens: float | None
    compositions: int  # made: activated at least once
    impaired: int
    repaired: int  # the engine moved them off the fault, and they were active again
    recovered: int  # active again only once the fault healed
    # Compose latency percentiles, "p50" .. "p99.9": only those the sample count supports.
    latency_ms: dict[str, float]

    def unanswered(self) -> int:
        """Requests the log neither served nor refused: a compose the client gave up on
        (timed out, or throttled: an answer that writes nothing)."""
        return self.requests - self.served - sum(self.refused.values())


# ---- the figures, from the log ----


PERCENTILES = (50.0, 90.0, 99.0, 99.9)
SERVING_PERCENTILES = (50.0, 99.0)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank `q`th percentile of sorted seconds, in milliseconds (0 for none)."""
    if not ordered:
        return 0.0
    return 1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def supported(q: float, samples: int) -> bool:
    """Whether `samples` values can tell a `q`th percentile from their maximum: at least one
    value above it (p99 wants 100 samples, p99.9 wants 1,000)."""
    return q < 100 and samples >= math.ceil(round(100 / (100 - q), 6))


def percentiles(seconds: Sequence[float], qs: Sequence[float]) -> dict[str, float]:
    """The `qs` percentiles of `seconds` their count supports, in ms, named "p50" .. "p99.9"."""
    ordered = sorted(seconds)
    return {f"p{q:g}": percentile(ordered, q) for q in qs if supported(q, len(ordered))}


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def request_of(labels: dict[str, str]) -> int:
    """The trace request a compose served: pooled phases are 2n and 2n+1, fixed ones n."""
    number = int(labels["demand"])
    return number if labels.get("scheduler") == "fixed-pods" else number // 2


def phases_of(request: int, pooled: bool) -> tuple[int, int]:
    """A request's prefill and decode phases, as its composes are labelled (`demand`)."""
    return (2 * request, 2 * request + 1) if pooled else (request, request)


def served_by_model(
    demand: Sequence[Request],
    served: set[int],
    pooled: bool,
    gpus: dict[int, int],
    waits: dict[int, float],
) -> list[Served]:
    """The served requests as the serving model needs them: the trace's tokens, the GPUs each
    phase got (`gpus`, from the log) and how long it waited for them (`waits`, client-timed;
    by phase). A fixed request decodes on the box it holds: no second wait."""
    out = []
    for request in demand:
        prefill, decode = phases_of(request.number, pooled)
        if request.number not in served or prefill not in waits or decode not in waits:
            continue  # refused, or a reply the client never saw: nothing measured
        out.append(
            Served(
                context_tokens=request.context_tokens,
                generated_tokens=request.generated_tokens,
                prefill_wait_s=waits[prefill],
                prefill_gpus=gpus[prefill],
                decode_wait_s=waits[decode] if pooled else 0.0,
                decode_gpus=gpus[decode],
            )
        )
    return out


def figures(
    hall: dict[str, Any],
    events: Sequence[dict[str, Any]],
    intervals: Sequence[dict[str, Any]],
    demand: Sequence[Request],
    latencies: Sequence[float],
    waits: dict[int, float],
) -> Figures:
    """One run's figures from its log's events and its `history` intervals, the trace requests
    it ran (`demand`) and what its client timed: every compose's latency, and by phase the wait
    from its due time to the reply that composed it."""
    devices = [n for n in hall["nodes"] if n["kind"] == "device"]
    gpus = sum(d["device_kind"] == "gpu" for d in devices)
    pool_gib = sum(d.get("capacity_gib") or 0.0 for d in devices if d["device_kind"] == "memory")
    asked = [e for e in events if e["type"] in ("CompositionRequested", "CompositionRejected")]
    begin = min(e["at"] for e in asked)
    spans = [(_time(i["start"]), _time(i["end"]) if i["end"] else None, i) for i in intervals]
    end = max([begin, *(e for _, e, _ in spans if e is not None)])
    seconds = max(1.0, (end - begin).total_seconds())

    phases: dict[int, set[int]] = {}  # request -> its composed phases
    request_by_composition: dict[str, int] = {}
    phase_gpus: dict[int, int] = {}  # composed phase -> the GPUs it got
    need: dict[str, float] = {}  # composition -> the GPU-seconds its work needed
    for e in events:
        if e["type"] == "CompositionRequested":
            request = e["data"]["request"]
            labels = request["labels"]
            phases.setdefault(request_of(labels), set()).add(int(labels["demand"]))
            request_by_composition[e["data"]["composition_id"]] = request_of(labels)
            phase_gpus[int(labels["demand"])] = got = sum(
                d.get("count", 1) for d in request["devices"] if d["kind"] == "gpu"
            )
            # A box says what its work needed (it holds eight GPUs for it); a pooled phase
            # asked for the GPUs and the lease its work needs, as the log has it.
            need[e["data"]["composition_id"]] = float(
                labels.get("need_gpu_seconds", got * (request.get("lease_seconds") or 0))
            )
    pooled_run = any(
        e["data"]["request"]["labels"].get("scheduler") == "example"
        for e in events
        if e["type"] == "CompositionRequested"
    )
    served = {r for r, got in phases.items() if not pooled_run or len(got) == 2}
    expired = {e["data"]["composition_id"] for e in events if e["type"] == "LeaseExpired"}
    cut_short = served & {
        request_by_composition[e["data"]["composition_id"]]
        for e in events
        if e["type"] == "CompositionReleased"
        and e["data"]["composition_id"] not in expired
        and e["data"]["composition_id"] in request_by_composition
    }
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

    # The shares held are steps that change only where an interval starts or ends: the
    # figures below are exact; the sparklines sample them about once a second.
    held = held_over_time(spans, begin, end, gpus, pool_gib)
    steps = [((b - a).total_seconds(), g, m) for (a, g, m), (b, _, _) in itertools.pairwise(held)]
    samples = math.ceil(seconds)
    times = [(end - begin).total_seconds() * k / samples for k in range(samples)]
    changes_at = [at for at, _, _ in held]
    sampled = [
        held[bisect.bisect_right(changes_at, begin + timedelta(seconds=t)) - 1] for t in times
    ]
    gpu_share = [g for _, g, _ in sampled]
    memory_share = [m for _, _, m in sampled]
    memory_full = [(d, (1 - g) * gpus) for d, g, m in steps if m >= 0.9]
    gpus_full = [(d, (1 - m) * pool_gib) for d, g, m in steps if g >= 0.9]

    def length(s: datetime, e: datetime | None) -> float:
        return ((e or end) - s).total_seconds()

    def mean(weighted: Sequence[tuple[float, float]]) -> float | None:
        """The time-weighted mean of (seconds, value) steps; None over no time."""
        total = sum(d for d, _ in weighted)
        return sum(d * v for d, v in weighted) / total if total > 0 else None

    def per_served(dollars: float) -> float | None:
        return dollars / len(served) if served else None

    gpu_seconds = sum(length(s, e) for s, e, i in spans if i["kind"] == "gpu")
    held_by: dict[str, float] = {}  # composition -> GPU-seconds held
    for start, stop, interval in spans:
        if interval["kind"] == "gpu":
            cid = interval["composition_id"]
            held_by[cid] = held_by.get(cid, 0.0) + length(start, stop)
    # Held past what the work needed (the lease tick's slack, a box's unneeded GPUs); a
    # composition released before its lease ran out (by policy) strands nothing.
    stranded = sum(max(0.0, got - need.get(cid, 0.0)) for cid, got in held_by.items())
    device_gib = {d["id"]: d.get("capacity_gib") for d in devices}
    billed_by_kind: dict[str, float] = defaultdict(float)
    for start, stop, interval in spans:
        billed_by_kind[interval["kind"]] += (
            length(start, stop) / SECONDS_PER_HOUR * hourly_price(interval, device_gib)
        )
    hall_by_kind: dict[str, float] = defaultdict(float)
    for d in devices:
        hall_by_kind[d["device_kind"]] += (
            (d.get("cost_per_hour") or 0.0) * seconds / SECONDS_PER_HOUR
        )
    billed, hall_cost = sum(billed_by_kind.values()), sum(hall_by_kind.values())
    modelled = served_by_model(demand, served, pooled_run, phase_gpus, waits)
    tokens_served = sum(r.tokens for r in demand if r.number in served)
    impaired = {e["data"]["composition_id"] for e in events if e["type"] == "CompositionImpaired"}
    repaired, recovered = mended(events)
    return Figures(
        requests=len(demand),
        served=len(served),
        served_cut_short=len(cut_short),
        refused=refused,
        tokens_served=tokens_served,
        tokens_cut_short=sum(r.tokens for r in demand if r.number in cut_short),
        ttft_ms=percentiles([ttft(s) for s in modelled], SERVING_PERCENTILES),
        tpot_ms=percentiles([tpot(s) for s in modelled], SERVING_PERCENTILES),
        span_s=(end - begin).total_seconds(),
        last_arrival_s=max((r.at for r in demand), default=0.0),
        times=times,
        gpus_held_share=gpu_share,
        memory_held_share=memory_share,
        held_steps=[((at - begin).total_seconds(), g, m) for at, g, m in held],
        gpu_held_mean=100 * (mean([(d, g) for d, g, _ in steps]) or 0.0),
        gpu_held_peak=100 * max((g for _, g, _ in steps), default=0.0),
        memory_held_mean=100 * (mean([(d, m) for d, _, m in steps]) or 0.0),
        gpu_seconds=gpu_seconds,
        gpu_hours=gpu_seconds / SECONDS_PER_HOUR,
        idle_gpu_seconds=stranded,
        free_gpus_memory_full=mean(memory_full),
        free_gib_gpus_full=mean(gpus_full),
        billed=billed,
        hall_cost=hall_cost,
        billed_by_kind=dict(billed_by_kind),
        hall_cost_by_kind=dict(hall_by_kind),
        billed_per_served=per_served(billed),
        hall_per_served=per_served(hall_cost),
        billed_per_million_tokens=per_million_tokens(billed, tokens_served),
        hall_per_million_tokens=per_million_tokens(hall_cost, tokens_served),
        compositions=len(
            {e["data"]["composition_id"] for e in events if e["type"] == "CompositionActivated"}
        ),
        impaired=len(impaired),
        repaired=len(repaired),
        recovered=len(recovered),
        latency_ms=percentiles(latencies, PERCENTILES),
    )


def held_over_time(
    spans: Sequence[tuple[datetime, datetime | None, dict[str, Any]]],
    begin: datetime,
    end: datetime,
    gpus: int,
    pool_gib: float,
) -> list[tuple[datetime, float, float]]:
    """The shares of the hall's GPUs and pooled GiB held, as steps: (moment, GPU share, memory
    share) held from that moment on, at `begin`, at each moment an interval starts or ends, and
    at `end` (what is held then: an open interval, none once every lease has run out)."""
    changes: dict[datetime, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for start, stop, interval in spans:
        column = {"gpu": 0, "memory": 1}.get(interval["kind"])
        if column is None:
            continue
        amount = 1.0 if column == 0 else interval["capacity_gib"] or 0.0
        changes[max(start, begin)][column] += amount
        if stop is not None:
            changes[stop][column] -= amount
    out = []
    held_gpus = held_gib = 0.0
    for at in sorted({begin, end, *changes}):
        step = changes.get(at, [0.0, 0.0])
        held_gpus, held_gib = held_gpus + step[0], held_gib + step[1]
        out.append(
            (at, held_gpus / gpus if gpus else 0.0, held_gib / pool_gib if pool_gib else 0.0)
        )
    return out


def hourly_price(interval: dict[str, Any], device_gib: dict[str, float | None]) -> float:
    """What holding `interval` costs an hour: its device's cost_per_hour, and for a slice of
    pooled memory the slice's share of it (its GiB / the device's GiB): a pool is priced whole,
    and many compositions hold slices of it at once."""
    price: float = interval["cost_per_hour"] or 0.0
    if interval["kind"] != "memory" or not interval.get("capacity_gib"):
        return price
    whole = device_gib.get(interval["device"])
    return price * min(1.0, interval["capacity_gib"] / whole) if whole else price


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
    for k, e in enumerate(events):
        if e["type"] == "ComponentFaulted":
            faulted.add(e["data"]["component"])
        elif e["type"] == "ComponentRecovered":
            faulted.discard(e["data"]["component"])
        elif e["type"] == "CompositionRejected" and faulted:
            details = e["data"].get("details") or {}
            labels = (e["data"].get("request") or {}).get("labels") or {}
            return {
                "position": e["position"],
                "code": e["data"]["code"],
                "message": e["data"]["message"],
                "funnel": details.get("funnel"),
                # A fixed request refused by one box tries another: a refusal is not the
                # request's end.
                "then_composed": "demand" in labels
                and any(
                    later["type"] == "CompositionRequested"
                    and request_of(later["data"]["request"]["labels"]) == request_of(labels)
                    for later in events[k + 1 :]
                ),
            }
    return None


# A figure's own sense: "lower" or "higher" is better for the hall that shows it; None for a
# figure that is neither (what was asked, what was held: more held may be more served).
Better = str | None


def comparison(pooled_figures: Figures, fixed_figures: Figures) -> str:
    """The side-by-side table: pooled, fixed, pooled / fixed, and whether that is better or
    worse for pooled by the figure's own sense. The seeds' own units come first (served,
    TTFT, TPOT, GPU-hours, $ per million tokens), then how they came about."""

    def row(
        what: str, p: float | None, f: float | None, fmt: str = "{:.0f}", better: Better = None
    ) -> list[str]:
        """A figure of both runs, their ratio and the verdict; "-" for a figure too few
        samples support, and for a ratio over nothing (no `inf`)."""
        shown = [fmt.format(x) if x is not None else "-" for x in (p, f)]
        ratio = f"{p / f:.2f}x" if p is not None and f else "-"
        return [what, *shown, ratio, verdict(p, f, better)]

    p, f = pooled_figures, fixed_figures
    rows = [
        row("requests", p.requests, f.requests),
        row("served", p.served, f.served, better="higher"),
        row(
            "  of them cut short by a release",
            p.served_cut_short,
            f.served_cut_short,
            better="lower",
        ),
        row("refused", sum(p.refused.values()), sum(f.refused.values()), better="lower"),
    ]
    for reason in sorted(set(p.refused) | set(f.refused)):
        rows.append(
            row(f"  refused: {reason}", p.refused[reason], f.refused[reason], better="lower")
        )
    if p.unanswered() or f.unanswered():
        rows.append(
            row("neither served nor refused", p.unanswered(), f.unanswered(), better="lower")
        )
    serving = (("TTFT", p.ttft_ms, f.ttft_ms, "{:.1f}"), ("TPOT", p.tpot_ms, f.tpot_ms, "{:.2f}"))
    for measure, pooled_ms, fixed_ms, fmt in serving:
        for q in SERVING_PERCENTILES:
            name = f"p{q:g}"
            what = f"{measure} {name}, ms (model)"
            rows.append(row(what, pooled_ms.get(name), fixed_ms.get(name), fmt, better="lower"))
    rows += [
        row(
            "tokens served (context + generated)", p.tokens_served, f.tokens_served, better="higher"
        ),
        row("  of requests cut short", p.tokens_cut_short, f.tokens_cut_short, better="lower"),
        row("GPU-hours held", p.gpu_hours, f.gpu_hours, "{:.3f}"),
        row(
            "$ per million tokens, billed",
            p.billed_per_million_tokens,
            f.billed_per_million_tokens,
            "{:.2f}",
            better="lower",
        ),
        row(
            "$ per million tokens, whole hall",
            p.hall_per_million_tokens,
            f.hall_per_million_tokens,
            "{:.2f}",
            better="lower",
        ),
        row("GPUs held, mean % of the hall's", p.gpu_held_mean, f.gpu_held_mean, "{:.1f}"),
        row("GPUs held, peak % of the hall's", p.gpu_held_peak, f.gpu_held_peak, "{:.1f}"),
        row("pooled memory held, mean %", p.memory_held_mean, f.memory_held_mean, "{:.1f}"),
        row("GPU-seconds held", p.gpu_seconds, f.gpu_seconds),
        row(
            "  of which held idle (stranded)",
            p.idle_gpu_seconds,
            f.idle_gpu_seconds,
            better="lower",
        ),
        row(
            "free GPUs while memory >= 90% held",
            p.free_gpus_memory_full,
            f.free_gpus_memory_full,
            "{:.1f}",
            better="lower",
        ),
        row(
            "free GiB while GPUs >= 90% held",
            p.free_gib_gpus_full,
            f.free_gib_gpus_full,
            better="lower",
        ),
        *(
            row(
                f"compose latency p{q:g}, ms (client)",
                p.latency_ms.get(f"p{q:g}"),
                f.latency_ms.get(f"p{q:g}"),
                "{:.1f}",
                better="lower",
            )
            for q in PERCENTILES
        ),
        row("billed $ (held x cost_per_hour)", p.billed, f.billed, "{:.4f}"),
        row(
            "billed $ per served request",
            p.billed_per_served,
            f.billed_per_served,
            "{:.4f}",
            better="lower",
        ),
        row(
            "hall $ per served request",
            p.hall_per_served,
            f.hall_per_served,
            "{:.4f}",
            better="lower",
        ),
        row("compositions made", p.compositions, f.compositions),
        # A share, not a count: pooled makes a composition per phase, fixed one per request.
        row(
            "compositions impaired, % of made",
            share(p.impaired, p.compositions),
            share(f.impaired, f.compositions),
            "{:.1f}",
            better="lower",
        ),
        row("compositions repaired", p.repaired, f.repaired),
        row("  back only once the fault healed", p.recovered, f.recovered),
    ]
    header = ["figure", "pooled", "fixed pods", "pooled / fixed", "pooled is"]
    return table(header, rows) + "\n" + COMPARISON_KEY


#: Two runs of the same arm differ by a few percent (which compositions the storm catches,
#: the engine's timing): a ratio this close to 1 is no verdict either way.
ABOUT_THE_SAME = 0.05

COMPARISON_KEY = (
    "(pooled is: better or worse for the pooled hall by the figure's own sense, fewer or"
    f" lower where that is better; about the same within {ABOUT_THE_SAME:.0%} either way, what"
    " two runs of one arm differ by; blank for a figure that is neither, or with a side"
    " missing. -: a percentile its samples cannot support (pN needs 100 / (100 - N): p50 2,"
    " p90 10, p99 100, p99.9 1,000), a figure over no moment, or a ratio over nothing)"
)


def share(part: int, whole: int) -> float | None:
    """`part` as a % of `whole`; None over nothing."""
    return 100 * part / whole if whole else None


def verdict(p: float | None, f: float | None, better: Better) -> str:
    """ "better", "worse", "same" or "about the same" (within ABOUT_THE_SAME) for pooled, by
    `better`; "" without a sense or a side."""
    if better is None or p is None or f is None:
        return ""
    if p == f:
        return "same"
    if p > 0 and f > 0 and max(p / f, f / p) < 1 + ABOUT_THE_SAME:  # either way alike
        return "about the same"
    return "better" if (p > f) == (better == "higher") else "worse"


def sparkline(values: Sequence[float]) -> str:
    """A share held over time in one line of block characters (0 to 1); anything held shows,
    as at least the lowest mark."""
    blocks = " ▁▂▃▄▅▆▇█"
    return "".join(blocks[min(8, max(v > 0, round(max(0.0, v) * 8)))] for v in values)
