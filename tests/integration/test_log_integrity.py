"""The log protects itself: append-only in the database, gap-free versions, a verifiable chain.

ARCHITECTURE §6. The engine writes through NATS as usual; the tampering is done the way an
operator with a SQL prompt would try it, on a connection of its own, as the schema's owner:
privileges do not stop the owner, the log's triggers do (test_least_privilege.py shows the
engine's role stopped by its privileges as well).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric, gpu
from harness import Harness, serving
from isolation import Database, unique_schema_name

from trellis.adapters.postgres.migrations import (
    MigrationError,
    migrate,
    migration_files,
    require_current,
)
from trellis.engine.core.events import ComponentDrained, encode
from trellis.engine.core.records import GENESIS_HASH, Head, RecordedEvent, chain_hash, verify_chain

DOMAIN = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest_asyncio.fixture
async def sql(owner_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection inside the test's schema, as its owner at a SQL prompt would have."""
    conn = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    yield conn
    await conn.close()


async def with_some_history(h: Harness, domain: str = DOMAIN) -> None:
    """Given: an imported fabric and a few changes to it (four events)."""
    expect_ok(await h.client.admin(domain, "import-topology", fabric()))
    expect_ok(await h.client.admin(domain, "drain", {"id": "sw-1"}))
    expect_ok(
        await h.client.admin(domain, "report-fault", {"component": "gpu-02", "state": "failed"})
    )
    expect_ok(await h.client.admin(domain, "add-node", {"node": gpu("gpu-03")}))


async def recorded(h: Harness, domain: str = DOMAIN) -> list[RecordedEvent]:
    return [e async for e in h.store.read(domain)]


async def snapshot(sql: asyncpg.Connection) -> list[tuple[Any, ...]]:
    rows = await sql.fetch(
        "SELECT *, data::text AS data_text FROM trellis_events ORDER BY position"
    )
    return [tuple(r) for r in rows]


# ---- append-only ----


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE trellis_events SET actor = 'mallory'",
        "UPDATE trellis_events SET data = '{}'::json WHERE version = 2",
        "DELETE FROM trellis_events",
        "DELETE FROM trellis_events WHERE version = (SELECT max(version) FROM trellis_events)",
        "TRUNCATE trellis_events",
        "TRUNCATE trellis_events, trellis_streams",
    ],
)
async def test_the_database_refuses_to_change_or_remove_logged_events(
    h: Harness, sql: asyncpg.Connection, statement: str
) -> None:
    await with_some_history(h)
    before = await snapshot(sql)

    with pytest.raises(asyncpg.PostgresError, match="append-only"):
        await sql.execute(statement)

    assert await snapshot(sql) == before
    assert verify_chain(await recorded(h)) is None


@pytest.mark.parametrize(
    "statement",
    ["UPDATE trellis_requests SET reply = '{}'", "DELETE FROM trellis_requests"],
)
async def test_the_database_refuses_to_change_or_remove_stored_replies(
    h: Harness, sql: asyncpg.Connection, statement: str
) -> None:
    await with_some_history(h)
    before = await sql.fetch("SELECT * FROM trellis_requests ORDER BY position")

    with pytest.raises(asyncpg.PostgresError, match="append-only"):
        await sql.execute(statement)

    assert await sql.fetch("SELECT * FROM trellis_requests ORDER BY position") == before


async def test_the_database_refuses_to_truncate_stored_replies(
    h: Harness, sql: asyncpg.Connection
) -> None:
    await with_some_history(h)
    before = await sql.fetch("SELECT * FROM trellis_requests ORDER BY position")

    with pytest.raises(asyncpg.PostgresError, match="append-only"):
        await sql.execute("TRUNCATE trellis_requests")

    assert await sql.fetch("SELECT * FROM trellis_requests ORDER BY position") == before


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE trellis_streams SET version = version + 5",
        "DELETE FROM trellis_streams",
        "TRUNCATE trellis_streams",
        "INSERT INTO trellis_streams VALUES ('x', 1, 1, repeat('0', 64))",
    ],
)
async def test_only_the_log_itself_may_move_a_stream_head(
    h: Harness, sql: asyncpg.Connection, statement: str
) -> None:
    await with_some_history(h)
    before = await sql.fetch("SELECT * FROM trellis_streams ORDER BY domain")

    with pytest.raises(asyncpg.PostgresError, match="not allowed"):
        await sql.execute(statement)

    assert await sql.fetch("SELECT * FROM trellis_streams ORDER BY domain") == before


