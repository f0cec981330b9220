"""The economics demo's two runs: the same real demand through a real engine, pooled and fixed.

Both runs drive one engine (NATS, Postgres, the simulated fabric), each in a domain of its own,
only through NATS:

- pooled: the example scheduler (examples/scheduler.py, its classes loaded from the file)
  composes each request's prefill (GPUs by prompt) and then its decode (one GPU and a CXL
  memory slice by context and output), from any rack over the OCS;
- fixed pods: each request gets one box whole (a host, its eight GPUs, its NIC and NVMe, by the
  `box` label), leased for its prefill and a decode on all eight GPUs; no pooled memory: a
  request whose KV cache exceeds the box's HBM headroom asks for the rest from memory of its
  box, which none has, and the engine refuses it. A box is not repaired: nothing but its own
  devices carry its label.

Leases expire (nothing is released by hand). Midway a failure storm strikes both: the GPU tray
that carries the most of the run's connections at that moment loses its PCIe switch, and a
group of OCS ports fails; all heal a while later. While the storm lasts the run asks the
engine `why` about the tray and about a composition that used it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trellis.adapters.entrypoints.economics.data import HALL, example_scheduler, trace_files
from trellis.adapters.entrypoints.economics.workload import (
    PREFILL_SECONDS,
    Request,
    compress,
    read_trace,
)
from trellis.adapters.nats.client import TrellisClient

WEIGHTS_GIB = 140.0  # a 70B model in fp16 fills this much of a box's HBM before any KV cache
TRACE_WINDOW_S = 600.0  # the trace's first ten minutes are the demand's shape
TRAY = "tray-"  # the GPU trays' switches (examples/make_hall.py)
STORM_PORTS = tuple(f"ocs-2:{p}" for p in range(1, 5))  # the ocs-2 uplinks of sw-r2 .. sw-r5
BOX_TRIES = 3  # a fixed request tries this many boxes before it is refused
CUT_OFF_S = 2.0  # a box whose compose found no path is skipped this long


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


@dataclass(frozen=True)
class Why:
    """An answer of the engine's `why` query, asked at a moment of the run."""

    at: float  # seconds into the run
    id: str
    text: str
    chain: list[str]  # the event types that made it so
    moment: str = "in the storm"  # or "before the fault"


@dataclass
class Run:
    """One run: its domain, what the client measured, and its progress as it goes."""

    name: str
    domain: str
    latencies: list[float] = field(default_factory=list)  # seconds, measured by the client
    # A composed phase (its `demand` label) -> seconds from its due time to the reply that
    # composed it, measured by the client: what the serving model's TTFT and TPOT wait.
    waits: dict[int, float] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)  # composes sent / composed / refused
    stage: str = "waiting"
    started: float | None = None  # time.monotonic() when its demand began
    ended: float | None = None  # time.monotonic() when its last lease had run out
    gpus_held: int = 0  # from the run's KV view, for the progress view
    gpus: int = 0
    struck: list[str] = field(default_factory=list)  # what the storm failed
    whys: list[Why] = field(default_factory=list)

    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or time.monotonic()) - self.started


def demand(plan: Plan) -> list[Request]:
    rows = read_trace(trace_files())
    return compress(rows, seconds=plan.seconds, count=plan.requests, window=TRACE_WINDOW_S)


def boxes(hall: dict[str, Any]) -> dict[str, list[str]]:
    """host -> the GPUs in its box."""
    out: dict[str, list[str]] = {}
    for node in hall["nodes"]:
        if node.get("device_kind") == "gpu" and "box" in node.get("labels", {}):
            out.setdefault(node["labels"]["box"], []).append(node["id"])
    return out


def needed_gpu_seconds(request: Request) -> int:
    """The GPU-seconds a request's work needs: its prefill GPUs for a second, then a decode on
    one GPU (a box's eight do that work in an eighth of the time)."""
    return request.prefill_gpus * 1 + request.decode_seconds


def hbm_headroom(gpus: Sequence[str], hbm: dict[str, float]) -> float:
    """The GiB a box's HBM holds beyond the model's weights: room for a KV cache."""
    return sum(hbm[g] for g in gpus) - WEIGHTS_GIB


def best_box(
    request: Request,
    pods: dict[str, list[str]],
    hbm: dict[str, float],
    free: set[str],
    tried: set[str],
    skipped: set[str],
) -> str:
    """The box to try next for `request`: one whose HBM holds its KV cache before one that
    cannot (an H100 box's headroom is a third of an MI300X box's), then the most `free` GPUs;
    not one `tried`, nor one `skipped` (cut off) while another is left."""
    untried = [b for b in pods if b not in tried]
    candidates = [b for b in untried if b not in skipped] or untried
    return max(
        candidates,
        key=lambda box: (
            request.decode_gib <= hbm_headroom(pods[box], hbm),
            sum(g in free for g in pods[box]),
        ),
    )


