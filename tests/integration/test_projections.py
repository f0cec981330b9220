"""Projections and read models, fed by real intents over NATS into the Postgres log.

The scenario composes for three tenants in one hall (and one in a second hall), releases one
composition, extends a lease, drains and faults devices and fails a switch. Tests then read
the projection tables and the read models, rebuild from scratch and compare, and break the
followers mid-batch to check that rows and checkpoints only ever move together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_ok
from harness import Harness, serving, undecodable_event

from trellis.engine.service.follower import Follower, Stalled
from trellis.engine.service.ports import EventStore
from trellis.projections.base import Fact, Projection
from trellis.projections.devices import DevicesProjection
from trellis.projections.read_models import PostgresReadModels
from trellis.projections.sink import ProjectionSink, default_projections, rebuild
from trellis.projections.table import PostgresRows

HALL = "hall-1"
OTHER_HALL = "hall-2"
DOMAINS = (HALL, OTHER_HALL)
FABRIC = json.loads((Path(__file__).parents[2] / "examples" / "fabric.json").read_text())


# ---- fixtures ----


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest_asyncio.fixture
async def pool(database_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool in the test's schema for probes and for runners built by the tests."""
    p = await asyncpg.create_pool(
        database_url, min_size=1, max_size=6, server_settings={"search_path": pg_schema}
    )
    yield p
    await p.close()


class Scenario(msgspec.Struct, kw_only=True):
    """What the scenario did: compose results by tenant and the last committed position."""

    acme: dict[str, Any]
    globex: dict[str, Any]
    initech: dict[str, Any]
    other_hall: dict[str, Any]
    extended: dict[str, Any]
    last: int


async def play(h: Harness) -> Scenario:
    """Given: two halls with the example fabric, and a day's worth of intents."""
    client = h.client
    expect_ok(await client.admin(HALL, "import-topology", FABRIC))
    expect_ok(await client.admin(OTHER_HALL, "import-topology", FABRIC))
    acme = expect_ok(
        await client.intent(
            HALL,
            "acme",
            "compose",
            {
                "request_id": "r-acme",
                "host": "host-01",
                "devices": [
                    {"kind": "gpu", "count": 2, "bandwidth_gbps": 64},
                    {"kind": "memory", "capacity_gib": 512, "bandwidth_gbps": 64},
                ],
                "constraints": {"max_hops": 6},
                "lease_seconds": 3600,
                "labels": {"workload": "decode"},
                "reason": "decode pool scale-up",
            },
        )
    )
    globex = expect_ok(
        await client.intent(
            HALL,
            "globex",
            "compose",
            {"request_id": "r-globex", "host": "host-03", "devices": [{"kind": "gpu"}]},
        )
    )
    initech = expect_ok(
        await client.intent(
            HALL,
            "initech",
            "compose",
            {
                "request_id": "r-initech",
                "host": "host-02",
                "devices": [{"kind": "gpu"}, {"kind": "memory", "capacity_gib": 128}],
                "reason": "batch job",
            },
        )
    )
    other_hall = expect_ok(
        await client.intent(
            OTHER_HALL,
            "acme",
            "compose",
            {"request_id": "r-acme", "host": "host-01", "devices": [{"kind": "gpu"}]},
        )
    )
    expect_ok(
        await client.intent(
            HALL,
            "initech",
            "release",
            {"request_id": "r-initech-done", "composition_id": initech["composition_id"]},
        )
    )
    extended = expect_ok(
        await client.intent(
            HALL,
            "acme",
            "extend",
            {
                "request_id": "r-acme-more",
                "composition_id": acme["composition_id"],
                "lease_seconds": 600,
            },
        )
    )
    expect_ok(
        await client.admin(
            HALL, "drain", {"request_id": "r-drain", "id": "gpu-012", "reason": "firmware"}
        )
    )
    expect_ok(
        await client.admin(
            HALL,
            "report-fault",
            {"request_id": "r-ecc", "component": "gpu-011", "state": "degraded", "detail": "ecc"},
        )
    )
    fault = await client.admin(
        HALL,
        "report-fault",
        {"request_id": "r-fault", "component": "sw-pool", "state": "failed", "detail": "psu"},
    )
    assert expect_ok(fault)["impaired"] == [acme["composition_id"]]
    return Scenario(
        acme=acme,
        globex=globex,
        initech=initech,
        other_hall=other_hall,
        extended=extended,
        last=fault["position"],
    )