# ---- the hash chain ----


async def test_the_hash_chain_verifies_from_genesis_to_the_stream_head(h: Harness) -> None:
    await with_some_history(h)

    events = await recorded(h)

    assert [e.version for e in events] == [1, 2, 3, 4]
    assert events[0].prev_hash == GENESIS_HASH
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(events))
    assert verify_chain(events) is None
    last = events[-1]
    assert await h.store.head(DOMAIN) == Head(last.version, last.position, last.hash)
    # Verifying a tail from a known head works as well as from genesis.
    start = Head(events[1].version, events[1].position, events[1].hash)
    assert verify_chain(events[2:], start) is None


async def test_verify_chain_names_the_first_event_that_was_tampered_with(h: Harness) -> None:
    await with_some_history(h)
    events = await recorded(h)
    replace = msgspec.structs.replace

    def altered(index: int, **changes: Any) -> list[RecordedEvent]:
        copy = list(events)
        copy[index] = replace(copy[index], **changes)
        return copy

    forged = encode(ComponentDrained(component="gpu-01"))
    assert verify_chain(altered(1, data=forged)) == events[1].version
    assert verify_chain(altered(1, data=events[1].data + b" ")) == events[1].version
    assert verify_chain(altered(3, actor="mallory")) == events[3].version
    assert verify_chain(altered(0, causation_id="someone-else")) == events[0].version
    assert (
        verify_chain(altered(2, recorded_at=datetime(2020, 1, 1, tzinfo=UTC))) == events[2].version
    )
    assert verify_chain(events[:1] + events[2:]) == events[2].version  # one event dropped
    assert verify_chain([events[0], events[2], events[1], events[3]]) == events[2].version


# ---- versions and positions ----


async def test_versions_are_gap_free_per_domain_and_positions_strictly_increase(
    h: Harness, sql: asyncpg.Connection
) -> None:
    # Given: two domains written to in turns and at the same time, with rejected intents between.
    for domain in ("hall-1", "hall-2"):
        expect_ok(await h.client.admin(domain, "import-topology", fabric()))
    for i in range(4):
        replies = await asyncio.gather(
            h.client.admin("hall-1", "add-node", {"node": gpu(f"gpu-a{i}")}),
            h.client.admin("hall-2", "add-node", {"node": gpu(f"gpu-b{i}")}),
            h.client.admin("hall-1", "drain", {"id": "ghost"}),
            h.client.admin("hall-2", "add-node", {"node": gpu("gpu-01")}),
        )
        expect_ok(replies[0]), expect_ok(replies[1])
        expect_error(replies[2], "not_found"), expect_error(replies[3], "conflict")

    # Then
    everything = [e async for e in h.store.read_all()]
    positions = [e.position for e in everything]
    assert positions == sorted(set(positions))
    for domain in ("hall-1", "hall-2"):
        events = [e for e in everything if e.domain == domain]
        assert [e.version for e in events] == list(range(1, 6))
        assert events == await recorded(h, domain)
        assert verify_chain(events) is None
    heads = await sql.fetch("SELECT domain, version FROM trellis_streams ORDER BY domain")
    assert [tuple(r) for r in heads] == [("hall-1", 5), ("hall-2", 5)]


def follow_on(
    head: Head,
    *,
    version: int | None = None,
    prev_hash: str | None = None,
    at: datetime | None = None,
) -> tuple:
    """A ComponentDrained row for the events table, recorded `at` (default now); by default
    the correct next one."""
    version = head.version + 1 if version is None else version
    prev = head.hash if prev_hash is None else prev_hash
    fields = {
        "id": str(uuid.uuid4()),
        "domain": DOMAIN,
        "version": version,
        "type": "ComponentDrained",
        "schema_version": 1,
        "recorded_at": datetime.now(UTC) if at is None else at,
        "actor": "operator",
        "causation_id": "by-hand",
        "correlation_id": "by-hand",
        "data": encode(ComponentDrained(component="gpu-01")),
    }
    digest = chain_hash(prev, **fields)  # type: ignore[arg-type]
    return (
        uuid.UUID(fields["id"]),
        DOMAIN,
        version,
        "ComponentDrained",
        1,
        fields["recorded_at"],
        "operator",
        "by-hand",
        "by-hand",
        fields["data"].decode(),  # type: ignore[attr-defined]
        prev,
        digest,
    )