def box_body(
    request: Request, box: str, gpus: Sequence[str], hbm: dict[str, float]
) -> dict[str, Any]:
    """The compose of a whole box for `request`: its GPUs, NIC and NVMe, leased for a prefill
    and a decode on all its GPUs (the serving model's rate, as its TTFT and TPOT count them)."""
    devices: list[dict[str, Any]] = [
        {"kind": "gpu", "count": len(gpus)},
        {"kind": "nic"},
        {"kind": "nvme"},
    ]
    headroom = hbm_headroom(gpus, hbm)
    if request.decode_gib > headroom:  # the rest would have to come from outside the box
        devices.append({"kind": "memory", "capacity_gib": request.decode_gib - headroom})
    return {
        "request_id": f"fixed-{uuid.uuid4().hex}",
        "host": box,
        "devices": devices,
        "constraints": {"labels": {"box": box}},
        "lease_seconds": request.seconds_on(len(gpus)),
        "labels": {
            "scheduler": "fixed-pods",
            "demand": str(request.number),
            "need_gpu_seconds": str(needed_gpu_seconds(request)),
        },
    }


async def _timed(run: Run, call: Any) -> Any:
    started = time.perf_counter()
    try:
        return await call
    finally:
        run.latencies.append(time.perf_counter() - started)


def _counted(run: Run, composed: bool) -> None:
    run.counts["sent"] += 1
    run.counts["composed" if composed else "refused"] += 1


async def _watch_gpus(run: Run, view: Any) -> None:
    """Keep the progress view's count of held GPUs from the scheduler's KV view."""
    while True:
        free = sum(map(len, view.free_gpus().values()))
        run.gpus = sum(d.kind == "gpu" for d in view.devices.values())
        run.gpus_held = run.gpus - free
        await asyncio.sleep(0.25)


async def drain(run: Run, requests: Sequence[Request]) -> None:
    """Wait until every lease has run out (the lease keeper ticks each second), the GPU
    watcher still counting what is held."""
    run.stage = "draining"
    await asyncio.sleep(max((r.seconds for r in requests), default=0) + 2.5)
    run.ended = time.monotonic()


async def pooled(nc: Any, prefix: str, run: Run, requests: Sequence[Request], plan: Plan) -> None:
    """The example scheduler composes each phase from the pools; its policy releases what the
    engine could not repair (it tracks each placement, so it knows the composition is its own).
    A phase is placed once, at its due time: nothing is placed again."""
    ex = example_scheduler()
    scheduler = ex.Scheduler(nc, domain=run.domain, tenant="pooled", prefix=prefix, lease_slack=0)
    await scheduler.start()
    start = run.started = time.monotonic()
    watcher = asyncio.create_task(_watch_gpus(run, scheduler.view))

    async def phase(number: int, at: float, wanted: Any) -> bool:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        now = time.monotonic()
        placement = ex.Placement(number, wanted, now, now + wanted.seconds)
        scheduler.placements.append(placement)
        composed = bool(await _timed(run, scheduler.compose(placement)))
        _counted(run, composed)
        if composed:
            run.waits[number] = time.monotonic() - (start + at)
        return composed

    async def one(request: Request) -> None:
        prefill = ex.Demand(gpus=request.prefill_gpus, seconds=PREFILL_SECONDS)
        if not await phase(2 * request.number, request.at, prefill):
            return
        decode = ex.Demand(gpus=1, memory_gib=request.decode_gib, seconds=request.decode_seconds)
        await phase(2 * request.number + 1, request.at + PREFILL_SECONDS, decode)

    try:
        await asyncio.gather(*(one(r) for r in requests), storm(nc, prefix, run, plan))
        await drain(run, requests)
    finally:
        watcher.cancel()
        await scheduler.stop(release=False)  # leases ended what was held


