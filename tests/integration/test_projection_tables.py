"""A projection table's statements against real Postgres: every column type a projection uses
goes out and comes back exactly, through the live followers' writes (PostgresRows) and the
rebuild's (projections/replay.write), and keys of any column type select and delete."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest_asyncio

from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.adapters.postgres.verify import ProjectionReplay
from trellis.projections.history import INTERVALS, HistoryProjection
from trellis.projections.replay import Changes, write
from trellis.projections.table import Column, PostgresRows, Row, Table, as_stored

ODD = Table(
    "proj_test_odd",
    (
        Column("domain", "text"),
        Column("name", "text"),
        Column("at_position", "bigint"),
        Column("weight", "float8"),
        Column("ok", "boolean"),
        Column("since", "timestamptz"),
        Column("note", "text"),
        Column("detail", "jsonb"),
    ),
    key=("domain", "name", "at_position"),
    group=("domain", "name"),
)

ROWS: list[Row] = [
    {
        "domain": "hall",
        "name": 'quote " back \\ slash',
        "at_position": 2**62,
        "weight": 0.1 + 0.2,
        "ok": True,
        "since": datetime(2026, 12, 5, 20, 33, 0, 123456, tzinfo=UTC),
        "note": "ünïcödé, \U0001d50a (beyond the BMP) and a tab\t",
        "detail": {"z": [1, 2.5, None], "a": "x", "nested": {"deep": True}},
    },
    {
        "domain": "hall",
        "name": 'quote " back \\ slash',
        "at_position": 7,
        "weight": 1e-300,
        "ok": False,
        "since": datetime(2026, 1, 1, 1, 0, 0, 1, tzinfo=timezone(timedelta(hours=5))),
        "note": None,  # SQL NULL
        "detail": None,  # JSON null, not SQL NULL
    },
    {
        "domain": "lab",
        "name": "plain",
        "at_position": 0,
        "weight": -3,
        "ok": None,
        "since": None,
        "note": "",
        "detail": "a JSON string",
    },
]


@pytest_asyncio.fixture
async def conn(owner_url: str, pg_schema: str) -> AsyncIterator[Any]:
    """A connection in the test's schema, holding a table of its own."""
    c = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    columns = ", ".join(f"{c.name} {c.type}" for c in ODD.columns)
    await c.execute(f"CREATE TABLE {ODD.name} ({columns}, PRIMARY KEY ({', '.join(ODD.key)}))")
    yield c
    await c.close()


def by_key(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=ODD.key_of)


async def stored(conn: Any) -> list[Row]:
    return by_key([ODD.decode(r) for r in await conn.fetch(f"SELECT * FROM {ODD.name}")])


async def test_the_live_path_writes_and_reads_back_every_column_type_exactly(conn: Any) -> None:
    async with conn.transaction(), PostgresRows.batch(conn) as rows:
        await rows.write(ODD, [], ROWS)
    expected = by_key([as_stored(ODD, row) for row in ROWS])
    assert await stored(conn) == expected
    assert (await conn.fetchrow(f"SELECT detail IS NULL AS sql_null FROM {ODD.name} "
                                "WHERE at_position = 7"))["sql_null"] is False  # fmt: skip
    rows = PostgresRows(conn)
    keys = [ODD.key_of(r) for r in ROWS]
    assert by_key(await rows.fetch(ODD, ODD.key, keys)) == expected
    assert by_key(await rows.fetch(ODD, ODD.group, [("hall", ROWS[0]["name"])])) == expected[:2]
    assert await rows.fetch(ODD, ODD.key, [("hall", "plain", 0)]) == []


async def test_the_live_path_replaces_and_deletes_by_key(conn: Any) -> None:
    async with conn.transaction(), PostgresRows.batch(conn) as rows:
        await rows.write(ODD, [], ROWS)
    changed = {**ROWS[2], "weight": 2.5, "detail": [1, "two"]}
    async with conn.transaction(), PostgresRows.batch(conn) as rows:
        await rows.write(ODD, [ODD.key_of(ROWS[0])], [changed])
    assert await stored(conn) == by_key([as_stored(ODD, ROWS[1]), as_stored(ODD, changed)])