# By hand, as the domain's writer would (its writer epoch in `fence`, $13).
INSERT = """INSERT INTO trellis_events (id, domain, version, type, schema_version, recorded_at,
            actor, causation_id, correlation_id, data, prev_hash, hash, fence)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::json, $11, $12, $13)"""


async def test_the_database_refuses_an_event_that_does_not_follow_the_stream_head(
    h: Harness, sql: asyncpg.Connection
) -> None:
    await with_some_history(h)
    head = await h.store.head(DOMAIN)
    before = await snapshot(sql)

    refused = {
        "gap": follow_on(head, version=head.version + 2),
        "wrong prev_hash": follow_on(head, prev_hash="f" * 64),
        "same version again": follow_on(head, version=head.version, prev_hash=head.hash),
        "rewrites version 1": follow_on(head, version=1, prev_hash=GENESIS_HASH),
        "first event off genesis": follow_on(Head(0, 0, "a" * 64)),
    }
    for case, row in refused.items():
        with pytest.raises(asyncpg.PostgresError) as refusal:
            await sql.execute(INSERT, *row, h.engine.fence(DOMAIN))
        assert refusal.value.sqlstate == "TR001", (case, refusal.value)
        assert await snapshot(sql) == before, case

    fence = h.engine.fence(DOMAIN)
    await sql.execute(INSERT, *follow_on(head), fence)  # the well-formed next event is accepted
    assert verify_chain(await recorded(h)) is None


async def test_an_append_checks_its_writers_fence_once_and_refuses_a_stale_one_whole(
    h: Harness, sql: asyncpg.Connection
) -> None:
    """schema/017: the lease is looked up once per append and domain, not once per event (it
    cost some 10 µs an event inside the log's lock), and a stale epoch still refuses every row
    of the append, even when each of them links to the head."""
    await with_some_history(h)
    fence = h.engine.fence(DOMAIN)
    assert fence is not None
    rows, head = [], await h.store.head(DOMAIN)
    for _ in range(5):
        row = follow_on(head)
        rows.append(row)
        head = Head(row[2], 0, row[-1])
    many = (
        "INSERT INTO trellis_events (id, domain, version, type, schema_version, recorded_at, "
        "actor, causation_id, correlation_id, data, prev_hash, hash, fence) "
        "SELECT r.id, r.domain, r.version, r.type, r.schema_version, r.recorded_at, r.actor, "
        "r.causation_id, r.correlation_id, r.data::json, r.prev_hash, r.hash, $2 "
        "FROM unnest($1::trellis_events_by_hand[]) AS r ORDER BY r.version"
    )
    await sql.execute(
        "CREATE TEMP TABLE trellis_events_by_hand (id uuid, domain text, version bigint, "
        "type text, schema_version int, recorded_at timestamptz, actor text, causation_id text, "
        "correlation_id text, data text, prev_hash text, hash text)"
    )
    before = await snapshot(sql)

    with pytest.raises(asyncpg.PostgresError) as refusal:
        await sql.execute(many, rows, fence - 1)
    assert refusal.value.sqlstate == "TR004", refusal.value
    assert await snapshot(sql) == before

    # Each fence check reads the lease table once: this transaction's own scans of it count.
    lease_reads = (
        "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables "
        "WHERE relid = 'trellis_writer_leases'::regclass"
    )
    async with sql.transaction():
        reads_before = await sql.fetchval(lease_reads)
        await sql.execute(many, rows, fence)
        reads = await sql.fetchval(lease_reads) - reads_before
    assert reads == 1
    assert verify_chain(await recorded(h)) is None