class Projector:
    """A follower of each hall over one ProjectionSink, as an engine runs them."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        store: EventStore,
        projections: Sequence[Projection] | None = None,
        batch_size: int = 500,
    ):
        self.pool = pool
        self.store = store
        self.sink = ProjectionSink(pool, projections)
        self.followers = {
            d: Follower(d, store, self.sink, batch_size=batch_size, poll_interval=0.2)
            for d in DOMAINS
        }

    async def catch_up(self) -> int:
        return sum([await f.catch_up() for f in self.followers.values()])

    def start(self) -> None:
        for follower in self.followers.values():
            follower.start()

    async def stop(self) -> None:
        for follower in self.followers.values():
            await follower.stop()

    async def wait_for(self, position: int, timeout: float = 5.0) -> bool:
        """Each hall's projections hold its events up to `position`."""
        for domain, follower in self.followers.items():
            head = (await self.store.head(domain)).position
            if not await follower.wait_for(min(position, head), timeout):
                return False
        return True

    async def wait_for_domain(self, domain: str, position: int, timeout: float = 5.0) -> bool:
        return await self.followers[domain].wait_for(position, timeout)

    def failures(self) -> list[Any]:
        return [f.failure for f in self.followers.values() if f.failure is not None]


@pytest_asyncio.fixture
async def played(h: Harness, pool: asyncpg.Pool) -> Scenario:
    scenario = await play(h)
    # The engine's own followers have folded the scenario; these tests fold it again with
    # followers of their own, from an empty start.
    for domain in DOMAINS:
        follower = h.followers.of("projections", domain)
        assert follower is not None
        await follower.stop()
    await pool.execute(f"TRUNCATE {', '.join(PROJECTION_TABLES)}")
    await pool.execute("DELETE FROM trellis_follower_checkpoints WHERE follower NOT LIKE 'relay:%'")
    return scenario


@pytest_asyncio.fixture
async def runner(h: Harness, pool: asyncpg.Pool, played: Scenario) -> AsyncIterator[Projector]:
    """Followers in the background, caught up with the scenario."""
    r = Projector(pool, h.store)
    r.start()
    assert await r.wait_for(played.last, timeout=10)
    yield r
    await r.stop()


@pytest_asyncio.fixture
async def models(runner: Projector) -> PostgresReadModels:
    return PostgresReadModels(runner.pool, _Waiter(runner))


class _Waiter:
    """The read models' view of a Projector (what Followers gives an engine)."""

    def __init__(self, projector: Projector):
        self._projector = projector

    async def wait_for(self, sink: str, domain: str, position: int, timeout: float = 5.0) -> bool:
        return await self._projector.wait_for_domain(domain, position, timeout)

    def failures(self) -> list[Any]:
        return self._projector.failures()


# ---- probes ----

PROJECTION_TABLES = [
    "proj_compositions",
    "proj_connections",
    "proj_connection_requests",
    "proj_devices",
    "proj_components",
    "proj_device_holds",
    "proj_history_intervals",
    "proj_history_compositions",
    "proj_history_devices",
]


async def dump(pool: asyncpg.Pool) -> dict[str, list[str]]:
    """Every row of every projection table and the checkpoints, as sorted canonical JSON."""
    dumped = {
        t: [r[0] for r in await pool.fetch(f"SELECT to_jsonb(t)::text FROM {t} AS t ORDER BY 1")]
        for t in PROJECTION_TABLES
    }
    dumped["checkpoints"] = [
        r[0]
        for r in await pool.fetch(
            "SELECT to_jsonb(t)::text FROM trellis_follower_checkpoints AS t "
            "WHERE follower NOT LIKE 'relay:%' ORDER BY 1"
        )
    ]
    return dumped


JSONB_COLUMNS = {"labels", "devices", "impaired_by", "chain", "path", "links", "why"}


async def rows(pool: asyncpg.Pool, sql: str, *args: Any) -> list[dict[str, Any]]:
    """Query rows as dicts, jsonb columns decoded."""
    out = []
    for record in await pool.fetch(sql, *args):
        row = dict(record)
        for k in JSONB_COLUMNS & row.keys():
            row[k] = json.loads(row[k])
        out.append(row)
    return out


async def checkpoints(pool: asyncpg.Pool, domain: str = HALL) -> dict[str, int]:
    """The projections' checkpoints of one domain, by projection name."""
    return dict(
        await pool.fetch(
            "SELECT follower, position FROM trellis_follower_checkpoints "
            "WHERE domain = $1 AND follower NOT LIKE 'relay:%'",
            domain,
        )
    )


