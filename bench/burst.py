"""Bursty real demand (issue 11 item 5): Azure's production LLM inference trace replayed as
compositions against a real engine on the 4,096-device fabric, sped up, with a switch fault in
the middle.

Data: the Azure LLM inference trace 2023 (`AzureLLMInferenceTrace_conv.csv` and `_code.csv`:
TIMESTAMP, ContextTokens, GeneratedTokens), from Azure/AzurePublicDataset
(https://github.com/Azure/AzurePublicDataset, commit b469a113cedca53ddc3bdea71a143dc4b7d8700c),
licensed CC-BY 4.0; the data of Patel, Choukse, Zhang, Shah, Goiri, Maleki and Bianchini,
"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024. Read from
`--trace-dir` (default: `data/azure-llm-trace-2023` in the repo, else `../shared/data/...`).

- Trace: both services merged in time order, `--minutes` of it from `--start` minutes after
  both have begun, replayed open-loop `--speedup` times faster than recorded.
- Each request becomes one compose (tenant `conv-<k>` or `code-<k>`, k < 4, and a host drawn
  at random, seeded): prefill GPUs by prompt length, one per `--tokens-per-gpu` context tokens
  (at least 1, at most `--max-gpus`), each with `--gpu-gbps` reserved; a context of
  `--long-context` tokens or more also takes a memory slice for its KV cache
  (`{"kind": "memory", "capacity_gib": ceil(tokens x 320 KiB)}`, Llama-2-70B's KV bytes per
  token, at `--memory-gbps`). Its service time (a plain model, not Splitwise's measurements):
  prompt / (5,000 tokens/s per GPU) + generated tokens x 50 ms, divided by the speedup (times
  `--hold-scale`, default 1). `lease_seconds` is that, rounded up to whole seconds (at least
  1, the contract's smallest lease). Every `--expire-every`-th request (default 10th) is left
  to its lease, which the engine's lease keeper ends; every other is released by the bench
  when its service time ends after the compose reply.
- At most `--in-flight` intents (composes and releases) are outstanding at once; an arrival
  beyond that waits for a slot, so "queued" (scheduled arrival to reply) can exceed "compose"
  (sent to reply).
- Fault: at `--fault-at` of the window (trace time) the switch on the most live paths is
  reported `failed` (admin `report-fault`); at `--heal-at` it is reported `healthy`. The
  replies name the compositions touched and those left impaired: repaired = touched minus
  impaired; the log's PathRerouted / DeviceReplaced / CompositionImpaired are counted too.
- Bursts: the trace is cut into `--window`-second windows (trace time); a window whose
  arrival count is over `--burst-factor` (1.5) times the median window's is a burst, the rest
  calm. A compose belongs to the window of its scheduled arrival.
- Utilization: the `free` query (GPUs, and memory's free GiB) sampled every `--sample-every`
  seconds of wall time; held = total minus free (the bench faults no device, so every device
  stays in the free list's universe).
- Floor: bench/intents.py's clean floor (one NATS request-reply whose responder commits one
  row), half before the engine starts and half after it stopped; its functions are imported.
  Latencies are printed beside it as ratios.

Every compose reply is checked (ok: `active` on the asked host with the asked devices;
rejections counted by code and, for `no_capacity` / `no_path`, by the funnel stage that
emptied); at the end the log must agree (releases = activated composes, lease expiries = those
the bench did not release, rejections recorded) and the simulated fabric must hold nothing.
Uses TRELLIS_NATS_URL / TRELLIS_DATABASE_URL when set, else embedded servers; a fresh schema
(dropped afterwards) and subject prefix. The last line printed is one JSON object with every
figure.

    python bench/burst.py                            # ~85 s on 2 cores
    python bench/burst.py --minutes 2 --speedup 20   # a short look
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path as FsPath
from typing import Any

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

from nats.errors import TimeoutError as NatsTimeout

from bench.fabrics import World, build, document
from bench.intents import (
    BenchFailure,
    CpuMeter,
    Probe,
    conn_info,
    floor_noise,
    floor_setup,
    fresh_schema,
    percentile,
    progress,
    servers,
    settle,
    stats,
    timed_ms,
)
from trellis.adapters.bootstrap import RunningEngine, engine_on
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.settings import Settings

REPO = FsPath(__file__).resolve().parents[1]
TRACE_DIRS = [REPO / "data/azure-llm-trace-2023", REPO / "../shared/data/azure-llm-trace-2023"]
DOMAIN = "burst"
KV_BYTES_PER_TOKEN = 80 * 8 * 128 * 2 * 2  # Llama-2-70B: layers x KV heads x dim x (K, V) x fp16
PREFILL_TOKENS_PER_S = 5000.0  # per GPU
DECODE_S_PER_TOKEN = 0.050
MEMORY_POOL_GIB = 256.0  # each pooled memory device of the fabric
REJECTIONS = ("no_capacity", "no_path", "quota")


# ---- the trace ----


@dataclass
class Request:
    index: int
    at: float  # trace seconds since the window's start
    service: str  # "conv" or "code"
    context: int
    generated: int
    tenant: str
    host: str
    gpus: int
    memory_gib: float  # 0: no slice
    hold_s: float  # wall seconds it holds its devices after the compose reply
    lease: int
    expire: bool  # left to its lease
    burst: bool = False
    # what happened
    due: float = math.nan  # scheduled arrival, loop time
    sent: float = math.nan
    replied: float = math.nan
    code: str = ""  # "" ok, else the error code (or "timeout")
    stage: str = ""
    cid: str = ""
    paths: list[list[str]] = field(default_factory=list)
    impaired: bool = False  # answered `impaired`
    retries: int = 0  # resends after `unavailable` or a timeout, same request_id
    release_ms: float = math.nan
    release_code: str = ""

    @property
    def compose_ms(self) -> float:
        return (self.replied - self.sent) * 1000


def trace_dir(given: str | None) -> FsPath:
    for d in [FsPath(given)] if given else TRACE_DIRS:
        if (d / "AzureLLMInferenceTrace_conv.csv").exists():
            return d.resolve()
    raise SystemExit(f"no Azure LLM trace in {given or ' or '.join(map(str, TRACE_DIRS))}")


def load_trace(
    directory: FsPath, start_min: float, minutes: float
) -> list[tuple[float, str, int, int]]:
    """(seconds since the window's start, service, context, generated), in time order: both
    services merged, the window opening `start_min` minutes after the later of their first
    requests."""
    rows: list[tuple[datetime, str, int, int]] = []
    firsts = []
    for service in ("conv", "code"):
        with open(directory / f"AzureLLMInferenceTrace_{service}.csv", newline="") as f:
            part = [
                (
                    datetime.fromisoformat(r["TIMESTAMP"][:26]),
                    service,
                    int(r["ContextTokens"]),
                    int(r["GeneratedTokens"]),
                )
                for r in csv.DictReader(f)
            ]
        firsts.append(min(p[0] for p in part))
        rows += part
    rows.sort()
    origin = max(firsts)
    out = []
    for t, service, ctx, gen in rows:
        at = (t - origin).total_seconds() - start_min * 60
        if 0 <= at < minutes * 60:
            out.append((at, service, ctx, gen))
    return out


def requests(rows: list[tuple[float, str, int, int]], hosts: list[str], args: Any) -> list[Request]:
    rng = random.Random(args.seed)
    out = []
    for i, (at, service, ctx, gen) in enumerate(rows):
        gpus = min(args.max_gpus, max(1, math.ceil(ctx / args.tokens_per_gpu)))
        memory = (
            float(math.ceil(ctx * KV_BYTES_PER_TOKEN / 2**30)) if ctx >= args.long_context else 0.0
        )
        service_s = ctx / (PREFILL_TOKENS_PER_S * gpus) + gen * DECODE_S_PER_TOKEN
        hold = service_s * args.hold_scale / args.speedup
        out.append(
            Request(
                index=i,
                at=at,
                service=service,
                context=ctx,
                generated=gen,
                tenant=f"{service}-{rng.randrange(4)}",
                host=rng.choice(hosts),
                gpus=gpus,
                memory_gib=memory,
                hold_s=hold,
                lease=max(1, math.ceil(hold)),
                expire=args.expire_every > 0 and i % args.expire_every == args.expire_every - 1,
            )
        )
    return out


def mark_bursts(reqs: list[Request], minutes: float, window: float, factor: float) -> dict:
    """Flag each request whose window's arrivals exceed `factor` x the median window's."""
    n = max(1, math.ceil(minutes * 60 / window))
    counts = [0] * n
    for r in reqs:
        counts[min(n - 1, int(r.at // window))] += 1
    median = statistics.median(counts)
    burst = [c > factor * median for c in counts]
    for r in reqs:
        r.burst = burst[min(n - 1, int(r.at // window))]
    return {
        "window_s": window,
        "windows": n,
        "median_per_window": median,
        "threshold_per_window": factor * median,
        "burst_windows": sum(burst),
        "max_per_window": max(counts),
        "requests_in_bursts": sum(r.burst for r in reqs),
    }


# ---- checks ----


def check_compose(r: Request, reply: dict[str, Any]) -> None:
    """Record the outcome of one compose; a reply that is neither a success nor a rejection
    the engine may give under load is a bench failure."""
    if reply.get("ok"):
        res = reply.get("result") or {}
        devices = res.get("devices", [])
        kinds = sorted(d.get("kind") for d in devices)
        want = sorted(["gpu"] * r.gpus + (["memory"] if r.memory_gib else []))
        # `impaired`: a fault struck one of its paths between the reservation and the reply.
        state = res.get("state")
        if state not in ("active", "impaired") or res.get("host") != r.host or kinds != want:
            raise BenchFailure(f"compose {r.index}: {json.dumps(reply)[:600]}")
        r.impaired = state == "impaired"
        r.cid = res["composition_id"]
        r.paths = [d.get("path", []) for d in devices]
        return
    error = reply.get("error") or {}
    r.code = error.get("code", "?")
    if r.code in ("invalid", "not_found", "forbidden"):
        raise BenchFailure(f"compose {r.index} refused as {r.code}: {json.dumps(reply)[:600]}")
    funnel = (error.get("details") or {}).get("funnel") or []
    r.stage = next(
        (s["stage"] for s in funnel if s["remaining"] == 0), "host" if not funnel else ""
    )


# ---- the replay ----


class Replay:
    def __init__(self, clients: list[TrellisClient], reqs: list[Request], args: Any):
        self.clients = clients
        self.reqs = reqs
        self.args = args
        self.slots = asyncio.Semaphore(args.in_flight)
        self.live: dict[str, Request] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.t0 = 0.0
        self.samples: list[dict[str, float]] = []
        self.faults: list[dict[str, Any]] = []
        self.max_lag_s = 0.0
        self.stall_ms: list[float] = []

    def wall(self, trace_s: float) -> float:
        return self.t0 + trace_s / self.args.speedup

    def client(self, i: int) -> TrellisClient:
        return self.clients[i % len(self.clients)]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.t0 = loop.time() + 0.5
        end = self.args.minutes * 60
        side = [
            asyncio.create_task(self.sampler(end)),
            asyncio.create_task(self.fault(end)),
            asyncio.create_task(self.stalls(end)),
        ]
        for r in self.reqs:
            delay = self.wall(r.at) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.slots.acquire()
            r.due = self.wall(r.at)
            self.max_lag_s = max(self.max_lag_s, loop.time() - r.due)
            self.tasks.append(asyncio.create_task(self.one(r)))
        await asyncio.gather(*self.tasks, *side)  # the first BenchFailure ends the run

    async def call(self, r: Request, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        """One intent in a slot, resent with the same request_id (the contract's safe retry)
        after `unavailable` or a timeout, up to 3 times."""
        body = {"request_id": str(uuid.uuid4()), **body}
        for attempt in range(4):
            try:
                reply = await self.client(r.index).intent(DOMAIN, r.tenant, verb, body)
            except NatsTimeout:
                reply = {"ok": False, "error": {"code": "timeout"}}
            code = (reply.get("error") or {}).get("code")
            if code not in ("unavailable", "timeout") or attempt == 3:
                return reply
            r.retries += 1
            await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def one(self, r: Request) -> None:
        loop = asyncio.get_running_loop()
        devices: list[dict[str, Any]] = [
            {"kind": "gpu", "count": r.gpus, "bandwidth_gbps": self.args.gpu_gbps}
        ]
        if r.memory_gib:
            devices.append(
                {
                    "kind": "memory",
                    "capacity_gib": r.memory_gib,
                    "bandwidth_gbps": self.args.memory_gbps,
                }
            )
        body = {
            "host": r.host,
            "devices": devices,
            "lease_seconds": r.lease,
            "labels": {"workload": "prefill", "service": r.service},
            "reason": f"azure trace {r.service} request {r.index}",
        }
        r.sent = loop.time()
        try:
            reply = await self.call(r, "compose", body)
        finally:
            self.slots.release()
        r.replied = loop.time()
        check_compose(r, reply)
        if not r.cid:
            return
        self.live[r.cid] = r
        if r.expire:
            await asyncio.sleep(r.lease + 0.05)
            self.live.pop(r.cid, None)
            return
        await asyncio.sleep(r.hold_s)
        await self.slots.acquire()
        t = loop.time()
        try:
            released = await self.call(r, "release", {"composition_id": r.cid, "reason": "served"})
        finally:
            self.slots.release()
        r.release_ms = (loop.time() - t) * 1000
        self.live.pop(r.cid, None)
        if released.get("ok"):
            if (released.get("result") or {}).get("state") != "released":
                raise BenchFailure(f"release of {r.cid}: {json.dumps(released)[:600]}")
        else:
            # A release that arrives after the lease ran out (a slow compose) finds it gone.
            r.release_code = (released.get("error") or {}).get("code", "?")

    async def stalls(self, end: float) -> None:
        """How late the event loop (the engine's and the bench's) wakes a 50 ms sleep."""
        loop = asyncio.get_running_loop()
        while loop.time() < self.wall(end):
            t = loop.time()
            await asyncio.sleep(0.05)
            self.stall_ms.append((loop.time() - t - 0.05) * 1000)

    async def sampler(self, end: float) -> None:
        """Held GPUs and memory, from the `free` query, every `--sample-every` wall seconds."""
        loop = asyncio.get_running_loop()
        client = self.clients[-1]
        while loop.time() < self.wall(end) + 0.5:
            t = loop.time()
            try:
                gpus = await client.query(DOMAIN, "free", {"kind": "gpu"})
                memory = await client.query(DOMAIN, "free", {"kind": "memory"})
            except NatsTimeout:  # a missing sample, not a failed run
                gpus = memory = {}
            if gpus.get("ok") and memory.get("ok"):
                self.samples.append(
                    {
                        "trace_s": (t - self.t0) * self.args.speedup,
                        "free_gpus": len(gpus["result"]["devices"]),
                        "free_gib": sum(d["free_gib"] for d in memory["result"]["devices"]),
                        "query_ms": (loop.time() - t) * 1000,
                    }
                )
            await asyncio.sleep(max(0.0, self.args.sample_every - (loop.time() - t)))

    async def fault(self, end: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self.wall(self.args.fault_at * end) - loop.time()))
        on: dict[str, int] = {}
        for r in list(self.live.values()):
            for switch in {n for p in r.paths for n in p if "-spine" in n or "-leaf" in n}:
                on[switch] = on.get(switch, 0) + 1
        switch = max(sorted(on), key=lambda s: on[s]) if on else "p00-r0-spine0"
        client = self.clients[0]
        for state, at in (("failed", self.args.fault_at), ("healthy", self.args.heal_at)):
            await asyncio.sleep(max(0.0, self.wall(at * end) - loop.time()))
            t = loop.time()
            body = {"request_id": str(uuid.uuid4()), "component": switch, "state": state}
            for _ in range(4):  # resent with the same request_id, like the intents
                try:
                    reply = await client.admin(DOMAIN, "report-fault", body)
                except NatsTimeout:
                    reply = {"ok": False, "error": {"code": "timeout"}}
                if (reply.get("error") or {}).get("code") not in ("unavailable", "timeout"):
                    break
            if not reply.get("ok"):
                raise BenchFailure(f"report-fault {switch} {state}: {reply}")
            res = reply["result"]
            touched, impaired = res.get("compositions", []), res.get("impaired", [])
            self.faults.append(
                {
                    "switch": switch,
                    "state": state,
                    "trace_s": (t - self.t0) * self.args.speedup,
                    "live_paths_on_it": on.get(switch, 0),
                    "reply_ms": (loop.time() - t) * 1000,
                    "touched": len(touched),
                    "impaired": len(impaired),
                    "repaired": len(touched) - len(impaired),
                }
            )
            progress(
                f"  fault: {switch} {state}: {len(touched)} compositions touched, "
                f"{len(impaired)} left impaired, reply in {self.faults[-1]['reply_ms']:.0f} ms"
            )


# ---- the run ----


async def verify(running: RunningEngine, reqs: list[Request], warmup: int) -> dict[str, Any]:
    """The log agrees with the replies (and the warm-up's pairs); nothing is left live or
    held."""
    async with running.projections.pool.acquire() as conn:
        rows = await conn.fetch("SELECT type, count(*) AS n FROM trellis_events GROUP BY type")
    counts = {r["type"]: r["n"] for r in rows}
    ok = [r for r in reqs if r.cid]
    released = [r for r in ok if not r.expire and not r.release_code]
    rejected = [r for r in reqs if r.code in REJECTIONS]
    composed = len(ok) + warmup
    problems = []
    if counts.get("CompositionReleased", 0) != composed:
        problems.append(f"{counts.get('CompositionReleased', 0)} released, {composed} composed")
    if counts.get("LeaseExpired", 0) != len(ok) - len(released):
        problems.append(
            f"{counts.get('LeaseExpired', 0)} leases expired, {len(ok) - len(released)} left to"
        )
    if counts.get("CompositionActivated", 0) < composed:
        problems.append(f"{counts.get('CompositionActivated', 0)} activated, {composed} composed")
    if counts.get("CompositionRejected", 0) != len(rejected):
        problems.append(
            f"{counts.get('CompositionRejected', 0)} recorded rejections, {len(rejected)}"
        )
    state = running.engine.state(DOMAIN)
    live = [c for c in state.compositions.values() if c.state != "released"] if state else []
    if live:
        problems.append(f"{len(live)} compositions not released")
    snapshot = await running.fabric.snapshot(DOMAIN)
    held = len(snapshot.bindings) + len(snapshot.circuits)
    if held:
        problems.append(f"the simulated fabric still holds {held} bindings or circuits")
    return {"event_counts": counts, "problems": problems}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.from_env()
    directory = trace_dir(args.trace_dir)
    world: World = build(1)
    doc = document(world, MEMORY_POOL_GIB)
    reqs = requests(load_trace(directory, args.start, args.minutes), world.hosts, args)
    if not reqs:
        raise SystemExit("the trace window holds no request")
    bursts = mark_bursts(reqs, args.minutes, args.window, args.burst_factor)
    n_gpus = sum(1 for d in world.devices.values() if d.kind == "gpu")
    n_pools = sum(1 for d in world.devices.values() if d.kind == "memory")
    result: dict[str, Any] = {
        "bench": "burst",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "nats": "configured" if settings.nats_url else "embedded",
        "postgres": "configured" if settings.database_url else "embedded",
        "trace": {
            "dir": str(directory),
            "start_min": args.start,
            "minutes": args.minutes,
            "speedup": args.speedup,
            "requests": len(reqs),
            "rate_per_s_wall": len(reqs) / (args.minutes * 60) * args.speedup,
            "with_memory": sum(1 for r in reqs if r.memory_gib),
            "gpus_asked": sum(r.gpus for r in reqs),
            "left_to_lease": sum(r.expire for r in reqs),
            "bursts": bursts,
        },
        "fabric": {
            "devices": world.device_count,
            "gpus": n_gpus,
            "memory_pools": n_pools,
            "memory_gib": n_pools * MEMORY_POOL_GIB,
            "failed_links": len(world.conditions.unusable),
        },
        "knobs": {k: v for k, v in vars(args).items() if k not in ("trace_dir",)},
    }
    progress(
        f"trace: {len(reqs)} requests in {args.minutes:g} min from {directory}, "
        f"{result['trace']['rate_per_s_wall']:.0f}/s at {args.speedup:g}x; "
        f"{bursts['burst_windows']} of {bursts['windows']} windows are bursts"
    )
    started = time.perf_counter()
    async with (
        servers(settings) as (nats_url, database_url, owner_url, _monitor),
        fresh_schema(owner_url, args.keep) as schema,
    ):
        prefix = f"b{uuid.uuid4().hex[:12]}"
        async with conn_info(owner_url) as info:
            result["server"] = info
        combined, nats_only, pg_only, _, close_floor = await floor_setup(
            nats_url, owner_url, schema, prefix
        )
        chunks: list[list[float]] = []
        half = max(50, args.floor_samples // 2)
        try:
            progress(f"floor: {half} samples before the engine, {half} after ...")
            await timed_ms(combined, 50, 5)  # warm-up
            chunks.append(await timed_ms(combined, half, args.budget / 2))
            parts_nats = await timed_ms(nats_only, half // 2, args.budget / 4)
            parts_pg = await timed_ms(pg_only, half // 2, args.budget / 4)
            settings = Settings(
                nats_url=nats_url,
                database_url=database_url,
                database_owner_url=owner_url,
                db_schema=schema,
                subject_prefix=prefix,
            )
            async with engine_on(settings) as running:
                probe = Probe(running)
                ncs = [await connect_nats(nats_url, name=f"bench-burst-{i}") for i in range(4)]
                try:
                    clients = [TrellisClient(nc, prefix=prefix, timeout=30) for nc in ncs]
                    t = time.perf_counter()
                    reply = await clients[0].admin(DOMAIN, "import-topology", doc)
                    if not reply.get("ok"):
                        raise BenchFailure(f"import: {json.dumps(reply)[:600]}")
                    result["import_s"] = time.perf_counter() - t
                    for link in sorted(world.conditions.unusable):
                        reply = await clients[0].admin(
                            DOMAIN, "report-fault", {"component": link, "state": "failed"}
                        )
                        if not reply.get("ok"):
                            raise BenchFailure(f"fault {link}: {reply}")
                    progress(f"engine: fabric imported in {result['import_s']:.1f} s; warm-up ...")
                    for i in range(args.warmup):
                        body = {
                            "host": world.hosts[i % len(world.hosts)],
                            "devices": [{"kind": "gpu"}],
                        }
                        c = await clients[0].intent(DOMAIN, "warmup", "compose", body)
                        cid = (c.get("result") or {}).get("composition_id")
                        if not c.get("ok") or not cid:
                            raise BenchFailure(f"warm-up compose: {c}")
                        await clients[0].intent(
                            DOMAIN, "warmup", "release", {"composition_id": cid}
                        )
                    await settle(running, [DOMAIN])
                    progress(f"replay: {args.minutes * 60 / args.speedup:.0f} s of wall time ...")
                    mark = probe.mark()
                    meter = CpuMeter()
                    replay = Replay(clients, reqs, args)
                    t = time.perf_counter()
                    await replay.run()
                    result["replay_s"] = time.perf_counter() - t
                    result["cpu"] = meter.read()
                    result["engine"] = probe.since(mark)
                    result["max_dispatch_lag_s"] = replay.max_lag_s
                    result["loop_stall"] = stats(replay.stall_ms)
                    progress("replay done; waiting for leases and followers ...")
                    await asyncio.sleep(1.5)  # the lease keeper's next tick
                    try:
                        # Bounded: an engine that lost its writer lease under load may never
                        # settle (see docs/benchmarks.md); the figures are printed anyway.
                        await asyncio.wait_for(settle(running, [DOMAIN]), 120)
                        check = await asyncio.wait_for(verify(running, reqs, args.warmup), 60)
                    except TimeoutError:
                        check = {
                            "event_counts": {},
                            "problems": ["the engine did not settle within 120 s after the replay"],
                        }
                finally:
                    for nc in ncs:
                        await nc.close()
            chunks.append(await timed_ms(combined, half, args.budget / 2))
        finally:
            await close_floor()
    result["seconds"] = time.perf_counter() - started
    result["floor"] = stats([ms for c in chunks for ms in c])
    result["floor_chunks_p50_ms"] = [percentile(c, 50) for c in chunks]
    result["floor_noise"] = floor_noise(result["floor"], result["floor_chunks_p50_ms"])
    result["floor_parts"] = {"nats_request_reply": stats(parts_nats), "pg_commit": stats(parts_pg)}
    result["check"] = check
    result["faults"] = replay.faults
    result["engine_warnings"] = [w for w in WARNINGS.lines if "superuser" not in w]
    figures(result, reqs, replay.samples, args, n_gpus, n_pools * MEMORY_POOL_GIB)
    return result


# ---- figures ----


def figures(
    result: dict[str, Any],
    reqs: list[Request],
    samples: list[dict[str, float]],
    args: Any,
    n_gpus: int,
    memory_gib: float,
) -> None:
    floor = result["floor"]
    answered = [r for r in reqs if not math.isnan(r.replied) and r.code != "timeout"]
    ok = [r for r in answered if r.cid]
    groups = {
        "all": ok,
        "calm": [r for r in ok if not r.burst],
        "burst": [r for r in ok if r.burst],
    }
    latency: dict[str, Any] = {}
    for name, rs in groups.items():
        s = stats([r.compose_ms for r in rs])
        queued = stats([(r.replied - r.due) * 1000 for r in rs])
        s["queued_p50_ms"], s["queued_p99_ms"] = queued["p50_ms"], queued["p99_ms"]
        for q in ("p50", "p99", "p999"):
            s[f"{q}_over_floor"] = s[f"{q}_ms"] / floor[f"{q}_ms"]
        latency[name] = s
    releases = [r.release_ms for r in reqs if not math.isnan(r.release_ms) and not r.release_code]
    latency["release"] = stats(releases)
    for q in ("p50", "p99", "p999"):
        latency["release"][f"{q}_over_floor"] = latency["release"][f"{q}_ms"] / floor[f"{q}_ms"]
    result["latency"] = latency

    reasons: dict[str, int] = {}
    for r in reqs:
        if r.code:
            key = f"{r.code}: {r.stage}" if r.stage else r.code
            reasons[key] = reasons.get(key, 0) + 1
    late: dict[str, int] = {}
    for r in reqs:
        if r.release_code:
            late[r.release_code] = late.get(r.release_code, 0) + 1
    result["outcomes"] = {
        "requests": len(reqs),
        "active": len(ok),
        "rejected": sum(1 for r in reqs if r.code),
        "answered_impaired": sum(1 for r in ok if r.impaired),
        "resends": sum(r.retries for r in reqs),
        "by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "rejected_in_bursts": sum(1 for r in reqs if r.code and r.burst),
        "released_by_bench": sum(1 for r in ok if not r.expire and not r.release_code),
        "left_to_lease": sum(1 for r in ok if r.expire),
        "release_refused": late,
    }

    counts = result["check"]["event_counts"]
    result["repair"] = {
        "faults": result["faults"],
        "log": {
            k: counts.get(k, 0)
            for k in ("CompositionImpaired", "PathRerouted", "DeviceReplaced", "CompositionFailed")
        },
    }

    # Utilization over time, in `args.slices` slices of the trace window.
    end = args.minutes * 60
    n = args.slices
    rows = []
    for i in range(n):
        lo, hi = end * i / n, end * (i + 1) / n
        arrived = [r for r in reqs if lo <= r.at < hi]
        done = [r for r in arrived if r.cid]
        ss = [s for s in samples if lo <= s["trace_s"] < hi]
        gpu_held = [1 - s["free_gpus"] / n_gpus for s in ss]
        mem_held = [1 - s["free_gib"] / memory_gib for s in ss]
        rows.append(
            {
                "from_s": lo,
                "to_s": hi,
                "arrivals_per_s": len(arrived) / (hi - lo),
                "burst_share": sum(r.burst for r in arrived) / len(arrived) if arrived else 0.0,
                "active": len(done),
                "rejected": sum(1 for r in arrived if r.code),
                "compose_p50_ms": percentile([r.compose_ms for r in done], 50),
                "compose_p99_ms": percentile([r.compose_ms for r in done], 99),
                "gpu_held_mean": statistics.fmean(gpu_held) if gpu_held else math.nan,
                "gpu_held_max": max(gpu_held, default=math.nan),
                "memory_held_mean": statistics.fmean(mem_held) if mem_held else math.nan,
                "fault": ",".join(f["state"] for f in result["faults"] if lo <= f["trace_s"] < hi),
            }
        )
    result["utilization"] = {
        "slices": rows,
        "samples": len(samples),
        "free_query_p50_ms": percentile([s["query_ms"] for s in samples], 50),
        "gpu_held_series": [round(1 - s["free_gpus"] / n_gpus, 4) for s in samples],
        "memory_held_series": [round(1 - s["free_gib"] / memory_gib, 5) for s in samples],
    }


SPARK = " ▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    if not values:
        return ""
    step = max(1, math.ceil(len(values) / width))
    vals = [max(values[i : i + step]) for i in range(0, len(values), step)]
    top = max(vals) or 1.0
    return "".join(SPARK[min(8, round(v / top * 8))] for v in vals)


def report(result: dict[str, Any]) -> None:
    floor, lat, out, tr = result["floor"], result["latency"], result["outcomes"], result["trace"]
    b = tr["bursts"]
    print(
        f"trace: {tr['requests']} requests, {tr['minutes']:g} min from {tr['start_min']:g} min, "
        f"{tr['speedup']:g}x ({tr['rate_per_s_wall']:.0f}/s wall); bursts: {b['burst_windows']} "
        f"of {b['windows']} windows of {b['window_s']:g} s over {b['threshold_per_window']:.0f} "
        f"arrivals (1.5x the median {b['median_per_window']:g}), {b['requests_in_bursts']} requests"
    )
    head = (
        f"{'':>14} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>8} {'max ms':>8} "
        f"{'p50/floor':>9} {'p99/floor':>9} {'p99.9/fl':>9} {'queued p50':>10} {'queued p99':>10}"
    )
    print(head)
    print("-" * len(head))
    print(
        f"{'floor (clean)':>14} {floor['n']:>6} {floor['p50_ms']:>8.2f} {floor['p99_ms']:>8.2f} "
        f"{floor['p999_ms']:>8.2f} {floor['max_ms']:>8.2f} {'1.0x':>9} {'1.0x':>9} {'1.0x':>9}"
    )
    for name in ("all", "calm", "burst", "release"):
        s = lat[name]
        label = f"compose {name}" if name != "release" else "release"
        queued = (
            f" {s['queued_p50_ms']:>10.1f} {s['queued_p99_ms']:>10.1f}" if name != "release" else ""
        )
        print(
            f"{label:>14} {s['n']:>6} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['p999_ms']:>8.2f} "
            f"{s['max_ms']:>8.2f} {s['p50_over_floor']:>8.1f}x {s['p99_over_floor']:>8.1f}x "
            f"{s['p999_over_floor']:>8.1f}x{queued}"
        )
    print(
        "compose: sent to reply (reserve, fabric, settle); queued: scheduled arrival to reply "
        "(waiting for one of the in-flight slots included)."
    )
    print()
    print(
        f"outcomes: {out['active']} active ({out['answered_impaired']} answered impaired), "
        f"{out['rejected']} rejected "
        f"({out['rejected_in_bursts']} in bursts); released by the bench "
        f"{out['released_by_bench']}, left to their lease {out['left_to_lease']}"
        + (f", release refused {out['release_refused']}" if out["release_refused"] else "")
        + f"; {out['resends']} resends after unavailable or a timeout"
    )
    for reason, count in out["by_reason"].items():
        print(f"  rejected {reason}: {count} ({count / out['requests'] * 100:.1f}%)")
    for f in result["repair"]["faults"]:
        print(
            f"fault: {f['switch']} {f['state']} at {f['trace_s']:.0f} s (trace; "
            f"{f['live_paths_on_it']} live compositions on it when chosen): "
            f"{f['touched']} touched, {f['repaired']} "
            f"repaired, {f['impaired']} left impaired; reply {f['reply_ms']:.0f} ms"
        )
    log = result["repair"]["log"]
    print("log: " + ", ".join(f"{k} {v}" for k, v in log.items()))
    print()
    u = result["utilization"]
    head = (
        f"{'trace s':>11} {'arr/s':>6} {'burst':>5} {'active':>6} {'rej':>4} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'GPU held':>8} {'GPU max':>7} {'mem held':>8} fault"
    )
    print(head)
    print("-" * len(head))
    for row in u["slices"]:
        print(
            f"{row['from_s']:>5.0f}-{row['to_s']:<5.0f} {row['arrivals_per_s']:>6.1f} "
            f"{row['burst_share'] * 100:>4.0f}% {row['active']:>6} {row['rejected']:>4} "
            f"{row['compose_p50_ms']:>7.1f} {row['compose_p99_ms']:>7.1f} "
            f"{row['gpu_held_mean'] * 100:>7.1f}% {row['gpu_held_max'] * 100:>6.1f}% "
            f"{row['memory_held_mean'] * 100:>7.2f}% {row['fault']}"
        )
    print(
        f"GPU held  |{sparkline(u['gpu_held_series'])}| max "
        f"{max(u['gpu_held_series'], default=0) * 100:.1f}% of {result['fabric']['gpus']}"
    )
    print(
        f"mem held  |{sparkline(u['memory_held_series'])}| max "
        f"{max(u['memory_held_series'], default=0) * 100:.2f}% of "
        f"{result['fabric']['memory_gib']:.0f} GiB"
    )
    print(
        f"arr/s: arrivals per trace second; burst: share of them in burst windows; utilization "
        f"from {u['samples']} `free` samples (p50 {u['free_query_p50_ms']:.0f} ms each)."
    )
    e, cpu = result["engine"], result["cpu"]
    print(
        f"engine: {e['transactions']} commits of {e['replies_per_tx']:.1f} replies; replay "
        f"{result['replay_s']:.1f} s wall (max dispatch lag {result['max_dispatch_lag_s']:.2f} s; "
        f"event loop late by p50 {result['loop_stall']['p50_ms']:.1f}, p99 "
        f"{result['loop_stall']['p99_ms']:.0f}, max {result['loop_stall']['max_ms']:.0f} ms); "
        f"process CPU {cpu['process_cpu_share'] * 100:.0f}% of a core, machine busy "
        f"{cpu['machine_busy_share'] * 100:.0f}%"
    )
    chunks = result["floor_chunks_p50_ms"]
    print(
        f"floor: p50 before the engine and after it {', '.join(f'{c:.2f}' for c in chunks)} ms"
        + (
            f"; NOISY: {result['floor_noise']} (ratios are indicative only)"
            if result["floor_noise"]
            else ""
        )
    )
    for w in result["engine_warnings"]:
        print(f"engine warning: {w}")
    problems = result["check"]["problems"]
    print("checks: " + ("every reply and the log agree" if not problems else "; ".join(problems)))
    print(json.dumps(result, separators=(",", ":"), default=str))


class Warnings(logging.Handler):
    """The engine's warnings during the run (a lost writer lease, say), kept for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("engine", "adapters", "projections")):
            self.lines.append(f"{record.name}: {record.getMessage()}"[:300])


WARNINGS = Warnings()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace-dir", help="the folder with the two CSV files")
    parser.add_argument("--start", type=float, default=0.0, help="minutes into the trace")
    parser.add_argument("--minutes", type=float, default=12.0, help="of trace to replay")
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--hold-scale", type=float, default=1.0, help="x every service time")
    parser.add_argument("--tokens-per-gpu", type=int, default=2000, help="context tokens")
    parser.add_argument("--max-gpus", type=int, default=8)
    parser.add_argument("--gpu-gbps", type=float, default=32.0)
    parser.add_argument("--long-context", type=int, default=4096, help="tokens: memory slice")
    parser.add_argument("--memory-gbps", type=float, default=64.0)
    parser.add_argument("--expire-every", type=int, default=10, help="0: release every one")
    parser.add_argument("--in-flight", type=int, default=128, help="outstanding intents")
    parser.add_argument("--window", type=float, default=10.0, help="trace seconds per window")
    parser.add_argument("--burst-factor", type=float, default=1.5)
    parser.add_argument("--fault-at", type=float, default=0.5, help="share of the window")
    parser.add_argument("--heal-at", type=float, default=0.75, help="share of the window")
    parser.add_argument("--sample-every", type=float, default=2.0, help="wall seconds")
    parser.add_argument("--slices", type=int, default=10, help="rows of the utilization table")
    parser.add_argument("--warmup", type=int, default=20, help="serial pairs before the replay")
    parser.add_argument("--floor-samples", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds for the floor")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    args = parser.parse_args()
    if not 0 < args.fault_at < args.heal_at <= 1:
        parser.error("need 0 < --fault-at < --heal-at <= 1")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger().addHandler(WARNINGS)
    try:
        result = asyncio.run(bench(args))
    except BenchFailure as exc:
        raise SystemExit(f"a reply was not what the bench can count; no figures: {exc}") from exc
    report(result)
    if result["check"]["problems"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
