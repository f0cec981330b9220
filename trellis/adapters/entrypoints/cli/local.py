"""Commands that work on local files or the database, without an engine:
`projections rebuild`, `schema export`."""

from __future__ import annotations

import argparse
import asyncio
import time

from trellis.adapters.endpoints import find_endpoint
from trellis.adapters.entrypoints.cli.errors import CliError
from trellis.adapters.nats.contract import contract_files
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.adapters.settings import Settings
from trellis.projections import rebuild


def projections_rebuild(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    url = find_endpoint(settings, "database_url")
    if url is None:
        raise CliError("no database: set TRELLIS_DATABASE_URL or start one with `trellis up`")

    async def go() -> tuple[int, float]:
        store = await PostgresEventStore.open(url, schema=settings.db_schema)
        pool = await connect_pool(url, schema=settings.db_schema, max_size=4)
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