async def highest_position_in_rows(pool: asyncpg.Pool) -> int:
    """The highest log position any projection row mentions (0 if none)."""
    found = await pool.fetchval(
        """
        SELECT coalesce(max(p), 0) FROM (
            SELECT updated_position AS p FROM proj_compositions
            UNION ALL
            SELECT (e->>'position')::bigint FROM proj_compositions, jsonb_array_elements(chain) e
            UNION ALL
            SELECT (why->>'position')::bigint FROM proj_connections
            UNION ALL
            SELECT (why->>'position')::bigint FROM proj_connection_requests
            UNION ALL
            SELECT (e->>'position')::bigint FROM proj_components, jsonb_array_elements(chain) e
        ) AS mentioned
        """
    )
    return int(found)


async def log_position(pool: asyncpg.Pool, domain: str, type_: str, request_id: str) -> int:
    position: int = await pool.fetchval(
        "SELECT position FROM trellis_events WHERE domain = $1 AND type = $2 AND causation_id = $3",
        domain,
        type_,
        request_id,
    )
    return position


# ---- the projection tables ----


async def test_connections_hold_one_row_per_bound_device_with_its_request(
    runner: Projector, pool: asyncpg.Pool, played: Scenario
) -> None:
    connections = await rows(
        pool, "SELECT * FROM proj_connections WHERE domain = $1 ORDER BY device", HALL
    )
    acme, globex = played.acme, played.globex
    expected = {(acme["composition_id"], d["id"]): d for d in acme["devices"]} | {
        (globex["composition_id"], d["id"]): d for d in globex["devices"]
    }
    # The released composition left no rows behind.
    assert {(c["composition_id"], c["device"]) for c in connections} == set(expected)
    requested = await log_position(pool, HALL, "CompositionRequested", "r-acme")
    reserved_at = await pool.fetchval(
        "SELECT recorded_at FROM trellis_events WHERE domain = $1 AND type = 'DevicesReserved'"
        " AND causation_id = 'r-acme'",
        HALL,
    )
    for c in connections:
        device = expected[(c["composition_id"], c["device"])]
        assert c["path"] == device["path"]
        assert c["path"][0] == c["host"]
        assert c["bandwidth_gbps"] == device["bandwidth_gbps"]
        assert c["capacity_gib"] == device["capacity_gib"]
        assert len(c["links"]) == len(c["path"]) - 1  # cables; circuits count as hops too
        if c["tenant"] == "acme":
            assert c["host"] == "host-01"
            assert c["since"] == reserved_at
            assert c["why"] == {
                "request_id": "r-acme",
                "actor": "acme",
                "reason": "decode pool scale-up",
                "labels": {"workload": "decode"},
                "constraints": {
                    "max_hops": 6,
                    "max_latency_ns": None,
                    "isolation": "shared",
                    "labels": {},
                },
                "position": requested,
            }
        else:
            assert (c["tenant"], c["host"], c["why"]["request_id"]) == (
                "globex",
                "host-03",
                "r-globex",
            )
    other = await rows(pool, "SELECT * FROM proj_connections WHERE domain = $1", OTHER_HALL)
    assert [(c["composition_id"], c["device"]) for c in other] == [
        (played.other_hall["composition_id"], played.other_hall["devices"][0]["id"])
    ]


async def test_compositions_keep_every_composition_with_its_state_and_chain(
    runner: Projector, pool: asyncpg.Pool, played: Scenario
) -> None:
    found = {
        r["composition_id"]: r
        for r in await rows(pool, "SELECT * FROM proj_compositions WHERE domain = $1", HALL)
    }
    acme = found[played.acme["composition_id"]]
    assert (acme["tenant"], acme["host"], acme["state"]) == ("acme", "host-01", "impaired")
    assert acme["devices"] == played.acme["devices"]
    assert acme["impaired_by"] == [{"component": "sw-pool", "reason": "sw-pool failed: psu"}]
    assert (acme["labels"], acme["reason"], acme["request_id"]) == (
        {"workload": "decode"},
        "decode pool scale-up",
        "r-acme",
    )
    assert msgspec.to_builtins(acme["expires_at"]) == played.extended["expires_at"]
    assert found[played.globex["composition_id"]]["state"] == "active"
    assert found[played.initech["composition_id"]]["state"] == "released"
    # The chain is exactly the log's events that name the composition, in order.
    for cid, row in found.items():
        log = await pool.fetch(
            "SELECT type, position, actor, causation_id FROM trellis_events"
            " WHERE domain = $1 AND data->>'composition_id' = $2 ORDER BY position",
            HALL,
            cid,
        )
        assert [(e["type"], e["position"], e["actor"], e["request_id"]) for e in row["chain"]] == [
            tuple(e) for e in log
        ]
        assert row["updated_position"] == log[-1]["position"]
    types = [e["type"] for e in acme["chain"]]
    assert types[0] == "CompositionRequested"
    assert types[-2:] == ["LeaseExtended", "CompositionImpaired"]
    assert types.count("PathEstablished") == 3