async def test_heads_written_before_the_time_moved_into_the_chain_keep_their_time_check(
    database: Database, tmp_path: Path
) -> None:
    """schema/015 checks an event's time against its stream head's: a head written before it
    learns its event's time as the migration runs, so the check holds across the upgrade."""
    name = unique_schema_name()
    sql = await asyncpg.connect(database.owner_url)
    try:
        await sql.execute(f"CREATE SCHEMA {name}; SET search_path = {name}")
        for version, path in migration_files():  # the log as it was before schema/015
            if version < 15:
                shutil.copy(path, tmp_path)
        await migrate(sql, tmp_path)
        noon = datetime(2026, 12, 5, 12, tzinfo=UTC)
        await sql.execute(INSERT, *follow_on(Head(), at=noon), None)
        before = await sql.fetchrow("SELECT version, position, hash FROM trellis_streams")
        head = Head(*before)

        assert 15 in await migrate(sql)

        with pytest.raises(asyncpg.PostgresError) as refusal:
            await sql.execute(INSERT, *follow_on(head, at=noon - timedelta(seconds=1)), None)
        assert refusal.value.sqlstate == "TR005"
        assert await sql.fetchrow("SELECT version, position, hash FROM trellis_streams") == before
        await sql.execute(INSERT, *follow_on(head, at=noon), None)  # the same time may follow
    finally:
        await sql.execute(f"DROP SCHEMA {name} CASCADE")
        await sql.close()


async def test_a_schema_a_newer_trellis_migrated_is_refused_by_an_older_one(
    database: Database, tmp_path: Path
) -> None:
    """A rollback: code that lacks the newest migration would run on tables, checks and
    triggers it was never written for. It refuses, naming the migration, and applies nothing."""
    name = unique_schema_name()
    sql = await asyncpg.connect(database.owner_url)
    try:
        await sql.execute(f"CREATE SCHEMA {name}; SET search_path = {name}")
        await migrate(sql)
        files = migration_files()
        newest = files[-1][0]
        for _, path in files[:-1]:  # the older version's schema/ folder
            shutil.copy(path, tmp_path)
        applied = await sql.fetchval("SELECT count(*) FROM trellis_migrations")

        with pytest.raises(MigrationError, match=f"migration\\(s\\) {newest:03d} that this"):
            await migrate(sql, tmp_path)
        assert await sql.fetchval("SELECT count(*) FROM trellis_migrations") == applied
    finally:
        await sql.execute(f"DROP SCHEMA {name} CASCADE")
        await sql.close()


async def test_verify_and_export_refuse_a_schema_of_another_version(
    database: Database, tmp_path: Path
) -> None:
    """The upgrade probe: an older build's verify, against a schema a newer engine migrated,
    named the newer fold's rows as tamper findings, and its export appended them. Both
    commands now read only a schema exactly as migrated as this build: newer or older."""
    name = unique_schema_name()
    sql = await asyncpg.connect(database.owner_url)
    try:
        await sql.execute(f"CREATE SCHEMA {name}; SET search_path = {name}")
        files = migration_files()
        newest = files[-1][0]
        older = tmp_path / "older"
        older.mkdir()
        for _, path in files[:-1]:
            shutil.copy(path, older)
        await migrate(sql, older)  # an older engine's schema

        with pytest.raises(MigrationError, match=f"lacks migration\\(s\\) {newest:03d} that"):
            await require_current(sql)
        await migrate(sql)
        await require_current(sql)  # current: nothing to say
        with pytest.raises(MigrationError, match=f"migration\\(s\\) {newest:03d} that this"):
            await require_current(sql, older)  # the older build, on the newer schema
    finally:
        await sql.execute(f"DROP SCHEMA {name} CASCADE")
        await sql.close()


async def test_the_engine_catches_up_with_an_event_another_writer_appended(
    h: Harness, sql: asyncpg.Connection
) -> None:
    # Given: another writer appended an event the engine has not seen.
    await with_some_history(h)
    await sql.execute(INSERT, *follow_on(await h.store.head(DOMAIN)), h.engine.fence(DOMAIN))

    # When: the engine's next intent finds its head stale.
    reply = await h.client.admin(DOMAIN, "drain", {"id": "l-host"})

    # Then: it re-read the log, decided on top of it, and the chain is whole.
    assert expect_ok(reply)["changed"] is True
    events = await recorded(h)
    assert [e.version for e in events] == [1, 2, 3, 4, 5, 6]
    assert events[4].causation_id == "by-hand" and reply["position"] == events[5].position
    assert verify_chain(events) is None
    topo = expect_ok(await h.client.query(DOMAIN, "topology"))
    assert {n["id"] for n in topo["nodes"] if n["drained"]} == {"sw-1", "gpu-01"}
