"""Intent benchmark (ARCHITECTURE §10 "Intents"): compose+release round trips through NATS and
committed Postgres transactions, as ratios to two floors measured in the same run.

- unit floor: one NATS request-reply to a trivial responder whose handler commits one small row
  (a single INSERT in a transaction on an asyncpg connection) before it replies: the least an
  intent can cost (a reply only after commit). Serial; p50, p99, p99.9 and the serial rate
  (1 / mean).
- saga floor: the I/O a compose needs, done by hand and in sequence: the client's
  request-reply, whose handler commits the reserve, makes the simulated hardware's durable
  write (one binding, through a SimulatedFabric with the engine's kind of state file) and
  commits the settlement before it replies.
  Both floors are measured clean, with nothing of Trellis running: half before the engine
  starts, half after it stopped. A short "loaded" sample of the unit floor beside each phase
  shows what the engine's background work does to it (printed, never a baseline). When a
  floor is noisy (its p99 over 3x its p50, or its p50 moving 1.5x between before and after),
  no target based on it is judged.
- the engine (`adapters.bootstrap.engine_on`: Postgres log, projections, NATS intake) drives a
  SimulatedFabric on a state file, as `trellis up` does (`--fabric-memory`: in memory only). A
  compose is answered after its saga settled it: two commits and the hardware's durable write;
  a release is one commit (the hardware lets go after the reply).
- serial: one client composes (1 GPU) and releases, pair after pair, on a fabric of 8 racks
  joined by one OCS (`--racks`), and on the project's own fabric (examples/fabric.json).
- load: 8 and 64 clients (`--concurrency`), each composing and releasing in a loop for a
  bounded time on one domain, then 64 clients spread over 4 domains (one writer and one saga
  each). Throughput is printed in pairs and in intents (a pair is a compose and a release);
  the target counts intents over the unit floor's serial rate.
- the clients run in a process of their own (spawned once), as real clients do, so the
  engine process's CPU with its follower process's (the log followers run there by default,
  as `trellis up` runs them) is the engine's alone: the CPU-per-pair target. It includes the
  simulated hardware's state thread (its durable writes stand in for the hardware's, and the
  saga floor counts them as I/O); the lines under the table say how much of it that was, and
  what the whole machine spent per pair, PostgreSQL's local processes apart (its sessions for
  the engine and the followers: the writes the intents cause, which the target leaves out),
  and of those the engine's sessions and the followers', told apart by their application_name
  (trellis/adapters/postgres/sessions.py).
- `--loop uvloop` runs the engine on uvloop instead of asyncio's own loop.
- `--followers both` runs the engine phases once with followers inline (rows `<phase>@inline`)
  and once in their process; `--metrics both` once without and once with Prometheus metrics
  scraped every second (rows `<phase>@metrics`).
- diagnostic (`-np` rows, no target; followers inline only): serial and the largest load again
  with the projection runner paused, to show what its transactions cost the intents.

Targets: serial compose and release p99 within 1.5x the saga floor's p99 (on both fabrics);
throughput at 8 and 64 clients at least 5x the unit floor's serial rate, in intents; the
engine's CPU per compose+release pair at most 1 ms. Every reply is checked (compose ok and
`active` with one GPU, release ok and `released`), and at the end the log is counted
(activations = composes, releases = releases, no failed or rejected composition) and the
simulated hardware must hold nothing: a fast failure cannot pass for a fast answer. Uses
TRELLIS_NATS_URL / TRELLIS_DATABASE_URL when set, else embedded servers in a temporary
directory; a fresh schema (dropped afterwards) and subject prefix. The last line printed is
one JSON object with every figure.

    python bench/intents.py             # ~2 min on 2 cores
    python bench/intents.py --quick     # ~40 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from pathlib import Path as FsPath
from typing import Any, NamedTuple

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

import asyncpg
import msgspec
from nats.aio.msg import Msg

from bench.placement import percentile
from trellis.adapters import event_loop
from trellis.adapters.bootstrap import RunningEngine, embedded_or_configured, engine_on
from trellis.adapters.collector import settle_for_serving
from trellis.adapters.fabric.sim import STATE_THREAD, SimulatedFabric
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.postgres import sessions
from trellis.adapters.settings import FollowersMode, Settings
from trellis.engine.core.fabric import FabricBinding
from trellis.engine.core.throttle import RateLimit
from trellis.projections import PostgresReadModels

TENANTS = [f"tenant-{i}" for i in range(8)]
RACKS = 4
HOSTS_PER_RACK = 4


# ---- figures ----


def stats(samples_ms: list[float]) -> dict[str, float]:
    n = len(samples_ms)
    mean = sum(samples_ms) / n if n else float("nan")
    return {
        "n": n,
        "p50_ms": percentile(samples_ms, 50),
        "p99_ms": percentile(samples_ms, 99),
        "p999_ms": percentile(samples_ms, 99.9),
        "max_ms": max(samples_ms, default=float("nan")),
        "mean_ms": mean,
        "serial_rate_per_s": 1000 / mean if n else float("nan"),
    }


# ---- the fabric ----


def topology(gpus_per_rack: int, racks: int = RACKS, ocs: bool = False) -> dict[str, Any]:
    """`racks` racks; each has one PCIe switch carrying HOSTS_PER_RACK hosts and `gpus_per_rack`
    GPUs (A100 and H100 alternating). Requests ask for any GPU, so each compose picks among the
    rack's free ones and nothing runs out while clients per rack <= gpus_per_rack. With `ocs`,
    every rack switch also has an uplink to one port of one optical circuit switch, so the
    racks are joined as the issue's probe fabric is (8 racks, one OCS)."""
    nodes: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    if ocs:
        nodes.append({"id": "ocs-0", "kind": "ocs", "ports": 2 * racks, "latency_ns": 30})
    for r in range(racks):
        sw = f"sw-r{r}"
        nodes.append({"id": sw, "kind": "switch", "latency_ns": 150, "labels": {"rack": f"r{r}"}})
        if ocs:
            links.append({"id": f"l-{sw}-ocs", "a": sw, "b": "ocs-0", "b_port": r,
                          "capacity_gbps": 256})  # fmt: skip
        for h in range(HOSTS_PER_RACK):
            host = f"host-r{r}-{h}"
            nodes.append({"id": host, "kind": "host", "labels": {"rack": f"r{r}"}})
            links.append({"id": f"l-{host}", "a": host, "b": sw, "capacity_gbps": 256})
        for g in range(gpus_per_rack):
            model, gen = (("A100", 8), ("H100", 9))[g % 2]
            gpu = f"gpu-r{r}-{g:03d}"
            nodes.append(
                {
                    "id": gpu,
                    "kind": "device",
                    "device_kind": "gpu",
                    "vendor": "nvidia",
                    "model": model,
                    "generation": gen,
                    "memory_gib": 80,
                    "labels": {"rack": f"r{r}"},
                }
            )
            links.append({"id": f"l-{gpu}", "a": sw, "b": gpu, "capacity_gbps": 64})
    return {"nodes": nodes, "links": links}