async def test_devices_show_attributes_health_and_holder(
    runner: Projector, pool: asyncpg.Pool, played: Scenario
) -> None:
    devices = {
        r["device"]: r
        for r in await rows(pool, "SELECT * FROM proj_devices WHERE domain = $1", HALL)
    }
    assert set(devices) == {n["id"] for n in FABRIC["nodes"] if n["kind"] == "device"}
    owners = {d: r["owner"] for d, r in devices.items() if r["owner"]}
    assert owners == {
        d["id"]: c["composition_id"]
        for c in (played.acme, played.globex)
        for d in c["devices"]
        if d["capacity_gib"] is None
    }
    initech_gpu = played.initech["devices"][0]["id"]
    assert devices[initech_gpu]["owner"] is None  # given back by the release
    mem = devices["mem-01"]
    assert (mem["memory_used_gib"], mem["capacity_gib"], mem["device_kind"]) == (
        512.0,
        2048.0,
        "memory",
    )
    assert devices["gpu-001"]["memory_used_gib"] is None
    assert (devices["gpu-012"]["drained"], devices["gpu-012"]["health"]) == (True, "healthy")
    assert devices["gpu-011"]["health"] == "degraded"
    spec = next(n for n in FABRIC["nodes"] if n["id"] == "gpu-004")
    row = devices["gpu-004"]
    assert (row["vendor"], row["model"], row["generation"], row["memory_gib"]) == (
        spec["vendor"],
        spec["model"],
        spec["generation"],
        spec["memory_gib"],
    )
    assert (row["cost_per_hour"], row["labels"]) == (spec["cost_per_hour"], spec["labels"])
    components = {
        r["id"]: r
        for r in await rows(pool, "SELECT * FROM proj_components WHERE domain = $1", HALL)
    }
    assert set(components) == {n["id"] for n in FABRIC["nodes"]} | {
        lk["id"] for lk in FABRIC["links"]
    }
    assert (components["sw-pool"]["kind"], components["sw-pool"]["health"]) == ("switch", "failed")
    assert [e["type"] for e in components["sw-pool"]["chain"]] == [
        "TopologyImported",
        "ComponentFaulted",
    ]
    assert components["l-001"]["kind"] == "link"
    # What a release gives back, it gives back exactly: initech's holds are gone.
    holds = await rows(pool, "SELECT * FROM proj_device_holds WHERE domain = $1", HALL)
    assert {h["composition_id"] for h in holds} == {
        played.acme["composition_id"],
        played.globex["composition_id"],
    }


# ---- rebuild, atomicity, crashes ----


async def test_rebuild_yields_exactly_the_rows_folded_live(
    h: Harness, runner: Projector, pool: asyncpg.Pool, played: Scenario
) -> None:
    assert sorted(runner.sink.tables) == sorted(PROJECTION_TABLES)
    live = await dump(pool)
    assert all(live[t] for t in PROJECTION_TABLES), "the scenario fills every table"
    await runner.stop()
    replayed = await rebuild(pool, h.store, DOMAINS)
    assert replayed == await pool.fetchval("SELECT count(*) FROM trellis_events")
    assert await dump(pool) == live
    # Batch boundaries change nothing: replay one and two events per transaction.
    for size in (1, 2):
        assert await rebuild(pool, h.store, DOMAINS, batch_size=size) == replayed
        assert await dump(pool) == live


async def emptied(runner: Projector, pool: asyncpg.Pool) -> dict[str, list[str]]:
    """Stop the live followers and empty their tables and checkpoints; what they held."""
    live = await dump(pool)
    await runner.stop()
    await pool.execute(f"TRUNCATE {', '.join(PROJECTION_TABLES)}")
    await pool.execute("UPDATE trellis_follower_checkpoints SET version = 0, position = 0")
    return live