async def test_the_rebuild_writes_what_the_live_path_writes(conn: Any) -> None:
    async with conn.transaction():
        await write(conn, [Changes(ODD, [], changed=[], new=ROWS)])  # COPY
    changed = {**ROWS[1], "weight": 4.0, "detail": None}
    async with conn.transaction():  # an upsert and a delete
        await write(conn, [Changes(ODD, [ODD.key_of(ROWS[2])], changed=[changed], new=[])])
    assert await stored(conn) == by_key([as_stored(ODD, ROWS[0]), as_stored(ODD, changed)])


async def test_a_prefetch_planned_on_an_empty_table_still_looks_keys_up_once_it_grows(
    owner_url: str, pg_schema: str
) -> None:
    """A follower's connection keeps its prepared statements, and Postgres would soon reuse one
    generic plan for each. A plan made while the table was empty must neither scan the whole
    table once it has grown, nor walk another of its indexes over a whole domain: every pass
    would then read every row. The history intervals have four such indexes. The projections'
    sessions (as bootstrap and `projections rebuild` name them) plan each run instead."""
    await (await PostgresEventStore.open(owner_url, schema=pg_schema)).close()  # migrates
    pool = await connect_pool(owner_url, schema=pg_schema, application_name=sessions.PROJECTIONS)
    try:
        async with pool.acquire() as conn:
            await lookups_read_only_what_they_find(conn)
    finally:
        await pool.close()


async def test_the_audit_replay_plans_its_lookups_as_the_projections_do(
    owner_url: str, pg_schema: str
) -> None:
    """`trellis verify` folds the log into temporary copies of the projection tables, which
    grow from empty and are never analyzed: its lookups must follow their size too."""
    await (await PostgresEventStore.open(owner_url, schema=pg_schema)).close()  # migrates
    conn = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    try:
        await ProjectionReplay(conn, pg_schema, [HistoryProjection()]).prepare()
        await lookups_read_only_what_they_find(conn)
    finally:
        await conn.close()


async def lookups_read_only_what_they_find(conn: Any) -> None:
    """Lookups by key and by group on the history intervals, planned while the table is
    empty (and left unanalyzed), then run on 5,000 rows: two lookups read two rows."""
    await conn.execute(f"ALTER TABLE {INTERVALS.name} SET (autovacuum_enabled = false)")
    rows = PostgresRows(conn)
    key, group = ("hall", "c-7", "gpu-7", 7), ("hall", "c-7")
    for _ in range(8):  # past the custom plans Postgres tries first: the plan is generic
        assert await rows.fetch(INTERVALS, INTERVALS.key, [key]) == []
        assert await rows.fetch(INTERVALS, INTERVALS.group, [group]) == []
    started = datetime(2026, 12, 6, tzinfo=UTC)
    grown = [
        {
            "domain": "hall", "composition_id": f"c-{i}", "device": f"gpu-{i}",
            "start_position": i, "kind": "gpu", "model": "h100", "host": f"host-{i % 8}",
            "tenant": "acme", "started_at": started + timedelta(seconds=i),
            "ended_at": None, "end_position": None, "end_reason": None,
            "bandwidth_gbps": 64.0, "capacity_gib": None, "cost_per_hour": 2.0,
        }
        for i in range(5000)
    ]  # fmt: skip
    async with conn.transaction(), PostgresRows.batch(conn) as batch:
        await batch.write(INTERVALS, [], grown)
    scans = (
        "SELECT seq_scan, idx_scan, idx_tup_fetch FROM pg_stat_xact_user_tables"
        " WHERE relid = $1::regclass"
    )
    async with conn.transaction():  # pending counts are flushed only between transactions
        before = await conn.fetchrow(scans, INTERVALS.name)
        found = await rows.fetch(INTERVALS, INTERVALS.key, [key])
        assert [r["composition_id"] for r in found] == ["c-7"]
        found = await rows.fetch(INTERVALS, INTERVALS.group, [group])
        assert [r["start_position"] for r in found] == [7]
        after = await conn.fetchrow(scans, INTERVALS.name)
    read = {k: after[k] - before[k] for k in ("seq_scan", "idx_scan", "idx_tup_fetch")}
    # Two index lookups, each reading only the row it finds.
    assert read == {"seq_scan": 0, "idx_scan": 2, "idx_tup_fetch": 2}, read