def host_of(worker: int, racks: int = RACKS) -> str:
    """Workers spread evenly over racks first, then over the hosts of a rack."""
    rack, slot = worker % racks, (worker // racks) % HOSTS_PER_RACK
    return f"host-r{rack}-{slot}"


# ---- checks ----


class BenchFailure(Exception):
    """A reply that is not the success the bench asked for: the run is not a measurement."""


def check_compose(reply: dict[str, Any], host: str) -> str:
    result = reply.get("result") if reply.get("ok") else None
    if (
        not isinstance(result, dict)
        or result.get("state") != "active"
        or result.get("host") != host
        or len(result.get("devices", [])) != 1
        or result["devices"][0].get("kind") != "gpu"
    ):
        raise BenchFailure(f"compose on {host}: {json.dumps(reply)[:600]}")
    cid: str = result["composition_id"]
    return cid


def check_release(reply: dict[str, Any], cid: str) -> None:
    result = reply.get("result") if reply.get("ok") else None
    if (
        not isinstance(result, dict)
        or result.get("state") != "released"
        or result.get("composition_id") != cid
    ):
        raise BenchFailure(f"release of {cid}: {json.dumps(reply)[:600]}")


# ---- probes on the running engine (wrappers on instances; no engine code changes) ----


class Probe:
    """Counts the engine's commits: transactions, events and replies per transaction, time
    inside `append`, and the projections' batches."""

    def __init__(self, running: RunningEngine):
        self.appends: list[tuple[float, int, int]] = []  # (ms, events, replies)
        self.projection_batches: list[tuple[float, int]] = []  # (ms, events)
        store, runner = running.store, running.projections
        append = store.append
        # A probe around the projection sink's batch commit, when it has one by that name (a
        # private method: if it is renamed, the bench still runs and reports no batches).
        commit = getattr(runner, "_commit", None)

        async def timed_append(
            domain: str, expected: Any, events: Any, replies: Any, fence: int | None = None
        ) -> Any:
            t0 = time.perf_counter()
            try:
                return await append(domain, expected, events, replies, fence=fence)
            finally:
                self.appends.append(((time.perf_counter() - t0) * 1000, len(events), len(replies)))

        async def timed_commit(domain: str, facts: Any, first: int) -> Any:
            assert commit is not None
            t0 = time.perf_counter()
            try:
                return await commit(domain, facts, first)
            finally:
                self.projection_batches.append(((time.perf_counter() - t0) * 1000, len(facts)))

        store.append = timed_append  # type: ignore[method-assign,assignment]
        if commit is not None:
            runner._commit = timed_commit  # type: ignore[method-assign]

    def mark(self) -> tuple[int, int]:
        return len(self.appends), len(self.projection_batches)

    def since(self, mark: tuple[int, int]) -> dict[str, float]:
        appends = self.appends[mark[0] :]
        batches = self.projection_batches[mark[1] :]
        n = len(appends)
        return {
            "transactions": n,
            "replies_per_tx": sum(a[2] for a in appends) / n if n else 0.0,
            "events_per_tx": sum(a[1] for a in appends) / n if n else 0.0,
            "append_p50_ms": percentile([a[0] for a in appends], 50),
            "append_p99_ms": percentile([a[0] for a in appends], 99),
            "append_ms_total": sum(a[0] for a in appends),
            "projection_batches": len(batches),
            "projection_events_per_batch": (
                sum(b[1] for b in batches) / len(batches) if batches else 0.0
            ),
            "projection_ms_total": sum(b[0] for b in batches),
        }


# ---- CPU: where the wall time went ----


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine; (0, 0) where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class CpuMeter:
    """The engine process's CPU time (this one: the clients run in their own), the part of it
    the simulated hardware's state thread spent, the follower process's when the followers
    run in one (`pid`), the machine's busy share and CPU time, and what the local PostgreSQL's
    processes spent (the engine's sessions and the followers'; nothing when the server runs
    elsewhere)."""

    def __init__(self, pid: int | None = None) -> None:
        t = os.times()
        self._pid = pid
        self._proc = t.user + t.system
        self._child = _process_cpu_s(pid)
        self._hardware = _hardware_threads_cpu_s()
        self._postgres = _processes_cpu_s(POSTGRES_COMM)
        self._wall = time.perf_counter()
        self._machine = _machine_ticks()

    def read(self, named: dict[int, str] | None = None) -> dict[str, float]:
        """The figures since the meter started; `named`: the application_name of each
        Postgres session by pid (`session_names`), to tell the engine's sessions from the
        followers'."""
        t = os.times()
        wall = time.perf_counter() - self._wall
        busy, total = _machine_ticks()
        d_busy, d_total = busy - self._machine[0], total - self._machine[1]
        hardware = _hardware_threads_cpu_s()
        postgres = _processes_cpu_s(POSTGRES_COMM)
        spent = {pid: s - self._postgres.get(pid, 0.0) for pid, s in postgres.items()}
        named = named or {}
        return {
            "process_cpu_s": t.user + t.system - self._proc,
            "process_cpu_share": (t.user + t.system - self._proc) / wall if wall else 0.0,
            "hardware_cpu_s": sum(s - self._hardware.get(tid, 0.0) for tid, s in hardware.items()),
            "follower_cpu_s": max(0.0, _process_cpu_s(self._pid) - self._child),
            # A session that started meanwhile counts whole; one that ended is lost (the pools
            # keep theirs for the run).
            "postgres_cpu_s": sum(spent.values()),
            "postgres_engine_cpu_s": sum(
                s for pid, s in spent.items() if named.get(pid) in sessions.ENGINE_SESSIONS
            ),
            "postgres_followers_cpu_s": sum(
                s for pid, s in spent.items() if named.get(pid) in sessions.FOLLOWERS
            ),
            "machine_cpu_s": d_busy / os.sysconf("SC_CLK_TCK"),
            "machine_busy_share": d_busy / d_total if d_total else float("nan"),
        }


async def wal_written(database_url: str) -> dict[str, float]:
    """The server's WAL so far: bytes in all (its insert position, exact), and the bytes each
    session wrote (`pg_stat_get_backend_wal`, PostgreSQL 18 on; a session reports its own
    within about a second), by backend pid as `wal:<pid>`."""
    conn = await asyncpg.connect(database_url)
    try:
        lsn = await conn.fetchval("SELECT pg_current_wal_insert_lsn() - '0/0'")
        written = {"bytes": float(lsn)}
        with contextlib.suppress(asyncpg.UndefinedFunctionError):
            for r in await conn.fetch(
                "SELECT a.pid, w.wal_bytes FROM pg_stat_activity AS a,"
                " LATERAL pg_stat_get_backend_wal(a.pid) AS w"
                " WHERE a.backend_type = 'client backend'"
            ):
                written[f"wal:{r['pid']}"] = float(r["wal_bytes"])
    finally:
        await conn.close()
    return written


def wal_per_pair(
    before: dict[str, float], after: dict[str, float], named: dict[int, str], pairs: int
) -> dict[str, float | None]:
    """WAL bytes per pair in all, and of it the engine's sessions' and the followers' (None
    where the server does not say by session)."""
    spent = {int(k[4:]): v - before.get(k, 0.0) for k, v in after.items() if k.startswith("wal:")}

    def of(names: tuple[str, ...]) -> float | None:
        if not spent:
            return None
        return sum(v for pid, v in spent.items() if named.get(pid) in names) / max(1, pairs)

    return {
        "bytes": (after["bytes"] - before["bytes"]) / max(1, pairs),
        "engine_bytes": of(sessions.ENGINE_SESSIONS),
        "followers_bytes": of(sessions.FOLLOWERS),
    }


async def session_names(database_url: str) -> dict[int, str]:
    """Each Postgres session's application_name, by its backend's pid."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT pid, application_name FROM pg_stat_activity")
    finally:
        await conn.close()
    return {r["pid"]: r["application_name"] for r in rows}


def _process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far; 0 without one (or /proc)."""
    if pid is None:
        return 0.0
    return _cpu_s(f"/proc/{pid}/stat")


#: The process name of PostgreSQL's server and every session's backend.
POSTGRES_COMM = "postgres"


def _processes_cpu_s(comm: str) -> dict[int, float]:
    """CPU seconds so far of each process named `comm` on this machine, by pid."""
    found: dict[int, float] = {}
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            name = FsPath(entry.path, "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        if name == comm:
            found[int(entry.name)] = _cpu_s(f"{entry.path}/stat")
    return found


def _hardware_threads_cpu_s() -> dict[int, float]:
    """CPU seconds so far of each of this process's simulated-hardware state threads, by
    thread id. Their work stands in for the hardware's own (the saga floor counts it as I/O),
    so the bench shows it apart from the engine's."""
    return {
        thread.native_id: _cpu_s(f"/proc/self/task/{thread.native_id}/stat")
        for thread in threading.enumerate()
        if thread.name.startswith(STATE_THREAD) and thread.native_id is not None
    }


def _cpu_s(stat: str) -> float:
    """User + system CPU seconds from a /proc stat file; 0 where there is none."""
    try:
        fields = FsPath(stat).read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the floor ----


class Floors(NamedTuple):
    """Each a timed operation: the unit floor, its parts, the saga floor; and `close`."""

    unit: Callable[[], Awaitable[None]]
    nats_only: Callable[[], Awaitable[None]]
    pg_only: Callable[[], Awaitable[None]]
    saga: Callable[[], Awaitable[None]]
    close: Callable[[], Awaitable[None]]


async def floor_setup(
    nats_url: str,
    database_url: str,
    schema: str,
    prefix: str,
    fabric_state: FsPath | None = None,
) -> Floors:
    """The floors (ARCHITECTURE §10), served by a responder of the bench's own:
    - unit: a request-reply whose handler commits one row, then replies;
    - saga: the I/O a compose needs, by hand and in sequence: a request-reply whose handler
      commits the reserve, makes the simulated hardware's durable write (one binding, through
      a SimulatedFabric of its own with `fabric_state`, the engine's kind of state file: a
      new generation written, fsynced and linked, and its folder fsynced; None: in memory)
      and commits the settlement, then replies. Samples alternate bind and unbind, so the
      hardware's state stays one binding small."""
    responder = await connect_nats(nats_url, name="bench-floor-responder")
    client = await connect_nats(nats_url, name="bench-floor-client")
    # The responder's commits go through a connection of its own, like the engine's pool.
    conn = await asyncpg.connect(database_url, server_settings={"search_path": schema})
    await conn.execute(
        "CREATE TABLE bench_floor (id bigserial PRIMARY KEY, at timestamptz NOT NULL "
        "DEFAULT now(), body text NOT NULL)"
    )
    insert = "INSERT INTO bench_floor (body) VALUES ($1)"
    reply_body = msgspec.json.encode({"ok": True, "result": {}, "position": 1, "replayed": False})
    hardware = SimulatedFabric(state_file=fabric_state)
    binding = FabricBinding(
        host="host-r0-0", device="gpu-r0-000", path=["host-r0-0", "sw-r0", "gpu-r0-000"],
        composition_id="c-floor",
    )  # fmt: skip
    bound = [False]

    async def commit(body: str) -> None:
        async with conn.transaction():
            await conn.execute(insert, body)

    async def commit_then_reply(msg: Msg) -> None:
        await commit(msg.data.decode())
        await msg.respond(reply_body)

    async def reserve_program_settle(msg: Msg) -> None:
        await commit(msg.data.decode())
        program = hardware.unbind if bound[0] else hardware.bind
        await program("floor", binding)
        bound[0] = not bound[0]
        await commit("settled")
        await msg.respond(reply_body)

    async def echo(msg: Msg) -> None:
        await msg.respond(reply_body)

    handlers = {"commit": commit_then_reply, "saga": reserve_program_settle, "echo": echo}
    for name, handler in handlers.items():
        await responder.subscribe(f"{prefix}.floor.{name}", queue="bench-floor", cb=handler)
    await responder.flush()
    body = msgspec.json.encode({"request_id": str(uuid.uuid4()), "composition_id": "c-0"})
    pg_conn = await asyncpg.connect(database_url, server_settings={"search_path": schema})

    def round_trip(name: str) -> Callable[[], Awaitable[None]]:
        async def timed() -> None:
            msg = await client.request(f"{prefix}.floor.{name}", body, timeout=10)
            msgspec.json.decode(msg.data)

        return timed

    async def pg_only() -> None:
        async with pg_conn.transaction():
            await pg_conn.execute(insert, "x")

    async def close() -> None:
        await client.close()
        await responder.close()
        await conn.close()
        await pg_conn.close()

    return Floors(round_trip("commit"), round_trip("echo"), pg_only, round_trip("saga"), close)


async def timed_ms(op: Callable[[], Awaitable[None]], n: int, budget_s: float) -> list[float]:
    out: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await op()
        out.append((time.perf_counter_ns() - t0) / 1e6)
        if time.perf_counter() > deadline:
            break
    return out


# ---- the engine ----


class Load:
    """Latencies of one phase: pairs, composes and releases (ms), its wall time, and how far
    the event stream trailed the log (ms from each event's recorded time to its arrival at a
    subscriber of the stream's subjects)."""

    def __init__(self) -> None:
        self.pair: list[float] = []
        self.compose: list[float] = []
        self.release: list[float] = []
        self.stream_trail: list[float] = []
        self.seconds = 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "pairs": len(self.pair),
            "seconds": self.seconds,
            "pairs_per_s": len(self.pair) / self.seconds if self.seconds else float("nan"),
            "pair": stats(self.pair),
            "compose": stats(self.compose),
            "release": stats(self.release),
            "stream_trail": stats(self.stream_trail),
        }


async def pair(client: TrellisClient, domain: str, tenant: str, host: str, load: Load) -> None:
    """One compose then one release, both checked."""
    t0 = time.perf_counter_ns()
    composed = await client.intent(
        domain,
        tenant,
        "compose",
        {"host": host, "devices": [{"kind": "gpu"}], "reason": "bench"},
    )
    t1 = time.perf_counter_ns()
    cid = check_compose(composed, host)
    released = await client.intent(domain, tenant, "release", {"composition_id": cid})
    t2 = time.perf_counter_ns()
    check_release(released, cid)
    load.compose.append((t1 - t0) / 1e6)
    load.release.append((t2 - t1) / 1e6)
    load.pair.append((t2 - t0) / 1e6)


async def run_load(
    clients: list[TrellisClient],
    domains: list[str],
    workers: int,
    seconds: float,
    max_pairs: int,
    hosts: list[str],
) -> Load:
    """`workers` loops of compose+release until `seconds` pass or `max_pairs` are done; worker
    i works in domain i % len(domains) as tenant i % 8 on host (i // domains) % len(hosts)."""
    load = Load()
    started = time.perf_counter()
    deadline = started + seconds
    budget = [max_pairs]

    async def worker(i: int) -> None:
        client = clients[i % len(clients)]
        domain = domains[i % len(domains)]
        tenant = TENANTS[i % len(TENANTS)]
        host = hosts[(i // len(domains)) % len(hosts)]
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            await pair(client, domain, tenant, host, load)

    await asyncio.gather(*(worker(i) for i in range(workers)))
    load.seconds = time.perf_counter() - started
    return load


class LoadPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One phase's clients, as the client process runs them."""

    nats_url: str
    prefix: str
    domains: list[str]
    workers: int
    seconds: float
    max_pairs: int
    hosts: list[str]


class _Recorded(msgspec.Struct):
    """What the trail needs of a stream message: when its event was recorded."""

    recorded_at: str


_recorded = msgspec.json.Decoder(_Recorded).decode


@contextlib.asynccontextmanager
async def stream_trail(nc: Any, prefix: str, domains: list[str]) -> AsyncIterator[list[float]]:
    """While open, the ms by which each event of `domains` reached a subscriber of the event
    stream's subjects after it was recorded: what the relay's gathering costs a watcher of the
    stream (the KV bucket is written in the same pass). The clock is this machine's, as the
    engine's is; the trail includes the append (about a millisecond)."""
    trail: list[float] = []
    wanted = {f"{prefix}.events.{d}." for d in domains}

    async def arrived(msg: Msg) -> None:
        now = time.time()
        if msg.subject[: msg.subject.rfind(".") + 1] in wanted:
            at = datetime.fromisoformat(_recorded(msg.data).recorded_at)
            trail.append((now - at.timestamp()) * 1000)

    sub = await nc.subscribe(f"{prefix}.events.>", cb=arrived)
    try:
        yield trail
    finally:
        await sub.unsubscribe()


def load_in_child(plan: bytes) -> bytes:
    """Run a LoadPlan in this (client) process; its latencies, or the failure, as JSON.

    The clients run in a process of their own, as real clients do: the bench process's CPU
    is then the engine's alone, which is what the CPU-per-pair target counts."""
    todo = msgspec.json.decode(plan, type=LoadPlan)

    async def run() -> Load:
        ncs = [await connect_nats(todo.nats_url, name=f"bench-client-{i}") for i in range(4)]
        try:
            clients = [TrellisClient(nc, prefix=todo.prefix, timeout=30) for nc in ncs]
            async with stream_trail(ncs[0], todo.prefix, todo.domains) as trail:
                # (The last pass's events arrive after the phase: they are not counted.)
                load = await run_load(
                    clients, todo.domains, todo.workers, todo.seconds, todo.max_pairs, todo.hosts
                )
            load.stream_trail = trail
            return load
        finally:
            for nc in ncs:
                await nc.close()

    try:
        load = asyncio.run(run())
    except BenchFailure as exc:
        return msgspec.json.encode({"failure": str(exc)})
    return msgspec.json.encode(
        {"pair": load.pair, "compose": load.compose, "release": load.release,
         "stream_trail": load.stream_trail, "seconds": load.seconds}
    )  # fmt: skip


class ClientProcess:
    """The one process every phase's clients run in (spawned once, reused)."""

    def __init__(self) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))

    async def run(self, plan: LoadPlan) -> Load:
        loop = asyncio.get_running_loop()
        raw = await loop.run_in_executor(self._pool, load_in_child, msgspec.json.encode(plan))
        got = msgspec.json.decode(raw)
        if "failure" in got:
            raise BenchFailure(got["failure"])
        load = Load()
        load.pair, load.compose, load.release = got["pair"], got["compose"], got["release"]
        load.stream_trail = got["stream_trail"]
        load.seconds = got["seconds"]
        return load

    def close(self) -> None:
        self._pool.shutdown()


async def settle(running: RunningEngine, domains: list[str]) -> None:
    """Let the fabric sagas and the projections finish what the last phase left, so one phase's
    backlog is not charged to the next."""
    for d in domains:
        sync = running.engine.fabric_sync(d)
        if sync is not None:
            await asyncio.wait_for(sync.wait_idle(), 30)
    # The checkpoints table says how far the projections are, in either mode (the follower
    # process's followers are not this process's to ask).
    projected = PostgresReadModels(
        running.projections.pool, projections=running.projections.checkpoint_names
    )
    for d in domains:
        head = (await running.store.head(d)).position
        await projected.wait_for(d, head, timeout=60)


async def verify_log(
    running: RunningEngine, domains: list[str], composes: int, releases: int
) -> dict[str, Any]:
    """The log agrees with the replies, and the hardware holds nothing."""
    async with running.projections.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT type, count(*) AS n FROM trellis_events WHERE domain = ANY($1::text[])"
            " GROUP BY type",
            domains,
        )
    counts = {r["type"]: r["n"] for r in rows}
    problems = []
    if counts.get("CompositionActivated", 0) != composes:
        problems.append(f"{counts.get('CompositionActivated', 0)} activated, {composes} composed")
    if counts.get("CompositionReleased", 0) != releases:
        problems.append(f"{counts.get('CompositionReleased', 0)} released, {releases} released")
    for bad in ("CompositionFailed", "CompositionRejected", "CompositionImpaired"):
        if counts.get(bad):
            problems.append(f"{counts[bad]} {bad}")
    held = 0
    for d in domains:
        snapshot = await running.fabric.snapshot(d)
        held += len(snapshot.bindings) + len(snapshot.circuits)
        state = running.engine.state(d)
        live = [c for c in state.compositions.values() if c.state != "released"] if state else []
        if live:
            problems.append(f"{d}: {len(live)} compositions not released")
    if held:
        problems.append(f"the simulated fabric still holds {held} bindings or circuits")
    return {"event_counts": counts, "problems": problems}


