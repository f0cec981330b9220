"""`trellis demo economics`: the same real demand through the engine twice, pooled and fixed.

The demand is Azure's LLM inference trace (adapters/entrypoints/workload.py), the hall
examples/hall.json. Both runs drive one real engine (NATS, Postgres, the simulated fabric), each
in a domain of its own, only through NATS:

- pooled: the example scheduler (examples/scheduler.py, its classes loaded from the file)
  composes each request's prefill (GPUs by prompt) and then its decode (one GPU and a CXL
  memory slice by context and output), from any rack over the OCS;
- fixed pods: each request gets one box whole (a host, its eight GPUs, its NIC and NVMe, by the
  `box` label), no pooled memory: a request whose KV cache exceeds the box's HBM headroom asks
  for the rest from memory of its box, which none has, and the engine refuses it. A box is not
  repaired: nothing but its own devices carry its label.

Leases expire (nothing is released by hand). Midway a failure storm strikes both: a rack's
PCIe switch and a group of OCS ports fail, and heal a while later.

The figures come from the log, not from the run's counters: the `history` query (who held which
device when) and the log's CompositionRequested, CompositionRejected (with its funnel),
CompositionImpaired and CompositionActivated events. Compose latency is the exception: it is
the reply time the client measured.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from trellis.adapters.bootstrap import connect_nats, running_engine
from trellis.adapters.entrypoints.render import table
from trellis.adapters.entrypoints.workload import Request, compress, read_trace
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.settings import Settings

REPO = Path(__file__).resolve().parents[2]
HALL = REPO / "examples" / "hall.json"
TRACE = REPO / "examples" / "azure-llm-trace-2023"
SCHEDULER = REPO / "examples" / "scheduler.py"
WEIGHTS_GIB = 140.0  # a 70B model in fp16 fills this much of a box's HBM before any KV cache
TRACE_WINDOW_S = 600.0  # the trace's first ten minutes are the demand's shape
STORM_SWITCH = "sw-r1"
STORM_PORTS = tuple(f"ocs-2:{p}" for p in range(1, 5))  # the uplinks of sw-r2 .. sw-r5


@dataclass(frozen=True)
class Plan:
    """What to run: `requests` over `seconds`, a storm from `storm_at` for `storm_for`."""

    seconds: float = 45.0
    requests: int = 200
    hall: Path = HALL

    @property
    def storm_at(self) -> float:
        return self.seconds / 2

    @property
    def storm_for(self) -> float:
        return self.seconds / 4


@dataclass
class Run:
    name: str
    domain: str
    latencies: list[float] = field(default_factory=list)  # seconds, measured by the client


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
    repaired: int
    p99_ms: float


def example_scheduler() -> ModuleType:
    """examples/scheduler.py as a module: it imports nothing from Trellis, so it is loaded by
    path, as a user's own file would be."""
    name = "trellis_example_scheduler"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCHEDULER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def demand(plan: Plan) -> list[Request]:
    rows = read_trace(sorted(TRACE.glob("*.csv")))
    return compress(rows, seconds=plan.seconds, count=plan.requests, window=TRACE_WINDOW_S)


def boxes(hall: dict[str, Any]) -> dict[str, list[str]]:
    """host -> the GPUs in its box."""
    out: dict[str, list[str]] = {}
    for node in hall["nodes"]:
        if node.get("device_kind") == "gpu" and "box" in node.get("labels", {}):
            out.setdefault(node["labels"]["box"], []).append(node["id"])
    return out


def needed_gpu_seconds(request: Request) -> int:
    return request.prefill_gpus * 1 + request.decode_seconds


# ---- the two runs ----


async def _timed(run: Run, call: Any) -> Any:
    started = time.perf_counter()
    try:
        return await call
    finally:
        run.latencies.append(time.perf_counter() - started)