async def fixed(
    nc: Any, prefix: str, run: Run, requests: Sequence[Request], plan: Plan, hall: dict[str, Any]
) -> None:
    """One whole box per request, or a refusal; no pooled memory, no repair.

    Its scheduler chooses a box whose HBM holds the request's KV cache, the one with the most
    free GPUs in its KV view (best_box). A box whose compose found no path (its tray cut off by
    the storm) is skipped for a while, and the request tries the next box, BOX_TRIES in all."""
    ex = example_scheduler()
    view = ex.Scheduler(nc, domain=run.domain, tenant="fixed", prefix=prefix)
    await view.start()  # only its local view of free GPUs is used
    client = TrellisClient(nc, prefix=prefix)
    hbm = {n["id"]: n.get("memory_gib") or 0.0 for n in hall["nodes"]}
    pods = boxes(hall)
    cut_off: dict[str, float] = {}  # box -> until when it is skipped
    start = run.started = time.monotonic()
    watcher = asyncio.create_task(_watch_gpus(run, view.view))

    async def one(request: Request) -> None:
        await asyncio.sleep(max(0.0, start + request.at - time.monotonic()))
        tried: set[str] = set()
        for _ in range(BOX_TRIES):
            free = {g for ids in view.view.free_gpus().values() for g in ids}
            skipped = {b for b, until in cut_off.items() if until > time.monotonic()}
            box = best_box(request, pods, hbm, free, tried, skipped)
            tried.add(box)
            body = box_body(request, box, pods[box], hbm)
            reply = await _timed(run, client.intent(run.domain, "fixed", "compose", body))
            if reply["ok"]:
                view.view.took(reply["result"]["composition_id"], reply["result"]["devices"])
                _counted(run, True)
                run.waits[request.number] = time.monotonic() - (start + request.at)
                return
            if reply["error"]["code"] != "no_path":
                break  # no whole box free, or none left whose HBM holds the KV cache: refused
            cut_off[box] = time.monotonic() + CUT_OFF_S
        _counted(run, False)

    try:
        await asyncio.gather(*(one(r) for r in requests), storm(nc, prefix, run, plan))
        await drain(run, requests)
    finally:
        watcher.cancel()
        await view.stop(release=False)


async def busiest_tray(client: TrellisClient, domain: str) -> tuple[str, str | None]:
    """The GPU tray whose switch the most of `domain`'s connections cross now, and one
    composition that crosses it."""
    reply = await client.query(domain, "connections", {})
    crossing: Counter[str] = Counter()
    example: dict[str, str] = {}
    for row in reply["result"]["connections"] if reply["ok"] else []:
        for part in row["path"]:
            if part.startswith(TRAY):
                crossing[part] += 1
                example.setdefault(part, row["composition_id"])
    if not crossing:
        return "tray-host-r1-1", None
    tray = max(sorted(crossing), key=lambda t: crossing[t])
    return tray, example[tray]


async def ask_why(client: TrellisClient, run: Run, id: str, moment: str = "in the storm") -> None:
    reply = await client.query(run.domain, "why", {"id": id})
    at = round(run.elapsed(), 1)
    if reply["ok"]:
        result = reply["result"]
        chain = [entry["type"] for entry in result["chain"]]
        run.whys.append(Why(at, id, result["text"], chain, moment))
    else:
        run.whys.append(Why(at, id, reply["error"]["message"], [], moment))


async def storm(nc: Any, prefix: str, run: Run, plan: Plan) -> None:
    """The busiest GPU tray's switch and a group of OCS ports fail midway, and heal later;
    `why` is asked about the tray before it fails, and about it and a composition that
    crossed it while they are down."""
    client = TrellisClient(nc, prefix=prefix)
    await asyncio.sleep(plan.storm_at)
    tray, composition = await busiest_tray(client, run.domain)
    run.struck = [tray, *STORM_PORTS]
    # What the tray carries just before it fails: the repairs that come with the fault move
    # what they can at once, and the tray then carries nothing.
    await ask_why(client, run, tray, "before the fault")
    run.stage = "storm"
    for component in run.struck:
        fault = {"component": component, "state": "failed", "detail": "economics storm"}
        await client.admin(run.domain, "report-fault", fault)
    # Asked as soon as the faults are recorded: the repairs came in the same commits, and the
    # composition is still held (phases last seconds).
    await ask_why(client, run, tray)
    if composition is not None:
        await ask_why(client, run, composition)
    await asyncio.sleep(max(0.0, plan.storm_at + plan.storm_for - run.elapsed()))
    for component in run.struck:
        await client.admin(run.domain, "report-fault", {"component": component, "state": "healthy"})
    run.stage = "healed"


async def log_of(store: Any, domain: str) -> list[dict[str, Any]]:
    """The domain's events as `{"type", "at", "position", "data"}`, from Postgres."""
    return [
        {"type": e.type, "at": e.recorded_at, "position": e.position, "data": json.loads(e.data)}
        async for e in store.read(domain)
    ]


async def history(client: TrellisClient, domain: str, position: int) -> list[dict[str, Any]]:
    reply = await client.query(domain, "history", {"min_position": position})
    if not reply["ok"]:
        raise RuntimeError(f"history of {domain}: {reply['error']['message']}")
    intervals: list[dict[str, Any]] = reply["result"]["intervals"]
    return intervals