class Servers(NamedTuple):
    """`Endpoints` with the owner's URL always given: the benches make their own schemas."""

    nats_url: str
    database_url: str
    database_owner_url: str
    nats_monitor_url: str | None


@contextlib.asynccontextmanager
async def servers(settings: Settings) -> AsyncIterator[Servers]:
    """The configured servers, or embedded ones in a temporary directory. Without an owner URL
    the one database URL is the owner's as well (docs/security.md, Least privilege)."""
    with contextlib.ExitStack() as stack:
        if not (settings.nats_url and settings.database_url) and settings.data_dir is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="trellis-bench-"))
            settings = msgspec.structs.replace(settings, data_dir=FsPath(tmp))
        async with embedded_or_configured(settings) as urls:
            owner = urls.database_owner_url or urls.database_url
            yield Servers(urls.nats_url, urls.database_url, owner, urls.nats_monitor_url)


@contextlib.asynccontextmanager
async def fresh_schema(database_url: str, keep: bool) -> AsyncIterator[str]:
    name = f"bench_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"CREATE SCHEMA {name}")
    finally:
        await conn.close()
    try:
        yield name
    finally:
        if not keep:
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
            finally:
                await conn.close()


# ---- the run ----


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Scrapes:
    """How many scrapes of the metrics page a phase saw (each read in full)."""

    taken = 0