async def pooled(nc: Any, prefix: str, run: Run, requests: Sequence[Request], plan: Plan) -> None:
    """The example scheduler composes each phase from the pools; its policy releases what the
    engine could not repair."""
    ex = example_scheduler()
    scheduler = ex.Scheduler(nc, domain=run.domain, tenant="pooled", prefix=prefix, lease_slack=0)
    await scheduler.start()
    start = time.monotonic()

    async def phase(number: int, at: float, wanted: Any) -> bool:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        now = time.monotonic()
        placement = ex.Placement(number, wanted, now, now + wanted.seconds)
        return bool(await _timed(run, scheduler.compose(placement)))

    async def one(request: Request) -> None:
        prefill = ex.Demand(gpus=request.prefill_gpus, seconds=1.0)
        if not await phase(2 * request.number, request.at, prefill):
            return
        decode = ex.Demand(gpus=1, memory_gib=request.decode_gib, seconds=request.decode_seconds)
        await phase(2 * request.number + 1, request.at + 1.0, decode)

    try:
        await asyncio.gather(*(one(r) for r in requests), storm(nc, prefix, run.domain, plan))
    finally:
        await scheduler.stop(release=False)  # leases end what is held


async def fixed(
    nc: Any, prefix: str, run: Run, requests: Sequence[Request], plan: Plan, hall: dict[str, Any]
) -> None:
    """One whole box per request, or a refusal; no pooled memory, no repair."""
    ex = example_scheduler()
    view = ex.Scheduler(nc, domain=run.domain, tenant="fixed", prefix=prefix)
    await view.start()  # only its local view of free GPUs is used
    client = TrellisClient(nc, prefix=prefix)
    hbm = {n["id"]: n.get("memory_gib") or 0.0 for n in hall["nodes"]}
    pods = boxes(hall)
    start = time.monotonic()

    async def one(request: Request) -> None:
        await asyncio.sleep(max(0.0, start + request.at - time.monotonic()))
        free = {g for ids in view.view.free_gpus().values() for g in ids}
        box = max(pods, key=lambda host: sum(g in free for g in pods[host]))  # whole, else fullest
        devices: list[dict[str, Any]] = [
            {"kind": "gpu", "count": len(pods[box])},
            {"kind": "nic"},
            {"kind": "nvme"},
        ]
        headroom = sum(hbm[g] for g in pods[box]) - WEIGHTS_GIB
        if request.decode_gib > headroom:  # the rest would have to come from outside the box
            devices.append({"kind": "memory", "capacity_gib": request.decode_gib - headroom})
        body = {
            "request_id": f"fixed-{uuid.uuid4().hex}",
            "host": box,
            "devices": devices,
            "constraints": {"labels": {"box": box}},
            "lease_seconds": request.seconds,
            "labels": {
                "scheduler": "fixed-pods",
                "demand": str(request.number),
                "need_gpu_seconds": str(needed_gpu_seconds(request)),
            },
        }
        reply = await _timed(run, client.intent(run.domain, "fixed", "compose", body))
        if reply["ok"]:
            view.view.took(reply["result"]["composition_id"], reply["result"]["devices"])

    try:
        await asyncio.gather(*(one(r) for r in requests), storm(nc, prefix, run.domain, plan))
    finally:
        await view.stop(release=False)


async def storm(nc: Any, prefix: str, domain: str, plan: Plan) -> None:
    """A rack switch and a group of OCS ports fail midway, and heal later."""
    client = TrellisClient(nc, prefix=prefix)
    await asyncio.sleep(plan.storm_at)
    for component in (STORM_SWITCH, *STORM_PORTS):
        fault = {"component": component, "state": "failed", "detail": "economics storm"}
        await client.admin(domain, "report-fault", fault)
    await asyncio.sleep(plan.storm_for)
    for component in (STORM_SWITCH, *STORM_PORTS):
        await client.admin(domain, "report-fault", {"component": component, "state": "healthy"})


async def log_of(store: Any, domain: str) -> list[dict[str, Any]]:
    """The domain's events as `{"type", "at", "data"}`, from Postgres."""
    return [
        {"type": e.type, "at": e.recorded_at, "data": json.loads(e.data)}
        async for e in store.read(domain)
    ]


async def history(client: TrellisClient, domain: str, position: int) -> list[dict[str, Any]]:
    reply = await client.query(domain, "history", {"min_position": position})
    if not reply["ok"]:
        raise RuntimeError(f"history of {domain}: {reply['error']['message']}")
    intervals: list[dict[str, Any]] = reply["result"]["intervals"]
    return intervals


