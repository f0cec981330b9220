"""Event relay catch-up benchmark: how fast a relay drains a log it has fallen behind on.

The engine (`adapters.bootstrap.engine_on`, simulated fabric) appends a log of compose+release
pairs from many concurrent clients while its own relay is stopped. Then a fresh relay, on a
subject prefix (so a stream, a bucket and a checkpoint) of its own, relays that whole log: fold
every event, publish it (atomic batches of up to 500), put the changed KV keys, checkpoint.
Each run is timed from the follower's `catch_up()` to its return, and checked: the stream holds
the log's events, in position order, once each. Events/s is the log's length over that time;
the best and the median run are printed.

Then the relay's own CPU per event without I/O, on the same log: decode, fold, find the keys
each event changed and render their values, passes of 130 events coalesced (what a pass at 64
clients holds). Once with the compiled map diff (`ext._diff_c.changed_keys`) and once with its
Python reference, alternated, so the table gives the ratio measured in one run.

Uses TRELLIS_NATS_URL / TRELLIS_DATABASE_URL when set, else embedded servers; a fresh schema
(dropped afterwards). The last line printed is one JSON object with every figure.

    python bench/relay.py               # ~20,000 events, 3 runs
    python bench/relay.py --events 5000 --runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path as FsPath
from typing import Any
from unittest import mock

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

from bench.intents import TENANTS, Load, fresh_schema, host_of, pair, progress, servers, topology
from trellis.adapters.bootstrap import engine_on
from trellis.adapters.nats import kv_state
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import bucket_name, stream_name
from trellis.adapters.nats.relay import RelaySink
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.adapters.settings import Settings
from trellis.engine.core.records import RecordedEvent
from trellis.engine.core.throttle import RateLimit
from trellis.engine.service.follower import Follower
from trellis.ext import _diff_py

try:
    from trellis.ext import _diff_c
except ImportError:  # not built: the table says so
    _diff_c = None  # type: ignore[assignment]

DOMAIN = "bench"


async def fill(client: TrellisClient, running: Any, events: int, workers: int) -> int:
    """Compose+release pairs from `workers` clients until the log holds `events` events."""
    load = Load()

    async def worker(i: int) -> None:
        while (await running.store.head(DOMAIN)).position < events:
            await pair(client, DOMAIN, TENANTS[i % len(TENANTS)], host_of(i), load)

    await asyncio.gather(*(worker(i) for i in range(workers)))
    sync = running.engine.fabric_sync(DOMAIN)
    if sync is not None:  # the fabric sagas of the last pairs may still be committing
        await asyncio.wait_for(sync.wait_idle(), 30)
    head: int = (await running.store.head(DOMAIN)).position
    return head


async def one_run(nats_url: str, database_url: str, schema: str, head: int) -> dict[str, Any]:
    prefix = f"relaybench{uuid.uuid4().hex[:8]}"
    nc = await connect_nats(nats_url, name="bench-relay")
    js = nc.jetstream()
    pool = await connect_pool(database_url, schema=schema, max_size=2)
    relay = RelaySink(pool, nc, prefix=prefix)
    await relay.prepare()
    follower = Follower(DOMAIN, PostgresEventStore(pool), relay)
    try:
        started = time.perf_counter()
        published = await follower.catch_up()
        seconds = time.perf_counter() - started
        info = await js.stream_info(stream_name(prefix))
        first = await js.get_msg(stream_name(prefix), 1)
        last = await js.get_msg(stream_name(prefix), info.state.last_seq)
        positions = [json.loads(m.data or b"{}")["position"] for m in (first, last)]
        ok = published == head and info.state.messages == head and positions == [1, head]
        return {"events": published, "seconds": seconds, "events_per_s": head / seconds, "ok": ok}
    finally:
        await pool.close()
        await js.delete_stream(stream_name(prefix))
        await js.delete_key_value(bucket_name(prefix))
        await nc.close()


PASS_EVENTS = 130  # what one pass of the relay holds at 64 clients on one domain


def render_cpu(records: list[RecordedEvent], diff: Callable[..., set[str]]) -> float:
    """CPU seconds per event of the relay's rendering of `records` with `diff` as its map diff:
    decode, fold, changed keys and their values, coalesced per pass (no I/O)."""
    with mock.patch.object(kv_state, "changed_keys", diff):
        view = kv_state.View.empty(DOMAIN)
        started = time.process_time()
        for start in range(0, len(records), PASS_EVENTS):
            changed: list[kv_state.KeyChange] = []
            for record in records[start : start + PASS_EVENTS]:
                event = record.event()
                before = view
                view = kv_state.fold(view, event, record.recorded_at, record.position)
                changed += kv_state.changes(before, view, event, record.position)
            kv_state.coalesce(changed)
        return (time.process_time() - started) / len(records)


async def rendering(database_url: str, schema: str, rounds: int) -> dict[str, Any]:
    """`render_cpu` with each map diff, alternated over `rounds`: the best and median µs."""
    pool = await connect_pool(database_url, schema=schema, max_size=1)
    try:
        records = [r async for r in PostgresEventStore(pool).read(DOMAIN)]
    finally:
        await pool.close()
    diffs = {"python": _diff_py.changed_keys}
    if _diff_c is not None:
        diffs["cython"] = _diff_c.changed_keys
    took: dict[str, list[float]] = {name: [] for name in diffs}
    for _ in range(rounds):
        for name, diff in diffs.items():
            took[name].append(render_cpu(records, diff) * 1e6)
    return {
        name: {"best_us": min(us), "median_us": statistics.median(us)} for name, us in took.items()
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    async with (
        servers(Settings.from_env()) as (nats_url, database_url, owner_url, _monitor),
        fresh_schema(owner_url, keep=False) as schema,
    ):
        prefix = f"relayfill{uuid.uuid4().hex[:8]}"
        settings = Settings(
            nats_url=nats_url,
            database_url=database_url,
            database_owner_url=owner_url,
            db_schema=schema,
            subject_prefix=prefix,
            domains=[DOMAIN],
            followers="inline",  # its relay is stopped while the log fills
            tenant_rate=RateLimit(0),  # the clients fill the log as fast as it takes them
        )
        async with engine_on(settings) as running:
            client_nc = await connect_nats(nats_url, name="bench-client")
            try:
                client = TrellisClient(client_nc, prefix=prefix)
                reply = await client.admin(DOMAIN, "import-topology", topology(gpus_per_rack=64))
                assert reply.get("ok"), reply
                own = running.followers.of("relay", DOMAIN)
                assert own is not None
                await own.stop()  # the log grows; nothing relays it
                progress(f"filling the log with {args.events} events ...")
                head = await fill(client, running, args.events, args.workers)
            finally:
                await client_nc.close()
        nc = await connect_nats(nats_url, name="bench-cleanup")
        await nc.jetstream().delete_stream(stream_name(prefix))
        await nc.jetstream().delete_key_value(bucket_name(prefix))
        await nc.close()
        runs = []
        for i in range(args.runs):
            runs.append(await one_run(nats_url, database_url, schema, head))
            progress(f"run {i + 1}: {runs[-1]['events_per_s']:,.0f} events/s")
        progress("the relay's rendering per event, each map diff ...")
        render = await rendering(database_url, schema, args.rounds)
    rates = [r["events_per_s"] for r in runs]
    return {
        "events": head,
        "runs": runs,
        "best_events_per_s": max(rates),
        "median_events_per_s": statistics.median(rates),
        "ok": all(r["ok"] for r in runs),
        "render": render,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="log length to relay")
    parser.add_argument("--workers", type=int, default=64, help="clients filling the log")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="of the rendering, each diff")
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    print(
        f"{result['events']:,} events: best {result['best_events_per_s']:,.0f} events/s, "
        f"median {result['median_events_per_s']:,.0f}; "
        + ("stream == log" if result["ok"] else "STREAM DIFFERS FROM THE LOG")
    )
    render = result["render"]
    reference = render["python"]["median_us"]
    print(f"\nthe relay's rendering, CPU µs per event ({args.rounds} rounds each, alternated)")
    print(f"{'map diff':<22}{'best':>8}{'median':>8}{'÷ reference':>13}")
    for name, label in (("python", "Python reference"), ("cython", "compiled (default)")):
        if name not in render:
            print(f"{label:<22}{'not built':>8}")
            continue
        us = render[name]
        print(
            f"{label:<22}{us['best_us']:>8.1f}{us['median_us']:>8.1f}"
            f"{us['median_us'] / reference:>12.2f}x"
        )
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
