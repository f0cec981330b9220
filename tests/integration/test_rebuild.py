"""`projections.sink.rebuild` against live followers, row by row, on a log long enough that
compositions, intervals and holds live across many of its batches.

A rebuild folds with the rows carried in memory and written by COPY (projections/replay.py);
live followers fetch, fold and upsert each batch (projections/table.py). Both run the same
`Projection.apply` (each fold has one definition), so what is compared here is where the rows
come from and go to: a change to a fold changes both paths alike. The log is decided
by the engine's pure core (seeded, no engine running): composes of GPUs and memory slices,
settled or failed, extended, expired, released, with drains, faults, recoveries and a
device removed and added again in between, so every projection table changes many times.
"""

from __future__ import annotations

import gc
import json
import logging
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_ok
from harness import serving, undecodable_event

from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.actors import ENGINE, OPERATOR
from trellis.engine.core.context import Context
from trellis.engine.core.decide import decide
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import (
    EstablishComposition,
    ExpireLeases,
    FailComposition,
    decode_intent,
    settle_request_id,
)
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent
from trellis.engine.core.state import DomainState, evolve
from trellis.engine.service.follower import Follower, Stalled
from trellis.projections.past import format_of
from trellis.projections.sink import (
    ProjectionSink,
    default_projections,
    rebuild,
    rebuild_if_folds_changed,
)

DOMAIN = "hall-1"
FABRIC = json.loads((Path(__file__).parents[2] / "examples" / "fabric.json").read_text())
T0 = datetime(2026, 3, 1, tzinfo=UTC)
HOSTS = [n["id"] for n in FABRIC["nodes"] if n["kind"] == "host"]


def decided_log(intents: int, seed: int) -> list[PendingEvent]:
    """The events of `intents` random intents against the example fabric, as the engine's
    decide/evolve would record them (rejected intents record nothing)."""
    rng = random.Random(seed)
    state = DomainState(domain=DOMAIN)
    events: list[PendingEvent] = []
    now = T0
    live: list[str] = []
    pending: list[str] = []
    n = 0

    def run(actor: str, family: str, verb: str, body: dict[str, Any]) -> Any:
        nonlocal state, n
        n += 1
        request_id = body.setdefault("request_id", f"r-{n}")
        if verb == "establish":
            intent: Any = EstablishComposition(**body)
        elif verb == "fail":
            intent = FailComposition(**body)
        elif verb == "expire":
            intent = ExpireLeases(request_id=request_id)
        else:
            intent = decode_intent(family, verb, json.dumps(body).encode())  # type: ignore[arg-type]
        try:
            decision = decide(
                state, intent, Context(domain=DOMAIN, actor=actor, verb=verb, now=now)
            )
        except IntentRejected:
            return None
        for event in decision.events:
            state = evolve(state, event)
            events.append(
                PendingEvent.of(
                    event, actor=actor, causation_id=request_id, correlation_id=request_id, at=now
                )
            )
        return decision.result if decision.events else None

    run(OPERATOR, "admin", "import-topology", dict(FABRIC))
    for _ in range(intents):
        now += timedelta(seconds=rng.randint(1, 90))
        roll = rng.random()
        if roll < 0.35:
            ask: dict[str, Any] = {"kind": "gpu"}
            if rng.random() < 0.4:
                ask = {"kind": "memory", "capacity_gib": rng.choice([64, 128, 256])}
            lease = rng.choice([None, 600, 3600])
            result = run(
                f"t{rng.randint(1, 4)}",
                "intent",
                "compose",
                {
                    "host": rng.choice(HOSTS),
                    "devices": [ask],
                    **({"lease_seconds": lease} if lease else {}),
                    "labels": {"job": f"j{rng.randint(1, 9)}"},
                },
            )
            if result is not None:
                pending.append(result.composition_id)
        elif roll < 0.55 and pending:
            cid = pending.pop(rng.randrange(len(pending)))
            settle = {"request_id": settle_request_id(cid), "composition_id": cid}
            if rng.random() < 0.1:
                run(ENGINE, "internal", "fail", {**settle, "step": "bind", "error": "timeout"})
            elif run(ENGINE, "internal", "establish", settle):
                live.append(cid)
        elif roll < 0.75 and live:
            cid = live.pop(rng.randrange(len(live)))
            owner = state.compositions[cid].tenant
            run(owner, "intent", "release", {"composition_id": cid})
        elif roll < 0.8 and live:
            run(
                "t1", "intent", "extend", {"composition_id": rng.choice(live), "lease_seconds": 900}
            )
        elif roll < 0.85:
            run(ENGINE, "internal", "expire", {})
            live = [c for c in live if c in state.compositions]
        elif roll < 0.9:
            gpu = f"gpu-0{rng.randint(10, 12)}"
            run(OPERATOR, "admin", rng.choice(["drain", "undrain"]), {"id": gpu})
        elif roll < 0.95:
            component = rng.choice(["gpu-011", "sw-pool", "mem-01", "sw-r1"])
            state_ = rng.choice(["failed", "degraded", "healthy", "healthy"])
            run(OPERATOR, "admin", "report-fault", {"component": component, "state": state_})
        else:
            # A re-import re-specifies every node; drain marks and holds must survive it.
            run(OPERATOR, "admin", "import-topology", dict(FABRIC))
    return events


