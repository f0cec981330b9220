"""The event relay: the Postgres log, in position order, onto JetStream; current state into KV.

For every event after its checkpoint the relay
1. publishes the event envelope (ARCHITECTURE §6, `data` byte for byte as stored, so a consumer
   can check the hash chain) to `<prefix>.events.<domain>.<type>` in the stream, with
   `Nats-Msg-Id` = the event id. Publishes are pipelined: up to `window` (256) are on the wire
   before the relay waits for the oldest PubAck. Each carries `Nats-Expected-Last-Sequence`, the
   stream sequence the event before it gets, so the server stores an event only directly after
   its predecessor: if one is lost or refused, every later one in flight is refused too, never
   stored out of order. On a refusal or a missing PubAck the relay abandons the batch (no KV
   puts, no checkpoint), reads where the stream really ends and does the batch again from there;
2. folds it into its own copy of the domain's DomainState (engine.state.evolve, rebuilt from
   the log on start) and notes the KV keys it changed (adapters.nats.kv_state);
3. after a batch (up to 500 events: whatever was committed since the last one), puts each
   changed key's latest value into the KV bucket and moves its checkpoint (schema/004)
   forward, in the transaction that has held the checkpoint row locked since the batch began.
   Relays of several engine instances take turns on that lock; the one that waited skips what
   the other has published.

So nothing the engine acknowledged is lost from the stream, and nothing reaches it twice:
- A restart (or a re-sync after a failed window) resumes at the checkpoint. What was published
  but not checkpointed (a crash, a stop or a failure mid-batch) is recognised by the stream's
  last message, whose position says how far the stream really goes; below it only the KV keys
  are put again (puts are idempotent). The stream's duplicate window (2 minutes, by event id)
  is the second line of defence: a publish of the failed window that reaches the server late,
  after the re-sync, is dropped as a duplicate of its resend (the server checks the message id
  before the expected sequence), or it lands first and the resend is the duplicate.
- Order: the expected sequence chains each publish to the one before it. The chain starts at
  the stream's last sequence, read together with the position of the event stored there, so
  the stream is always the log's events in position order, with no gap and no repeat.
- The log is read by position exactly as the projection runner reads it
  (`PostgresEventStore.read_all`): appends are serialised (schema/001), so an event that commits
  late never has a lower position than one already read; the sequence-gap bug cannot occur.

The relay runs beside the engine, never in its commit path: the engine's on-commit callback
only pokes it (`notify`), and a poll every second covers what other engine instances append.
Failures (NATS or Postgres away, an event this code cannot decode) are logged and retried with
backoff; the engine keeps serving meanwhile.

Stream and bucket names, their configuration and the message body: adapters/nats/jetstream.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import asyncpg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError
from nats.js.kv import KeyValue

from adapters.nats.jetstream import (
    DEFAULT_PREFIX,
    Envelope,
    StreamEnd,
    StreamLimits,
    bucket_name,
    encode_envelope,
    ensure_bucket,
    ensure_stream,
    event_subject,
    stream_end,
    stream_name,
)
from adapters.nats.kv_state import KeyChange, changes, coalesce
from adapters.postgres.store import PostgresEventStore, connect_pool
from engine.events import Event
from engine.records import RecordedEvent
from engine.state import DomainState, evolve

log = logging.getLogger("trellis.relay")

PUBLISH_TIMEOUT_S = 5.0
PUBLISH_WINDOW = 256
RESYNC_ATTEMPTS = 5  # re-syncs in a row without a batch checkpointed before backing off
KV_IN_FLIGHT = 256
_WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for Nats-Expected-Last-Sequence mismatches

_ENSURE_CHECKPOINT = """
INSERT INTO trellis_relay_checkpoints (stream, position) VALUES ($1, 0)
    ON CONFLICT (stream) DO NOTHING
"""
_READ_CHECKPOINT = "SELECT position FROM trellis_relay_checkpoints WHERE stream = $1"
_LOCK_CHECKPOINT = "SELECT position FROM trellis_relay_checkpoints WHERE stream = $1 FOR UPDATE"
_SAVE_CHECKPOINT = "UPDATE trellis_relay_checkpoints SET position = $2 WHERE stream = $1"


class LogSource(Protocol):
    """Every domain's events in global position order (PostgresEventStore is one)."""

    def read_all(self, after_position: int = 0) -> AsyncIterator[RecordedEvent]: ...


