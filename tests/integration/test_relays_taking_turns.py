"""Relays of several engines take turns on a domain's checkpoint: one that is behind the
checkpoint another moved must leave the bucket as that one put it.

Every engine's follower process relays every domain. A relay whose cached checkpoint is
behind the stored one publishes nothing twice; it must not put its older values either: they
rolled up the newer relay's final value and delete marker, and a released composition's key
was live again for good (`trellis verify`: "in the bucket but not in the log").
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric
from harness import Harness, bucket_values, serving, without_positions
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import bucket_name, stream_name
from trellis.adapters.nats.relay import RelaySink
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.records import RecordedEvent
from trellis.engine.service.follower import Follower

HALL = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    conn = await connect_nats(nats_url, name="test-relays")
    yield conn
    await conn.close()


async def released_composition(h: Harness) -> tuple[str, list[RecordedEvent]]:
    """Given: an import the engine's relay put, then a composition made and released that no
    relay has seen yet. Its id, and the domain's log."""
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await h.relayed(HALL)
    own = h.followers.of("relay", HALL)
    assert own is not None
    await own.stop()
    composed = expect_ok(
        await h.client.intent(
            HALL, "acme", "compose", {"host": "host-01", "devices": [{"kind": "gpu"}]}
        )
    )
    cid = composed["composition_id"]
    expect_ok(await h.client.intent(HALL, "acme", "release", {"composition_id": cid}))
    return cid, [r async for r in h.store.read(HALL)]


def before_release(log: list[RecordedEvent]) -> list[RecordedEvent]:
    """The log up to the release: the composition live, its GPU held."""
    released = next(i for i, r in enumerate(log) if r.type == "CompositionReleased")
    return log[:released]


async def relay_all(pool: asyncpg.Pool, nc: NATS, prefix: str) -> RelaySink:
    """A relay that relays the whole log, as another engine's would."""
    ahead = RelaySink(pool, nc, prefix=prefix)
    await ahead.prepare()
    await Follower(HALL, PostgresEventStore(pool), ahead).catch_up()
    return ahead


async def test_a_relay_behind_the_checkpoint_puts_no_older_values(
    h: Harness, nc: NATS, pool: asyncpg.Pool, subject_prefix: str
) -> None:
    cid, log = await released_composition(h)
    behind = RelaySink(pool, nc, prefix=subject_prefix)
    await behind.prepare()
    await behind.resume(HALL)  # its checkpoint: the import
    await relay_all(pool, nc, subject_prefix)  # meanwhile another relay takes the lot
    js = nc.jetstream()
    bucket = await bucket_values(js, subject_prefix)
    key = f"{HALL}.composition.{cid}"
    assert key not in bucket  # released: deleted

    done = await behind.apply(HALL, before_release(log))

    assert done.version == log[-1].version  # the stored checkpoint, past this whole batch
    assert await bucket_values(js, subject_prefix) == bucket


async def test_a_relay_behind_the_checkpoint_refills_a_bucket_it_made_only_once_caught_up(
    h: Harness, nc: NATS, pool: asyncpg.Pool, subject_prefix: str
) -> None:
    """The bucket removed and made again by the relay that is behind: its fold must reach
    the checkpoint before it puts every key, on a batch or on a quiet moment."""
    cid, log = await released_composition(h)
    behind = RelaySink(pool, nc, prefix=subject_prefix)
    await behind.prepare()
    await behind.resume(HALL)
    await relay_all(pool, nc, subject_prefix)
    js: JetStreamContext = nc.jetstream()
    bucket = await bucket_values(js, subject_prefix)
    await js.delete_key_value(bucket_name(subject_prefix))
    await behind.prepare()  # makes it again: every domain's keys are to be put in full
    key = f"{HALL}.composition.{cid}"

    earlier = before_release(log)
    await behind.apply(HALL, earlier)
    await behind.refresh(HALL)
    assert key not in await bucket_values(js, subject_prefix)

    await behind.apply(HALL, log[len(earlier) :])  # nothing of it left to relay...
    await behind.refresh(HALL)  # ...so the next quiet moment puts the keys
    refilled = await bucket_values(js, subject_prefix)
    assert without_positions(refilled) == without_positions(bucket)


async def test_a_relay_that_finds_a_bucket_another_made_again_refills_the_domain(
    h: Harness, nc: NATS, pool: asyncpg.Pool, subject_prefix: str
) -> None:
    """TRELLIS_FOLLOWERS=process after the JetStream store was lost: the engine's own relay
    makes the bucket again at its start, and the follower process's relay, which finds it
    made, must still put every key of a domain it had followed."""
    await released_composition(h)
    await relay_all(pool, nc, subject_prefix)
    js: JetStreamContext = nc.jetstream()
    bucket = await bucket_values(js, subject_prefix)
    await js.delete_key_value(bucket_name(subject_prefix))
    await RelaySink(pool, nc, prefix=subject_prefix).prepare()  # the engine's: made again

    follower = RelaySink(pool, nc, prefix=subject_prefix)  # the follower process's
    await follower.prepare()  # finds it made
    await Follower(HALL, PostgresEventStore(pool), follower).catch_up()
    await follower.refresh(HALL)

    assert without_positions(await bucket_values(js, subject_prefix)) == without_positions(bucket)


async def test_a_lost_stream_is_filled_again_from_the_log_once_the_checkpoint_is_reset(
    h: Harness,
    nc: NATS,
    pool: asyncpg.Pool,
    subject_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/deployment.md: a stream made again holds only later events, until the operator
    puts the relay's checkpoints back to 0; then every event is published again, in order."""
    _, log = await released_composition(h)
    await relay_all(pool, nc, subject_prefix)
    js: JetStreamContext = nc.jetstream()
    # Emptied from the front (as its age and size limits do a quiet domain's events, or an
    # operator's purge): no loss to speak of (the second re-check: said at every start).
    await js.purge_stream(stream_name(subject_prefix))
    with caplog.at_level(logging.WARNING, logger="trellis.relay"):
        await relay_all(pool, nc, subject_prefix)
    assert "holds none of the domain" not in caplog.text
    await js.delete_stream(stream_name(subject_prefix))
    # Made again empty, it lacks what the relay published: said once, with the way back (the
    # day-2 probe restored a log onto a fresh data dir and was told nothing).
    with caplog.at_level(logging.WARNING, logger="trellis.relay"):
        again = await relay_all(pool, nc, subject_prefix)
        await Follower(HALL, PostgresEventStore(pool), again).catch_up()  # not said twice
    said = [r.getMessage() for r in caplog.records if "holds none of the domain" in r.getMessage()]
    assert len(said) == 1 and "checkpoints back to 0" in said[0], said
    await pool.execute(
        "UPDATE trellis_follower_checkpoints SET version = 0, position = 0"
        " WHERE follower LIKE 'relay:%'"
    )
    await relay_all(pool, nc, subject_prefix)  # makes the stream again, and fills it

    info = await js.stream_info(stream_name(subject_prefix))
    assert info.state.messages == len(log)
    consumer = await js.pull_subscribe(f"{subject_prefix}.events.{HALL}.>", durable=None)
    messages = await consumer.fetch(len(log), timeout=5)
    versions = [msgspec.json.decode(m.data)["version"] for m in messages]
    assert versions == [r.version for r in log]