# ---- the figures, from the log ----


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
        repaired=len(_repaired(events)),
        p99_ms=1000 * ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        if ordered
        else 0.0,
    )


def _repaired(events: Sequence[dict[str, Any]]) -> set[str]:
    """Compositions activated again after an impairment: repaired."""
    impaired: set[str] = set()
    repaired: set[str] = set()
    for e in events:
        cid = e["data"].get("composition_id")
        if e["type"] == "CompositionImpaired":
            impaired.add(cid)
        elif e["type"] == "CompositionActivated" and cid in impaired:
            repaired.add(cid)
    return repaired


def comparison(pooled_figures: Figures, fixed_figures: Figures) -> str:
    """The side-by-side table: pooled, fixed, and pooled / fixed."""

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    def row(what: str, p: float, f: float, fmt: str = "{:.0f}") -> list[str]:
        ratio = f"{p / f:.2f}x" if f else ("-" if not p else "inf")
        return [what, fmt.format(p), fmt.format(f), ratio]

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
        row("GPU utilization, mean %", 100 * mean(p.gpu_util), 100 * mean(f.gpu_util), "{:.1f}"),
        row(
            "GPU utilization, peak %",
            100 * max(p.gpu_util, default=0),
            100 * max(f.gpu_util, default=0),
            "{:.1f}",
        ),
        row(
            "memory utilization, mean %",
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
    ]
    return table(["figure", "pooled", "fixed pods", "pooled / fixed"], rows)


def sparkline(values: Sequence[float]) -> str:
    """Utilization over time in one line of block characters (0 to 1)."""
    blocks = " ▁▂▃▄▅▆▇█"
    return "".join(blocks[min(8, round(max(0.0, v) * 8))] for v in values)


# ---- the whole demo ----


async def economics(
    nc: Any, store: Any, prefix: str, plan: Plan, *, stamp: str | None = None
) -> tuple[Figures, Figures, dict[str, list[dict[str, Any]]]]:
    """Both runs on a running engine; their figures, and each run's log by run name."""
    hall = json.loads(plan.hall.read_text())
    requests = demand(plan)
    client = TrellisClient(nc, prefix=prefix)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    out: list[Figures] = []
    logs: dict[str, list[dict[str, Any]]] = {}
    for name in ("pooled", "fixed"):
        run = Run(name, f"econ-{name}-{stamp}")
        topology = {**hall, "request_id": f"hall-{run.domain}", "reason": "economics hall"}
        reply = await client.admin(run.domain, "import-topology", topology)
        if not reply["ok"]:
            raise RuntimeError(f"the hall was refused: {reply['error']['message']}")
        print(f"{name}: {len(requests)} requests over {plan.seconds:g} s in {run.domain}")
        if name == "pooled":
            await pooled(nc, prefix, run, requests, plan)
        else:
            await fixed(nc, prefix, run, requests, plan, hall)
        await asyncio.sleep(max(r.seconds for r in requests) + 2.5)  # every lease has run out
        head = (await store.head(run.domain)).position
        intervals = await history(client, run.domain, head)
        logs[name] = await log_of(store, run.domain)
        got = figures(hall, logs[name], intervals, len(requests), run.latencies)
        print(f"  GPU utilization |{sparkline(got.gpu_util)}|")
        print(f"  memory          |{sparkline(got.memory_util)}|")
        out.append(got)
    return out[0], out[1], logs


async def main(plan: Plan, settings: Settings) -> None:
    """Start an engine as configured (embedded servers for unset URLs), run both, compare."""
    async with running_engine(settings) as running:
        nc = await connect_nats(running.nats_url, name="trellis-economics")
        try:
            p, f, _ = await economics(nc, running.store, running.subject_prefix, plan)
        finally:
            await nc.close()
    print()
    print(comparison(p, f))
    print(
        "\ndemand: Azure LLM inference trace 2023 (Azure/AzurePublicDataset, CC-BY 4.0);"
        " figures from the log's history and events; latency as the client measured it."
    )


if __name__ == "__main__":
    asyncio.run(main(Plan(), Settings.from_env()))