async def test_two_followers_of_each_domain_fold_each_event_once(
    h: Harness, runner: Projector, pool: asyncpg.Pool, played: Scenario
) -> None:
    live = await emptied(runner, pool)
    first = Projector(pool, h.store, batch_size=2)
    second = Projector(pool, h.store, batch_size=3)
    await asyncio.gather(first.catch_up(), second.catch_up())
    for domain in DOMAINS:
        head = (await h.store.head(domain)).position
        assert first.followers[domain].position == second.followers[domain].position == head
    assert await dump(pool) == live


class CountingPool:
    """A pool whose connections count the statements sent without rows back (`execute`)."""

    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool
        self.executes: list[str] = []

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        async with self._pool.acquire() as conn:
            yield _Counting(conn, self.executes)


class _Counting:
    def __init__(self, conn: asyncpg.Connection, executes: list[str]):
        self._conn, self._executes = conn, executes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def execute(self, sql: str, *args: Any) -> str:
        self._executes.append(sql)
        return await self._conn.execute(sql, *args)


async def test_a_batch_writes_every_table_and_the_checkpoints_in_one_statement(
    h: Harness, runner: Projector, pool: asyncpg.Pool, played: Scenario
) -> None:
    live = await emptied(runner, pool)
    counting = CountingPool(pool)
    sink = ProjectionSink(counting)  # type: ignore[arg-type]
    for domain in DOMAINS:
        await Follower(domain, h.store, sink, batch_size=10_000).catch_up()
    # Per domain: the checkpoints ensured when it resumes, then its one batch: every
    # projection's rows (deleted and upserted, in all nine tables) and the four checkpoints.
    batches = [sql for sql in counting.executes if "trellis_follower_checkpoints AS c" in sql]
    assert len(batches) == len(DOMAINS)
    assert len(counting.executes) == 2 * len(DOMAINS)
    assert all(sql.count(" AS (\n") >= 3 for sql in batches)  # several tables' writes in it
    assert await dump(pool) == live


class Broken:
    """A projection that behaves like `inner` until it meets `position`, then `fails`."""

    def __init__(self, inner: Projection, position: int, fail: Any):
        self.inner, self.position, self.fail = inner, position, fail
        self.name, self.tables = inner.name, inner.tables

    async def apply(self, source: PostgresRows, facts: Sequence[Fact]) -> None:
        if any(f.record.position == self.position for f in facts):
            await self.fail(source.conn)
        await self.inner.apply(source, facts)


def with_broken_devices(position: int, fail: Any) -> list[Projection]:
    # The devices projection folds last, so when it fails the others have already folded
    # their rows of the batch in the transaction.
    projections = default_projections()
    assert isinstance(projections[-1], DevicesProjection)
    return [*projections[:-1], Broken(projections[-1], position, fail)]


async def test_a_failed_batch_leaves_rows_and_checkpoints_as_the_last_commit_did(
    h: Harness, pool: asyncpg.Pool, played: Scenario
) -> None:
    reserved = await log_position(pool, HALL, "DevicesReserved", "r-globex")

    async def boom(conn: asyncpg.Connection) -> None:
        raise RuntimeError("disk full")

    broken = Projector(pool, h.store, projections=with_broken_devices(reserved, boom), batch_size=4)
    with pytest.raises(RuntimeError, match="disk full"):
        await broken.followers[HALL].catch_up()
    saved = await checkpoints(pool)
    assert len(set(saved.values())) == 1, saved
    (committed,) = set(saved.values())
    assert 0 < committed < reserved
    # Nothing of the failed batch is visible, though the others had folded their part.
    assert await highest_position_in_rows(pool) <= committed
    assert not await pool.fetchval(
        "SELECT count(*) FROM proj_compositions WHERE request_id = 'r-globex'"
    )
    # Healthy followers resume from the checkpoint and end where a rebuild ends.
    healthy = Projector(pool, h.store, batch_size=4)
    await healthy.catch_up()
    resumed = await dump(pool)
    await rebuild(pool, h.store, DOMAINS)
    assert await dump(pool) == resumed


