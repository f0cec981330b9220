"""Least privilege in Postgres: the engine's role may only read and append the log.

Issue 9 item 6. The schema's owner migrates and grants (adapters/postgres/privileges.py); the
engine connects as a role of its own, as every engine in these tests does (conftest.py). So
append-only holds twice: the log's triggers stop even the owner (test_log_integrity.py), and
the engine's role is stopped by its privileges first, however it tries to get around them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric, gpu
from harness import Harness, serving
from isolation import (
    Database,
    delete_relay_targets,
    drop_schema,
    unique_schema_name,
    unique_subject_prefix,
)

from trellis.adapters.embedded.postgres_server import (
    PG_ENGINE_ROLE,
    PG_OWNER_ROLE,
    EmbeddedPostgres,
)
from trellis.adapters.postgres.migrations import MigrationError, prepare_schema
from trellis.adapters.postgres.privileges import TABLES, Kind, PrivilegeError
from trellis.engine.core.events import ComponentDrained, encode
from trellis.engine.core.records import chain_hash

DOMAIN = "hall-1"
INSUFFICIENT_PRIVILEGE = "42501"

# Everything the engine's role might try to get past the triggers, before changing the log.
BYPASSES = {
    "nothing": None,
    "disable the table's triggers": "ALTER TABLE {table} DISABLE TRIGGER ALL",
    "drop its append-only trigger": "DROP TRIGGER {trigger} ON {table}",
    "replica mode (no triggers fire)": "SET session_replication_role = replica",
    "become the owner": "SET ROLE {owner}",
    "grant itself the privileges": "GRANT UPDATE, DELETE, TRUNCATE ON {table} TO {engine}",
}
CHANGES = {
    "update": "UPDATE {table} SET actor = 'mallory'",
    "delete": "DELETE FROM {table}",
    "truncate": "TRUNCATE {table}",
}
APPEND_ONLY_TRIGGER = {
    "trellis_events": "trellis_events_no_update",
    "trellis_requests": "trellis_requests_no_update",
}


@pytest.fixture
def least_privileged(database: Database) -> Database:
    """The session's database, which must give the engine a role other than the owner's."""
    if database.engine_role == database.owner_role:
        pytest.skip("the configured database gives one role only (no TRELLIS_DATABASE_OWNER_URL)")
    return database


@pytest_asyncio.fixture
async def h(
    nats_url: str, least_privileged: Database, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, least_privileged.url, pg_schema, subject_prefix) as harness:
        yield harness


async def connect(url: str, schema: str) -> asyncpg.Connection:
    return await asyncpg.connect(url, server_settings={"search_path": schema})


async def with_some_history(h: Harness) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    expect_ok(await h.client.admin(DOMAIN, "drain", {"id": "sw-1"}))
    expect_ok(await h.client.admin(DOMAIN, "add-node", {"node": gpu("gpu-03")}))


async def rows(conn: asyncpg.Connection, table: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await conn.fetch(f"SELECT *, ctid::text FROM {table} ORDER BY 1")]


@pytest.mark.parametrize("table", ["trellis_events", "trellis_requests"])
async def test_the_engine_role_cannot_change_the_log_even_after_trying_to_disable_its_triggers(
    h: Harness, least_privileged: Database, pg_schema: str, table: str
) -> None:
    # Given: a log with history, and a SQL prompt as the engine's own role.
    await with_some_history(h)
    owner = await connect(least_privileged.owner_url, pg_schema)
    engine = await connect(least_privileged.url, pg_schema)
    try:
        before = await rows(owner, table)
        names = {
            "table": table,
            "trigger": APPEND_ONLY_TRIGGER[table],
            "owner": least_privileged.owner_role,
            "engine": least_privileged.engine_role,
        }
        refused: dict[str, str | None] = {}
        for bypass, attempt in BYPASSES.items():
            if attempt is not None:
                try:
                    await engine.execute(attempt.format(**names))
                except asyncpg.PostgresError as exc:
                    refused[bypass] = exc.sqlstate
                else:
                    refused[bypass] = None  # GRANT without grant options only warns
            # When: each change is tried after each bypass attempt.
            for change, statement in CHANGES.items():
                try:
                    await engine.execute(statement.format(**names))
                except asyncpg.PostgresError as exc:
                    refused[f"{change} after {bypass}"] = exc.sqlstate
                else:
                    refused[f"{change} after {bypass}"] = "accepted"

        # Then: every attempt was refused for lack of privilege, and the rows are as they were.
        expected = {k: INSUFFICIENT_PRIVILEGE for k in refused}
        expected["grant itself the privileges"] = None
        assert refused == expected
        assert await rows(owner, table) == before
        assert await engine.fetchval("SHOW session_replication_role") == "origin"
    finally:
        await engine.close()
        await owner.close()


async def test_the_engine_role_holds_exactly_the_privileges_its_tables_kind_gives(
    h: Harness, least_privileged: Database, pg_schema: str
) -> None:
    await with_some_history(h)  # the engine served, as this role, on these grants alone
    engine = await connect(least_privileged.url, pg_schema)
    try:
        assert await engine.fetchval("SELECT current_user") == least_privileged.engine_role
        held = {
            r["table_name"]: {p.strip() for p in r["privileges"].split(",")}
            for r in await engine.fetch(
                "SELECT table_name, string_agg(privilege_type, ',') AS privileges "
                "FROM information_schema.role_table_grants "
                "WHERE grantee = current_user AND table_schema = $1 GROUP BY table_name",
                pg_schema,
            )
        }
        assert held == {t: {p.strip() for p in k.value.split(",")} for t, k in TABLES.items()}
        assert TABLES["trellis_events"] is Kind.LOG
        assert (
            await engine.fetchval("SELECT has_schema_privilege($1, 'CREATE')", pg_schema) is False
        )
        assert await engine.fetchval(
            "SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles "
            "WHERE rolname = current_user"
        ) is False  # fmt: skip
    finally:
        await engine.close()


async def test_the_chain_trigger_runs_as_the_owner_and_cannot_be_pointed_at_a_temp_table(
    h: Harness, least_privileged: Database, pg_schema: str
) -> None:
    # Given: a log with history; the engine's role may create temporary tables (PUBLIC may).
    await with_some_history(h)
    head = await h.store.head(DOMAIN)
    engine = await connect(least_privileged.url, pg_schema)
    try:
        function = await engine.fetchrow(
            "SELECT prosecdef, proconfig, proowner::regrole::text AS owner, "
            "has_function_privilege('public', oid, 'EXECUTE') AS public_may_call "
            "FROM pg_proc WHERE oid = 'trellis_events_chain'::regproc"
        )
        assert function["prosecdef"] is True
        assert function["proconfig"] == [f"search_path={pg_schema}, pg_temp"]
        assert function["owner"] == least_privileged.owner_role
        assert function["public_may_call"] is False

        # When: it shadows trellis_streams with a temporary table (temp tables come first in a
        # search_path that does not place pg_temp) holding a head that would accept a gap,
        # and lets the owner, whose rights the trigger runs with, write there.
        await engine.execute(
            "CREATE TEMP TABLE trellis_streams (domain text PRIMARY KEY, version bigint, "
            "position bigint, hash text)"
        )
        await engine.execute(
            "INSERT INTO pg_temp.trellis_streams VALUES ($1, 99, 0, $2)", DOMAIN, "f" * 64
        )
        await engine.execute(
            f"GRANT ALL ON pg_temp.trellis_streams TO {least_privileged.owner_role}"
        )
        gap = event_row(version=100, prev_hash="f" * 64)

        # Then: the trigger still checks the real head, and refuses the gap.
        with pytest.raises(asyncpg.PostgresError) as refusal:
            await engine.execute(INSERT, *gap, h.engine.fence(DOMAIN))
        assert refusal.value.sqlstate == "TR001"
        assert await h.store.head(DOMAIN) == head
        # The well-formed next event is the engine role's to append.
        fence = h.engine.fence(DOMAIN)  # as the domain's writer appends
        await engine.execute(INSERT, *event_row(head.version + 1, head.hash), fence)
        assert (await h.store.head(DOMAIN)).version == head.version + 1
    finally:
        await engine.close()


INSERT = """INSERT INTO trellis_events (id, domain, version, type, schema_version, recorded_at,
            actor, causation_id, correlation_id, data, prev_hash, hash, fence)
            VALUES ($1, $2, $3, $4, 1, $5, 'operator', 'by-hand', 'by-hand', $6::json, $7, $8,
                    $9)"""


def event_row(version: int, prev_hash: str) -> tuple[Any, ...]:
    """A ComponentDrained row for INSERT, chained onto `prev_hash`."""
    fields: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "domain": DOMAIN,
        "version": version,
        "type": "ComponentDrained",
        "schema_version": 1,
        "recorded_at": datetime.now(UTC),
        "actor": "operator",
        "causation_id": "by-hand",
        "correlation_id": "by-hand",
        "data": encode(ComponentDrained(component="gpu-01")),
    }
    digest = chain_hash(prev_hash, **fields)
    return (
        uuid.UUID(fields["id"]),
        DOMAIN,
        version,
        fields["type"],
        fields["recorded_at"],
        fields["data"].decode(),
        prev_hash,
        digest,
    )


@pytest_asyncio.fixture
async def bare_schema(database: Database) -> AsyncIterator[str]:
    """A schema its owner created and nothing else: no tables, no grants."""
    name = unique_schema_name()
    conn = await asyncpg.connect(database.owner_url)
    try:
        await conn.execute(f"CREATE SCHEMA {name}")
    finally:
        await conn.close()
    yield name
    await drop_schema(database, name)


async def test_given_the_owner_url_the_engine_migrates_a_new_schema_and_serves_without_owning_it(
    nats_url: str, least_privileged: Database, bare_schema: str, subject_prefix: str
) -> None:
    # When: an engine starts on a new schema with its own URL and the owner's, as `trellis up`.
    async with serving(
        nats_url,
        least_privileged.url,
        bare_schema,
        subject_prefix,
        owner_url=least_privileged.owner_url,
    ) as h:
        # Then: it serves...
        await with_some_history(h)
        owner = await connect(least_privileged.owner_url, bare_schema)
        try:
            # ...on tables the owner owns and the engine's role was granted.
            owners = await owner.fetch(
                "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = $1", bare_schema
            )
            assert [r["tableowner"] for r in owners] == [least_privileged.owner_role]
            assert await owner.fetchval(
                "SELECT has_table_privilege($1, 'trellis_events', 'INSERT') "
                "AND NOT has_table_privilege($1, 'trellis_events', 'UPDATE')",
                least_privileged.engine_role,
            )
        finally:
            await owner.close()


async def test_without_the_owner_url_the_engine_role_cannot_migrate_and_says_what_is_missing(
    nats_url: str, least_privileged: Database, bare_schema: str, subject_prefix: str
) -> None:
    with pytest.raises(MigrationError, match="TRELLIS_DATABASE_OWNER_URL"):
        async with serving(nats_url, least_privileged.url, bare_schema, subject_prefix):
            pass
    owner = await asyncpg.connect(least_privileged.owner_url)
    try:
        tables = await owner.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname = $1", bare_schema
        )
        assert tables == 0
    finally:
        await owner.close()


async def test_with_one_url_its_role_migrates_and_serves_and_a_warning_names_the_risk(
    nats_url: str,
    database: Database,
    bare_schema: str,
    subject_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # When: the one URL a Postgres gives is the owner's, used for migrations and the engine.
    with caplog.at_level(logging.WARNING, logger="trellis.adapters.postgres.store"):
        async with serving(nats_url, database.owner_url, bare_schema, subject_prefix) as h:
            # Then: it still works...
            await with_some_history(h)
    # ...and it said that only the triggers keep the log append-only.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("only triggers keep the log append-only" in w for w in warnings), warnings


async def test_grants_are_refused_while_a_trellis_table_has_no_kind(
    least_privileged: Database, pg_schema: str
) -> None:
    owner = await connect(least_privileged.owner_url, pg_schema)
    try:
        await owner.execute("CREATE TABLE trellis_unclassified (id int)")
    finally:
        await owner.close()

    with pytest.raises(PrivilegeError, match="trellis_unclassified"):
        await prepare_schema(least_privileged.owner_url, pg_schema, least_privileged.engine_role)


# ---- the embedded Postgres of an older Trellis ----

# What initdb --auth=trust wrote, and an older Trellis left in place.
TRUST_HBA = """local all all trust
host all all 127.0.0.1/32 trust
host all all ::1/128 trust
"""


async def as_before_least_privilege(server: EmbeddedPostgres) -> None:
    """Turn `server`'s data dir into one an older Trellis left: every object owned by the
    superuser, no Trellis roles, migration 006 not applied, trust logins, no passwords file."""
    trellis_db = server.superuser_url.rsplit("/", 1)[0] + "/trellis"
    conn = await asyncpg.connect(trellis_db)
    try:
        await conn.execute(f"""
            REASSIGN OWNED BY {PG_OWNER_ROLE} TO postgres;
            DROP OWNED BY {PG_ENGINE_ROLE};
            ALTER FUNCTION legacy.trellis_events_chain() SECURITY INVOKER RESET search_path;
            GRANT EXECUTE ON FUNCTION legacy.trellis_events_chain() TO PUBLIC;
            DELETE FROM legacy.trellis_migrations WHERE version = 6;
        """)  # fmt: skip
    finally:
        await conn.close()
    conn = await asyncpg.connect(server.superuser_url)
    try:
        await conn.execute(f"DROP ROLE {PG_ENGINE_ROLE}; DROP ROLE {PG_OWNER_ROLE}")
    finally:
        await conn.close()
    await asyncio.to_thread(server.stop)
    (server.pgdata / "pg_hba.conf").write_text(TRUST_HBA)
    server.passwords_path.unlink()


@pytest.mark.slow
async def test_an_embedded_data_dir_from_before_is_brought_to_least_privilege_keeping_its_log(
    nats_url: str, tmp_path: Path
) -> None:
    # Given: a data dir an older Trellis served from, with history in its log.
    server = EmbeddedPostgres(tmp_path / "pg")
    await asyncio.to_thread(server.start)
    try:
        trellis_db = server.superuser_url.rsplit("/", 1)[0] + "/trellis"
        prefix = unique_subject_prefix()
        conn = await asyncpg.connect(trellis_db)
        await conn.execute("CREATE SCHEMA legacy")
        await conn.close()
        async with serving(nats_url, trellis_db, "legacy", prefix) as h:
            await with_some_history(h)
            head = await h.store.head(DOMAIN)
        await as_before_least_privilege(server)
        old_password_less = f"postgresql://postgres@127.0.0.1:{server.port}/trellis"

        # When: this Trellis starts it.
        await asyncio.to_thread(server.start)

        # Then: logins need passwords now...
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(old_password_less)
        # ...the owner migrates and the engine's role serves the same log, continuing it...
        async with serving(nats_url, server.url, "legacy", prefix, owner_url=server.owner_url) as h:
            assert await h.store.head(DOMAIN) == head
            expect_ok(await h.client.admin(DOMAIN, "undrain", {"id": "sw-1"}))
            assert (await h.store.head(DOMAIN)).version == head.version + 1
        # ...and only with the privileges of its kind.
        engine = await connect(server.url, "legacy")
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await engine.execute("ALTER TABLE trellis_events DISABLE TRIGGER ALL")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await engine.execute("DELETE FROM trellis_events")
        finally:
            await engine.close()
        await delete_relay_targets(nats_url, prefix)
    finally:
        await asyncio.to_thread(server.stop)
