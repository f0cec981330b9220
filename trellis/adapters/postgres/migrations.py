"""Apply the numbered SQL files in schema/ once each, in order, under a lock.

The schema's owner migrates and then grants the engine's role its privileges
(adapters/postgres/privileges.py). A connection with nothing left to apply only reads
trellis_migrations, so an engine whose role may not change the schema starts once the owner
has migrated it.
"""

from __future__ import annotations

import hashlib
import os
import re
from importlib import resources
from pathlib import Path

import asyncpg

from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.privileges import grant_engine


def _schema_dir() -> Path:
    """TRELLIS_SCHEMA_DIR, else the package `trellis.schema`: the repository's schema/, which
    setup.py maps into the package (a wheel carries it, an editable install maps onto it)."""
    configured = os.environ.get("TRELLIS_SCHEMA_DIR")
    return Path(configured) if configured else Path(str(resources.files("trellis.schema")))


SCHEMA_DIR = _schema_dir()
_MIGRATION_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")


class MigrationError(RuntimeError):
    """A migration already applied was edited afterwards, the schema folder is missing, or
    migrations are pending and this role may not apply them."""


def migration_files(folder: Path = SCHEMA_DIR) -> list[tuple[int, Path]]:
    where = f"{folder} (TRELLIS_SCHEMA_DIR)" if os.environ.get("TRELLIS_SCHEMA_DIR") else folder
    if not folder.is_dir():
        raise MigrationError(f"schema folder {where} not found")
    found = [(_MIGRATION_NAME.match(p.name), p) for p in folder.iterdir()]
    files = sorted((int(m.group(1)), p) for m, p in found if m)
    if not files:
        # Else nothing was migrated, and the first check of the tables blamed privileges.
        raise MigrationError(f"schema folder {where} holds no migrations (NNN_name.sql)")
    return files


def _checksum(sql: str) -> str:
    return hashlib.sha256(sql.encode()).hexdigest()


def _check_unchanged(done: dict[int, str], files: list[tuple[int, Path, str]]) -> None:
    for version, path, sql in files:
        if version in done and done[version] != _checksum(sql):
            raise MigrationError(f"{path.name} changed after it was applied")
    # A schema a newer Trellis migrated (a rollback): this code would run on tables, checks
    # and triggers it was never written for.
    newer = sorted(set(done) - {version for version, _, _ in files})
    if newer:
        raise MigrationError(
            f"the schema holds migration(s) {', '.join(f'{v:03d}' for v in newer)} that this "
            "Trellis does not know: a newer version migrated it. Run that version (or one as "
            "new), or restore a backup taken before the upgrade (docs/operations.md, "
            '"Upgrading and rolling back")'
        )


async def _up_to_date(conn: asyncpg.Connection, files: list[tuple[int, Path, str]]) -> bool:
    if await conn.fetchval("SELECT to_regclass('trellis_migrations')") is None:
        return False
    done = dict(await conn.fetch("SELECT version, checksum FROM trellis_migrations"))
    _check_unchanged(done, files)
    return all(version in done for version, _, _ in files)


async def require_current(conn: asyncpg.Connection, folder: Path = SCHEMA_DIR) -> None:
    """Refuse a schema this build's commands would misread: one a newer Trellis migrated, or
    one that lacks migrations this build expects (its engine was not started on it yet).
    `verify` and `export`, which read the tables without migrating, check it first: an older
    build's verify named a newer fold's rows as findings, and an export appended them.

    Raises:
        MigrationError: which migrations differ, and what to run.
    """
    files = [(version, path, path.read_text()) for version, path in migration_files(folder)]
    if await conn.fetchval("SELECT to_regclass('trellis_migrations')") is None:
        return  # no Trellis schema here: the command says so in its own words
    done = dict(await conn.fetch("SELECT version, checksum FROM trellis_migrations"))
    _check_unchanged(done, files)
    pending = [version for version, _, _ in files if version not in done]
    if pending:
        raise MigrationError(
            f"the schema lacks migration(s) {', '.join(f'{v:03d}' for v in pending)} that "
            "this Trellis expects: an older version's engine runs on it. Start this version's "
            "engine (`trellis up`) once, which migrates it, or use that older version's "
            "commands"
        )


async def migrate(
    conn: asyncpg.Connection, folder: Path = SCHEMA_DIR, *, engine_role: str | None = None
) -> list[int]:
    """Bring the current schema (search_path) up to date; return the versions applied now.

    With `engine_role` (run by the schema's owner), also give that role the engine's
    privileges, in the same transaction. Idempotent and safe to run from several engines at
    once: a transaction-scoped advisory lock per schema lets one of them apply while the others
    wait and then find nothing to do.

    Raises:
        MigrationError: An applied migration was edited, or migrations are pending and this
            connection's role may not apply them.
    """
    files = [(version, path, path.read_text()) for version, path in migration_files(folder)]
    if engine_role is None and await _up_to_date(conn, files):
        return []
    applied_now: list[int] = []
    try:
        async with conn.transaction():
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.trellis_migrations'))"
            )
            await conn.execute(
                """CREATE TABLE IF NOT EXISTS trellis_migrations (
                       version integer PRIMARY KEY,
                       name text NOT NULL,
                       checksum text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = dict(await conn.fetch("SELECT version, checksum FROM trellis_migrations"))
            _check_unchanged(done, files)
            for version, path, sql in files:
                if version in done:
                    continue
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO trellis_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    version,
                    path.name,
                    _checksum(sql),
                )
                applied_now.append(version)
            if engine_role is not None and engine_role != await conn.fetchval(
                "SELECT current_user"
            ):
                await grant_engine(conn, engine_role)
    except (asyncpg.InsufficientPrivilegeError, asyncpg.InvalidSchemaNameError) as exc:
        # No schema selected: it does not exist, or this role may not even use it.
        who, path = await conn.fetchrow("SELECT current_user, current_setting('search_path')")
        raise MigrationError(
            f"role {who} cannot migrate the schema (search_path {path}): {exc}. Migrations "
            "run as the schema's owner, given by TRELLIS_DATABASE_OWNER_URL "
            "(docs/security.md, Least privilege)"
        ) from exc
    return applied_now


async def prepare_schema(owner_dsn: str, schema: str | None, engine_role: str) -> list[int]:
    """As the owner (`owner_dsn`): migrate `schema` (the search_path's when None) and give
    `engine_role` the engine's privileges in it. Returns the versions applied now."""
    named = {"application_name": sessions.MIGRATIONS}
    conn = await asyncpg.connect(
        owner_dsn,
        server_settings={**named, **({"search_path": schema} if schema else {})},
        timeout=5.0,
    )
    try:
        return await migrate(conn, engine_role=engine_role)
    finally:
        await conn.close()