class RelayStalled(RuntimeError):
    """The log holds an event this code cannot decode (a newer engine wrote it, or it is damaged).

    Everything before it is relayed; the relay retries, so upgrading the code unblocks it.
    """

    def __init__(self, position: int, type_: str, cause: str):
        super().__init__(f"cannot relay event {position} ({type_}): {cause}")
        self.position = position


class _Rewind(Exception):
    """The checkpoint moved behind what this relay has folded (reset by an operator)."""


class _Resync(Exception):
    """A publish of the window was refused or not acknowledged: the stream may hold part of the
    batch, so read where it ends and do the batch again from there."""


class EventRelay:
    """Follows the log and keeps the stream and the KV bucket up to date with it.

    Args:
        pool: asyncpg pool whose search_path holds the log (migrations applied).
        source: reads the log in position order.
        js: a JetStream context on a NATS connection of the relay's own.
        prefix: the subject prefix (`trellis`); also decides the stream and bucket names.
        limits: what the stream keeps; set on the stream at every start.
        batch_size: events per checkpoint transaction.
        window: publishes on the wire before waiting for the oldest PubAck.
        publish_timeout: seconds to wait for a PubAck before re-syncing.
        poll_interval: seconds between looks at the log when nobody calls `notify()`.
        owns_pool: close `pool` in `close()`.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        source: LogSource,
        js: JetStreamContext,
        *,
        prefix: str = DEFAULT_PREFIX,
        limits: StreamLimits | None = None,
        batch_size: int = 500,
        window: int = PUBLISH_WINDOW,
        publish_timeout: float = PUBLISH_TIMEOUT_S,
        poll_interval: float = 1.0,
        owns_pool: bool = False,
    ):
        self.prefix = prefix
        self.stream = stream_name(prefix)
        self.bucket = bucket_name(prefix)
        self._pool = pool
        self._source = source
        self._js = js
        self._limits = limits or StreamLimits()
        self._batch_size = batch_size
        self._window = window
        self._publish_timeout = publish_timeout
        self._poll_interval = poll_interval
        self._owns_pool = owns_pool
        self._kv: KeyValue | None = None
        # Publishes the stream dropped as duplicates: events published before whose checkpoint
        # and stream tail were both lost (expected 0; more means the window did the work).
        self.duplicates = 0
        self.resyncs = 0  # windows abandoned and done again after reading the stream's end
        self._sent = 0  # events this relay has published and checkpointed
        self._states: dict[str, DomainState] = {}
        self._folded = 0  # the last position folded into _states
        self._published = 0  # the checkpoint as last seen: everything up to it is in the stream
        # Where the stream ends, read after (re)starts and when another relay moved the
        # checkpoint; the sequence then follows this relay's own publishes (None: read it).
        self._end: StreamEnd | None = None
        self._stale = True  # ensure the stream and bucket and re-read checkpoint and tail first
        self._lock = asyncio.Lock()
        self._poke = asyncio.Event()
        self._advanced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, dsn: str, js: JetStreamContext, *, schema: str | None = None, **kwargs: Any
    ) -> EventRelay:
        """A relay with a small pool of its own (pinned to `schema` if given) for reading the
        log and for its checkpoint, so it never takes a connection the engine's appends need.
        The schema must be migrated already (PostgresEventStore.open does that)."""
        pool = await connect_pool(dsn, schema=schema, min_size=1, max_size=2)
        return cls(pool, PostgresEventStore(pool), js, owns_pool=True, **kwargs)

    @property
    def position(self) -> int:
        """The log position up to which every event is in the stream (the checkpoint)."""
        return self._published

    def notify(self) -> None:
        """Poke the background task: the log has grown (call after each commit)."""
        self._poke.set()

    async def start(self) -> None:
        """Create or update the stream and the bucket (raising if that fails), then relay in the
        background until `stop()`: catch up now, then after every `notify()`."""
        async with self._lock:
            await self._prepare()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-relay")

    async def stop(self) -> None:
        """Stop the background task. A batch in flight is not checkpointed; the next start
        finds its events in the stream and does not publish them again."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self, drain_timeout: float = 2.0) -> None:
        """Stop, publishing on the way out what the engine committed last: call it after the
        engine has stopped, so the stream is complete on a clean exit. Draining gives up after
        `drain_timeout` seconds (NATS may be away); the next start publishes the rest."""
        await self.stop()
        if drain_timeout > 0:
            try:
                await asyncio.wait_for(self.catch_up(), drain_timeout)
            except Exception as exc:
                log.warning("event relay stopped before the end of the log: %r", exc)
        if self._owns_pool:
            await self._pool.close()

    async def wait_for(self, position: int, timeout: float = 5.0) -> bool:
        """True once every event up to `position` is in the stream and its keys in the bucket;
        False if that takes over `timeout`."""
        self.notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._published < position:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), remaining)
        return True

    async def catch_up(self) -> int:
        """Relay the log up to its end; return how many events this call published.

        Raises:
            RelayStalled: an event cannot be decoded; everything before it is relayed.
        """
        async with self._lock:
            sent, resyncs, progress = self._sent, 0, self._published
            try:
                while True:
                    if self._stale:
                        await self._prepare()
                    try:
                        await self._drain()
                        return self._sent - sent
                    except _Rewind:
                        log.info("relay checkpoint of %s moved back; folding again", self.stream)
                        self._states, self._folded, self._stale = {}, 0, True
                    except _Resync as exc:
                        if self._published != progress:
                            resyncs, progress = 0, self._published
                        resyncs += 1
                        if resyncs > RESYNC_ATTEMPTS:
                            raise
                        self.resyncs += 1
                        log.warning("relay re-syncing with %s: %s", self.stream, exc)
                        self._stale = True
            except BaseException:
                self._stale = True  # the stream, the bucket or the checkpoint may have moved
                raise

    # ---- internals ----

    async def _run(self) -> None:
        failures = 0
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                raise asyncio.CancelledError  # a cancel that wait_for swallowed (Python 3.11)
            self._poke.clear()
            try:
                await self.catch_up()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc  # a stop the driver reported as an error
                failures += 1
                log.exception("event relay failed (attempt %d)", failures)
                await asyncio.sleep(min(30.0, 0.05 * 2**failures))
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._poll_interval)

    async def _prepare(self) -> None:
        """Ensure the stream and the bucket; read the checkpoint and how far the stream goes."""
        await ensure_stream(self._js, self.prefix, self._limits)
        self._kv = await ensure_bucket(self._js, self.prefix, self._limits.replicas)
        async with self._pool.acquire() as conn:
            await conn.execute(_ENSURE_CHECKPOINT, self.stream)
            checkpoint = await conn.fetchval(_READ_CHECKPOINT, self.stream)
        if checkpoint < self._published:  # reset by an operator: fold from the start again
            self._states, self._folded = {}, 0
        self._published = checkpoint
        # Everything up to the stream's last message is in it: the relay publishes in position
        # order, each event stored only directly after the one before.
        self._end = await stream_end(self._js, self.prefix)
        self._stale = False

    async def _drain(self) -> None:
        batch: list[RecordedEvent] = []
        async for record in self._source.read_all(self._folded):
            batch.append(record)
            if len(batch) >= self._batch_size:
                await self._relay(batch)
                batch = []
        if batch:
            await self._relay(batch)

    async def _relay(self, batch: list[RecordedEvent]) -> None:
        """Fold a batch; publish and put what lies past the checkpoint; move the checkpoint.

        The fold goes into a copy of the states, kept only if the batch commits, so a failure
        leaves the relay exactly where its checkpoint is."""
        states = dict(self._states)
        last = batch[-1].position
        if last <= self._published:  # rebuilding the states from events already relayed
            for record in batch:
                _fold(states, record)
            self._advance(states, last, self._published)
            return
        folded, stalled = self._folded, None
        changed: list[KeyChange] = []
        async with self._pool.acquire() as conn, conn.transaction():
            done = await conn.fetchval(_LOCK_CHECKPOINT, self.stream)
            if done < self._published:
                raise _Rewind
            if self._end is None or done > self._published:
                # Another relay (another engine instance) published since this one last looked.
                self._end = await stream_end(self._js, self.prefix)
            end = self._end
            window = _Window(self._js, self.stream, end.seq, self._window, self._publish_timeout)
            try:
                for record in batch:
                    try:
                        before, event, after = _fold(states, record)
                    except RelayStalled as exc:
                        stalled = exc  # checkpoint what came before it, then stop
                        break
                    folded = record.position
                    if record.position <= done:
                        continue  # another relay did this one
                    if record.position > end.position:
                        await window.publish(
                            event_subject(self.prefix, record),
                            encode_envelope(Envelope.of(record)),
                            record.id,
                        )
                    changed += changes(before, after, event, record.position)
                await window.settle()
            except BaseException:
                window.abandon()
                self._end = None  # part of the window may be stored: read where the stream ends
                raise
            finally:
                self.duplicates += window.duplicates
            if window.sent:
                # A duplicate did not take the sequence it was sent for, so the chain is off.
                self._end = None if window.duplicates else StreamEnd(window.seq, folded)
            await self._write(coalesce(changed))
            checkpoint = max(done, folded)
            await conn.execute(_SAVE_CHECKPOINT, self.stream, checkpoint)
        self._sent += window.sent
        self._advance(states, folded, checkpoint)
        if stalled is not None:
            raise stalled

    async def _write(self, writes: dict[str, list[bytes | None]]) -> None:
        """Put (or delete) the batch's keys: one key's writes in order, different keys at once
        (a few hundred in flight at most), so their requests share the connection's flushes."""
        kv = self._kv
        assert kv is not None

        async def write(key: str, values: list[bytes | None]) -> None:
            for value in values:
                if value is None:
                    await kv.delete(key)
                else:
                    await kv.put(key, value)

        keys = list(writes)
        for start in range(0, len(keys), KV_IN_FLIGHT):
            async with asyncio.TaskGroup() as group:
                for key in keys[start : start + KV_IN_FLIGHT]:
                    group.create_task(write(key, writes[key]))

    def _advance(self, states: dict[str, DomainState], folded: int, published: int) -> None:
        self._states, self._folded, self._published = states, folded, published
        # Wake every wait_for; each re-checks the position against its own target.
        advanced, self._advanced = self._advanced, asyncio.Event()
        advanced.set()


