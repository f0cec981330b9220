"""An engine served over real NATS and Postgres inside the test's own schema and subjects."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec

from adapters.bootstrap import connect_nats
from adapters.client import TrellisClient
from adapters.clock import SystemClock
from adapters.nats_intake import NatsIntake
from adapters.postgres_store import PostgresEventStore
from engine.service import Engine


class Harness(msgspec.Struct, kw_only=True):
    engine: Engine
    store: PostgresEventStore
    client: TrellisClient


@contextlib.asynccontextmanager
async def serving(
    nats_url: str, database_url: str, schema: str, prefix: str, **engine_kwargs: object
) -> AsyncIterator[Harness]:
    """Run an engine until the context exits; `client` talks to it as any client would."""
    store = await PostgresEventStore.open(database_url, schema=schema)
    engine = Engine(store, SystemClock(), **engine_kwargs)  # type: ignore[arg-type]
    await engine.start()
    server_nc = await connect_nats(nats_url, name="test-engine")
    intake = NatsIntake(server_nc, engine, prefix=prefix)
    await intake.start()
    client_nc = await connect_nats(nats_url, name="test-client")
    try:
        yield Harness(engine=engine, store=store, client=TrellisClient(client_nc, prefix=prefix))
    finally:
        await client_nc.close()
        await intake.stop()
        await server_nc.close()
        await engine.close()
        await store.close()
