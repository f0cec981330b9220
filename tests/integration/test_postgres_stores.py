"""The PostgreSQL adapters of the storage ports against the ports' contract
(tests/store_contract.py), the same suite the in-memory doubles pass; the log's own guarantees
beyond it (append-only, content checks, privileges) are in test_log_integrity.py and its
neighbours."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest_asyncio
from store_contract import EventStoreContract, LeaseStoreContract, SnapshotStoreContract, Stores

from trellis.adapters.bootstrap import follower_sinks
from trellis.adapters.postgres.leases import PostgresLeases
from trellis.adapters.postgres.snapshots import PostgresSnapshots
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.engine.core.checkpoints import Signer


@pytest_asyncio.fixture
async def stores(database_url: str, pg_schema: str) -> AsyncIterator[Stores]:
    log = await PostgresEventStore.open(database_url, schema=pg_schema)
    pool = await connect_pool(database_url, schema=pg_schema)
    yield Stores(
        log=log, leases=PostgresLeases(pool), snapshots=PostgresSnapshots(pool, Signer.generate())
    )
    await pool.close()
    await log.close()


class TestPostgresEventStore(EventStoreContract):
    pass


class TestPostgresLeaseStore(LeaseStoreContract):
    pass


class TestPostgresSnapshotStore(SnapshotStoreContract):
    pass


async def test_the_log_commits_to_disk_and_the_followers_pools_do_not_wait_for_it(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    """An append is acknowledged only once it is on disk; what the followers write is rebuilt
    from the log, so their commits do not take a turn in its flushes (bootstrap.py)."""
    log = await PostgresEventStore.open(database_url, schema=pg_schema)
    try:
        async with log._pool.acquire() as conn:
            assert await conn.fetchval("SHOW synchronous_commit") == "on"
    finally:
        await log.close()
    async with contextlib.AsyncExitStack() as stack:
        sinks = await follower_sinks(
            stack,
            nats_url,
            database_url,
            schema=pg_schema,
            prefix=subject_prefix,
            stream_limits=None,
            secure=None,
            signer=None,
            checkpoint_every=1000,
            snapshot_every=0,
        )
        for pool in (sinks.projections.pool, sinks.relay.pool):
            assert await pool.fetchval("SHOW synchronous_commit") == "off"
