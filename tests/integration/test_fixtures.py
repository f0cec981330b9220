"""The shared fixtures hand out working servers and isolated names."""

from __future__ import annotations

import re

import asyncpg
import nats

from adapters.bootstrap import nats_servers


async def test_pg_schema_is_a_fresh_schema_in_the_session_database(
    database_url: str, pg_schema: str
) -> None:
    assert re.fullmatch(r"t_[0-9a-f]{12}", pg_schema)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"create table {pg_schema}.probe (id int)")
        tables = await conn.fetch(
            "select table_name from information_schema.tables where table_schema = $1", pg_schema
        )
        assert [t["table_name"] for t in tables] == ["probe"]
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
