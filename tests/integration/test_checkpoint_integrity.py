"""The checkpointer signs only what the log holds, and stands behind no stored row it did not sign
over the log (adapters/postgres/checkpoints.py).

- A tail the log lost (a failover to a standby without the last commits) and written anew at
  the same versions is not signed with the leaves the checkpointer read before.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest
import pytest_asyncio
from store_contract import T0, pending

from trellis.adapters.postgres.checkpoints import PostgresAuditTrail
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.checkpoints import Signer, open_checkpoint
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import ConsistencyQuery
from trellis.engine.core.merkle import MerkleTree, leaf_hash
from trellis.engine.core.records import RecordedEvent
from trellis.engine.core.results import ConsistencyResult

DOMAIN = "hall-1"
FORGED_ROOT = "A" * 43 + "="


@pytest_asyncio.fixture
async def store(database_url: str, pg_schema: str) -> AsyncIterator[PostgresEventStore]:
    log = await PostgresEventStore.open(database_url, schema=pg_schema)
    yield log
    await log.close()


@pytest_asyncio.fixture
async def owner(owner_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    yield conn
    await conn.close()


class Published(list[tuple[str, int, str]]):
    async def __call__(self, domain: str, size: int, note: str) -> None:
        self.append((domain, size, note))


def trail_of(
    store: PostgresEventStore, signer: Signer, published: Published, every: int = 1000
) -> PostgresAuditTrail:
    return PostgresAuditTrail(store._pool, signer, every=every, publish=published)


async def grown_to(store: PostgresEventStore, version: int, hours: int = 0) -> list[RecordedEvent]:
    """The domain's log, `version` events long: events appended after its head."""
    head = await store.head(DOMAIN)
    batch = pending(version - head.version, at=T0 + timedelta(hours=hours))
    await store.append(DOMAIN, head, batch, [])
    return [e async for e in store.read(DOMAIN)]


def root_of(log: list[RecordedEvent], size: int) -> str:
    tree = MerkleTree(leaf_hash(bytes.fromhex(e.hash)) for e in log[:size])
    return base64.b64encode(tree.root()).decode()


async def lose_tail(owner: asyncpg.Connection, keep: int) -> None:
    """What a promoted standby that lacks the last commits holds: the log up to `keep`."""
    async with owner.transaction():
        await owner.execute("ALTER TABLE trellis_events DISABLE TRIGGER USER")
        await owner.execute("ALTER TABLE trellis_streams DISABLE TRIGGER USER")
        await owner.execute(
            "DELETE FROM trellis_events WHERE domain = $1 AND version > $2", DOMAIN, keep
        )
        await owner.execute(
            "UPDATE trellis_streams s SET version = e.version, position = e.position, "
            "hash = e.hash FROM trellis_events e "
            "WHERE s.domain = $1 AND e.domain = $1 AND e.version = $2",
            DOMAIN, keep,
        )  # fmt: skip
        await owner.execute("ALTER TABLE trellis_events ENABLE TRIGGER USER")
        await owner.execute("ALTER TABLE trellis_streams ENABLE TRIGGER USER")


async def test_a_tail_lost_and_written_anew_is_signed_as_the_log_holds_it(
    store: PostgresEventStore, owner: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: checkpoints of 10 and 17 events, then the log loses 16 and 17 in a failover and
    # the writer writes 16 to 19 anew.
    signer, published = Signer.generate(), Published()
    trail = trail_of(store, signer, published)
    await grown_to(store, 17)
    await trail.checkpoint(DOMAIN, 10)
    await trail.checkpoint(DOMAIN, 17)
    await lose_tail(owner, keep=15)
    log = await grown_to(store, 19, hours=1)

    # When: the checkpoint of 19 is asked for.
    with caplog.at_level(logging.WARNING, logger="trellis.checkpoints"):
        signed = await trail.checkpoint(DOMAIN, 19)

    # Then: it signs the log's 19 events, not the 17 it read before with two new ones.
    assert signed.root == root_of(log, 19)
    assert open_checkpoint(signed.note, signer.verifier).root == base64.b64decode(root_of(log, 19))
    assert published[-1] == (DOMAIN, 19, signed.note)
    assert "no longer holds the 17 events" in caplog.text
    # Proofs come from the log as it is too; the lost 17 has no checkpoint of this log.
    proof = await trail.answer(DOMAIN, ConsistencyQuery(from_size=10, to_size=19), head=19)
    assert isinstance(proof, ConsistencyResult)
    assert (proof.from_root, proof.to_root) == (root_of(log, 10), root_of(log, 19))
    # A tree that only lost its tail (nothing written anew yet) is read again as well.
    await lose_tail(owner, keep=18)
    with pytest.raises(IntentRejected) as short:
        await trail.answer(DOMAIN, ConsistencyQuery(from_size=10, to_size=19), head=19)
    assert short.value.code == "unavailable"
    assert (await trail.checkpoint(DOMAIN, 18)).root == root_of(log, 18)
