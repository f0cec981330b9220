"""The shared fixtures hand out working servers and isolated names."""

from __future__ import annotations

import re

import asyncpg
import nats
from isolation import Database

from trellis.adapters.nats.connect import nats_servers
from trellis.adapters.postgres.privileges import TABLES


async def test_pg_schema_is_a_fresh_migrated_schema_in_the_session_database(
    database: Database, pg_schema: str
) -> None:
    assert re.fullmatch(r"t_[0-9a-f]{12}", pg_schema)
    conn = await asyncpg.connect(database.owner_url)
    try:
        tables = await conn.fetch(
            "select table_name from information_schema.tables where table_schema = $1", pg_schema
        )
        assert sorted(t["table_name"] for t in tables) == sorted(TABLES)
        assert await conn.fetchval(f"select count(*) from {pg_schema}.trellis_events") == 0
        await conn.execute(f"create table {pg_schema}.probe (id int)")  # the owner's to change
    finally:
        await conn.close()


async def test_subject_prefix_is_one_subject_token_on_the_session_nats(
    nats_url: str, subject_prefix: str
) -> None:
    assert re.fullmatch(r"t[0-9a-f]{12}", subject_prefix)
    nc = await nats.connect(nats_servers(nats_url))
    try:
        sub = await nc.subscribe(f"{subject_prefix}.>")
        await nc.publish(f"{subject_prefix}.hello", b"hi")
        assert (await sub.next_msg(timeout=5)).data == b"hi"
        assert (await nc.jetstream().account_info()) is not None
    finally:
        await nc.close()
