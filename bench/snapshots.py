"""Snapshots benchmark: engine start and answers at past moments on a long log, with and
without snapshots (issue 10; ARCHITECTURE §4 point in time).

A log of compose / establish / release cycles (decided by the engine's own pure core, so every
event is one the engine would write) is appended in large batches to a fresh schema, with a
state snapshot every `--every` events as the writer takes them; the projections are then
folded by a ProjectionSink, which takes the read-model snapshots. Measured, each against the
same figure without snapshots in the same run:

- engine start: a DomainWriter's `catch_up` (what `Engine` does for a domain on first use);
- a state query (`topology`) at a random past position: engine.service.snapshots.state_at + answer;
- a history query (`why` of a GPU) at a random past position: PostgresReadModels.past;
- the seal of the newest snapshot of each kind (engine/service/snapshots.py): what the writer
  pays to sign one and each reader to check it, against the fold a snapshot saves.

Uses TRELLIS_DATABASE_URL when set, else an embedded PostgreSQL; the schema is dropped
afterwards. The last line printed is one JSON object with every figure.

    python bench/snapshots.py                    # 1,000,000 events (~10 min on 2 cores)
    python bench/snapshots.py --events 100000    # ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path as FsPath
from typing import Any

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

from bench.intents import fresh_schema, progress, servers, topology
from trellis.adapters.postgres.snapshots import PostgresSnapshots
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.adapters.settings import Settings
from trellis.engine.core.actors import ENGINE, OPERATOR
from trellis.engine.core.checkpoints import Signer
from trellis.engine.core.context import Context
from trellis.engine.core.decide import decide
from trellis.engine.core.intents import (
    EstablishComposition,
    Intent,
    decode_intent,
    settle_request_id,
)
from trellis.engine.core.queries import answer
from trellis.engine.core.records import Head, PendingEvent
from trellis.engine.core.state import DomainState, evolve
from trellis.engine.service import snapshots
from trellis.engine.service.follower import Follower
from trellis.engine.service.ports import Snapshot
from trellis.engine.service.writer import DomainWriter
from trellis.projections import PostgresReadModels, ProjectionSink

DOMAIN = "bench"
_APPEND = 1000  # events per append: one commit stays well inside the store's statement timeout


class Clock:
    def __init__(self) -> None:
        self.at = datetime(2026, 1, 1, tzinfo=UTC)

    def now(self) -> datetime:
        return self.at


async def fill(store: PostgresEventStore, snaps: PostgresSnapshots, events: int, every: int) -> int:
    """Append compose / establish / release cycles until the log holds `events` events."""
    clock = Clock()
    state, head = DomainState(domain=DOMAIN), Head()
    pending: list[PendingEvent] = []
    n = 0

    def run(actor: str, verb: str, family: str, body: dict[str, Any]) -> Any:
        nonlocal state
        intent = (
            EstablishComposition(**body)
            if verb == "establish"
            else decode_intent(family, verb, json.dumps(body).encode())  # type: ignore[arg-type]
        )
        assert isinstance(intent, Intent)  # an intent or admin verb, never a query
        ctx = Context(domain=DOMAIN, actor=actor, verb=verb, now=clock.at)
        decision = decide(state, intent, ctx)
        for event in decision.events:
            state = evolve(state, event)
            pending.append(
                PendingEvent.of(
                    event,
                    actor=actor,
                    causation_id=body["request_id"],
                    correlation_id=body["request_id"],
                    at=clock.at,
                )
            )
        return decision.result

    doc = topology(32)
    hosts = [n["id"] for n in doc["nodes"] if n["kind"] == "host"]
    run(OPERATOR, "import-topology", "admin", {**doc, "request_id": "topo"})
    live: list[tuple[str, str]] = []
    rng = random.Random(7)
    last_snapshot = 0
    while head.version + len(pending) < events:
        n += 1
        clock.at += timedelta(milliseconds=10)
        if len(live) < 48:
            tenant = f"t{n % 8}"
            result = run(
                tenant,
                "compose",
                "intent",
                {"request_id": f"c{n}", "host": rng.choice(hosts), "devices": [{"kind": "gpu"}]},
            )
            cid = result.composition_id
            run(
                ENGINE,
                "establish",
                "internal",
                {"request_id": settle_request_id(cid), "composition_id": cid},
            )
            live.append((tenant, cid))
        else:
            tenant, cid = live.pop(rng.randrange(len(live)))
            run(tenant, "release", "intent", {"request_id": f"r{n}", "composition_id": cid})
        if len(pending) >= _APPEND:
            head = (await store.append(DOMAIN, head, pending, [])).head
            pending = []
            if head.version // every > last_snapshot // every:
                await snaps.save(snapshots.of_state(state, head, clock.at))
                last_snapshot = head.version
            if head.version % 100_000 < _APPEND:  # a line per 100k events
                progress(f"  {head.version} events")
    if pending:
        head = (await store.append(DOMAIN, head, pending, [])).head
    return head.version


def summary(seconds: list[float]) -> dict[str, float]:
    return {"n": len(seconds), "median_s": statistics.median(seconds), "max_s": max(seconds)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.from_env()
    result: dict[str, Any] = {"bench": "snapshots", "every": args.every}
    async with (
        servers(settings) as urls,
        fresh_schema(urls.database_owner_url, args.keep) as schema,
    ):
        store = await PostgresEventStore.open(
            urls.database_url, schema=schema, owner_dsn=urls.database_owner_url
        )
        pool = await connect_pool(urls.database_url, schema=schema, max_size=4)
        signer = Signer.generate()
        snaps = PostgresSnapshots(pool, signer)
        try:
            progress(f"appending {args.events} events ...")
            t0 = time.perf_counter()
            total = await fill(store, snaps, args.events, args.every)
            result["events"] = total
            result["append_s"] = time.perf_counter() - t0
            progress("folding the projections (read-model snapshots) ...")
            t0 = time.perf_counter()
            sink = ProjectionSink(pool, snapshot_every=args.every, signer=signer)
            await Follower(DOMAIN, store, sink, batch_size=2000).catch_up()
            result["projections_s"] = time.perf_counter() - t0
            result["snapshots"] = {
                r["kind"]: {"count": r["n"], "mean_bytes": float(r["size"])}
                for r in await pool.fetch(
                    "SELECT kind, count(*) AS n, avg(length(body)) AS size "
                    "FROM trellis_snapshots GROUP BY kind"
                )
            }

            async def start(with_snapshots: bool) -> float:
                writer = DomainWriter(
                    DOMAIN, store, Clock(), 1, snapshots=snaps if with_snapshots else None
                )
                t = time.perf_counter()
                await writer.catch_up()
                assert writer.head.version == total
                return time.perf_counter() - t

            rng = random.Random(11)
            targets = [rng.randrange(2, total) for _ in range(args.samples)]

            async def past(version: int, with_snapshots: bool) -> tuple[float, float]:
                located = await store.locate(DOMAIN, await _position(pool, version))
                assert located is not None
                target = located[0]
                store_ = snaps if with_snapshots else None
                t = time.perf_counter()
                state = await snapshots.state_at(store, store_, DOMAIN, target)
                answer(state, decode_intent("query", "topology", b"{}"), "topology")
                state_s = time.perf_counter() - t
                models = PostgresReadModels(pool, log=store, snapshots=store_)
                t = time.perf_counter()
                answers = await models.past(DOMAIN, target)
                why = await answers.why(DOMAIN, "gpu-r0-000")
                assert why is not None
                return state_s, time.perf_counter() - t

            progress("engine start ...")
            with_start = [await start(True) for _ in range(3)]
            without_start = [await start(False) for _ in range(args.slow_samples)]
            progress("queries at past positions ...")
            with_past = [await past(v, True) for v in targets]
            without_past = [await past(v, False) for v in targets[: args.slow_samples]]
            result["start"] = {"with": summary(with_start), "without": summary(without_start)}
            result["state_query"] = {
                "with": summary([s for s, _ in with_past]),
                "without": summary([s for s, _ in without_past]),
            }
            result["why_query"] = {
                "with": summary([w for _, w in with_past]),
                "without": summary([w for _, w in without_past]),
            }
            result["seal"] = {}
            for kind in ("state", "read_models"):
                async for newest in snaps.candidates(DOMAIN, kind):  # none below --every
                    result["seal"][kind] = _seal_cost(signer, newest)
                    break
        finally:
            await pool.close()
            await store.close()
    return result


def _seal_cost(signer: Signer, snapshot: Snapshot) -> dict[str, float]:
    """Median seconds to seal `snapshot` and to check its seal, over 200."""
    signature = snapshots.seal(signer, snapshot)
    sign_s, check_s = [], []
    for _ in range(200):
        t = time.perf_counter()
        snapshots.seal(signer, snapshot)
        sign_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert snapshots.is_sealed(signer.verifier, snapshot, signature)
        check_s.append(time.perf_counter() - t)
    return {
        "bytes": len(snapshot.body),
        "sign_s": statistics.median(sign_s),
        "check_s": statistics.median(check_s),
    }


async def _position(pool: Any, version: int) -> int:
    position: int = await pool.fetchval(
        "SELECT position FROM trellis_events WHERE domain = $1 AND version = $2", DOMAIN, version
    )
    return position


def table(result: dict[str, Any]) -> str:
    rows = [
        ("engine start (catch_up)", "start"),
        ("topology at a random past position", "state_query"),
        ("why at a random past position", "why_query"),
    ]
    lines = [
        f"log: {result['events']} events; snapshots every {result['every']} events: "
        + ", ".join(
            f"{k} {v['count']} x {v['mean_bytes'] / 1024:.0f} KiB"
            for k, v in result["snapshots"].items()
        ),
        "",
        f"{'figure':<38} {'with snapshots':>16} {'without':>12} {'without / with':>15}",
    ]
    for name, k in rows:
        w, wo = result[k]["with"]["median_s"], result[k]["without"]["median_s"]
        lines.append(f"{name:<38} {w * 1000:>13.0f} ms {wo * 1000:>9.0f} ms {wo / w:>14.0f}x")
    lines.append("")
    lines.append(
        "median of: with snapshots 3 starts and --samples positions; without, --slow-samples"
    )
    lines.append("")
    for kind, cost in result["seal"].items():
        lines.append(
            f"seal of a {kind} snapshot ({cost['bytes'] / 1024:.0f} KiB): sign "
            f"{cost['sign_s'] * 1e6:.0f} us, check {cost['check_s'] * 1e6:.0f} us (median of 200)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=10_000, help="events between snapshots")
    parser.add_argument("--samples", type=int, default=5, help="past positions, with snapshots")
    parser.add_argument("--slow-samples", type=int, default=2, help="the same, without")
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    print(table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
