"""The event relay against real JetStream: the stream carries the log, the bucket the state.

Schedulers are written against these (ARCHITECTURE §3, §6): a consumer on
`<prefix>.events.>` gets exactly the log's events, in position order, with the event ids as
message ids, and nothing twice across restarts; a KV watch sees compositions come and go and
devices change hands, with values equal to what the engine's own state says.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric, fetch
from harness import Harness, serving
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from adapters.bootstrap import connect_nats
from adapters.nats.jetstream import (
    Envelope,
    StreamConfigError,
    StreamLimits,
    bucket_name,
    ensure_stream,
    stream_name,
)
from adapters.nats.kv_state import composition_entry, device_entry, host_entry
from adapters.nats.relay import EventRelay, RelayStalled
from engine.records import PendingEvent, RecordedEvent, verify_chain

HALL = "hall-1"


# ---- fixtures and helpers ----


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A connection of the test's own, as a scheduler would have."""
    conn = await connect_nats(nats_url, name="test-scheduler")
    yield conn
    await conn.close()


class Played(msgspec.Struct, kw_only=True):
    acme: str  # released
    globex: str  # impaired by the fault on its memory pool
    acme_gpu: str
    last: int


async def play(h: Harness) -> Played:
    """Given: an import, two compositions, a release and a fault.

    Each step waits until the relay has caught up with it, so a watcher sees every step (the
    relay puts only the latest value of a key per batch, and a batch may span several steps).
    """
    client = h.client
    expect_ok(await client.admin(HALL, "import-topology", fabric()))
    await relayed(h)
    acme = expect_ok(
        await client.intent(
            HALL, "acme", "compose", {"host": "host-01", "devices": [{"kind": "gpu"}]}
        )
    )
    await relayed(h)
    globex = expect_ok(
        await client.intent(
            HALL,
            "globex",
            "compose",
            {"host": "host-01", "devices": [{"kind": "memory", "capacity_gib": 256}]},
        )
    )
    await relayed(h)
    expect_ok(
        await client.intent(HALL, "acme", "release", {"composition_id": acme["composition_id"]})
    )
    await relayed(h)
    fault = await client.admin(
        HALL, "report-fault", {"component": "mem-01", "state": "degraded", "detail": "ecc"}
    )
    expect_ok(fault)
    return Played(
        acme=acme["composition_id"],
        globex=globex["composition_id"],
        acme_gpu=acme["devices"][0]["id"],
        last=await relayed(h),
    )


async def relayed(h: Harness) -> int:
    """Wait until the stream and the bucket hold everything in the log; its last position."""
    head = (await h.store.head(HALL)).position
    assert await h.relay.wait_for(head)
    return head


async def the_log(h: Harness) -> list[RecordedEvent]:
    return [record async for record in h.store.read_all()]


