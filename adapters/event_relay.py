"""The event relay: the Postgres log, in position order, onto JetStream; current state into KV.

For every event after its checkpoint the relay
1. publishes the event envelope (ARCHITECTURE §6, `data` byte for byte as stored, so a consumer
   can check the hash chain) to `<prefix>.events.<domain>.<type>` in the stream, with
   `Nats-Msg-Id` = the event id, and waits for the PubAck before the next one (so the stream
   holds the events in log order);
2. folds it into its own copy of the domain's DomainState (engine.state.evolve, rebuilt from
   the log on start) and notes the KV keys it changed (adapters.kv_state);
3. after a batch (up to 500 events: whatever was committed since the last one), puts each
   changed key's latest value into the KV bucket and moves its checkpoint (schema/004)
   forward, in the transaction that has held the checkpoint row locked since the batch began.
   Relays of several engine instances take turns on that lock; the one that waited skips what
   the other has published.

So nothing the engine acknowledged is lost from the stream, and nothing reaches it twice:
- A restart resumes at the checkpoint. What was published but not checkpointed (a crash or a
  stop mid-batch) is recognised by the stream's last message, whose position says how far the
  stream really goes; below it only the KV keys are put again (puts are idempotent). The
  stream's duplicate window (2 minutes, by event id) is the second line of defence.
- The log is read by position exactly as the projection runner reads it
  (`PostgresEventStore.read_all`): appends are serialised (schema/001), so an event that commits
  late never has a lower position than one already read; the sequence-gap bug cannot occur.

The relay runs beside the engine, never in its commit path: the engine's on-commit callback
only pokes it (`notify`), and a poll every second covers what other engine instances append.
Failures (NATS or Postgres away, an event this code cannot decode) are logged and retried with
backoff; the engine keeps serving meanwhile.

Stream and bucket names, their configuration and the message body: adapters/jetstream.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import asyncpg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from adapters.jetstream import (
    DEFAULT_PREFIX,
    Envelope,
    StreamLimits,
    bucket_name,
    encode_envelope,
    ensure_bucket,
    ensure_stream,
    event_subject,
    stream_name,
    stream_tail,
)
from adapters.kv_state import KeyChange, changes, coalesce
from adapters.postgres_store import PostgresEventStore
from engine.events import Event
from engine.records import RecordedEvent
from engine.state import DomainState, evolve

log = logging.getLogger("trellis.relay")

PUBLISH_TIMEOUT_S = 5.0
KV_IN_FLIGHT = 256

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


class EventRelay:
    """Follows the log and keeps the stream and the KV bucket up to date with it.

    Args:
        pool: asyncpg pool whose search_path holds the log (migrations applied).
        source: reads the log in position order.
        js: a JetStream context on a NATS connection of the relay's own.
        prefix: the subject prefix (`trellis`); also decides the stream and bucket names.
        limits: what the stream keeps; set on the stream at every start.
        batch_size: events per checkpoint transaction.
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
        self._poll_interval = poll_interval
        self._owns_pool = owns_pool
        self._kv: KeyValue | None = None
        # Publishes the stream dropped as duplicates: events published before whose checkpoint
        # and stream tail were both lost (expected 0; more means the window did the work).
        self.duplicates = 0
        self._states: dict[str, DomainState] = {}
        self._folded = 0  # the last position folded into _states
        self._published = 0  # the checkpoint as last seen: everything up to it is in the stream
        self._tail = 0  # the position of the stream's last message, read after (re)starts
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
        settings = {"search_path": schema} if schema else {}
        pool = await asyncpg.create_pool(
            dsn, min_size=1, max_size=2, server_settings=settings, timeout=5, reset=_keep_session
        )
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
            try:
                while True:
                    if self._stale:
                        await self._prepare()
                    try:
                        return await self._drain()
                    except _Rewind:
                        log.info("relay checkpoint of %s moved back; folding again", self.stream)
                        self._states, self._folded, self._stale = {}, 0, True
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
        self._kv = await ensure_bucket(self._js, self.prefix)
        async with self._pool.acquire() as conn:
            await conn.execute(_ENSURE_CHECKPOINT, self.stream)
            checkpoint = await conn.fetchval(_READ_CHECKPOINT, self.stream)
        if checkpoint < self._published:  # reset by an operator: fold from the start again
            self._states, self._folded = {}, 0
        self._published = checkpoint
        # Everything up to the stream's last message is in it: the relay publishes in position
        # order, each event only after the one before was stored.
        self._tail = await stream_tail(self._js, self.prefix)
        self._stale = False

    async def _drain(self) -> int:
        published = 0
        batch: list[RecordedEvent] = []
        async for record in self._source.read_all(self._folded):
            batch.append(record)
            if len(batch) >= self._batch_size:
                published += await self._relay(batch)
                batch = []
        if batch:
            published += await self._relay(batch)
        return published

    async def _relay(self, batch: list[RecordedEvent]) -> int:
        """Fold a batch; publish and put what lies past the checkpoint; move the checkpoint.

        The fold goes into a copy of the states, kept only if the batch commits, so a failure
        leaves the relay exactly where its checkpoint is."""
        states = dict(self._states)
        last = batch[-1].position
        if last <= self._published:  # rebuilding the states from events already relayed
            for record in batch:
                _fold(states, record)
            self._advance(states, last, self._published)
            return 0
        published, folded, stalled = 0, self._folded, None
        changed: list[KeyChange] = []
        async with self._pool.acquire() as conn, conn.transaction():
            done = await conn.fetchval(_LOCK_CHECKPOINT, self.stream)
            if done < self._published:
                raise _Rewind
            for record in batch:
                try:
                    before, event, after = _fold(states, record)
                except RelayStalled as exc:
                    stalled = exc  # checkpoint what came before it, then stop
                    break
                folded = record.position
                if record.position <= done:
                    continue  # another relay (another engine instance) did this one
                if record.position > self._tail:
                    await self._publish(record)
                    published += 1
                changed += changes(before, after, event, record.position)
            await self._write(coalesce(changed))
            checkpoint = max(done, folded)
            await conn.execute(_SAVE_CHECKPOINT, self.stream, checkpoint)
        self._advance(states, folded, checkpoint)
        if stalled is not None:
            raise stalled
        return published

    async def _publish(self, record: RecordedEvent) -> None:
        ack = await self._js.publish(
            event_subject(self.prefix, record),
            encode_envelope(Envelope.of(record)),
            timeout=PUBLISH_TIMEOUT_S,
            stream=self.stream,  # land in our stream or fail, never in another one
            headers={"Nats-Msg-Id": record.id},
        )
        if ack.duplicate:
            self.duplicates += 1

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


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Hand a connection back to the pool as it is (asyncpg still rolls back an open
    transaction): the relay sets no session state and its lock is transaction-scoped, so the
    default reset's extra round trip per batch undoes nothing."""
