"""The PostgreSQL adapters of the storage ports against the ports' contract
(tests/store_contract.py), the same suite the in-memory doubles pass; the log's own guarantees
beyond it (append-only, content checks, privileges) are in test_log_integrity.py and its
neighbours."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from store_contract import EventStoreContract, LeaseStoreContract, SnapshotStoreContract, Stores

from trellis.adapters.postgres.leases import PostgresLeases
from trellis.adapters.postgres.snapshots import PostgresSnapshots
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool


@pytest_asyncio.fixture
async def stores(database_url: str, pg_schema: str) -> AsyncIterator[Stores]:
    log = await PostgresEventStore.open(database_url, schema=pg_schema)
    pool = await connect_pool(database_url, schema=pg_schema)
    yield Stores(log=log, leases=PostgresLeases(pool), snapshots=PostgresSnapshots(pool))
    await pool.close()
    await log.close()


class TestPostgresEventStore(EventStoreContract):
    pass


class TestPostgresLeaseStore(LeaseStoreContract):
    pass


class TestPostgresSnapshotStore(SnapshotStoreContract):
    pass
