"""What the engine's Postgres role may do: every Trellis table by kind, and the grants.

Two roles share a schema. The owner runs the migrations and owns every object in it. The
engine's role may only read and append the log, rewrite its read models, and keep its own
bookkeeping. So append-only is enforced twice: the log's triggers refuse UPDATE, DELETE and
TRUNCATE to everybody, and the engine's role has no such privilege, nor the ownership it
would need to disable a trigger.

A new table goes into TABLES with its kind. `grant_engine` refuses to run while a
``trellis_*`` or ``proj_*`` table is missing from TABLES, so a forgotten table fails loudly at
the first start instead of as a "permission denied" in the middle of serving.
"""

from __future__ import annotations

import enum

import asyncpg


class Kind(enum.Enum):
    """A kind of table, valued by the privileges the engine's role holds on it."""

    LOG = "SELECT, INSERT"
    """The record: read and appended, never changed (its triggers refuse that to anybody)."""
    LOG_HEAD = "SELECT"
    """Kept by the log's own chain trigger, which runs with the owner's rights."""
    READ_MODEL = "SELECT, INSERT, UPDATE, DELETE, TRUNCATE"
    """Folded from the log and rebuildable from it at will, with their checkpoints."""
    BOOKKEEPING = "SELECT, INSERT, UPDATE, DELETE"
    """The engine's own coordination rows, which the log does not hold."""
    SCHEMA_VERSION = "SELECT"
    """trellis_migrations: the engine checks that it is up to date; the owner writes it."""


TABLES: dict[str, Kind] = {
    "trellis_events": Kind.LOG,
    "trellis_requests": Kind.LOG,
    "trellis_checkpoints": Kind.LOG,  # signed tree heads: as permanent as the log
    "trellis_streams": Kind.LOG_HEAD,
    "trellis_migrations": Kind.SCHEMA_VERSION,
    "trellis_deployment": Kind.SCHEMA_VERSION,  # drawn by the migration, read by the engine
    "trellis_follower_checkpoints": Kind.BOOKKEEPING,
    "trellis_engines": Kind.BOOKKEEPING,
    "trellis_writer_leases": Kind.BOOKKEEPING,
    "trellis_snapshots": Kind.BOOKKEEPING,
    "trellis_projection_format": Kind.READ_MODEL,  # rewritten with the tables it describes
    "proj_compositions": Kind.READ_MODEL,
    "proj_connections": Kind.READ_MODEL,
    "proj_connection_requests": Kind.READ_MODEL,
    "proj_devices": Kind.READ_MODEL,
    "proj_components": Kind.READ_MODEL,
    "proj_device_holds": Kind.READ_MODEL,
    "proj_history_intervals": Kind.READ_MODEL,
    "proj_history_compositions": Kind.READ_MODEL,
    "proj_history_devices": Kind.READ_MODEL,
}

_OURS = ("trellis_", "proj_")


class PrivilegeError(RuntimeError):
    """The schema's tables and TABLES disagree, so the engine's grants cannot be given."""


def quote_ident(name: str) -> str:
    """`name` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


async def grant_engine(conn: asyncpg.Connection, role: str) -> None:
    """Give `role` exactly the engine's privileges in the current schema, and nothing else.

    Run by the schema's owner inside the migrations' transaction (so under their lock: two
    owners granting at once would collide on the catalog rows). Idempotent.

    Raises:
        PrivilegeError: A Trellis table is not in TABLES, or a table in TABLES does not exist.
    """
    schema: str = await conn.fetchval("SELECT current_schema()")
    present = {
        r["tablename"]
        for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = $1", schema)
    }
    unclassified = sorted(t for t in present if t.startswith(_OURS) and t not in TABLES)
    if unclassified:
        raise PrivilegeError(
            f"tables {', '.join(unclassified)} in schema {schema} have no kind: add them to "
            "TABLES in adapters/postgres/privileges.py"
        )
    missing = sorted(set(TABLES) - present)
    if missing:
        raise PrivilegeError(f"schema {schema} has no tables {', '.join(missing)}")
    who, where = quote_ident(role), quote_ident(schema)
    statements = [
        f"REVOKE ALL ON ALL TABLES IN SCHEMA {where} FROM {who}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {where} FROM {who}",
        f"REVOKE ALL ON SCHEMA {where} FROM {who}",
        # USAGE, not CREATE: the engine's role cannot add objects to the schema.
        f"GRANT USAGE ON SCHEMA {where} TO {who}",
    ]
    for kind in Kind:
        tables = sorted(t for t, k in TABLES.items() if k is kind)
        if tables:
            names = ", ".join(quote_ident(t) for t in tables)
            statements.append(f"GRANT {kind.value} ON TABLE {names} TO {who}")
    # trellis_events' identity column needs no sequence privilege: identity values are drawn
    # without that check.
    await conn.execute(";\n".join(statements))


async def bypasses_privileges(conn: asyncpg.Connection) -> bool:
    """True when this connection's role is a superuser or acts as the owner of the log, so
    only the log's triggers keep it append-only (such a role may disable them)."""
    return bool(
        await conn.fetchval(
            "SELECT r.rolsuper OR pg_has_role(current_user, c.relowner, 'USAGE') "
            "FROM pg_roles r, pg_class c "
            "WHERE r.rolname = current_user AND c.oid = 'trellis_events'::regclass"
        )
    )