async def test_a_follower_whose_session_dies_mid_batch_resumes_without_duplicates(
    h: Harness, pool: asyncpg.Pool, database_url: str, played: Scenario
) -> None:
    target = await log_position(pool, HALL, "CompositionImpaired", "r-fault")
    inside = asyncio.Event()
    backend: list[int] = []

    async def hang(conn: asyncpg.Connection) -> None:
        backend.append(await conn.fetchval("SELECT pg_backend_pid()"))
        inside.set()
        await asyncio.Event().wait()  # until the database kills the session under it

    crashing = Projector(pool, h.store, projections=with_broken_devices(target, hang), batch_size=5)
    crashing.start()
    await asyncio.wait_for(inside.wait(), 10)
    # The crash: the follower's database session dies with the batch's transaction open.
    killer = await asyncpg.connect(database_url)
    try:
        assert await killer.fetchval("SELECT pg_terminate_backend($1)", backend[0])
    finally:
        await killer.close()
    await crashing.stop()
    saved = await checkpoints(pool)
    assert max(saved.values()) < target
    assert await highest_position_in_rows(pool) <= min(saved.values())

    fresh = Projector(pool, h.store)
    fresh.start()
    try:
        assert await fresh.wait_for(played.last, timeout=10)
    finally:
        await fresh.stop()
    resumed = await dump(pool)
    chains = await pool.fetch("SELECT chain FROM proj_compositions")
    for (chain,) in chains:
        positions = [e["position"] for e in json.loads(chain)]
        assert positions == sorted(set(positions))
    await rebuild(pool, h.store, DOMAINS)
    assert await dump(pool) == resumed


async def test_an_undecodable_event_stalls_its_domain_after_everything_before_it(
    h: Harness, pool: asyncpg.Pool, played: Scenario
) -> None:
    head = await h.store.head(HALL)
    future = undecodable_event("00000000-0000-4000-8000-000000000001")
    appended = await h.store.append(HALL, head, [future], [], fence=h.engine.fence(HALL))
    stuck = Projector(pool, h.store, batch_size=1000)
    with pytest.raises(Stalled) as stalled:
        await stuck.followers[HALL].catch_up()
    assert stalled.value.position == appended.head.position
    assert stuck.followers[HALL].position == played.last
    assert not await stuck.wait_for_domain(HALL, appended.head.position, timeout=0.2)
    # The other hall is not held up by it.
    await stuck.followers[OTHER_HALL].catch_up()
    other = (await h.store.head(OTHER_HALL)).position
    assert await stuck.wait_for_domain(OTHER_HALL, other, timeout=0.2)


# ---- read models ----


def wire(answer: Any) -> Any:
    """A read model's answer as the reply carries it (engine/core/results.py Structs, encoded)."""
    return msgspec.to_builtins(answer)


async def test_composition_answers_with_the_compose_result_and_its_story(
    models: PostgresReadModels, played: Scenario
) -> None:
    acme = played.acme
    found = wire(await models.composition(HALL, acme["composition_id"]))
    assert found is not None
    assert {k: found[k] for k in ("composition_id", "host", "devices")} == {
        k: acme[k] for k in ("composition_id", "host", "devices")
    }
    assert found["expires_at"] == played.extended["expires_at"]
    assert (found["state"], found["tenant"], found["labels"], found["reason"]) == (
        "impaired",
        "acme",
        {"workload": "decode"},
        "decode pool scale-up",
    )
    assert found["created_at"] < found["expires_at"]
    assert found["impaired_by"] == [{"component": "sw-pool", "reason": "sw-pool failed: psu"}]
    assert [e["request_id"] for e in found["chain"]][-2:] == ["r-acme-more", "r-fault"]
    released = wire(await models.composition(HALL, played.initech["composition_id"]))
    assert released is not None and released["state"] == "released"
    assert released["devices"] == played.initech["devices"]
    assert wire(await models.composition(HALL, "c-unknown")) is None
    # Domains do not mix: the same tenant and request id make another composition elsewhere.
    assert wire(await models.composition(OTHER_HALL, acme["composition_id"])) is None


async def test_connections_filter_by_host_tenant_and_device(
    models: PostgresReadModels, played: Scenario
) -> None:
    every = wire(await models.connections(HALL))
    assert [set(r) for r in every] == [
        {
            "device",
            "host",
            "composition_id",
            "tenant",
            "path",
            "bandwidth_gbps",
            "capacity_gib",
            "since",
            "why",
        }
    ] * 4
    acme_devices = [d["id"] for d in played.acme["devices"]]
    by_host = wire(await models.connections(HALL, host="host-01"))
    assert [r["device"] for r in by_host] == sorted(acme_devices)
    by_tenant = wire(await models.connections(HALL, tenant="globex"))
    assert [(r["device"], r["host"]) for r in by_tenant] == [
        (played.globex["devices"][0]["id"], "host-03")
    ]
    by_device = wire(await models.connections(HALL, device="mem-01"))
    assert [(r["composition_id"], r["capacity_gib"]) for r in by_device] == [
        (played.acme["composition_id"], 512.0)
    ]
    assert by_device[0]["since"].endswith("Z")
    assert by_device[0]["why"]["reason"] == "decode pool scale-up"
    assert wire(await models.connections(HALL, host="host-01", tenant="globex")) == []
    assert wire(await models.connections(HALL, tenant="initech")) == []  # released
    assert wire(await models.connections("no-such-hall")) == []
    assert len(wire(await models.connections(OTHER_HALL))) == 1


