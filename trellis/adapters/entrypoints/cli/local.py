"""Commands that work on local files or the database, without an engine:
`projections rebuild`, `schema export`."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from trellis.adapters.endpoints import find_endpoint
from trellis.adapters.entrypoints.cli.errors import no_database
from trellis.adapters.nats.contract import contract_files
from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.adapters.settings import Settings
from trellis.projections import rebuild


def projections_rebuild(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    url = find_endpoint(settings, "database_url")
    if url is None:
        raise no_database()

    async def go() -> tuple[int, float]:
        store = await PostgresEventStore.open(
            url, schema=settings.db_schema, application_name=sessions.COMMAND
        )
        pool = await connect_pool(
            url, schema=settings.db_schema, max_size=4, application_name=sessions.PROJECTIONS
        )
        try:
            started = time.perf_counter()
            applied = await rebuild(pool, store, await store.domains())
            return applied, time.perf_counter() - started
        finally:
            await pool.close()
            await store.close()

    applied, seconds = asyncio.run(go())
    rate = applied / seconds if seconds else 0.0
    print(f"rebuilt {', '.join(_TABLES)} from {applied} events in {seconds:.2f} s ({rate:,.0f}/s)")
    return 0


_TABLES = ("compositions", "connections", "devices", "history")


def schema_export(args: argparse.Namespace) -> int:
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, content in contract_files().items():
        (args.dir / name).write_bytes(content)
        print(f"wrote {args.dir / name}")
    return 0


def add_projections(sub: Any) -> None:
    """`projections rebuild`."""
    proj = sub.add_parser("projections", help="the read models folded from the log")
    proj_sub = proj.add_subparsers(metavar="ACTION")
    rebuild = proj_sub.add_parser("rebuild", help="empty every projection and replay the log")
    rebuild.set_defaults(run=projections_rebuild)


def add_schema(sub: Any) -> None:
    """`schema export`."""
    schema = sub.add_parser("schema", help="the wire contract as JSON Schema")
    schema_sub = schema.add_subparsers(metavar="ACTION")
    schema_export_parser = schema_sub.add_parser(
        "export", help="write the contract's JSON Schema files (schema/json/*.schema.json)"
    )
    # Relative to where it runs: the repository's root regenerates the committed files, and an
    # installed package is never written into (its SCHEMA_DIR is inside site-packages).
    schema_export_parser.add_argument(
        "--dir",
        type=Path,
        default=Path("schema") / "json",
        metavar="DIR",
        help="where the files go; default ./schema/json",
    )
    schema_export_parser.set_defaults(run=schema_export)
