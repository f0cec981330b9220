"""Apply the numbered SQL files in schema/ once each, in order, under a lock."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import asyncpg

# The repository's schema/ folder; an installed (non-editable) engine is told where it is.
SCHEMA_DIR = Path(
    os.environ.get("TRELLIS_SCHEMA_DIR") or Path(__file__).resolve().parents[2] / "schema"
)
_MIGRATION_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")


class MigrationError(RuntimeError):
    """A migration already applied was edited afterwards, or the schema folder is missing."""


def migration_files(folder: Path = SCHEMA_DIR) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        raise MigrationError(f"schema folder {folder} not found")
    found = [(_MIGRATION_NAME.match(p.name), p) for p in folder.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m)


async def migrate(conn: asyncpg.Connection, folder: Path = SCHEMA_DIR) -> list[int]:
    """Bring the current schema (search_path) up to date; return the versions applied now.

    Idempotent and safe to run from several engines at once: a transaction-scoped advisory lock
    per schema lets one of them apply while the others wait and then find nothing to do.
    """
    applied_now: list[int] = []
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
        for version, path in migration_files(folder):
            sql = path.read_text()
            checksum = hashlib.sha256(sql.encode()).hexdigest()
            if version in done:
                if done[version] != checksum:
                    raise MigrationError(f"{path.name} changed after it was applied")
                continue
            await conn.execute(sql)
            await conn.execute(
                "INSERT INTO trellis_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                version,
                path.name,
                checksum,
            )
            applied_now.append(version)
    return applied_now
