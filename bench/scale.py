"""Scale benchmark (issue 25 item 4; docs/scale.md extrapolates from it): what one engine costs
per domain and per intent as halls grow, and what N engines do over M domains on one machine.

Engines run as `trellis up` processes (the deployed engine: NATS intake, Postgres log, inline
projections, event relay to JetStream and the KV bucket, simulated fabric in memory), so their
memory (VmRSS from /proc) and CPU (user + system from /proc) are theirs alone, apart from the
bench's clients. Servers are embedded (nats-server, PostgreSQL) unless TRELLIS_NATS_URL and
TRELLIS_DATABASE_URL are set; every fleet gets a fresh schema and subject prefix.

(a) One engine, one domain, per hall size: 4,096 devices (one pod of bench/fabrics.py: 64
    hosts, 8 racks, 2 OCS, pooled memory and NVMe) and 65,536 (16 pods and 4 core OCS). Per size:
    - idle: the engine up with no domain (RSS, start-up wall and CPU);
    - load a domain: `import-topology` (in parts) until the projections and the relay hold the
      whole log; the engine's CPU for it, its RSS after, the log's, the stream's and the
      bucket's bytes, events and keys;
    - per intent: compose (1 GPU) + release pairs, serial and with 16 clients; the engine's CPU
      ms per pair, p50/p99, and what the log, the stream and the bucket grew per pair;
    - start-up fold: the engine stopped and started again on the same log; from spawn to its
      first answered compose, against the idle engine's spawn to "up" (the fold is the
      difference), and its RSS serving the domain (no import buffers any more).
    Ratios are 65,536 over 4,096, in the same run.
(b) N engines over M small domains (intents.py's 4-rack fabric, 144 devices each): for each M,
    one engine first, then a second and a third started beside it. Domains spread by
    rendezvous hashing with balanced loads (trellis/engine/core/spread.py) through the fenced
    writer leases; before each load phase the bench waits until every domain is held and the
    holders are balanced within one (the time it took is printed). Then C clients compose and
    release over all M domains for a fixed time. Throughput and CPU per pair are given as
    ratios to the one-engine phase of the same M. Requests land on any engine (one queue
    group) and are forwarded to the domain's writer.

Every reply is checked (a compose `active` with one GPU on the host asked, a release
`released`); `unavailable` answers and timeouts are resent with the same request_id, as the
contract allows, and counted. At the end of each fleet the log is counted: activations =
composes, releases = releases, nothing failed, rejected or impaired. The last line printed is
one JSON object with every figure.

Every engine's output is read for "writer lease was lost", counted and printed. At the
engine's default lease time (3 s) a 65,536-device domain may never settle on a loaded machine:
loading it holds the engine's event loop past a lease time, the engine lets the domain go, takes
it again and loads it again (seen in two runs of three on 2 busy cores; docs/scale.md). The
bench gives up after 240 s and says how many leases were lost; `--hall-lease-ttl 10` runs (a)
with a 10 s lease (TRELLIS_LEASE_TTL). The fleets in (b) always run with the default.

    python bench/scale.py --hall-lease-ttl 10   # ~3 minutes on 2 cores
    python bench/scale.py --quick               # 4,096 devices; M=6 over 1 and 2 engines, ~45 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

import asyncpg
import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from bench.fabrics import build, document
from bench.intents import (
    TENANTS,
    BenchFailure,
    _machine_ticks,
    check_compose,
    check_release,
    conn_info,
    fresh_schema,
    percentile,
    servers,
)
from bench.intents import host_of as small_host_of
from bench.intents import topology as small_topology
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import bucket_name, stream_name
from trellis.adapters.settings import Settings
from trellis.projections.sink import default_projections

REPO = FsPath(__file__).resolve().parents[1]
SMALL_GPUS_PER_RACK = 32  # intents.py's fabric: 4 racks of 4 hosts and 32 GPUs, 144 devices
REQUEST_TIMEOUT_S = 10.0
FLEET_LEASE_TTL = 3.0  # the engine's default: what joins and handovers take is part of (b)
RESENDS = 12  # a reply not had after this many resends fails the run


# ---- engines as processes ----


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 once it is gone)."""
    try:
        fields = FsPath(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_mem_mib(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (the peak) of process `pid`, in MiB."""
    out = {"rss_mib": 0.0, "peak_mib": 0.0}
    try:
        text = FsPath(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss_mib" if key == "VmRSS" else "peak_mib"] = int(value.split()[0]) / 1024
    return out


class Engine:
    """One `trellis up`, its output in a file."""

    def __init__(self, number: int, proc: asyncio.subprocess.Process, output: FsPath) -> None:
        self.number = number
        self.proc = proc
        self.output = output
        self.spawned = time.perf_counter()
        self.up_s = float("nan")  # spawn to "trellis engine up"
        self.up_cpu_s = float("nan")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def mem(self) -> dict[str, float]:
        return proc_mem_mib(self.pid)

    def said(self) -> str:
        return self.output.read_text(errors="replace")

    def leases_lost(self) -> int:
        """How many times this engine said it lost a writer lease (an event loop held up past
        a lease time, or a lease store that did not answer in time)."""
        return self.said().count("its writer lease was lost")

    async def serving(self, within: float = 120.0) -> None:
        deadline = time.perf_counter() + within
        while "trellis engine up" not in self.said():
            if self.proc.returncode is not None or time.perf_counter() > deadline:
                raise BenchFailure(f"engine {self.number} did not come up:\n{self.said()[-3000:]}")
            await asyncio.sleep(0.01)
        self.up_s = time.perf_counter() - self.spawned
        self.up_cpu_s = self.cpu_s()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@dataclass
class Fleet:
    """Engines on the same servers, schema and subjects, as a deployment runs them."""

    env: dict[str, str]
    logs: FsPath
    schema: str
    prefix: str
    database_url: str
    engines: list[Engine] = field(default_factory=list)
    started: int = 0
    lost_by_stopped: int = 0  # leases lost by engines stopped since

    async def start_one(self) -> Engine:
        self.started += 1
        output = self.logs / f"{self.prefix}-engine-{self.started}.log"
        with output.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trellis.adapters.entrypoints.cli", "up",
                cwd=REPO, env=self.env, stdout=out, stderr=out,
            )  # fmt: skip
        engine = Engine(self.started, proc, output)
        self.engines.append(engine)
        await engine.serving()
        return engine

    async def stop(self, engine: Engine) -> None:
        await engine.stop()
        self.lost_by_stopped += engine.leases_lost()
        self.engines.remove(engine)

    def leases_lost(self) -> int:
        return self.lost_by_stopped + sum(e.leases_lost() for e in self.engines)

    async def close(self) -> None:
        for engine in list(self.engines):
            await self.stop(engine)

    async def sql(self, query: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(
            self.database_url, server_settings={"search_path": self.schema}
        )
        try:
            rows: list[asyncpg.Record] = await conn.fetch(query, *args)
            return rows
        finally:
            await conn.close()

    async def holders(self) -> dict[str, int]:
        """domain -> pid of the engine whose writer lease on it is live."""
        rows = await self.sql(
            "SELECT l.domain, e.name FROM trellis_writer_leases l "
            "JOIN trellis_engines e ON e.id = l.holder WHERE l.expires_at > clock_timestamp()"
        )
        return {r["domain"]: int(r["name"].rsplit(":", 1)[1]) for r in rows}

    async def settled(self, domains: list[str], within: float = 240.0) -> None:
        """Until the projections and the relay hold every event of `domains`."""
        names = [p.name for p in default_projections()] + [f"relay:{stream_name(self.prefix)}"]
        deadline = time.perf_counter() + within
        while True:
            rows = await self.sql(
                "SELECT d.domain FROM unnest($1::text[]) AS d(domain) WHERE "
                "(SELECT count(*) FROM trellis_follower_checkpoints c WHERE c.domain = d.domain "
                "AND c.follower = ANY($2::text[]) AND c.position >= (SELECT max(position) FROM "
                "trellis_events e WHERE e.domain = d.domain)) < cardinality($2::text[])",
                domains,
                names,
            )
            if not rows:
                return
            if time.perf_counter() > deadline:
                raise BenchFailure(
                    f"not projected and relayed within {within:.0f} s: "
                    f"{[r['domain'] for r in rows]}; the engines lost a writer lease "
                    f"{self.leases_lost()} times meanwhile (a longer --lease-ttl may help)"
                )
            await asyncio.sleep(0.05)


def engine_env(
    nats_url: str,
    database_url: str,
    owner_url: str,
    schema: str,
    prefix: str,
    data: FsPath,
    lease_ttl: float,
) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
        "TRELLIS_NATS_URL": nats_url,
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DATABASE_OWNER_URL": owner_url,
        "TRELLIS_DB_SCHEMA": schema,
        "TRELLIS_SUBJECT_PREFIX": prefix,
        "TRELLIS_DATA_DIR": str(data),
        # The engine's cost per intent, not a tenant's rate limit (bench/flood.py has that).
        "TRELLIS_TENANT_RATE": "0",
        "TRELLIS_LEASE_TTL": str(lease_ttl),
    }


# ---- clients ----


class Asker:
    """Requests with resends: a timeout, no responders or `unavailable` is sent again with the
    same request_id (the contract's idempotence), after a short, growing pause."""

    def __init__(self, clients: list[TrellisClient]) -> None:
        self.clients = clients
        self.resends = 0

    async def ask(self, i: int, subject_tail: str, body: dict[str, Any]) -> dict[str, Any]:
        client = self.clients[i % len(self.clients)]
        data = msgspec.json.encode({"request_id": str(uuid.uuid4()), **body})
        pause = 0.05
        for attempt in range(RESENDS + 1):
            if attempt:
                self.resends += 1
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)
            try:
                reply = await client.raw(subject_tail, data)
            except (NatsTimeout, NoRespondersError):
                continue
            if reply.get("ok") or reply.get("error", {}).get("code") != "unavailable":
                return reply
        raise BenchFailure(f"{subject_tail}: no answer after {RESENDS} resends")


@dataclass
class Pairs:
    pair: list[float] = field(default_factory=list)
    compose: list[float] = field(default_factory=list)
    release: list[float] = field(default_factory=list)
    seconds: float = 0.0


async def one_pair(asker: Asker, i: int, domain: str, tenant: str, host: str, out: Pairs) -> None:
    t0 = time.perf_counter_ns()
    composed = await asker.ask(
        i,
        f"intent.{domain}.{tenant}.compose",
        {"host": host, "devices": [{"kind": "gpu"}], "reason": "scale"},
    )
    t1 = time.perf_counter_ns()
    cid = check_compose(composed, host)
    released = await asker.ask(i, f"intent.{domain}.{tenant}.release", {"composition_id": cid})
    t2 = time.perf_counter_ns()
    check_release(released, cid)
    out.compose.append((t1 - t0) / 1e6)
    out.release.append((t2 - t1) / 1e6)
    out.pair.append((t2 - t0) / 1e6)


async def run_pairs(
    asker: Asker,
    domains: list[str],
    hosts: list[str],
    workers: int,
    seconds: float,
    max_pairs: int,
) -> Pairs:
    """`workers` loops of compose+release for `seconds` or `max_pairs` in all; worker i works
    in domain i % len(domains), as tenant i % 8, on host hosts[(i // len(domains)) % len]."""
    out = Pairs()
    started = time.perf_counter()
    deadline = started + seconds
    budget = [max_pairs]

    async def worker(i: int) -> None:
        domain = domains[i % len(domains)]
        host = hosts[(i // len(domains)) % len(hosts)]
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            await one_pair(asker, i, domain, TENANTS[i % len(TENANTS)], host, out)

    await asyncio.gather(*(worker(i) for i in range(workers)))
    out.seconds = time.perf_counter() - started
    return out


def latency(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "p50_ms": percentile(samples, 50),
        "p99_ms": percentile(samples, 99),
    }


class Meter:
    """CPU of some engine processes, and the machine's busy share, over a phase."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = list(engines)
        self.cpu = {e.pid: e.cpu_s() for e in self.engines}
        self.machine = _machine_ticks()
        self.wall = time.perf_counter()

    def read(self) -> dict[str, Any]:
        busy, total = _machine_ticks()
        d_busy, d_total = busy - self.machine[0], total - self.machine[1]
        per = {e.number: e.cpu_s() - self.cpu[e.pid] for e in self.engines}
        return {
            "wall_s": time.perf_counter() - self.wall,
            "engine_cpu_s": sum(per.values()),
            "engine_cpu_s_each": per,
            "machine_busy_share": d_busy / d_total if d_total else float("nan"),
        }


async def idle_share(engine: Engine, seconds: float) -> float:
    """The share of a core `engine` uses over `seconds` with nothing asked of it: its ticks,
    lease renewals, heartbeats and the followers' polls."""
    cpu0, t0 = engine.cpu_s(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (engine.cpu_s() - cpu0) / (time.perf_counter() - t0)


def pair_figures(pairs: Pairs, cpu: dict[str, Any], idle_share: float) -> dict[str, Any]:
    """A phase's figures; `idle_share` (the engines' CPU share at rest, in cores) is taken
    off the engines' CPU for the marginal cost of a pair."""
    n = len(pairs.pair)
    marginal = max(0.0, cpu["engine_cpu_s"] - idle_share * cpu["wall_s"])
    return {
        "pairs": n,
        "seconds": pairs.seconds,
        "pairs_per_s": n / pairs.seconds if pairs.seconds else float("nan"),
        "pair": latency(pairs.pair),
        "compose": latency(pairs.compose),
        "release": latency(pairs.release),
        "cpu": cpu,
        "engine_cpu_ms_per_pair": cpu["engine_cpu_s"] * 1000 / max(1, n),
        "engine_cpu_ms_per_pair_marginal": marginal * 1000 / max(1, n),
        "engine_cpu_share": cpu["engine_cpu_s"] / cpu["wall_s"] if cpu["wall_s"] else 0.0,
    }


# ---- sizes: the log, the stream, the bucket ----


async def log_sizes(fleet: Fleet, domains: list[str]) -> dict[str, float]:
    rows = await fleet.sql(
        "SELECT count(*) AS events, coalesce(sum(octet_length(data::text)), 0) AS data_bytes "
        "FROM trellis_events WHERE domain = ANY($1::text[])",
        domains,
    )
    tables = await fleet.sql(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) AS bytes FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind = 'r'",
        fleet.schema,
    )
    # The write-ahead log's position: what the server wrote in all (the bench's schema is the
    # only one busy on an embedded server), full-page images included.
    wal = await fleet.sql("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS at")
    return {
        "events": int(rows[0]["events"]),
        "event_data_bytes": int(rows[0]["data_bytes"]),
        "schema_bytes": int(tables[0]["bytes"]),
        "wal_bytes": int(wal[0]["at"]),
    }


async def js_sizes(nc: NATS, prefix: str) -> dict[str, int]:
    js = nc.jetstream()
    stream = await js.stream_info(stream_name(prefix))
    bucket = await js.stream_info(f"KV_{bucket_name(prefix)}")
    return {
        "stream_messages": stream.state.messages,
        "stream_bytes": stream.state.bytes,
        # History 1: one message per key, live or deleted (an ended composition's key leaves
        # a delete marker, which nothing purges).
        "kv_messages": bucket.state.messages,
        "kv_bytes": bucket.state.bytes,
    }


def nats_mem_mib(monitor_url: str | None) -> float:
    """The nats-server's resident memory (its /varz `mem`), in MiB; nan without a monitor."""
    if not monitor_url:
        return float("nan")
    import urllib.request

    with urllib.request.urlopen(f"{monitor_url}/varz", timeout=5) as reply:
        return float(json.loads(reply.read())["mem"]) / 2**20


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if isinstance(after[k], int | float)}


# ---- (a) one engine, one domain, per hall size ----


async def hall_phase(
    args: argparse.Namespace, urls: Any, pods: int, logs: FsPath, nc: NATS
) -> dict[str, Any]:
    world = build(pods)
    doc = {**document(world), "reason": "scale"}
    devices = world.device_count
    hosts = world.hosts
    domain = f"hall-{devices}"
    progress(f"(a) {devices:,} devices: {len(doc['nodes']):,} nodes, {len(doc['links']):,} links")
    out: dict[str, Any] = {
        "devices": devices,
        "nodes": len(doc["nodes"]),
        "links": len(doc["links"]),
    }
    nats_url, database_url, owner_url, _ = urls
    async with fresh_schema(owner_url, args.keep) as schema:
        prefix = f"s{uuid.uuid4().hex[:10]}"
        env = engine_env(
            nats_url, database_url, owner_url, schema, prefix, logs / prefix, args.hall_lease_ttl
        )
        fleet = Fleet(env, logs, schema, prefix, owner_url)
        clients = [TrellisClient(nc, prefix=prefix, timeout=REQUEST_TIMEOUT_S)]
        asker = Asker(clients)
        try:
            # The first start migrates the fresh schema; the idle baseline is a second start.
            engine = await fleet.start_one()
            first_up_s = engine.up_s
            await fleet.stop(engine)
            engine = await fleet.start_one()
            await asyncio.sleep(1.0)  # its first ticks and followers started
            out["idle"] = {
                "first_up_s": first_up_s,
                "up_s": engine.up_s,
                "up_cpu_s": engine.up_cpu_s,
                "cpu_share": await idle_share(engine, args.idle),
                **engine.mem(),
            }
            sizes0 = await log_sizes(fleet, [domain])
            nats0 = nats_mem_mib(urls.nats_monitor_url)
            # Load the domain: import (in parts) until the read models and the stream hold it.
            cpu0, t0 = engine.cpu_s(), time.perf_counter()
            client = TrellisClient(nc, prefix=prefix, timeout=600)
            reply = await client.import_topology(domain, doc)
            if not reply.get("ok"):
                raise BenchFailure(f"import into {domain}: {json.dumps(reply)[:600]}")
            imported_s = time.perf_counter() - t0
            await fleet.settled([domain])
            settled_s = time.perf_counter() - t0
            await asyncio.sleep(0.5)
            out["load"] = {
                "import_s": imported_s,
                "settled_s": settled_s,
                "engine_cpu_s": engine.cpu_s() - cpu0,
                **engine.mem(),
                **delta(await log_sizes(fleet, [domain]), sizes0),
                **await js_sizes(nc, prefix),
            }
            out["load"]["rss_over_idle_mib"] = out["load"]["rss_mib"] - out["idle"]["rss_mib"]
            # What holding the domain's stream messages and bucket keys costs the server.
            out["load"]["nats_mem_over_before_mib"] = nats_mem_mib(urls.nats_monitor_url) - nats0
            out["load"]["idle_cpu_share"] = await idle_share(engine, args.idle)
            progress(
                f"  loaded in {settled_s:.1f} s (import {imported_s:.1f} s), engine CPU "
                f"{out['load']['engine_cpu_s']:.1f} s, RSS {out['load']['rss_mib']:.0f} MiB"
            )
            # Per intent.
            js0, log0 = await js_sizes(nc, prefix), await log_sizes(fleet, [domain])
            warm = await run_pairs(asker, [domain], hosts, 1, 30, args.warmup)
            meter = Meter([engine])
            serial = await run_pairs(asker, [domain], hosts, 1, args.seconds * 2, args.serial)
            idle = out["load"]["idle_cpu_share"]
            out["serial"] = pair_figures(serial, meter.read(), idle)
            meter = Meter([engine])
            load = await run_pairs(asker, [domain], hosts, 16, args.seconds, 20_000)
            out["c16"] = pair_figures(load, meter.read(), idle)
            pairs = len(warm.pair) + len(serial.pair) + len(load.pair)
            await fleet.settled([domain])
            grown = {
                **delta(await js_sizes(nc, prefix), js0),
                **delta(await log_sizes(fleet, [domain]), log0),
            }
            out["per_pair"] = {k: v / pairs for k, v in grown.items()}
            out["per_pair"]["pairs"] = pairs
            out["serving_rss_mib"] = engine.mem()["rss_mib"]
            progress(
                f"  serial {out['serial']['pair']['p50_ms']:.1f} ms p50, "
                f"{out['serial']['engine_cpu_ms_per_pair']:.2f} engine CPU ms/pair; "
                f"16 clients {out['c16']['pairs_per_s']:.0f} pairs/s, "
                f"{out['c16']['engine_cpu_ms_per_pair']:.2f} CPU ms/pair"
            )
            # Start-up fold: the same log, a new engine.
            await fleet.stop(engine)
            engine = await fleet.start_one()
            t_spawn = engine.spawned
            first = Pairs()
            await one_pair(asker, 0, domain, TENANTS[0], hosts[0], first)
            answered_s = time.perf_counter() - t_spawn
            # The fold: spawn to the first answered pair, less the idle engine's spawn to "up"
            # and a serial pair's p50 (and likewise its CPU).
            pair_ms = out["serial"]["pair"]["p50_ms"]
            out["restart"] = {
                "up_s": engine.up_s,
                "first_answer_s": answered_s,
                "cpu_to_first_answer_s": engine.cpu_s(),
                "fold_s": answered_s - out["idle"]["up_s"] - pair_ms / 1000,
                "fold_cpu_s": engine.cpu_s()
                - out["idle"]["up_cpu_s"]
                - out["serial"]["engine_cpu_ms_per_pair_marginal"] / 1000,
            }
            await asyncio.sleep(1.0)
            out["restart"].update(engine.mem())
            out["restart"]["rss_over_idle_mib"] = out["restart"]["rss_mib"] - out["idle"]["rss_mib"]
            progress(
                f"  restart: first answer {answered_s:.2f} s after spawn (idle engine up in "
                f"{out['idle']['up_s']:.2f} s), RSS {out['restart']['rss_mib']:.0f} MiB"
            )
            composes = pairs + 1
            out["check"] = await verify(fleet, [domain], composes)
            out["resends"] = asker.resends
            out["leases_lost"] = fleet.leases_lost()
        finally:
            await fleet.close()
    return out


# ---- (b) N engines over M domains ----


async def balanced(fleet: Fleet, domains: list[str], within: float = 120.0) -> dict[int, int]:
    """Until every domain is held by a running engine, every engine holds some, and the
    counts are within one of each other; engine number -> domains held."""
    deadline = time.perf_counter() + within
    numbers = {e.pid: e.number for e in fleet.engines}
    while True:
        held = await fleet.holders()
        counts = Counter(numbers[pid] for d, pid in held.items() if d in domains and pid in numbers)
        per = {numbers[pid]: counts.get(numbers[pid], 0) for pid in numbers}
        if sum(counts.values()) == len(domains) and spread_of(per) <= 1:
            return per
        if time.perf_counter() > deadline:
            raise BenchFailure(f"domains not balanced within {within:.0f} s: {per}")
        await asyncio.sleep(0.1)


def spread_of(counts: dict[int, int]) -> int:
    """The largest difference between two engines' domain counts (0 for none or one)."""
    return max(counts.values()) - min(counts.values()) if counts else 0


async def fleet_phase(
    args: argparse.Namespace, urls: Any, n_domains: int, logs: FsPath, nc: NATS
) -> dict[str, Any]:
    nats_url, database_url, owner_url, _ = urls
    doc = small_topology(SMALL_GPUS_PER_RACK)
    devices = sum(1 for n in doc["nodes"] if n["kind"] == "device")
    hosts = [small_host_of(w) for w in range(16)]
    out: dict[str, Any] = {"domains": n_domains, "devices_per_domain": devices, "phases": []}
    async with fresh_schema(owner_url, args.keep) as schema:
        prefix = f"f{uuid.uuid4().hex[:10]}"
        env = engine_env(
            nats_url, database_url, owner_url, schema, prefix, logs / prefix, FLEET_LEASE_TTL
        )
        fleet = Fleet(env, logs, schema, prefix, owner_url)
        domains = [f"d{n_domains}-{i:02d}" for i in range(n_domains)]
        ncs = [await connect_nats(nats_url, name=f"scale-client-{i}") for i in range(4)]
        asker = Asker([TrellisClient(c, prefix=prefix, timeout=REQUEST_TIMEOUT_S) for c in ncs])
        composes = 0
        try:
            first = await fleet.start_one()
            await asyncio.sleep(1.0)
            idle = first.mem()
            empty_share = await idle_share(first, args.idle)
            cpu0 = first.cpu_s()
            t0 = time.perf_counter()
            for i, d in enumerate(domains):
                reply = await asker.ask(i, f"admin.{d}.import-topology", doc)
                if not reply.get("ok"):
                    raise BenchFailure(f"import into {d}: {json.dumps(reply)[:600]}")
            await fleet.settled(domains)
            await asyncio.sleep(0.5)
            loaded = first.mem()
            loaded_share = await idle_share(first, args.idle)
            out["load"] = {
                "seconds": time.perf_counter() - t0,
                "engine_cpu_s": first.cpu_s() - cpu0,
                "idle_rss_mib": idle["rss_mib"],
                "rss_mib": loaded["rss_mib"],
                "rss_per_domain_mib": (loaded["rss_mib"] - idle["rss_mib"]) / n_domains,
                "empty_idle_cpu_share": empty_share,
                "idle_cpu_share": loaded_share,
                "idle_cpu_share_per_domain": (loaded_share - empty_share) / n_domains,
            }
            progress(
                f"(b) {n_domains} domains of {devices} devices on one engine: "
                f"{out['load']['rss_per_domain_mib']:.2f} MiB each"
            )
            warm = await run_pairs(asker, domains, hosts, n_domains, 30, args.warmup)
            composes += len(warm.pair)
            for n_engines in range(1, args.engines + 1):
                if n_engines > 1:
                    engine = await fleet.start_one()
                    t_join = engine.spawned
                else:
                    t_join = time.perf_counter()
                per = await balanced(fleet, domains)
                balanced_s = time.perf_counter() - t_join
                clients = max(args.clients, n_domains)
                meter = Meter(fleet.engines)
                pairs = await run_pairs(asker, domains, hosts, clients, args.seconds, 50_000)
                composes += len(pairs.pair)
                # At rest, each engine costs what an empty one does, and the domains theirs.
                rest = n_engines * empty_share + (loaded_share - empty_share)
                figures = pair_figures(pairs, meter.read(), rest)
                figures.update(
                    engines=n_engines,
                    clients=clients,
                    held=per,
                    balance=spread_of(per),
                    balanced_s=balanced_s,
                    rss_mib={e.number: e.mem()["rss_mib"] for e in fleet.engines},
                )
                out["phases"].append(figures)
                progress(
                    f"  {n_engines} engine(s) {per} (balanced {balanced_s:.1f} s after start): "
                    f"{figures['pairs_per_s']:.0f} pairs/s, "
                    f"{figures['engine_cpu_ms_per_pair']:.2f} engine CPU ms/pair"
                )
            out["check"] = await verify(fleet, domains, composes)
            out["resends"] = asker.resends
            out["leases_lost"] = fleet.leases_lost()
        finally:
            for c in ncs:
                await c.close()
            await fleet.close()
    return out


async def verify(fleet: Fleet, domains: list[str], composes: int) -> dict[str, Any]:
    """The log agrees with the replies: every compose activated, every release recorded."""
    rows = await fleet.sql(
        "SELECT type, count(*) AS n FROM trellis_events WHERE domain = ANY($1::text[]) "
        "GROUP BY type",
        domains,
    )
    counts = {r["type"]: int(r["n"]) for r in rows}
    problems = []
    for kind in ("CompositionActivated", "CompositionReleased"):
        if counts.get(kind, 0) != composes:
            problems.append(f"{counts.get(kind, 0)} {kind}, {composes} answered")
    for bad in ("CompositionFailed", "CompositionRejected", "CompositionImpaired"):
        if counts.get(bad):
            problems.append(f"{counts[bad]} {bad}")
    return {"event_counts": counts, "problems": problems}


# ---- the run ----


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.from_env()
    result: dict[str, Any] = {
        "bench": "scale",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "hall_lease_ttl": args.hall_lease_ttl,
        "nats": "configured" if settings.nats_url else "embedded",
        "postgres": "configured" if settings.database_url else "embedded",
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trellis-scale-") as tmp:
        logs = FsPath(tmp)
        async with servers(settings) as urls:
            async with conn_info(urls.database_owner_url) as info:
                result["server"] = info
            nc = await connect_nats(urls.nats_url, name="scale-bench")
            try:
                result["halls"] = [
                    await hall_phase(args, urls, pods, logs, nc) for pods in args.pods
                ]
                result["fleets"] = [
                    await fleet_phase(args, urls, m, logs, nc) for m in args.domains
                ]
            finally:
                await nc.close()
    result["seconds"] = time.perf_counter() - started
    result["loadavg_after"] = os.getloadavg()
    result["problems"] = [
        p for part in result["halls"] + result["fleets"] for p in part["check"]["problems"]
    ]
    return result


def ratio(a: float, b: float) -> float:
    """a over b; nan when b is not above zero (a baseline within the noise of nothing)."""
    return a / b if b > 0 else float("nan")


def hall_table(halls: list[dict[str, Any]]) -> list[str]:
    rows = [
        "(a) one engine, one domain",
        f"{'devices':>8} {'idle MiB':>8} {'load s':>7} {'load cpu s':>10} {'RSS MiB':>8} "
        f"{'+MiB':>7} {'events':>6} {'log MiB':>7} {'stream MiB':>10} {'kv keys':>8} "
        f"{'fold s':>6} {'fold cpu':>8} {'+MiB srv':>8} {'rest cpu':>8} {'nats +MiB':>9}",
    ]
    rows.append("-" * len(rows[-1]))
    for h in halls:
        ld, rs = h["load"], h["restart"]
        rows.append(
            f"{h['devices']:>8,} {h['idle']['rss_mib']:>8.0f} {ld['settled_s']:>7.1f} "
            f"{ld['engine_cpu_s']:>10.1f} {ld['rss_mib']:>8.0f} {ld['rss_over_idle_mib']:>7.0f} "
            f"{ld['events']:>6} {ld['schema_bytes'] / 2**20:>7.1f} "
            f"{ld['stream_bytes'] / 2**20:>10.1f} {ld['kv_messages']:>8,} {rs['fold_s']:>6.2f} "
            f"{rs['fold_cpu_s']:>8.2f} {rs['rss_over_idle_mib']:>8.0f} "
            f"{ld['idle_cpu_share'] * 100:>7.1f}% {ld['nats_mem_over_before_mib']:>9.0f}"
        )
    rows += [
        "",
        f"{'devices':>8} {'phase':>7} {'pairs':>6} {'pairs/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'cpu ms/pair':>11} {'marginal':>8} {'engine cpu':>10} {'busy':>5} {'log B/pair':>10} "
        f"{'WAL B/pair':>10} {'stream B/pair':>13}",
    ]
    rows.append("-" * len(rows[-1]))
    for h in halls:
        for name in ("serial", "c16"):
            ph = h[name]
            rows.append(
                f"{h['devices']:>8,} {name:>7} {ph['pairs']:>6} {ph['pairs_per_s']:>8.0f} "
                f"{ph['pair']['p50_ms']:>7.2f} {ph['pair']['p99_ms']:>7.2f} "
                f"{ph['engine_cpu_ms_per_pair']:>11.2f} "
                f"{ph['engine_cpu_ms_per_pair_marginal']:>8.2f} "
                f"{ph['engine_cpu_share'] * 100:>9.0f}% "
                f"{ph['cpu']['machine_busy_share'] * 100:>4.0f}% "
                f"{h['per_pair']['schema_bytes']:>10.0f} {h['per_pair']['wal_bytes']:>10.0f} "
                f"{h['per_pair']['stream_bytes']:>13.0f}"
            )
    if len(halls) == 2:
        small, big = halls
        rows += ["", f"growth {big['devices']:,} / {small['devices']:,} devices (same run):"]
        pairs = [
            ("RSS to hold the domain (after restart)", "restart", "rss_over_idle_mib"),
            ("start-up fold (s)", "restart", "fold_s"),
            ("CPU to load (import, project, relay)", "load", "engine_cpu_s"),
            ("CPU at rest (share of a core)", "load", "idle_cpu_share"),
        ]
        for label, part, key in pairs:
            rows.append(
                f"  {label:<40} {ratio(big[part][key], small[part][key]):>6.1f}x "  # nan: ~0
                f"({small[part][key]:.2f} -> {big[part][key]:.2f})"
            )
        for name in ("serial", "c16"):
            s, b = small[name], big[name]
            for label, get in (
                ("CPU ms per pair", lambda x: x["engine_cpu_ms_per_pair"]),
                ("marginal CPU ms per pair", lambda x: x["engine_cpu_ms_per_pair_marginal"]),
                ("pair p50 ms", lambda x: x["pair"]["p50_ms"]),
                ("pair p99 ms", lambda x: x["pair"]["p99_ms"]),
            ):
                rows.append(
                    f"  {name + ' ' + label:<40} {ratio(get(b), get(s)):>6.2f}x "
                    f"({get(s):.2f} -> {get(b):.2f})"
                )
    rows += [
        "",
        "load s: import until the projections and the relay hold it; +MiB: RSS over the idle "
        "engine's; kv keys: bucket messages (devices and hosts); fold s/cpu: a restarted "
        "engine's spawn to its first answered pair, less the idle engine's spawn to up and a "
        "pair; +MiB srv: the restarted engine's RSS over the idle one's; rest cpu: the engine's "
        "CPU with the domain loaded and nothing asked; nats +MiB: the nats-server's memory (/varz) "
        "over its own before the import. cpu ms/pair: the engine's CPU per "
        "compose+release pair; marginal: less its CPU at rest over the phase.",
    ]
    return rows


def fleet_table(fleets: list[dict[str, Any]]) -> list[str]:
    rows = [
        "",
        "(b) N engines over M domains (all on this machine)",
        f"{'M':>3} {'N':>2} {'held':>12} {'bal s':>6} {'clients':>7} {'pairs/s':>8} "
        f"{'vs N=1':>7} {'p50 ms':>7} {'p99 ms':>7} {'cpu ms/pair':>11} {'marginal':>8} "
        f"{'vs N=1':>7} {'busy':>5} {'RSS MiB each':>16}",
    ]
    rows.append("-" * len(rows[-1]))
    for f in fleets:
        base = f["phases"][0]
        for ph in f["phases"]:
            held = "/".join(str(v) for _, v in sorted(ph["held"].items()))
            rss = "/".join(f"{v:.0f}" for _, v in sorted(ph["rss_mib"].items()))
            rows.append(
                f"{f['domains']:>3} {ph['engines']:>2} {held:>12} {ph['balanced_s']:>6.1f} "
                f"{ph['clients']:>7} {ph['pairs_per_s']:>8.0f} "
                f"{ratio(ph['pairs_per_s'], base['pairs_per_s']):>6.2f}x "
                f"{ph['pair']['p50_ms']:>7.2f} {ph['pair']['p99_ms']:>7.2f} "
                f"{ph['engine_cpu_ms_per_pair']:>11.2f} "
                f"{ph['engine_cpu_ms_per_pair_marginal']:>8.2f} "
                f"{ratio(ph['engine_cpu_ms_per_pair'], base['engine_cpu_ms_per_pair']):>6.2f}x "
                f"{ph['cpu']['machine_busy_share'] * 100:>4.0f}% {rss:>16}"
            )
        ld = f["load"]
        rows.append(
            f"    {f['domains']} domains of {f['devices_per_domain']} devices loaded on one engine "
            f"in {ld['seconds']:.1f} s: RSS {ld['idle_rss_mib']:.0f} -> {ld['rss_mib']:.0f} MiB, "
            f"{ld['rss_per_domain_mib']:.2f} MiB and {ld['engine_cpu_s'] / f['domains']:.2f} "
            f"CPU s per domain to load; at rest {ld['empty_idle_cpu_share'] * 100:.1f}% of a core "
            f"empty, {ld['idle_cpu_share'] * 100:.1f}% with them "
            f"({ld['idle_cpu_share_per_domain'] * 100:.2f}% per domain)"
        )
    rows += [
        "",
        "held: domains per engine at the phase (balanced within one first; bal s: from the new "
        "engine's spawn). cpu ms/pair: all engines' CPU per compose+release pair. busy: the "
        "whole machine (engines, servers, the bench's clients). vs N=1: against the one-engine "
        "phase of the same M, in this run.",
    ]
    return rows


def report(result: dict[str, Any]) -> None:
    print("\n".join(hall_table(result["halls"]) + fleet_table(result["fleets"])))
    print()
    parts = result["halls"] + result["fleets"]
    print(
        f"machine: {result['cpus']} CPUs, load average {result['loadavg_before'][0]:.2f} before "
        f"and {result['loadavg_after'][0]:.2f} after; run {result['seconds']:.0f} s; lease "
        f"time in (a) {result['hall_lease_ttl']:g} s; resends "
        f"{sum(p['resends'] for p in parts)}; writer leases lost "
        f"{sum(p['leases_lost'] for p in parts)}"
    )
    problems = result["problems"]
    print("checks: " + ("every reply and the log agree" if not problems else "; ".join(problems)))
    print(json.dumps(result, separators=(",", ":"), default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", default="1,16", help="hall sizes in pods (1: 4,096 devices)")
    parser.add_argument("--domains", default="6,24", help="M, small domains per fleet")
    parser.add_argument("--engines", type=int, default=3, help="N goes 1..this")
    parser.add_argument("--clients", type=int, default=48, help="in each fleet phase")
    parser.add_argument("--serial", type=int, default=200, help="serial pairs per hall")
    parser.add_argument("--warmup", type=int, default=20, help="pairs before timing")
    parser.add_argument("--seconds", type=float, default=6.0, help="per load phase")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds to measure rest CPU")
    parser.add_argument(
        "--hall-lease-ttl",
        type=float,
        default=3.0,
        help="TRELLIS_LEASE_TTL in (a) (3: the default; the fleets always run with 3)",
    )
    parser.add_argument("--quick", action="store_true", help="4,096 devices; M=6, N=1,2")
    parser.add_argument("--keep", action="store_true", help="keep the schemas afterwards")
    args = parser.parse_args()
    if args.quick:
        args.pods, args.domains, args.engines = "1", "6", min(args.engines, 2)
        args.serial, args.warmup, args.seconds, args.idle = 50, 10, 2.0, 1.0
        args.clients = min(args.clients, 24)
    args.pods = [int(p) for p in args.pods.split(",") if p]
    args.domains = [int(m) for m in args.domains.split(",") if m]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        result = asyncio.run(bench(args))
    except BenchFailure as exc:
        raise SystemExit(f"no figures: {exc}") from exc
    report(result)
    if result["problems"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