async def test_why_explains_a_connected_device_in_one_sentence(
    models: PostgresReadModels, played: Scenario
) -> None:
    cid = played.acme["composition_id"]
    answer = wire(await models.why(HALL, "gpu-001"))
    assert answer is not None
    (row,) = answer["connected_to"]
    assert (answer["id"], answer["kind"], row["composition_id"]) == ("gpu-001", "device", cid)
    assert answer["text"] == (
        f"gpu-001 is connected to host-01 over sw-r1 in composition {cid} for tenant acme"
        f" since {row['since']}, impaired by sw-pool, requested by acme (request r-acme):"
        " decode pool scale-up."
    )
    types = [e["type"] for e in answer["chain"]]
    assert types[0] == "TopologyImported" and "DevicesReserved" in types
    positions = [e["position"] for e in answer["chain"]]
    assert positions == sorted(set(positions))
    memory = wire(await models.why(HALL, "mem-01"))
    assert memory is not None
    assert " with 512 GiB over sw-r1, ocs-1, sw-pool " in memory["text"]


async def test_why_says_a_free_device_is_connected_to_nothing(
    models: PostgresReadModels, played: Scenario
) -> None:
    free = wire(await models.why(HALL, "gpu-005"))
    assert free is not None
    assert (free["kind"], free["connected_to"]) == ("device", [])
    assert free["text"] == "gpu-005 is connected to nothing; it is free and healthy."
    assert [e["type"] for e in free["chain"]] == ["TopologyImported"]
    degraded = wire(await models.why(HALL, "gpu-011"))
    assert degraded is not None
    assert degraded["text"] == "gpu-011 is connected to nothing; it is free and degraded (ecc)."
    drained = wire(await models.why(HALL, "gpu-012"))
    assert drained is not None
    assert drained["text"] == (
        "gpu-012 is connected to nothing; it is free and healthy and drained."
    )
    gpu = played.initech["devices"][0]["id"]
    given_back = wire(await models.why(HALL, gpu))
    assert given_back is not None and given_back["connected_to"] == []
    assert given_back["text"].startswith(
        f"{gpu} is connected to nothing; it is free and healthy; it was last connected to"
        f" host-02 in composition {played.initech['composition_id']} for tenant initech until "
    )
    # The events that gave it to initech and let it go: reserved, then released.
    held = [e["type"] for e in given_back["chain"] if e["type"] != "TopologyImported"]
    assert held[0] == "DevicesReserved" and held[-1] == "CompositionReleased", held


async def test_why_explains_a_host(models: PostgresReadModels, played: Scenario) -> None:
    cid = played.acme["composition_id"]
    busy = wire(await models.why(HALL, "host-01"))
    assert busy is not None
    assert busy["kind"] == "host"
    assert [r["device"] for r in busy["connected_to"]] == ["gpu-001", "gpu-002", "mem-01"]
    since = busy["connected_to"][0]["since"]
    assert busy["text"] == (
        f"host-01 is connected to gpu-001, gpu-002 and mem-01 in composition {cid} for tenant"
        f" acme since {since}, impaired by sw-pool, requested by acme (request r-acme):"
        " decode pool scale-up."
    )
    idle = wire(await models.why(HALL, "host-04"))
    assert idle is not None
    assert (idle["kind"], idle["connected_to"]) == ("host", [])
    assert idle["text"] == "host-04 is connected to nothing; it is healthy."