@pytest_asyncio.fixture
async def store(database_url: str, pg_schema: str) -> AsyncIterator[PostgresEventStore]:
    s = await PostgresEventStore.open(database_url, schema=pg_schema)
    yield s
    await s.close()


@pytest_asyncio.fixture
async def pool(database_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(
        database_url, min_size=1, max_size=6, server_settings={"search_path": pg_schema}
    )
    yield p
    await p.close()


@pytest_asyncio.fixture
async def logged(store: PostgresEventStore) -> int:
    """Given: a decided log of some 1,500 events in one domain; its length."""
    events = decided_log(intents=1200, seed=11)
    head = Head()
    for i in range(0, len(events), 200):
        head = (await store.append(DOMAIN, head, events[i : i + 200], [])).head
    return head.version


async def dump(pool: asyncpg.Pool) -> dict[str, list[str]]:
    """Every row of every projection table, and the checkpoints, as sorted canonical JSON."""
    tables = ProjectionSink(pool).tables
    dumped = {
        t: [r[0] for r in await pool.fetch(f"SELECT to_jsonb(t)::text FROM {t} AS t ORDER BY 1")]
        for t in tables
    }
    dumped["checkpoints"] = [
        r[0]
        for r in await pool.fetch(
            "SELECT to_jsonb(t)::text FROM trellis_follower_checkpoints AS t ORDER BY 1"
        )
    ]
    return dumped


async def followed(pool: asyncpg.Pool, store: PostgresEventStore, batch_size: int) -> int:
    """The live way: a follower over the projection sink, `batch_size` events a batch."""
    return await Follower(DOMAIN, store, ProjectionSink(pool), batch_size=batch_size).catch_up()


async def test_a_rebuild_leaves_every_row_as_live_followers_fold_it(
    pool: asyncpg.Pool, store: PostgresEventStore, logged: int
) -> None:
    assert await followed(pool, store, batch_size=7) == logged
    live = await dump(pool)
    counts = {t: len(rows) for t, rows in live.items()}
    # The log exercises every table and ends with rows of every kind of state.
    assert all(counts.values()), counts
    states = {json.loads(r)["state"] for r in live["proj_compositions"]}
    assert {"active", "released", "failed"} <= states, states
    reasons = {json.loads(r)["end_reason"] for r in live["proj_history_intervals"]}
    assert {"released", "lease_expired", "failed", None} <= reasons, reasons
    # One batch; batches that carry rows across (and drop and read back what they did not
    # touch); every event a batch of its own.
    for size in (10_000, 50, 1):
        assert await rebuild(pool, store, [DOMAIN], batch_size=size) == logged
        assert await dump(pool) == live, f"batch_size={size}"


async def test_a_rebuild_overtaken_by_a_live_follower_hands_over_and_ends_the_same(
    pool: asyncpg.Pool, store: PostgresEventStore, logged: int
) -> None:
    await followed(pool, store, batch_size=500)
    live = await dump(pool)

    class Overtaken:
        """The log, but once the rebuild has read 300 events a live follower, which saw the
        checkpoints go back, catches up past them."""

        def __init__(self) -> None:
            self.overtook = False

        async def read(
            self, domain: str, after_version: int = 0, limit: int | None = None
        ) -> AsyncIterator[RecordedEvent]:
            async for record in store.read(domain, after_version, limit):
                if record.version == 300 and not self.overtook:
                    self.overtook = True
                    await followed(pool, store, batch_size=9)
                yield record

    log = Overtaken()
    # What the projections hold, though the live follower applied most of it.
    assert await rebuild(pool, log, [DOMAIN], batch_size=100) == logged
    assert log.overtook
    assert await dump(pool) == live


async def test_a_rebuild_stops_at_an_undecodable_event_with_everything_before_it(
    pool: asyncpg.Pool, store: PostgresEventStore, logged: int
) -> None:
    await followed(pool, store, batch_size=500)
    live = await dump(pool)
    head = await store.head(DOMAIN)
    future = msgspec.structs.replace(
        undecodable_event(), recorded_at=datetime(2030, 1, 1, tzinfo=UTC)
    )
    appended = await store.append(DOMAIN, head, [future], [])
    with pytest.raises(Stalled) as stalled:
        await rebuild(pool, store, [DOMAIN], batch_size=64)
    assert stalled.value.position == appended.head.position
    assert await dump(pool) == live


async def test_a_rebuild_whose_log_read_fails_raises_it_with_the_batches_before_it_written(
    pool: asyncpg.Pool, store: PostgresEventStore, logged: int
) -> None:
    class Broken:
        """The log, lost after 700 events (the rebuild reads it ahead of its fold)."""

        async def read(
            self, domain: str, after_version: int = 0, limit: int | None = None
        ) -> AsyncIterator[RecordedEvent]:
            async for record in store.read(domain, after_version, limit):
                if record.version > 700:
                    raise ConnectionResetError("log lost")
                yield record

    with pytest.raises(ConnectionResetError):
        await rebuild(pool, Broken(), [DOMAIN], batch_size=100)
    checkpoints = await pool.fetch("SELECT version FROM trellis_follower_checkpoints")
    assert {r["version"] for r in checkpoints} == {700}
    # The ordinary follower takes it from there and ends as a rebuild of the whole log does.
    await followed(pool, store, batch_size=500)
    rebuilt = await dump(pool)
    await rebuild(pool, store, [DOMAIN])
    assert await dump(pool) == rebuilt


async def test_the_collector_after_a_rebuild_finds_its_rows_already_freed(
    pool: asyncpg.Pool, store: PostgresEventStore, logged: int
) -> None:
    """A replay pauses the garbage collector; the first collection after the pause scans every
    object allocated during it that is still alive. The pause ends once the replay's rows are
    freed, so that collection is an ordinary one (with 200k events, it took 0.2 s)."""
    scanned: list[int] = []

    def young(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            scanned.append(len(gc.get_objects(generation=0)))

    gc.callbacks.append(young)
    try:
        assert await rebuild(pool, store, [DOMAIN]) == logged
    finally:
        gc.callbacks.remove(young)
    # With the pause inside the replay, the first collection after it scanned 9,500 objects.
    assert max(scanned, default=0) < 2_500, scanned


async def test_tables_another_fold_wrote_are_folded_again_before_anything_follows(
    pool: asyncpg.Pool, store: PostgresEventStore, logged: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A fold that changed meaning in an upgrade (a lease's interval once ended at
    LeaseExpired, then at its release) left the rows it wrote before as they were, beside the
    new fold's: verify named them, the export copied them. A start with other folds than the
    tables were written with rebuilds them first."""
    assert await followed(pool, store, batch_size=500) == logged
    live = await dump(pool)
    # A fresh log keeps no format yet when followed by hand: an older version's tables.
    assert await pool.fetchval("SELECT format FROM trellis_projection_format") is None
    await pool.execute("UPDATE proj_history_intervals SET cost_per_hour = 0.01")  # old fold

    with caplog.at_level(logging.WARNING, logger="trellis.projections"):
        was = await rebuild_if_folds_changed(pool, store, [DOMAIN])

    assert was == "" and await dump(pool) == live
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("the projections were folded by an older version, this engine "), said
    current = await pool.fetchval("SELECT format FROM trellis_projection_format")
    assert current == format_of(default_projections())
    # Current: nothing to do. Another format (a newer or older revision): rebuilt again.
    assert await rebuild_if_folds_changed(pool, store, [DOMAIN]) is None
    await pool.execute("UPDATE trellis_projection_format SET format = 'read_models-older'")
    assert await rebuild_if_folds_changed(pool, store, [DOMAIN]) == "read_models-older"
    assert await dump(pool) == live


async def test_a_new_log_records_its_folds_without_a_rebuild(
    pool: asyncpg.Pool, store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trellis.projections"):
        assert await rebuild_if_folds_changed(pool, store, []) is None
    assert caplog.records == []
    stored = await pool.fetchval("SELECT format FROM trellis_projection_format")
    assert stored == format_of(default_projections())


async def test_an_engine_started_on_tables_of_other_folds_rebuilds_them_first(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, pool: asyncpg.Pool
) -> None:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        expect_ok(await h.client.admin(DOMAIN, "import-topology", FABRIC))
        gpu = {"host": "host-01", "devices": [{"kind": "gpu"}]}
        expect_ok(await h.client.intent(DOMAIN, "acme", "compose", gpu))
        await h.projected(DOMAIN)
        # The dump holds every follower's checkpoint: the relay's too must be at the head (it
        # was not once, when a batch's publish had to be done again just before the stop).
        await h.relayed(DOMAIN)
    live = await dump(pool)
    await pool.execute("UPDATE proj_history_intervals SET cost_per_hour = 0.01")
    await pool.execute("UPDATE trellis_projection_format SET format = 'read_models-older'")

    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        await h.projected(DOMAIN)
        await h.relayed(DOMAIN)
        assert await dump(pool) == live
