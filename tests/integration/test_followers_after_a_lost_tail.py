"""The log's followers after the log lost its tail and was written on (docs/deployment.md §3).

A failover to a standby without the last commits: the followers, which read the primary, had
followed events the log no longer holds, and the writer writes other events at those versions
(at later positions). The followers' checkpoints name version and position: a follower finds
the event its checkpoint names gone, says so, and starts the domain again from the log as it
stands. The read models answer the replacement events, the bucket holds what the log holds,
and the stream carries the replacements after what it had relayed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric
from harness import Harness, bucket_values, serving, without_positions
from lost_tail import lose_tail
from nats.aio.client import Client as NATS

from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import stream_name
from trellis.adapters.nats.kv_state import View, everything, fold
from trellis.engine.core.records import RecordedEvent

HALL = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    # Quiet followers look at their checkpoints every 0.2 s, not every 5.
    quick = {"poll_interval": 0.2}
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, follow_options=quick
    ) as harness:
        yield harness


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    conn = await connect_nats(nats_url, name="test-lost-tail")
    yield conn
    await conn.close()


async def settled(h: Harness) -> list[RecordedEvent]:
    """Until the sagas are done and the followers hold the whole log; the log."""
    await h.fabric_idle(HALL)
    await h.projected(HALL)
    await h.relayed(HALL)
    return [r async for r in h.store.read(HALL)]


def bucket_of(log: list[RecordedEvent]) -> dict[str, Any]:
    """What the bucket holds for a log: every live key of its fold."""
    view = View.empty(HALL)
    for record in log:
        view = fold(view, record.event(), record.recorded_at, record.position)
    return without_positions(
        {key: value for key, value in everything(view, 0) if value is not None}
    )


async def streamed(nc: NATS, prefix: str) -> list[str]:
    """The ids of the events in the stream, in its order."""
    js = nc.jetstream()
    stored = (await js.stream_info(stream_name(prefix))).state.messages
    sub = await js.subscribe(f"{prefix}.events.>", ordered_consumer=True)
    try:
        return [(await sub.next_msg(timeout=5)).headers["Nats-Msg-Id"] for _ in range(stored)]
    finally:
        await sub.unsubscribe()


async def compose(h: Harness, tenant: str, device: dict[str, Any]) -> str:
    body = {"host": "host-01", "devices": [device]}
    cid: str = expect_ok(await h.client.intent(HALL, tenant, "compose", body))["composition_id"]
    return cid


async def test_followers_start_a_domain_again_when_the_log_lost_what_they_followed(
    h: Harness,
    nc: NATS,
    owner_url: str,
    pg_schema: str,
    subject_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    kept = len(await settled(h))
    lost = await compose(h, "globex", {"kind": "nic"})
    followed = await settled(h)  # the read models, the stream and the bucket have it
    await lose_tail(owner_url, pg_schema, HALL, kept)

    caplog.set_level(logging.WARNING)
    replacement = await compose(h, "acme", {"kind": "gpu"})  # written at the lost versions...
    second = await compose(h, "acme", {"kind": "memory", "capacity_gib": 256})  # ...and past them
    log = await settled(h)

    assert len(log) > len(followed)  # the log went past the versions the followers had seen
    assert [r.position for r in log[kept:]] > [r.position for r in followed[kept:]]
    composed = expect_ok(await h.client.query(HALL, "composition", {"id": replacement}))
    assert composed["tenant"] == "acme"
    assert not (await h.client.query(HALL, "composition", {"id": lost}))["ok"]
    connections = expect_ok(await h.client.query(HALL, "connections", {}))
    assert {c["composition_id"] for c in connections["connections"]} == {replacement, second}
    bucket = await bucket_values(nc.jetstream(), subject_prefix)
    assert without_positions(bucket) == bucket_of(log)
    # What was relayed stays in the stream; the replacements follow it.
    assert await streamed(nc, subject_prefix) == [r.id for r in followed + log[kept:]]
    for sink in ("projections", "relay"):
        said = f"{sink} of domain {HALL}: the log no longer holds version {len(followed)}"
        assert any(said in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


async def test_quiet_followers_notice_a_tail_written_again_no_further_than_they_had_followed(
    h: Harness, nc: NATS, owner_url: str, pg_schema: str, subject_prefix: str
) -> None:
    """No event past the versions they had followed comes to show them: they look on their
    quiet polls."""
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    kept = len(await settled(h))
    await compose(h, "globex", {"kind": "nic"})
    followed = await settled(h)
    await lose_tail(owner_url, pg_schema, HALL, kept)

    replacement = await compose(h, "acme", {"kind": "nic"})  # as many events as the lost
    log = await settled(h)

    assert len(log) == len(followed)
    connections = expect_ok(await h.client.query(HALL, "connections", {}))
    assert {c["composition_id"] for c in connections["connections"]} == {replacement}
    bucket = await bucket_values(nc.jetstream(), subject_prefix)
    assert without_positions(bucket) == bucket_of(log)


async def test_a_relay_whose_checkpoint_went_back_with_the_log_publishes_the_replacements(
    h: Harness, nc: NATS, owner_url: str, pg_schema: str, subject_prefix: str
) -> None:
    """Its checkpoint names an event the log holds; the stream's last event is one it lost."""
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    kept = len(await settled(h))
    await compose(h, "globex", {"kind": "nic"})
    followed = await settled(h)
    await lose_tail(owner_url, pg_schema, HALL, kept, relay_checkpoint=True)

    await compose(h, "acme", {"kind": "gpu"})
    log = await settled(h)

    assert await streamed(nc, subject_prefix) == [r.id for r in followed + log[kept:]]
    bucket = await bucket_values(nc.jetstream(), subject_prefix)
    assert without_positions(bucket) == bucket_of(log)


async def test_a_relay_on_a_restored_log_publishes_every_event_written_since(
    h: Harness, nc: NATS, owner_url: str, pg_schema: str, subject_prefix: str
) -> None:
    """A log restored from a backup, the stream kept: the new events take the positions the
    stream's lost ones had, so positions cannot tell what the two share; hashes can."""
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    kept = len(await settled(h))
    await compose(h, "globex", {"kind": "nic"})
    await compose(h, "globex", {"kind": "gpu"})
    followed = await settled(h)
    await lose_tail(owner_url, pg_schema, HALL, kept, relay_checkpoint=True, reuse_positions=True)

    await compose(h, "acme", {"kind": "gpu"})
    log = await settled(h)
    assert log[-1].position <= followed[-1].position  # positions the stream's lost events have

    # A follower's progress is a position, which the relay passed long ago: wait on the stream.
    wanted = [r.id for r in followed + log[kept:]]
    for _ in range(100):
        if await streamed(nc, subject_prefix) == wanted:
            break
        await asyncio.sleep(0.1)
    assert await streamed(nc, subject_prefix) == wanted
    bucket = await bucket_values(nc.jetstream(), subject_prefix)
    assert without_positions(bucket) == bucket_of(log)