class _Window:
    """Publishes to the stream in order with up to `size` PubAcks outstanding.

    Every message expects the stream's last sequence to be the one its predecessor was sent
    for, so the server stores each only directly after the one before: the first message lost
    or refused makes every later one be refused (`_Resync`), never stored out of order.
    nats-py's `publish_async` writes each message to the connection before it returns, so they
    leave in the order published.
    """

    def __init__(self, js: JetStreamContext, stream: str, seq: int, size: int, timeout: float):
        self._js = js
        self._stream = stream
        self._size = max(1, size)
        self._timeout = timeout
        self.seq = seq  # the sequence the last message sent will get
        self.sent = 0  # messages acknowledged, duplicates included
        self.duplicates = 0
        self._pending: collections.deque[tuple[asyncio.Future[PubAck], int]] = collections.deque()

    async def publish(self, subject: str, body: bytes, msg_id: str) -> None:
        """Send one message; first wait for the oldest PubAck if `size` are outstanding."""
        if len(self._pending) >= self._size:
            await self._ack_oldest()
        headers = {"Nats-Msg-Id": msg_id, "Nats-Expected-Last-Sequence": str(self.seq)}
        future = await self._js.publish_async(
            subject,
            body,
            # No stall timeout: the window keeps far fewer in flight than nats-py's limit
            # (4,000), and a timeout makes every publish yield, so each went out in a write
            # of its own instead of sharing the connection's next flush.
            wait_stall=None,
            stream=self._stream,  # land in our stream or fail, never in another one
            headers=headers,
        )
        self.seq += 1
        self._pending.append((future, self.seq))

    async def settle(self) -> None:
        """Wait for every outstanding PubAck."""
        while self._pending:
            await self._ack_oldest()

    def abandon(self) -> None:
        """Stop waiting for what is outstanding (its PubAcks, if any come, are dropped)."""
        while self._pending:
            future, _ = self._pending.popleft()
            if future.done():
                if not future.cancelled():
                    future.exception()  # retrieved: nobody needs to hear about it again
            else:
                future.cancel()

    async def _ack_oldest(self) -> None:
        future, seq = self._pending[0]
        try:
            # Usually acknowledged already when the window is full: skip wait_for's timer.
            ack = (
                future.result() if future.done() else await asyncio.wait_for(future, self._timeout)
            )
        except TimeoutError as exc:
            raise _Resync(f"no PubAck for sequence {seq} in {self._timeout:g} s") from exc
        except APIError as exc:
            if exc.err_code == _WRONG_LAST_SEQUENCE:
                raise _Resync(f"sequence {seq} refused: {exc.description}") from exc
            raise
        self._pending.popleft()
        self.sent += 1
        if ack.duplicate:
            self.duplicates += 1  # stored already, by an earlier window or another relay
        elif ack.seq != seq:
            raise _Resync(f"stored at sequence {ack.seq}, not {seq}")


def _fold(
    states: dict[str, DomainState], record: RecordedEvent
) -> tuple[DomainState, Event, DomainState]:
    """Apply `record` to its domain's state in `states`; (state before, event, state after)."""
    try:
        event = record.event()
    except Exception as exc:
        raise RelayStalled(record.position, record.type, str(exc)) from exc
    before = states.get(record.domain) or DomainState(domain=record.domain)
    after = states[record.domain] = evolve(before, event)
    return before, event, after