@contextlib.asynccontextmanager
async def scraped(url: str | None) -> AsyncIterator[Scrapes]:
    """While open, GET `url` once a second, as a Prometheus would (15x its usual rate), so
    the phases pay for the page being rendered too. No url: nothing is scraped."""
    scrapes = Scrapes()

    async def scrape() -> None:
        assert url is not None
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        while True:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
            page = await reader.read()
            writer.close()
            if b"trellis_intents_total" not in page:
                raise BenchFailure(f"the metrics page at {url} lacks trellis_intents_total")
            scrapes.taken += 1
            await asyncio.sleep(1.0)

    task = asyncio.create_task(scrape()) if url else None
    try:
        yield scrapes
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


PROJECT_FABRIC = FsPath(__file__).resolve().parents[1] / "examples" / "fabric.json"


def project_fabric() -> tuple[dict[str, Any], str]:
    """The project's own example fabric (examples/fabric.json) and its first host."""
    doc: dict[str, Any] = json.loads(PROJECT_FABRIC.read_text())
    host = next(n["id"] for n in doc["nodes"] if n.get("kind") == "host")
    return doc, host


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.from_env()
    levels = [int(c) for c in args.concurrency.split(",") if c]
    followers: list[FollowersMode] = (
        ["inline", "process"] if args.followers == "both" else [args.followers]
    )
    metered = {"off": [False], "on": [True], "both": [False, True], "both-on-first": [True, False]}[
        args.metrics
    ]
    modes = [(f, m) for f in followers for m in metered]
    n_domains = args.domains
    spread = args.spread_clients
    racks = args.racks
    clients_per_rack = max([*levels, math.ceil(spread / n_domains)]) / racks
    gpus_per_rack = max(32, math.ceil(clients_per_rack * 1.25) + 8)
    doc = topology(gpus_per_rack, racks=racks, ocs=True)
    hosts = [host_of(w, racks=racks) for w in range(racks * HOSTS_PER_RACK)]
    project_doc, project_host = project_fabric()
    result: dict[str, Any] = {
        "bench": "intents",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loop": args.loop,
        "nats": "configured" if settings.nats_url else "embedded",
        "postgres": "configured" if settings.database_url else "embedded",
        "fabric": {
            "racks": racks,
            "ocs": 1,
            "hosts": racks * HOSTS_PER_RACK,
            "gpus_per_domain": racks * gpus_per_rack,
            "project": PROJECT_FABRIC.name,
            "hardware": "in memory" if args.fabric_memory else "state file (as trellis up)",
        },
        "load_average": os.getloadavg(),
    }
    started = time.perf_counter()
    clients_process = ClientProcess()
    async with (
        servers(settings) as (nats_url, database_url, owner_url, _monitor),
        fresh_schema(owner_url, args.keep) as schema,
    ):
        state_dir = FsPath(tempfile.mkdtemp(prefix="trellis-bench-fabric-"))
        prefix = f"b{uuid.uuid4().hex[:12]}"
        async with conn_info(owner_url) as info:
            result["server"] = info
        # The floors' table is the bench's own, in the schema the owner created.
        floors = await floor_setup(
            nats_url,
            owner_url,
            schema,
            prefix,
            None if args.fabric_memory else state_dir / "floor" / "fabric-sim.json",
        )
        combined, nats_only, pg_only, saga = (
            floors.unit,
            floors.nats_only,
            floors.pg_only,
            floors.saga,
        )
        try:
            # Both floors are measured clean, with nothing of Trellis running: half before the
            # engine starts, half after it stopped (and its relay and projections with it).
            # Beside each phase a short "loaded" chunk shows what the engine's background work
            # (followers catching up) does to the same round trip; it is no baseline.
            n_phases = 2 + len(levels) + (n_domains > 1) + 2 * args.diagnose
            half = max(50, args.floor_samples // 2)
            clean_chunks: list[list[float]] = []
            saga_chunks: list[list[float]] = []
            loaded_chunks: list[list[float]] = []

            async def clean_floors() -> None:
                clean_chunks.append(await timed_ms(combined, half, args.budget / 4))
                saga_chunks.append(await timed_ms(saga, half, args.budget / 4))

            async def loaded_floor() -> None:
                loaded_chunks.append(
                    await timed_ms(combined, max(20, half // 10), args.budget / (4 * n_phases))
                )

            progress(f"floors: {half} samples each before the engine, {half} after ...")
            await timed_ms(combined, 50, 5)  # warm-up
            await timed_ms(saga, 50, 5)
            await clean_floors()
            parts_nats = await timed_ms(nats_only, half // 2, args.budget / 8)
            parts_pg = await timed_ms(pg_only, half // 2, args.budget / 8)

            phases: dict[str, Any] = {}
            checks: list[dict[str, Any]] = []

            async def run_mode(mode: FollowersMode, metrics: bool) -> None:
                # Each mode drives domains and subjects of its own; its phases are named
                # "<phase>@inline" beside the default's when both run, and "<phase>@metrics"
                # when the engine serves Prometheus metrics (scraped every second).
                tag = "" if len(followers) == 1 or mode == Settings().followers else f"@{mode}"
                tag += "@metrics" if metrics and len(metered) > 1 else ""
                domains = [f"bench-{mode}-{int(metrics)}-{d}" for d in range(n_domains)]
                project = f"bench-{mode}-{int(metrics)}-project"
                mode_prefix = f"{prefix}{mode[0]}{int(metrics)}"
                hardware = (
                    None
                    if args.fabric_memory
                    else SimulatedFabric(state_file=state_dir / mode_prefix / "fabric-sim.json")
                )
                # A schema of its own too: a follower process follows every domain in its log.
                async with (
                    fresh_schema(owner_url, args.keep) as mode_schema,
                    engine_on(
                        Settings(
                            nats_url=nats_url,
                            database_url=database_url,
                            database_owner_url=owner_url,
                            db_schema=mode_schema,
                            subject_prefix=mode_prefix,
                            followers=mode,
                            metrics_port=0 if metrics else None,
                            # The intent path's cost, not a tenant's rate (bench/flood.py has
                            # that).
                            tenant_rate=RateLimit(0),
                        ),
                        fabric=hardware,
                    ) as running,
                    scraped(running.metrics_url) as scrapes,
                ):
                    probe = Probe(running)
                    settle_for_serving()  # as `trellis up` does once it serves
                    nc = await connect_nats(nats_url, name="bench-admin")
                    try:
                        admin = TrellisClient(nc, prefix=mode_prefix, timeout=30)
                        for d, d_doc in [*((d, doc) for d in domains), (project, project_doc)]:
                            reply = await admin.admin(d, "import-topology", d_doc)
                            if not reply.get("ok"):
                                raise BenchFailure(f"import into {d}: {reply}")
                    finally:
                        await nc.close()
                    composes = 0

                    async def counted(
                        doms: list[str], workers: int, secs: float, cap: int, on: list[str]
                    ) -> Load:
                        nonlocal composes
                        plan = LoadPlan(
                            nats_url=nats_url,
                            prefix=mode_prefix,
                            domains=doms,
                            workers=workers,
                            seconds=secs,
                            max_pairs=cap,
                            hosts=on,
                        )
                        load = await clients_process.run(plan)
                        composes += len(load.pair)
                        return load

                    async def phase(
                        name: str,
                        doms: list[str],
                        workers: int,
                        seconds: float,
                        cap: int,
                        on: list[str],
                        diagnostic: str = "",
                    ) -> None:
                        await settle(running, [*domains, project])
                        await loaded_floor()
                        mark = probe.mark()
                        process = running.follower_process
                        named = await session_names(database_url)
                        meter = CpuMeter(process.pid if process is not None else None)
                        wal_before = await wal_written(database_url)
                        load = await counted(doms, workers, seconds, cap, on)
                        figures = load.figures()
                        wal_after = await wal_written(database_url)
                        named.update(await session_names(database_url))  # new sessions too
                        figures["wal_per_pair"] = wal_per_pair(
                            wal_before, wal_after, named, len(load.pair)
                        )
                        figures["cpu"] = meter.read(named)
                        figures["cpu"]["process_cpu_ms_per_pair"] = (
                            (figures["cpu"]["process_cpu_s"] + figures["cpu"]["follower_cpu_s"])
                            * 1000
                            / max(1, len(load.pair))
                        )
                        for part in (
                            "hardware",
                            "postgres",
                            "postgres_engine",
                            "postgres_followers",
                            "machine",
                        ):
                            figures["cpu"][f"{part}_cpu_ms_per_pair"] = (
                                figures["cpu"][f"{part}_cpu_s"] * 1000 / max(1, len(load.pair))
                            )
                        figures["diagnostic"] = diagnostic
                        figures["serial"] = workers == 1
                        figures["followers"] = mode
                        figures["metrics"] = metrics
                        figures["scrapes"] = scrapes.taken
                        figures["clients"] = workers
                        figures["domains"] = len(doms)
                        figures["engine"] = probe.since(mark)
                        phases[name + tag] = figures
                        progress(
                            f"  {name}: {len(load.pair)} pairs in {load.seconds:.1f} s, "
                            f"{figures['pairs_per_s']:.0f} pairs/s, "
                            f"{figures['engine']['replies_per_tx']:.1f} replies per commit"
                        )

                    progress("engine: warm-up, serial ...")
                    await counted(domains[:1], 1, 30, args.warmup, hosts)
                    await counted([project], 1, 30, args.warmup, [project_host])
                    serial_s = args.seconds * 1.5
                    await phase("serial", domains[:1], 1, serial_s, args.serial_pairs, hosts)
                    await phase(
                        "serial/project", [project], 1, serial_s, args.serial_pairs,
                        [project_host],
                    )  # fmt: skip
                    for c in levels:
                        await phase(f"c{c}", domains[:1], c, args.seconds, args.max_pairs, hosts)
                    if n_domains > 1:
                        await phase(
                            f"c{spread}x{n_domains}d",
                            domains,
                            spread,
                            args.seconds,
                            args.max_pairs,
                            hosts,
                        )
                    if args.diagnose and mode == "inline" and not metrics:
                        # The same engine with its projection followers paused: what their
                        # transactions cost the intents (not the engine as deployed; no target).
                        await settle(running, [*domains, project])
                        paused = [running.followers.of("projections", d) for d in domains]
                        for follower in paused:
                            if follower is not None:
                                await follower.stop()
                        try:
                            why = "projections paused"
                            await phase(
                                "serial-np",
                                domains[:1],
                                1,
                                args.seconds,
                                args.serial_pairs // 2,
                                hosts,
                                why,
                            )
                            c = max(levels)
                            await phase(
                                f"c{c}-np",
                                domains[:1],
                                c,
                                args.seconds / 2,
                                args.max_pairs,
                                hosts,
                                why,
                            )
                        finally:
                            for follower in paused:
                                if follower is not None:
                                    follower.start()
                    if args.profile:
                        # The engine's own time in one more load phase (the clients are in
                        # their process, so what shows is the engine's).
                        import cProfile
                        import pstats

                        await settle(running, [*domains, project])
                        prof = cProfile.Profile()
                        prof.enable()
                        c = args.profile_clients or max(levels)
                        await counted(domains[:1], c, args.seconds, args.max_pairs, hosts)
                        prof.disable()
                        prof.dump_stats(args.profile)
                        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
                    await settle(running, [*domains, project])
                    checks.append(
                        await verify_log(running, [*domains, project], composes, composes)
                    )

            for mode in modes:
                await run_mode(*mode)
            await clean_floors()
        finally:
            await floors.close()
            clients_process.close()
            shutil.rmtree(state_dir, ignore_errors=True)
    result["seconds"] = time.perf_counter() - started
    result["floor"] = stats([ms for c in clean_chunks for ms in c])
    result["floor_chunks_p50_ms"] = [percentile(c, 50) for c in clean_chunks]  # before, after
    result["saga_floor"] = stats([ms for c in saga_chunks for ms in c])
    result["saga_floor_chunks_p50_ms"] = [percentile(c, 50) for c in saga_chunks]
    result["floor_loaded"] = stats([ms for c in loaded_chunks for ms in c])
    result["floor_noise"] = floor_noise(result["floor"], result["floor_chunks_p50_ms"])
    result["saga_floor_noise"] = floor_noise(
        result["saga_floor"], result["saga_floor_chunks_p50_ms"]
    )
    result["floor_parts"] = {"nats_request_reply": stats(parts_nats), "pg_commit": stats(parts_pg)}
    result["phases"] = phases
    result["check"] = {
        "event_counts": [c["event_counts"] for c in checks],
        "problems": [p for c in checks for p in c["problems"]],
    }
    return result


@contextlib.asynccontextmanager
async def conn_info(database_url: str) -> AsyncIterator[dict[str, str]]:
    conn = await asyncpg.connect(database_url)
    try:
        info = {
            "postgres": (await conn.fetchval("SHOW server_version")),
            "synchronous_commit": await conn.fetchval("SHOW synchronous_commit"),
            "fsync": await conn.fetchval("SHOW fsync"),
        }
    finally:
        await conn.close()
    yield info


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    floor, saga = result["floor"], result["saga_floor"]
    out: dict[str, Any] = {}
    for name, ph in result["phases"].items():
        out[name] = {
            what: {
                "p50": ph[what]["p50_ms"] / floor["p50_ms"],
                "p99": ph[what]["p99_ms"] / floor["p99_ms"],
                "p99_saga": ph[what]["p99_ms"] / saga["p99_ms"],
            }
            for what in ("pair", "compose", "release")
        }
        # A pair is two intents (a compose and a release); the floor is one round trip.
        out[name]["throughput_pairs"] = ph["pairs_per_s"] / floor["serial_rate_per_s"]
        out[name]["throughput"] = 2 * ph["pairs_per_s"] / floor["serial_rate_per_s"]
    return out


NOISY_P99_OVER_P50 = 3.0  # a floor whose own p99 is above this many p50s is no baseline
NOISY_DRIFT = 1.5  # nor one whose p50 after the engine differs this much from before


def floor_noise(floor: dict[str, float], chunk_p50s: list[float]) -> str:
    """Why the floor is too noisy to judge targets by, or "" when it is clean enough."""
    spread = floor["p99_ms"] / floor["p50_ms"]
    if spread > NOISY_P99_OVER_P50:
        return f"its p99 is {spread:.1f}x its p50 (over {NOISY_P99_OVER_P50:.0f}x)"
    if len(chunk_p50s) == 2 and min(chunk_p50s) > 0:
        drift = max(chunk_p50s) / min(chunk_p50s)
        if drift > NOISY_DRIFT:
            return f"its p50 moved {drift:.1f}x between before and after the engine"
    return ""


def table(result: dict[str, Any]) -> str:
    floor, saga = result["floor"], result["saga_floor"]
    r = ratios(result)
    rows = []
    head = (
        f"{'phase':>18} {'what':>8} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>8} "
        f"{'p99/unit':>8} {'p99/saga':>8} {'pairs/s':>8} {'intents/s':>9} {'rate/unit':>9} "
        f"{'per tx':>6} {'cpu ms':>6} {'busy':>5}"
    )
    rows.append(head)
    rows.append("-" * len(head))
    rows.append(
        f"{'unit floor':>18} {'nats+pg':>8} {floor['n']:>6} {floor['p50_ms']:>8.2f} "
        f"{floor['p99_ms']:>8.2f} {floor['p999_ms']:>8.2f} {'1.0x':>8} "
        f"{floor['p99_ms'] / saga['p99_ms']:>7.2f}x "
        f"{'':>8} {floor['serial_rate_per_s']:>9.0f} {'1.0x':>9}"
    )
    rows.append(
        f"{'saga floor':>18} {'by hand':>8} {saga['n']:>6} {saga['p50_ms']:>8.2f} "
        f"{saga['p99_ms']:>8.2f} {saga['p999_ms']:>8.2f} "
        f"{saga['p99_ms'] / floor['p99_ms']:>7.2f}x {'1.0x':>8} "
        f"{'':>8} {saga['serial_rate_per_s']:>9.0f} "
        f"{saga['serial_rate_per_s'] / floor['serial_rate_per_s']:>8.2f}x"
    )
    parts = [(result["floor_parts"][p], label) for p, label in (
        ("nats_request_reply", "nats"), ("pg_commit", "pg")
    )] + [(result["floor_loaded"], "loaded")]  # fmt: skip
    for s, label in parts:
        rows.append(
            f"{'':>18} {label:>8} {s['n']:>6} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} "
            f"{s['p999_ms']:>8.2f}"
        )
    for name, ph in result["phases"].items():
        label = name if ph["serial"] else f"{name} {ph['clients']}c/{ph['domains']}d"
        for what in ("pair", "compose", "release"):
            s = ph[what]
            extra = ""
            if what == "pair":
                cpu = ph["cpu"]
                extra = (
                    f" {ph['pairs_per_s']:>8.0f} {2 * ph['pairs_per_s']:>9.0f} "
                    f"{r[name]['throughput']:>8.2f}x "
                    f"{ph['engine']['replies_per_tx']:>6.1f} "
                    f"{cpu['process_cpu_ms_per_pair']:>6.2f} "
                    f"{cpu['machine_busy_share'] * 100:>4.0f}%"
                )
            rows.append(
                f"{label if what == 'pair' else '':>18} {what:>8} {s['n']:>6} "
                f"{s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['p999_ms']:>8.2f} "
                f"{r[name][what]['p99']:>7.1f}x {r[name][what]['p99_saga']:>7.2f}x{extra}"
            )
        trail = ph["stream_trail"]
        rows.append(
            f"{'':>18} {'trail':>8} {trail['n']:>6} {trail['p50_ms']:>8.2f} "
            f"{trail['p99_ms']:>8.2f} {trail['p999_ms']:>8.2f}"
        )
    rows.append("")
    rows.append(
        "unit floor: one NATS request-reply whose handler commits one row; saga floor: the I/O "
        "of a compose by hand (request-reply, reserve commit, the simulated hardware's durable "
        "write, settle commit); both measured clean, before the engine started and after it "
        "stopped. loaded: the unit round trip beside each phase, with the engine's followers "
        "running (no baseline). trail: how long after it was recorded each event reached a "
        "subscriber of the event stream (the followers' gathering and passes; the KV bucket is "
        "written in the same pass). serial: the fabric of "
        f"{result['fabric']['racks']} racks joined by one OCS; serial/project: "
        f"{result['fabric']['project']}. rate/unit: intents/s over the unit floor's serial "
        "rate. per tx: intents answered per engine commit (group commit); cpu ms: the engine "
        "process's CPU (with its follower process, if any) per pair, the simulated hardware's "
        "state thread included (the lines below say how much); the clients run in a process of "
        "their own. busy: the whole machine's CPU busy share."
    )
    if any(ph["diagnostic"] for ph in result["phases"].values()):
        rows.append("*-np: diagnostic, the projection runner paused; no target applies.")
    metered = [(n.removesuffix("@metrics"), n) for n in result["phases"] if n.endswith("@metrics")]
    if metered:
        rows += [
            "",
            f"{'metrics on/off':>18} {'pairs/s':>9} {'p50':>7} {'p99':>7} {'cpu/pair':>8} "
            f"{'scrapes':>7}",
        ]
        for plain, on in metered:
            a, b = result["phases"][plain], result["phases"][on]
            cpu = "process_cpu_ms_per_pair"
            rows.append(
                f"{plain:>18} {b['pairs_per_s'] / a['pairs_per_s']:>8.2f}x "
                f"{b['pair']['p50_ms'] / a['pair']['p50_ms']:>6.2f}x "
                f"{b['pair']['p99_ms'] / a['pair']['p99_ms']:>6.2f}x "
                f"{b['cpu'][cpu] / a['cpu'][cpu]:>7.2f}x {b['scrapes']:>7}"
            )
        rows.append(
            "metrics on/off: the same phase on an engine serving Prometheus metrics (scraped "
            "every second) over one without; pairs/s above 1 is faster, p50, p99 "
            "and cpu/pair (the engine's CPU per pair) above 1 cost more. Whatever else the "
            "machine runs meanwhile lands on one side only: cpu/pair is the steadier figure."
        )
    return "\n".join(rows)


SERIAL_TAIL_OVER_SAGA = 1.5  # ARCHITECTURE §10: serial p99 within 1.5x the saga floor's p99
THROUGHPUT_OVER_UNIT = 5.0  # intents/s at least 5x the unit floor's serial rate
CPU_MS_PER_PAIR = 1.0  # the engine's CPU per compose+release pair


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """Every §10 intent target, judged per phase; a noisy floor judges nothing it bases."""
    r = ratios(result)
    phases = {n: ph for n, ph in result["phases"].items() if not ph["diagnostic"]}
    out: dict[str, Any] = {}
    for name, ph in phases.items():
        if ph["serial"]:
            for what in ("compose", "release"):
                ratio = r[name][what]["p99_saga"]
                met = None if result["saga_floor_noise"] else ratio <= SERIAL_TAIL_OVER_SAGA
                out[f"{name}_{what}_p99_le_1.5x_saga_floor"] = {"ratio": ratio, "met": met}
        else:
            ratio = r[name]["throughput"]
            met = None if result["floor_noise"] else ratio >= THROUGHPUT_OVER_UNIT
            out[f"{name}_intents_per_s_ge_5x_unit_floor_rate"] = {"ratio": ratio, "met": met}
        cpu = ph["cpu"]["process_cpu_ms_per_pair"]
        out[f"{name}_engine_cpu_ms_per_pair_le_1"] = {"ratio": cpu, "met": cpu <= CPU_MS_PER_PAIR}
    return out


def wal_text(wal: dict[str, float | None]) -> str:
    total = f"{(wal['bytes'] or 0) / 1024:.1f} KiB"
    if wal["engine_bytes"] is None or wal["followers_bytes"] is None:
        return total
    return (
        f"{total} (the engine's sessions {wal['engine_bytes'] / 1024:.1f}, "
        f"the followers' {wal['followers_bytes'] / 1024:.1f})"
    )


def report(result: dict[str, Any]) -> None:
    print(table(result))
    print()
    for key, label in (("floor", "unit floor"), ("saga_floor", "saga floor")):
        floor = result[key]
        chunks = result[f"{key}_chunks_p50_ms"]
        print(
            f"{label}: serial rate {floor['serial_rate_per_s']:.0f}/s (1 / mean); p50 before the "
            f"engine and after it: {', '.join(f'{c:.2f}' for c in chunks)} ms"
        )
    print(f"loaded unit floor beside the phases: p50 {result['floor_loaded']['p50_ms']:.2f} ms")
    print("load average at the start (1, 5, 15 min): " + ", ".join(
        f"{x:.2f}" for x in result["load_average"]
    ))  # fmt: skip
    for name, ph in result["phases"].items():
        e, cpu = ph["engine"], ph["cpu"]
        print(
            f"{name}: {e['transactions']} commits of {e['replies_per_tx']:.1f} replies and "
            f"{e['events_per_tx']:.1f} events, append p50 {e['append_p50_ms']:.2f} ms, "
            f"p99 {e['append_p99_ms']:.2f} ms; projections: {e['projection_batches']} batches "
            f"of {e['projection_events_per_batch']:.0f} events, in a transaction "
            f"{e['projection_ms_total'] / 1000 / ph['seconds'] * 100:.0f}% of the time; "
            f"engine CPU {cpu['process_cpu_share'] * 100:.0f}% of a core; per pair "
            f"{cpu['process_cpu_ms_per_pair']:.2f} ms, of which the simulated hardware's state "
            f"thread {cpu['hardware_cpu_ms_per_pair']:.2f} and the follower process "
            f"{cpu['follower_cpu_s'] * 1000 / max(1, ph['pairs']):.2f}; the whole machine "
            f"{cpu['machine_cpu_ms_per_pair']:.2f} ms per pair, PostgreSQL's processes "
            f"{cpu['postgres_cpu_ms_per_pair']:.2f} of it (the engine's sessions "
            f"{cpu['postgres_engine_cpu_ms_per_pair']:.2f}, the followers' "
            f"{cpu['postgres_followers_cpu_ms_per_pair']:.2f}); WAL per pair "
            f"{wal_text(ph['wal_per_pair'])}"
        )
    result["targets"] = targets(result)
    for key, label in (("floor_noise", "unit floor"), ("saga_floor_noise", "saga floor")):
        if result[key]:
            print(f"targets on the {label} NOT JUDGED: {result[key]}; run again on a quieter "
                  "machine")  # fmt: skip
    for key, t in result["targets"].items():
        verdict = "not judged" if t["met"] is None else ("met" if t["met"] else "MISSED")
        unit = " ms" if key.endswith("cpu_ms_per_pair_le_1") else "x"
        print(f"target {key}: {t['ratio']:.2f}{unit} -> {verdict}")
    problems = result["check"]["problems"]
    print("checks: " + ("every reply and the log agree" if not problems else "; ".join(problems)))
    print(json.dumps(result, separators=(",", ":"), default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--floor-samples", type=int, default=2000, help="in chunks over the run")
    parser.add_argument("--serial-pairs", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=30, help="serial pairs before timing")
    parser.add_argument("--concurrency", default="8,64", help="clients, one domain")
    parser.add_argument("--domains", type=int, default=4, help="for the spread phase (1: none)")
    parser.add_argument("--spread-clients", type=int, default=64, help="in the spread phase")
    parser.add_argument("--racks", type=int, default=8, help="racks joined by one OCS")
    parser.add_argument(
        "--fabric-memory",
        action="store_true",
        help="simulated hardware in memory only (default: a state file, as trellis up keeps)",
    )
    parser.add_argument(
        "--loop",
        choices=event_loop.EVENT_LOOPS,
        default=event_loop.default(),
        help="the event loop the engine and its follower process run on (default: as `trellis "
        "up` runs them)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="per load phase")
    parser.add_argument("--max-pairs", type=int, default=20_000, help="per load phase")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds for all floor samples")
    parser.add_argument("--quick", action="store_true", help="short phases, fewer samples")
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    parser.add_argument("--profile", metavar="FILE", help="cProfile an extra load phase")
    parser.add_argument(
        "--profile-clients",
        type=int,
        default=0,
        metavar="N",
        help="clients in the profiled phase (1: serial; default: the most of --concurrency)",
    )
    parser.add_argument(
        "--followers",
        choices=("inline", "process", "both"),
        default=Settings().followers,
        help="where the log followers run (TRELLIS_FOLLOWERS; default: as `trellis up` runs "
        "them); both: one engine after the other",
    )
    parser.add_argument(
        "--metrics",
        choices=("off", "on", "both", "both-on-first"),
        default="off",
        help="serve Prometheus metrics, scraped every second; both: one engine without, then one "
        "with (both-on-first: the other order, to see what the order does)",
    )
    parser.add_argument(
        "--no-diagnose",
        dest="diagnose",
        action="store_false",
        help="skip the phases with the projection runner paused",
    )
    args = parser.parse_args()
    if args.quick:
        args.floor_samples = min(args.floor_samples, 400)
        args.serial_pairs = min(args.serial_pairs, 100)
        args.warmup = min(args.warmup, 10)
        args.concurrency = "8,64"
        args.spread_clients = min(args.spread_clients, 64)
        args.seconds = min(args.seconds, 2.0)
        args.budget = min(args.budget, 2.0)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        result = event_loop.run(bench(args), args.loop)
    except BenchFailure as exc:
        raise SystemExit(f"a reply was not the success asked for; no figures: {exc}") from exc
    report(result)
    problems = result["check"]["problems"]
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
