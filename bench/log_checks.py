"""What the log's content checks (schema/007) cost an append.

The engine writes a real log first (`adapters.bootstrap.engine_on`, simulated fabric): the
bench topology, then compose+release pairs from concurrent clients. Then the same events are
appended again, batch by batch as the engine committed them (grouped by causation, 8 requests a
batch, like a busy writer's group commit), into two fresh domains of fresh schemas: one with the
checks and one where the check trigger was dropped after the migrations. Batches alternate
between the two, so both see the same background load; each append is timed on its own. The
import (one large TopologyImported event) is timed apart, appended again and again to fresh
domains. The check alone (no commit, no fsync) is timed apart too: the log copied by one INSERT
... SELECT into a table with the check's trigger and into one without. Uses TRELLIS_NATS_URL /
TRELLIS_DATABASE_URL when set, else embedded servers. The last line printed is one JSON object
with every figure.

    python bench/log_checks.py               # ~40 s on 2 cores
    python bench/log_checks.py --pairs 200 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import re
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path as FsPath
from typing import Any

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

import asyncpg

from bench.intents import TENANTS, Load, fresh_schema, host_of, pair, progress, servers, topology
from trellis.adapters.bootstrap import engine_on
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.adapters.settings import Settings
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent

DOMAIN = "bench"


async def write_log(nats_url: str, database_url: str, schema: str, pairs: int) -> None:
    prefix = f"b{uuid.uuid4().hex[:12]}"
    settings = Settings(
        nats_url=nats_url, database_url=database_url, db_schema=schema, subject_prefix=prefix
    )
    async with engine_on(settings) as running:
        nc = await connect_nats(nats_url, name="bench-log-checks")
        try:
            client = TrellisClient(nc, prefix=prefix)
            reply = await client.admin(DOMAIN, "import-topology", topology(gpus_per_rack=64))
            assert reply["ok"], reply
            load, todo = Load(), iter(range(pairs))

            async def worker(i: int) -> None:
                for _ in todo:
                    await pair(client, DOMAIN, TENANTS[i % len(TENANTS)], host_of(i), load)

            await asyncio.gather(*(worker(i) for i in range(16)))
            sync = running.engine.fabric_sync(DOMAIN)
            if sync is not None:
                await asyncio.wait_for(sync.wait_idle(), 30)
        finally:
            await nc.close()


def as_pending(ev: RecordedEvent) -> PendingEvent:
    return PendingEvent(
        id=str(uuid.uuid4()),
        type=ev.type,
        schema_version=ev.schema_version,
        actor=ev.actor,
        causation_id=ev.causation_id,
        correlation_id=ev.correlation_id,
        recorded_at=ev.recorded_at,
        data=ev.data,
    )


def batches(events: list[RecordedEvent], requests_per_batch: int) -> list[list[RecordedEvent]]:
    """The events of `requests_per_batch` consecutive requests, batch after batch."""
    by_request = [list(g) for _, g in itertools.groupby(events, key=lambda e: e.causation_id)]
    return [
        [e for group in by_request[i : i + requests_per_batch] for e in group]
        for i in range(0, len(by_request), requests_per_batch)
    ]


@contextlib.asynccontextmanager
async def target(database_url: str, checked: bool) -> AsyncIterator[PostgresEventStore]:
    async with fresh_schema(database_url, keep=False) as schema:
        store = await PostgresEventStore.open(database_url, schema=schema)  # migrates
        try:
            if not checked:
                conn = await asyncpg.connect(database_url, server_settings={"search_path": schema})
                try:
                    await conn.execute("DROP TRIGGER trellis_events_a_content ON trellis_events")
                finally:
                    await conn.close()
            yield store
        finally:
            await store.close()


async def time_appends(
    stores: dict[str, PostgresEventStore], work: list[list[RecordedEvent]], domain: str
) -> dict[str, list[float]]:
    """Append every batch to each store in turn; milliseconds per append, by store."""
    heads = dict.fromkeys(stores, Head())
    times: dict[str, list[float]] = {name: [] for name in stores}
    for i, batch in enumerate(work):
        order = list(stores.items())
        for name, store in order if i % 2 else reversed(order):  # neither always goes first
            pending = [as_pending(e) for e in batch]
            t0 = time.perf_counter_ns()
            appended = await store.append(domain, heads[name], pending, [])
            times[name].append((time.perf_counter_ns() - t0) / 1e6)
            heads[name] = appended.head
    return times


async def time_check_alone(database_url: str, schema: str, rounds: int) -> dict[str, float]:
    """The content check's own time per event, apart from commits and fsyncs (whose noise is
    most of an append's spread): the log's events (the import apart) copied by one INSERT ...
    SELECT into a scratch table with the check's trigger, and into one without, alternated;
    the fastest of `rounds` each, in µs per event."""
    conn = await asyncpg.connect(database_url, server_settings={"search_path": schema})
    columns = "id, domain, actor, type, data"
    try:
        # The log's own trigger, WHEN condition and all (schema/018), on the scratch table.
        log_trigger = await conn.fetchval(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger "
            "WHERE tgrelid = 'trellis_events'::regclass AND tgname = 'trellis_events_a_content'"
        )
        probe_trigger = re.sub(
            r"^CREATE TRIGGER \S+ (.*?) ON \S+ ",
            r"CREATE TRIGGER content \1 ON probe_checked ",
            log_trigger,
        )
        await conn.execute(
            f"CREATE TEMP TABLE probe_checked AS SELECT {columns} FROM trellis_events WHERE false;"
            "CREATE TEMP TABLE probe_bare AS SELECT * FROM probe_checked;"
        )
        await conn.execute(probe_trigger)
        select = f"SELECT {columns} FROM trellis_events WHERE type <> 'TopologyImported'"
        events = await conn.fetchval(f"SELECT count(*) FROM ({select}) AS log")
        best = {"probe_checked": float("inf"), "probe_bare": float("inf")}
        for r in range(rounds):
            for table in sorted(best, reverse=bool(r % 2)):  # neither always goes first
                await conn.execute(f"TRUNCATE {table}")
                t0 = time.perf_counter_ns()
                await conn.execute(f"INSERT INTO {table} {select}")
                best[table] = min(best[table], (time.perf_counter_ns() - t0) / 1e3 / events)
    finally:
        await conn.close()
    checked, bare = best["probe_checked"], best["probe_bare"]
    return {
        "events": events,
        "checked_us_per_event": round(checked, 2),
        "bare_us_per_event": round(bare, 2),
        "cost_us_per_event": round(checked - bare, 2),
    }


def summary(ms: list[float], events: int) -> dict[str, float]:
    cuts = statistics.quantiles(ms, n=1000, method="inclusive") if len(ms) > 1 else ms * 999
    return {
        "appends": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(cuts[989], 3),
        "p999_ms": round(cuts[998], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "us_per_event": round(sum(ms) * 1000 / events, 1),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "log_checks"}
    async with (
        servers(Settings.from_env()) as urls,
        fresh_schema(urls.database_owner_url, keep=False) as source,
    ):
        # The owner's role throughout: the bench makes schemas, and drops a trigger.
        nats_url, database_url = urls.nats_url, urls.database_owner_url
        progress(f"writing a log of {args.pairs} compose+release pairs")
        await write_log(nats_url, database_url, source, args.pairs)
        store = await PostgresEventStore.open(database_url, schema=source)
        try:
            log = [e async for e in store.read(DOMAIN)]
        finally:
            await store.close()
        progress(f"the check alone, {args.alone_rounds} rounds")
        result["check_alone"] = await time_check_alone(database_url, source, args.alone_rounds)
        imported, rest = log[0], log[1:]
        work = batches(rest, args.batch)
        result["log"] = {
            "events": len(rest),
            "batches": len(work),
            "events_per_batch": round(len(rest) / len(work), 1),
            "import_bytes": len(imported.data),
        }
        async with target(database_url, True) as checked, target(database_url, False) as bare:
            stores = {"checked": checked, "unchecked": bare}
            runs: dict[str, list[float]] = {name: [] for name in stores}
            for r in range(args.rounds):
                progress(f"round {r + 1}/{args.rounds}: {len(work)} batches into each")
                times = await time_appends(stores, work, f"{DOMAIN}-{r}")
                for name in stores:
                    runs[name] += times[name]
            result["batches"] = {n: summary(ms, len(rest) * args.rounds) for n, ms in runs.items()}
            progress(f"{args.imports} imports of {len(imported.data)} bytes into each")
            imports: dict[str, list[float]] = {name: [] for name in stores}
            for i in range(args.imports):
                times = await time_appends(stores, [[imported]], f"import-{i}")
                for name in stores:
                    imports[name] += times[name]
            result["import"] = {n: summary(ms, args.imports) for n, ms in imports.items()}
    for part in ("batches", "import"):
        with_checks, without = result[part]["checked"], result[part]["unchecked"]
        result[part]["cost_us_per_event"] = round(
            with_checks["us_per_event"] - without["us_per_event"], 1
        )
        result[part]["ratio_p50"] = round(with_checks["p50_ms"] / without["p50_ms"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=400, help="compose+release pairs logged")
    parser.add_argument("--batch", type=int, default=8, help="requests per append")
    parser.add_argument("--rounds", type=int, default=5, help="times the log is appended")
    parser.add_argument("--imports", type=int, default=50, help="times the import is appended")
    parser.add_argument(
        "--alone-rounds", type=int, default=7, help="times the check alone runs over the log"
    )
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    for part in ("batches", "import"):
        r = result[part]
        c, u = r["checked"], r["unchecked"]
        print(
            f"{part:8} checked p50/p99/p99.9 {c['p50_ms']:.3f}/{c['p99_ms']:.3f}/"
            f"{c['p999_ms']:.3f} ms ({c['us_per_event']} us/event), unchecked "
            f"{u['p50_ms']:.3f}/{u['p99_ms']:.3f}/{u['p999_ms']:.3f} ms "
            f"({u['us_per_event']} us/event): +{r['cost_us_per_event']} us/event, "
            f"p50 x{r['ratio_p50']}"
        )
    a = result["check_alone"]
    print(
        f"alone    {a['events']} events by INSERT ... SELECT, fastest of {args.alone_rounds}: "
        f"checked {a['checked_us_per_event']} us/event, unchecked {a['bare_us_per_event']} "
        f"us/event: +{a['cost_us_per_event']} us/event"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
