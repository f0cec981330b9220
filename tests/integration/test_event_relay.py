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
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric, fetch
from harness import Harness, bucket_values, serving, undecodable_event
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import (
    Envelope,
    StreamConfigError,
    StreamLimits,
    bucket_name,
    ensure_bucket,
    ensure_stream,
    stream_name,
)
from trellis.adapters.nats.kv_state import (
    View,
    composition_entry,
    device_entry,
    fold,
    host_entry,
)
from trellis.adapters.nats.relay import RelayError, RelaySink
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.engine.core.records import RecordedEvent, verify_chain
from trellis.engine.service.follower import Follower, Stalled

HALL = "hall-1"
QUICK = {"poll_interval": 0.2, "max_backoff": 0.5}  # followers that notice things fast


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
            {
                "host": "host-01",
                "devices": [{"kind": "memory", "capacity_gib": 256}],
                "labels": {"job": "kv-cache"},
            },
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


async def relayed(h: Harness, timeout: float = 5.0) -> int:
    """Wait until the stream and the bucket hold everything in the log; its last position."""
    return await h.relayed(HALL, timeout)


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
    """Given: a log of a few hundred events that the harness's relay has not published.

    It published the import first, and is stopped idle: stopped in the middle of its batch,
    it could leave the import in the stream without its checkpoint, and the relays of the
    test would then count it as found in the stream."""
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await relayed(h)
    own = h.followers.of("relay", HALL)
    assert own is not None
    await own.stop()
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
    """A NATS connection whose `nth` atomic batch goes wrong, once, as `how` says:
    - "raise": a publish of the batch raises before sending (a connection error, say);
    - "lost": the batch's commit is never sent, so never acknowledged;
    - "ack lost": the batch is committed, but its acknowledgement never arrives;
    - "refused": the batch expects another last sequence, so the stream refuses it;
    - "hang": the commit never returns (a relay that dies here); `hung` is set then.
    """

    def __init__(self, nc: NATS, nth: int, how: str):
        self._nc, self._nth, self._how = nc, nth, how
        self.batches = 0
        self.hung = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nc, name)

    async def publish(self, subject: str, payload: bytes = b"", **kwargs: Any) -> None:
        headers = kwargs.get("headers") or {}
        if headers.get("Nats-Batch-Sequence") == "1":
            self.batches += 1
        if self.batches == self._nth:
            if self._how == "raise":
                raise ConnectionResetError("injected: the publish never left")
            if self._how == "refused" and "Nats-Expected-Last-Subject-Sequence" in headers:
                expected = int(headers["Nats-Expected-Last-Subject-Sequence"])
                headers = {**headers, "Nats-Expected-Last-Subject-Sequence": str(expected + 1000)}
                kwargs["headers"] = headers
        await self._nc.publish(subject, payload, **kwargs)

    async def request(self, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        headers = kwargs.get("headers") or {}
        if headers.get("Nats-Batch-Sequence") == "1":  # a batch of one event
            self.batches += 1
            if self.batches == self._nth and self._how == "refused":
                expected = int(headers["Nats-Expected-Last-Subject-Sequence"])
                kwargs["headers"] = {
                    **headers,
                    "Nats-Expected-Last-Subject-Sequence": str(expected + 1000),
                }
        if self.batches != self._nth or self._how == "refused":
            return await self._nc.request(subject, payload, **kwargs)
        timeout = kwargs.get("timeout", 1.0)
        match self._how:
            case "raise":
                raise ConnectionResetError("injected: the commit never left")
            case "lost":
                await asyncio.sleep(timeout)
            case "ack lost":
                await self._nc.publish(subject, payload, headers=kwargs.get("headers"))
                await asyncio.sleep(timeout)
            case "hang":
                self.hung.set()
                await asyncio.Event().wait()
        raise NatsTimeoutError


class Relay:
    """Another relay of the same stream and checkpoints: a RelaySink and a follower of HALL,
    with small batches so a backlog of a few hundred events spans several."""

    def __init__(self, pool: asyncpg.Pool, nc: Any, prefix: str, batch_size: int = 100):
        self.pool = pool
        # A short acknowledgement timeout keeps the lost-batch cases quick; long enough that a
        # loaded machine does not lose an acknowledgement of its own.
        self.sink = RelaySink(pool, nc, prefix=prefix, publish_timeout=2.0)
        self.follower = Follower(HALL, PostgresEventStore(pool), self.sink, batch_size=batch_size)

    @classmethod
    async def on(cls, nc: Any, database_url: str, schema: str, prefix: str, **kw: Any) -> Relay:
        pool = await connect_pool(database_url, schema=schema, max_size=2)
        relay = cls(pool, nc, prefix, **kw)
        await relay.sink.prepare()
        return relay

    async def catch_up(self, attempts: int = 1) -> int:
        """What the follower's background loop does: try, and on a failure try again."""
        for attempt in range(attempts):
            try:
                return await self.follower.catch_up()
            except RelayError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.follower.stop()
        await self.pool.close()


# ---- the stream ----


async def test_a_consumer_gets_every_event_of_the_log_in_position_order_keyed_by_event_id(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    await play(h)
    await relayed(h)

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
        own = h.followers.of("relay", HALL)
        assert own is not None
        await own.stop()  # so only the exit can publish what comes next
        expect_ok(await h.client.admin(HALL, "drain", {"id": "nvme-01"}))
        events = len(await the_log(h))
    # A clean exit publishes what the engine committed last.
    assert await stored_count(js, subject_prefix) == events

    # A plain restart resumes at the checkpoint.
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        await relayed(h)
        assert h.relay.duplicates == 0
    assert await stored_count(js, subject_prefix) == events

    # A relay that died after publishing, before its checkpoint (here: all of it), finds how
    # far the stream goes and publishes only what is new.
    await fetch(
        database_url,
        pg_schema,
        "UPDATE trellis_follower_checkpoints SET version = 0, position = 0 "
        "WHERE follower LIKE 'relay:%'",
    )
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        expect_ok(await h.client.admin(HALL, "drain", {"id": "nic-01"}))
        await relayed(h)
        assert h.relay.duplicates == events  # found in the stream, not sent again
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


async def test_a_backlog_is_published_in_full_batches_in_log_order_each_once(
    h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    relay = await Relay.on(nc, database_url, pg_schema, subject_prefix)
    try:
        assert await relay.catch_up() == len(log)
        assert relay.follower.position == log[-1].position
        assert relay.sink.duplicates == relay.sink.resyncs == 0
    finally:
        await relay.close()
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


@pytest.mark.parametrize("how", ["lost", "ack lost", "refused", "raise"])
async def test_a_batch_failing_is_done_again_without_reordering_or_duplicates(
    how: str, h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    faulty = Faulty(nc, nth=2, how=how)
    relay = await Relay.on(faulty, database_url, pg_schema, subject_prefix)
    try:
        if how == "refused":  # the stream moved: its end read again, in the same pass
            await relay.follower.catch_up()
            assert relay.sink.resyncs == 1
        else:
            with pytest.raises((RelayError, ConnectionResetError)):
                await relay.follower.catch_up()
            assert relay.follower.position == log[99].position  # the batch before it is in
        await relay.catch_up()
        assert faulty.batches > 2
        assert relay.follower.position == log[-1].position
        if how == "ack lost":  # committed, then found in the stream
            assert relay.sink.duplicates == 100
    finally:
        await relay.close()
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


async def test_a_relay_dying_mid_batch_leaves_its_successor_nothing_to_publish_twice(
    h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    faulty = Faulty(nc, nth=2, how="hang")
    dying = await Relay.on(faulty, database_url, pg_schema, subject_prefix)
    task = asyncio.create_task(dying.follower.catch_up())
    await asyncio.wait_for(faulty.hung.wait(), 10)
    task.cancel()  # its second batch sent but not committed, nothing of it checkpointed
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await dying.close()
    assert dying.follower.position == log[99].position
    assert await stored_count(nc.jetstream(), subject_prefix) == 100  # all or nothing

    successor = await Relay.on(nc, database_url, pg_schema, subject_prefix)
    try:
        assert await successor.catch_up() == len(log)  # it folds the log from the start...
        assert successor.sink.duplicates == 0  # ...and publishes what the dying one had not
    finally:
        await successor.close()
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


async def test_two_relays_of_one_log_publish_each_event_once(
    h: Harness, nc: NATS, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    log = await backlog(h)
    first = await Relay.on(nc, database_url, pg_schema, subject_prefix, batch_size=7)
    second = await Relay.on(nc, database_url, pg_schema, subject_prefix, batch_size=11)
    try:
        await asyncio.gather(first.catch_up(attempts=50), second.catch_up(attempts=50))
        assert first.follower.position == second.follower.position == log[-1].position
    finally:
        await first.close()
        await second.close()
    await assert_stream_is_the_log(nc.jetstream(), subject_prefix, log)


async def test_an_undecodable_event_stalls_its_domain_after_everything_before_it(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    await play(h)
    expect_ok(await h.client.admin(HALL, "drain", {"id": "nic-01"}))
    head = await h.store.head(HALL)
    await relayed(h)
    own = h.followers.of("relay", HALL)
    assert own is not None
    await own.stop()  # the test drives it
    future = undecodable_event("00000000-0000-4000-8000-000000000001")
    appended = await h.store.append(HALL, head, [future], [], fence=h.engine.fence(HALL))

    with pytest.raises(Stalled) as stalled:
        await own.catch_up()

    assert stalled.value.position == appended.head.position
    assert own.position == head.position  # the drain is out, checkpointed
    assert await stored_count(nc.jetstream(), subject_prefix) == len(await the_log(h)) - 1


async def test_the_relay_catches_up_after_nats_restarts_under_it(
    tmp_path: Path, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    own_nats = EmbeddedNats(tmp_path)
    own_nats.start()
    try:
        async with serving(
            own_nats.url, database_url, pg_schema, subject_prefix, follow_options=QUICK
        ) as h:
            await play(h)
            await relayed(h)
            own = h.followers.of("relay", HALL)
            assert own is not None
            await own.stop()
            for node in ("nic-01", "nvme-01", "sw-1"):
                expect_ok(await h.client.admin(HALL, "drain", {"id": node}))
            # NATS goes away under the relay, which keeps trying (and says so) until it is back.
            await asyncio.to_thread(own_nats.stop)
            own.start()
            # (A publish waits out its acknowledgement timeout, 5 s, while nats-py reconnects.)
            deadline = asyncio.get_running_loop().time() + 15
            while own.failure is None:
                assert asyncio.get_running_loop().time() < deadline, "the relay never failed"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(own_nats.start)
            await relayed(h, timeout=30)
            assert own.failure is None
            nc = await connect_nats(own_nats.url, name="test-after-restart")
            try:
                await assert_stream_is_the_log(nc.jetstream(), subject_prefix, await the_log(h))
                await assert_bucket_is_the_state(h, nc, subject_prefix)
            finally:
                await nc.close()
    finally:
        own_nats.stop()


async def test_the_bucket_is_made_again_and_refilled_when_it_is_removed_under_the_relay(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    nc: NATS,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, follow_options=QUICK
    ) as h:
        await play(h)
        await relayed(h)
        await nc.jetstream().delete_key_value(bucket_name(subject_prefix))

        # The next commit's puts fail; the relay says so, makes the bucket again and fills it
        # with the whole state, not just what changed since.
        expect_ok(await h.client.admin(HALL, "drain", {"id": "nic-01"}))
        await relayed(h, timeout=15)
        await assert_bucket_is_the_state(h, nc, subject_prefix)
        assert any("KV bucket" in r.getMessage() for r in caplog.records), "no failure logged"

        # A bucket removed while nothing happens is noticed too.
        await nc.jetstream().delete_key_value(bucket_name(subject_prefix))
        deadline = asyncio.get_running_loop().time() + 15
        while True:
            try:
                await assert_bucket_is_the_state(h, nc, subject_prefix)
                break
            except (AssertionError, BucketNotFoundError):
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.2)


async def test_a_restart_reconciles_the_bucket_with_the_log_and_leaves_the_rest_alone(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, nc: NATS
) -> None:
    """What relays before this one left may be another version's wording (an upgrade, or a
    rollback and back: the scheduler-author and upgrade probes), or values edited by hand: a
    relay taking a domain up puts what differs, deletes what the log does not hold, and leaves
    every other key as it is, its history (an ended composition's final value) and position
    kept."""
    js = nc.jetstream()
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, follow_options=QUICK
    ) as h:
        played = await play(h)
        await relayed(h)
    kv = await js.key_value(bucket_name(subject_prefix))
    key = f"{HALL}.composition.{played.globex}"
    older = value(await kv.get(key))
    older["conditions"][0]["message"] = "an older wording"
    await kv.put(key, msgspec.json.encode(older))
    forged = f"{HALL}.composition.c-forged"
    await kv.put(forged, msgspec.json.encode({**older, "tenant": "nobody"}))
    host = f"{HALL}.host.host-01"
    untouched = await kv.get(host)
    ended = f"{HALL}.composition.{played.acme}"

    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, follow_options=QUICK
    ) as h:
        deadline = asyncio.get_running_loop().time() + 15
        while value(await kv.get(key))["conditions"][0]["message"] == "an older wording":
            assert asyncio.get_running_loop().time() < deadline, "never put again"
            await asyncio.sleep(0.2)
        await assert_bucket_is_the_state(h, nc, subject_prefix)
    with pytest.raises(KeyNotFoundError):
        await kv.get(forged)
    assert (await kv.get(host)).revision == untouched.revision  # not written again
    history = await kv.history(ended)
    assert [e.operation for e in history] == [None, "DEL"]
    assert value(history[0])["state"] == "released"


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


async def assert_bucket_is_the_state(h: Harness, nc: NATS, prefix: str) -> None:
    """Every key of the bucket, and no other, with the value the engine's state gives it (and
    the conditions the log's events give each composition)."""
    stored = {
        key: {k: v for k, v in msgspec.json.decode(body).items() if k != "position"}
        for key, body in (await bucket_values(nc.jetstream(), prefix)).items()
    }
    state = h.engine.state(HALL)
    assert state is not None
    view = View.empty(HALL)
    async for record in h.store.read(HALL):
        view = fold(view, record.event(), record.recorded_at, record.position)
    expected: dict[str, Any] = {}
    for cid, c in state.compositions.items():
        expected[f"{HALL}.composition.{cid}"] = composition_entry(c, view.tracks[cid], 0)
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


async def test_the_bucket_holds_exactly_what_the_engine_believes(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    played = await play(h)
    await relayed(h)
    await assert_bucket_is_the_state(h, nc, subject_prefix)
    kv: KeyValue = await nc.jetstream().key_value(bucket_name(subject_prefix))
    globex = value(await kv.get(f"{HALL}.composition.{played.globex}"))
    assert (globex["state"], globex["labels"]) == ("impaired", {"job": "kv-cache"})
    with pytest.raises(KeyNotFoundError):  # ended: deleted
        await kv.get(f"{HALL}.composition.{played.acme}")


async def test_an_ended_compositions_final_value_stays_under_its_delete_marker(
    h: Harness, nc: NATS, subject_prefix: str
) -> None:
    """A watcher that the server had not yet sent the final value to when the marker came
    still gets it: what a key's history holds is what any watcher, however slow, is sent.
    With one value per key the marker replaced it, and one watcher in 20-40 releases saw
    only the delete. A key deleted with no final value (a removed device) keeps nothing
    under its marker: else that value would be the key's again once the marker went."""
    played = await play(h)
    kv: KeyValue = await nc.jetstream().key_value(bucket_name(subject_prefix))
    ended = await kv.history(f"{HALL}.composition.{played.acme}")
    assert [e.operation for e in ended] == [None, "DEL"]
    assert value(ended[0])["state"] == "released"

    device = f"{HALL}.device.{played.acme_gpu}"
    assert len(await kv.history(device)) == 1  # it changed hands twice: a live key keeps one
    expect_ok(await h.client.admin(HALL, "remove", {"id": played.acme_gpu}))
    await relayed(h)
    assert [e.operation for e in await kv.history(device)] == ["DEL"]


async def test_an_ended_compositions_delete_marker_leaves_the_bucket_after_its_ttl(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, nc: NATS
) -> None:
    """The marker tells a watcher that the key ended, then goes (TRELLIS_KV_MARKER_TTL):
    without a TTL every ended composition would stay in the bucket for ever."""
    limits = StreamLimits(marker_ttl_s=1)
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, stream_limits=limits
    ) as h:
        expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
        composed = expect_ok(
            await h.client.intent(
                HALL, "acme", "compose", {"host": "host-01", "devices": [{"kind": "gpu"}]}
            )
        )
        await relayed(h)
        js = nc.jetstream()
        bucket = bucket_name(subject_prefix)
        subject = f"$KV.{bucket}.{HALL}.composition.{composed['composition_id']}"
        # The marker as the bucket stores it, headers and all, seen however soon it goes.
        sub = await js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        try:
            released = {"composition_id": composed["composition_id"]}
            expect_ok(await h.client.intent(HALL, "acme", "release", released))
            final = await sub.next_msg(timeout=5)  # "released" comes before the marker
            msg = await sub.next_msg(timeout=5)
        finally:
            await sub.unsubscribe()
        assert msg.headers == {"KV-Operation": "DEL", "Nats-TTL": "1s"}
        assert msgspec.json.decode(final.data)["state"] == "released"
        assert final.headers == {"Nats-Rollup": "sub", "Nats-TTL": "1s"}  # goes with it

        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                await js.get_last_msg(f"KV_{bucket}", subject)
            except NotFoundError:
                break  # nothing of the ended composition is left in the bucket
            assert asyncio.get_running_loop().time() < deadline, "the marker stayed"
            await asyncio.sleep(0.2)
        await relayed(h)
        await assert_bucket_is_the_state(h, nc, subject_prefix)  # the live keys stay


async def test_a_bucket_made_without_message_ttls_is_given_them(
    nc: NATS, subject_prefix: str
) -> None:
    """A bucket that an older nats-py made cannot take a marker's TTL until it allows them;
    one that an older Trellis made kept one value per key."""
    js = nc.jetstream()
    bucket = bucket_name(subject_prefix)
    old = StreamConfig(
        name=f"KV_{bucket}", subjects=[f"$KV.{bucket}.>"], max_msgs_per_subject=1,
        allow_rollup_hdrs=True, deny_delete=True, storage=StorageType.FILE,
    )  # fmt: skip
    assert not (await js.add_stream(old)).config.allow_msg_ttl
    _, made = await ensure_bucket(js, subject_prefix)
    assert not made
    config = (await js.stream_info(f"KV_{bucket}")).config
    assert config.allow_msg_ttl and config.max_msgs_per_subject == 2


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