async def test_why_explains_a_composition(models: PostgresReadModels, played: Scenario) -> None:
    cid = played.globex["composition_id"]
    answer = wire(await models.why(HALL, cid))
    composition = wire(await models.composition(HALL, cid))
    assert answer is not None and composition is not None
    assert answer["kind"] == "composition"
    assert answer["chain"] == composition["chain"]
    gpu = played.globex["devices"][0]["id"]
    assert [r["device"] for r in answer["connected_to"]] == [gpu]
    request = next(e for e in composition["chain"] if e["type"] == "CompositionRequested")
    assert answer["text"] == (
        f"composition {cid} of tenant globex connects host-03 to {gpu}"
        f" since {composition['created_at']}, requested by globex (request r-globex);"
        " it is active."
    )
    assert request["request_id"] == "r-globex"
    gone = wire(await models.why(HALL, played.initech["composition_id"]))
    assert gone is not None
    assert gone["connected_to"] == []
    assert gone["text"].startswith(
        f"composition {played.initech['composition_id']} of tenant initech connected host-02 to "
    )
    assert gone["text"].endswith(
        "requested by initech (request r-initech): batch job; it is released."
    )


async def test_a_composition_names_only_what_impairs_it_now(h: Harness) -> None:
    """A recovery that mends a composition clears what impaired it, as evolve() does; the next
    fault is then the only one named, once however often it is reported. (The orchestration
    state machine found the projection still naming a switch that had long recovered.)"""
    fabric = {
        "nodes": [
            {"id": "host-1", "kind": "host"},
            {"id": "sw-a", "kind": "switch"},
            {"id": "gpu-1", "kind": "device", "device_kind": "gpu"},
        ],
        "links": [
            {"id": "l-ha", "a": "host-1", "b": "sw-a", "capacity_gbps": 100},
            {"id": "l-a1", "a": "sw-a", "b": "gpu-1", "capacity_gbps": 100},
        ],
    }
    expect_ok(await h.client.admin(HALL, "import-topology", fabric))
    body = {"host": "host-1", "device_ids": ["gpu-1"]}
    cid = expect_ok(await h.client.intent(HALL, "acme", "compose", body))["composition_id"]

    async def report(component: str, state: str) -> dict[str, Any]:
        expect_ok(
            await h.client.admin(HALL, "report-fault", {"component": component, "state": state})
        )
        found: dict[str, Any] = expect_ok(await h.client.query(HALL, "composition", {"id": cid}))
        return found

    assert (await report("sw-a", "failed"))["state"] == "impaired"
    mended = await report("sw-a", "healthy")
    assert (mended["state"], mended["impaired_by"]) == ("active", [])

    await report("l-a1", "degraded")
    again = await report("l-a1", "failed")
    assert again["state"] == "impaired"
    assert again["impaired_by"] == [{"component": "l-a1", "reason": "l-a1 degraded"}]
    why = expect_ok(await h.client.query(HALL, "why", {"id": cid}))
    assert why["text"].endswith("; it is impaired by l-a1.")


async def test_why_explains_a_link_and_a_switch_by_the_paths_over_them(
    models: PostgresReadModels, played: Scenario
) -> None:
    cid = played.acme["composition_id"]
    link = wire(await models.why(HALL, "l-001"))  # host-01 -- sw-r1
    assert link is not None
    assert link["kind"] == "link"
    assert {r["composition_id"] for r in link["connected_to"]} == {cid}
    assert link["text"] == (
        f"l-001 carries the paths from host-01 to gpu-001, gpu-002 and mem-01 in composition"
        f" {cid} for tenant acme; it is healthy."
    )
    unused = wire(await models.why(HALL, "l-020"))
    assert unused is not None
    assert unused["text"] == "l-020 carries nothing; it is healthy."
    switch = wire(await models.why(HALL, "sw-pool"))
    assert switch is not None
    assert switch["kind"] == "switch"
    assert [r["device"] for r in switch["connected_to"]] == ["mem-01"]
    assert switch["text"].endswith("; it is failed (psu).")
    assert [e["type"] for e in switch["chain"]][-2:] == ["ComponentFaulted", "CompositionImpaired"]


async def test_why_knows_nothing_of_an_unknown_id(
    models: PostgresReadModels, played: Scenario
) -> None:
    assert wire(await models.why(HALL, "gpu-999")) is None
    assert wire(await models.why("no-such-hall", "gpu-001")) is None


async def test_wait_for_tells_when_the_projections_include_a_position(
    runner: Projector, pool: asyncpg.Pool, played: Scenario
) -> None:
    assert await runner.wait_for_domain(HALL, played.last, timeout=0.1)
    assert not await runner.wait_for_domain(HALL, played.last + 1000, timeout=0.1)
    # Read models served from another process watch the checkpoints instead.
    watching = PostgresReadModels(pool)
    assert await watching.wait_for(HALL, played.last, timeout=0.1)
    assert not await watching.wait_for(HALL, played.last + 1000, timeout=0.1)