async def consume(js: JetStreamContext, prefix: str, count: int) -> list[Any]:
    """Every message a fresh consumer on `<prefix>.events.>` gets, expecting `count`."""
    sub = await js.subscribe(f"{prefix}.events.>", ordered_consumer=True)
    try:
        return [await sub.next_msg(timeout=5) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def stored_count(js: JetStreamContext, prefix: str) -> int:
    info = await js.stream_info(stream_name(prefix))
    return int(info.state.messages)


async def watched(watcher: Any, until: Any) -> list[Any]:
    """KV entries as the watcher delivers them, until one satisfies `until` (or 5 s pass)."""
    entries: list[Any] = []
    deadline = asyncio.get_running_loop().time() + 5
    while asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(TimeoutError):
            entry = await watcher.updates(timeout=0.5)
            if entry is None:  # the marker after the initial values
                continue
            entries.append(entry)
            if until(entry):
                return entries
    raise AssertionError(f"the watcher never saw the end; it saw {[e.key for e in entries]}")


def recorded(body: bytes) -> RecordedEvent:
    """A stream message's body read back as the log's record."""
    envelope = msgspec.json.decode(body, type=Envelope)
    fields = msgspec.structs.asdict(envelope)
    fields["recorded_at"] = datetime.fromisoformat(envelope.recorded_at)
    fields["data"] = bytes(envelope.data)
    return RecordedEvent(**fields)


def value(entry: Any) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.json.decode(entry.value)
    return decoded


async def burst(h: Harness, toggles: int = 20) -> None:
    """Many commits at once: every node of the hall drained and undrained `toggles` times, all
    nodes concurrently (one event per intent, 2 x toggles x 8 nodes of them)."""

    async def toggle(node: str) -> None:
        for _ in range(toggles):
            expect_ok(await h.client.admin(HALL, "drain", {"id": node}))
            expect_ok(await h.client.admin(HALL, "undrain", {"id": node}))

    async with asyncio.TaskGroup() as group:
        for node in fabric()["nodes"]:
            group.create_task(toggle(node["id"]))


async def backlog(h: Harness) -> list[RecordedEvent]:
    """Given: a log of a few hundred events that the harness's relay has not published."""
    await h.relay.stop()
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await burst(h)
    log = await the_log(h)
    assert len(log) > 300
    return log


async def assert_stream_is_the_log(js: JetStreamContext, prefix: str, log: list[Any]) -> None:
    """The stream holds exactly the log's events, in position order, each once."""
    assert await stored_count(js, prefix) == len(log)
    messages = await consume(js, prefix, len(log))
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [r.id for r in log]
    assert [recorded(m.data).position for m in messages] == [r.position for r in log]


class Faulty:
    """A JetStream context whose `nth` publish_async goes wrong, once, as `how` says:
    - "raise": it raises before sending (a connection error, say);
    - "lost": it is never sent and never acknowledged;
    - "ack lost": it is stored, but its PubAck never arrives;
    - "refused": it is sent expecting another last sequence, so the stream refuses it;
    - "hang": it never returns (a relay that dies here); `hung` is set when it is reached.
    """

    def __init__(self, js: JetStreamContext, nth: int, how: str):
        self._js, self._nth, self._how = js, nth, how
        self.calls = 0
        self.hung = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish_async(self, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls != self._nth:
            return await self._js.publish_async(subject, payload, **kwargs)
        never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        match self._how:
            case "raise":
                raise ConnectionResetError("injected: the publish never left")
            case "lost":
                return never
            case "ack lost":
                await self._js.publish_async(subject, payload, **kwargs)
                return never
            case "refused":
                headers = dict(kwargs.pop("headers"))
                expected = int(headers["Nats-Expected-Last-Sequence"])
                headers["Nats-Expected-Last-Sequence"] = str(expected + 1000)
                return await self._js.publish_async(subject, payload, headers=headers, **kwargs)
            case "hang":
                self.hung.set()
                await never
        raise AssertionError(self._how)


async def relay_on(
    js: Any, database_url: str, pg_schema: str, subject_prefix: str, **kwargs: Any
) -> EventRelay:
    """Another relay of the same stream and checkpoint, with small windows and batches so a
    backlog of a few hundred events spans several of each."""
    kwargs = {"window": 16, "batch_size": 100, "publish_timeout": 0.5, **kwargs}
    return await EventRelay.open(
        database_url, cast(JetStreamContext, js), schema=pg_schema, prefix=subject_prefix, **kwargs
    )


# ---- the stream ----


async def test_a_consumer_gets_every_event_of_the_log_in_position_order_keyed_by_event_id(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    played = await play(h)
    assert await h.relay.wait_for(played.last)

    log = await the_log(h)
    messages = await consume(nc.jetstream(), subject_prefix, len(log))

    assert await stored_count(nc.jetstream(), subject_prefix) == len(log)
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [r.id for r in log]
    assert [m.subject for m in messages] == [
        f"{subject_prefix}.events.{r.domain}.{r.type}" for r in log
    ]
    bodies = [recorded(m.data) for m in messages]
    assert bodies == log  # every §6 field, `data` byte for byte
    assert verify_chain(bodies) is None  # so a consumer can check the hash chain itself
    assert {"CompositionActivated", "CompositionReleased", "ComponentFaulted"} <= {
        r.type for r in log
    }


async def test_a_restart_publishes_nothing_twice_even_when_the_checkpoint_was_lost(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, nc: NATS
) -> None:
    js = nc.jetstream()
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        await play(h)
        await h.relay.stop()  # so only the exit can publish what comes next
        expect_ok(await h.client.admin(HALL, "drain", {"id": "nvme-01"}))
        events = len(await the_log(h))
    # A clean exit publishes what the engine committed last.
    assert await stored_count(js, subject_prefix) == events

    # A plain restart resumes at the checkpoint.
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        assert await h.relay.catch_up() == 0
        assert h.relay.duplicates == 0
    assert await stored_count(js, subject_prefix) == events

    # A relay that died after publishing, before its checkpoint (here: all of it), finds how
    # far the stream goes and publishes only what is new.
    await fetch(database_url, pg_schema, "UPDATE trellis_relay_checkpoints SET position = 0")
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        reply = await h.client.admin(HALL, "drain", {"id": "nic-01"})
        expect_ok(reply)
        assert await h.relay.wait_for(reply["position"])
        assert h.relay.duplicates == 0  # not even sent: the stream's tail said it had them
        log = await the_log(h)
    assert len(log) == events + 1
    assert await stored_count(js, subject_prefix) == len(log)
    messages = await consume(js, subject_prefix, len(log))
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [r.id for r in log]


async def test_a_burst_of_commits_reaches_the_stream_in_log_order_each_once(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    await play(h)
    await burst(h)

    await relayed(h)
    log = await the_log(h)
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)
    assert h.relay.duplicates == h.relay.resyncs == 0


async def test_a_backlog_is_published_in_full_windows_in_log_order_each_once(
    h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    relay = await relay_on(nc.jetstream(), database_url, pg_schema, subject_prefix)
    try:
        assert await relay.catch_up() == len(log)
        assert relay.position == log[-1].position
        assert relay.duplicates == relay.resyncs == 0
    finally:
        await relay.close(drain_timeout=0)
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


@pytest.mark.parametrize("how", ["lost", "ack lost", "refused"])
async def test_a_publish_failing_mid_window_is_resynced_without_reordering_or_duplicates(
    how: str, h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    faulty = Faulty(nc.jetstream(), nth=140, how=how)  # the 12th of 16 in the 9th window
    relay = await relay_on(faulty, database_url, pg_schema, subject_prefix)
    try:
        await relay.catch_up()
        assert faulty.calls > 140
        assert relay.resyncs >= 1
        assert relay.duplicates == 0
        assert relay.position == log[-1].position
    finally:
        await relay.close(drain_timeout=0)
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


async def test_a_publish_raising_mid_window_fails_the_batch_and_the_next_attempt_finishes(
    h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    faulty = Faulty(nc.jetstream(), nth=140, how="raise")
    relay = await relay_on(faulty, database_url, pg_schema, subject_prefix)
    try:
        with pytest.raises(ConnectionResetError):
            await relay.catch_up()
        assert relay.position == log[99].position  # the batch before the failing one is in
        await relay.catch_up()
        assert relay.duplicates == 0
        assert relay.position == log[-1].position
    finally:
        await relay.close(drain_timeout=0)
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


async def test_a_relay_dying_mid_window_leaves_its_successor_nothing_to_publish_twice(
    h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    faulty = Faulty(nc.jetstream(), nth=140, how="hang")
    dying = await relay_on(faulty, database_url, pg_schema, subject_prefix)
    task = asyncio.create_task(dying.catch_up())
    await asyncio.wait_for(faulty.hung.wait(), 10)
    task.cancel()  # 11 publishes of its window in flight, its batch not checkpointed
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await dying.close(drain_timeout=0)
    assert dying.position == log[99].position
    # What it sent before dying is on the wire; a successor starting sooner would send some of
    # it again, for the stream to drop as duplicates (or to refuse: the expected sequence).
    deadline = asyncio.get_running_loop().time() + 5
    while await stored_count(nc.jetstream(), subject_prefix) < 139:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)

    successor = await relay_on(nc.jetstream(), database_url, pg_schema, subject_prefix)
    try:
        published = await successor.catch_up()
        assert published == len(log) - 139  # what the dying relay had not sent
        assert successor.duplicates == 0
    finally:
        await successor.close(drain_timeout=0)
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


async def test_two_engines_relaying_one_log_publish_each_event_once(
    h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    other = await EventRelay.open(
        database_url, nc.jetstream(), schema=pg_schema, prefix=subject_prefix
    )
    await other.start()
    try:
        played = await play(h)
        assert await h.relay.wait_for(played.last)
        assert await other.wait_for(played.last)
        # They took turns on the checkpoint: neither sent what the other had published.
        assert h.relay.duplicates == other.duplicates == 0
    finally:
        await other.close()

    assert await stored_count(nc.jetstream(), subject_prefix) == len(await the_log(h))


async def test_an_undecodable_event_stalls_the_relay_after_everything_before_it(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    await play(h)
    await h.relay.stop()  # the test drives it
    expect_ok(await h.client.admin(HALL, "drain", {"id": "nic-01"}))
    head = await h.store.head(HALL)
    future = PendingEvent(
        id="00000000-0000-4000-8000-000000000001",
        type="EventFromTheFuture",
        schema_version=1,
        actor="operator",
        causation_id="r-future",
        correlation_id="r-future",
        recorded_at=datetime(2026, 1, 1, tzinfo=UTC),
        data=b"{}",
    )
    appended = await h.store.append(HALL, head, [future], [])

    with pytest.raises(RelayStalled) as stalled:
        await h.relay.catch_up()

    assert stalled.value.position == appended.head.position
    assert h.relay.position == head.position  # the drain is out, checkpointed
    assert await stored_count(nc.jetstream(), subject_prefix) == len(await the_log(h)) - 1


# ---- the bucket ----


async def test_a_kv_watch_sees_a_composition_come_and_go_and_its_device_change_hands(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    kv: KeyValue = await nc.jetstream().key_value(bucket_name(subject_prefix))
    watcher = await kv.watchall()
    try:
        played = await play(h)
        composition = f"{HALL}.composition.{played.acme}"
        entries = await watched(watcher, lambda e: e.key == composition and e.operation == "DEL")
        pool = f"{HALL}.device.mem-01"
        entries += await watched(watcher, lambda e: e.key == pool and b"degraded" in e.value)
    finally:
        await watcher.stop()

    mine = [e for e in entries if e.key == composition]
    states = [value(e)["state"] for e in mine if e.operation is None]
    # "pending" is there too unless the fabric settled the compose before the relay looked.
    assert list(dict.fromkeys(states))[-2:] == ["active", "released"]
    assert mine[-1].operation == "DEL"  # then gone: the bucket holds live compositions

    gpu = f"{HALL}.device.{played.acme_gpu}"
    assert [value(e)["owner"] for e in entries if e.key == gpu] == [None, played.acme, None]

    host = [value(e)["compositions"] for e in entries if e.key == f"{HALL}.host.host-01"]
    both = sorted([played.acme, played.globex])
    assert host == [[], [played.acme], both, [played.globex]]

    faulted = value(entries[-1])
    assert faulted["health"] == "degraded" and faulted["free"] is False


async def test_the_bucket_holds_exactly_what_the_engine_believes(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    played = await play(h)
    assert await h.relay.wait_for(played.last)
    kv: KeyValue = await nc.jetstream().key_value(bucket_name(subject_prefix))

    stored = {}
    for key in await kv.keys():
        entry = await kv.get(key)
        stored[key] = {k: v for k, v in value(entry).items() if k != "position"}

    state = h.engine.state(HALL)
    assert state is not None
    expected: dict[str, Any] = {}
    for cid, c in state.compositions.items():
        expected[f"{HALL}.composition.{cid}"] = composition_entry(c, 0)
    for node_id, node in state.nodes.items():
        if node.spec.kind == "device":
            expected[f"{HALL}.device.{node_id}"] = device_entry(state, node, 0)
        elif node.spec.kind == "host":
            expected[f"{HALL}.host.{node_id}"] = host_entry(state, node, 0)
    as_stored = {
        k: {f: v for f, v in msgspec.to_builtins(e).items() if f != "position"}
        for k, e in expected.items()
    }
    assert stored == as_stored
    assert stored[f"{HALL}.composition.{played.globex}"]["state"] == "impaired"
    assert f"{HALL}.composition.{played.acme}" not in stored  # ended: deleted


# ---- the stream's configuration ----


async def test_the_stream_limits_are_set_at_every_start_and_a_foreign_stream_is_refused(
    nc: NATS, subject_prefix: str
) -> None:
    js = nc.jetstream()
    await ensure_stream(js, subject_prefix, StreamLimits())
    await ensure_stream(js, subject_prefix, StreamLimits(max_bytes=1 << 20, max_age_s=3600))

    config = (await js.stream_info(stream_name(subject_prefix))).config
    assert config.subjects == [f"{subject_prefix}.events.>"]
    assert (config.max_bytes, config.max_age) == (1 << 20, 3600)
    assert config.duplicate_window == 120 and config.storage == "file"

    # Two prefixes that sanitise to one name: the second must not take the first's stream over.
    first, second = f"{subject_prefix}_x", f"{subject_prefix}.x"
    assert stream_name(first) == stream_name(second)
    await ensure_stream(js, first, StreamLimits())
    try:
        with pytest.raises(StreamConfigError, match=r"another subject prefix"):
            await ensure_stream(js, second, StreamLimits())
    finally:
        await js.delete_stream(stream_name(first))
