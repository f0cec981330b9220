"""The event relay: each domain's log, in version order, onto JetStream; current state into KV.

The relay is a sink of the engine's log followers (engine.service.follower): one follower per domain
hands it that domain's events in batches. For each batch the relay
1. folds the events into its own copy of the domain's state and compositions' conditions
   (kv_state.fold: engine.core.state.evolve and engine.core.conditions, rebuilt from the log when it
   resumes) and notes the KV keys they changed (adapters/nats/kv_state.py);
2. publishes the events it has not published yet to `<prefix>.events.<domain>.<type>` as one
   atomic batch (JetStream 2.12: all or none stored), each with `Nats-Msg-Id` = event id and the
   envelope of ARCHITECTURE §6 (`data` byte for byte as stored, so a consumer can check the
   hash chain). The batch's first message expects the last sequence on
   `<prefix>.events.<domain>.*` to be the one the relay last saw for the domain, so the server
   stores a domain's events only directly after the domain's previous one: never out of order,
   never twice, whatever other domains publish meanwhile;
3. puts each changed key's latest value into the KV bucket, and moves the domain's checkpoint
   (trellis_follower_checkpoints, schema/005) in the transaction that held the checkpoint row
   locked since the batch began. Relays of several engine instances take turns on that lock.

Nothing acknowledged is lost from the stream and nothing reaches it twice:
- A resume starts at the checkpoint. What was published but not checkpointed (a crash or a
  failure between the commit of the batch and the checkpoint) is recognised by the last message
  on the domain's subjects, whose version says how far the stream really goes; below it only the
  KV keys are put again (puts are idempotent).
- A refused batch (the domain's last sequence moved) or a missing reply makes the relay read
  where the domain's messages end and try again from there; the follower retries with backoff.
- Order between domains is the order in which their batches commit; within a domain it is the
  log's. Each message carries its log `position`.

A log that lost its tail (a failover to a standby without the last commits, docs/deployment.md
§3) and was written on since holds other events at the versions relayed: the relay notices
when the next event does not chain onto its fold, when its checkpoint names an event the log no
longer holds (version and position), or when the stream's last event is one the log no longer
holds. It says so, folds the domain again, publishes the log's events after the last one the
stream and the log share (after what was relayed; their ids differ, so they are not taken for
duplicates) and puts the domain's keys again in full.

Failures are the follower's to retry: a domain whose events cannot be relayed holds up only its
own feed. A bucket that is removed is made again and refilled with every domain's current state;
the stream and bucket are checked while the log is quiet, too.

Stream and bucket names, their configuration and the message body: adapters/nats/jetstream.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import asyncpg
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from trellis.adapters.nats import kv_state
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.jetstream import (
    DEFAULT_PREFIX,
    Envelope,
    StreamLimits,
    bucket_name,
    domain_end,
    encode_envelope,
    ensure_bucket,
    ensure_stream,
    event_subject,
    stream_event,
    stream_name,
)
from trellis.adapters.nats.kv_audit import bucket_entries
from trellis.adapters.nats.kv_state import KeyChange, View, changes, coalesce, everything
from trellis.engine.core.records import RecordedEvent
from trellis.engine.service.follower import Progress, Rewound, Stalled
from trellis.projections import follower_checkpoints

log = logging.getLogger("trellis.relay")

SINK_NAME = "relay"
PUBLISH_TIMEOUT_S = 5.0
ATOMIC_BATCH_MAX = 1000  # JetStream's limit on messages in one atomic batch
KV_IN_FLIGHT = 256
CHECK_INTERVAL_S = 2.0  # how often quiet followers look whether the stream and bucket exist
MIN_SERVER = (2, 12)  # atomic batches
# The log's hash at a version; its hashes from a version on; when a version was recorded.
_HASH_AT = "SELECT hash FROM trellis_events WHERE domain = $1 AND version = $2"
_HASHES_AFTER = "SELECT version, hash FROM trellis_events WHERE domain = $1 AND version > $2"
_RECORDED_AT = "SELECT recorded_at FROM trellis_events WHERE domain = $1 AND version = $2"
_WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for an expected-last-sequence mismatch


class RelayError(RuntimeError):
    """JetStream refused or did not answer a batch; the follower retries."""


class StreamMoved(RelayError):
    """The domain's subjects in the stream no longer end where the batch's guard expected."""


class UnsupportedServer(RelayError):
    """The NATS server is older than the relay needs (atomic batches came with 2.12)."""


class _End(msgspec.Struct, frozen=True):
    """Where a domain's messages end in the stream: the last one's sequence and event version
    (0, 0 when the stream holds none of them)."""

    seq: int
    version: int


_Changed = tuple[int, list[KeyChange]]  # an event's version and the keys it changed


class _Fold(msgspec.Struct, frozen=True):
    state: View
    version: int  # the last version folded into `state`
    hash: str = ""  # its chain hash: the next event's prev_hash, while the log still holds it


class RelaySink:
    """Publishes domains' events to the stream and their state to the bucket (a follower Sink).

    Args:
        pool: asyncpg pool whose search_path holds the log (migrations applied).
        nc: a NATS connection of the relay's own.
        prefix: the subject prefix (`trellis`); also decides the stream and bucket names.
        limits: what the stream keeps; set on the stream when the relay first prepares it.
        publish_timeout: seconds to wait for a batch's acknowledgement.
    """

    name = SINK_NAME

    def __init__(
        self,
        pool: asyncpg.Pool,
        nc: NATS,
        *,
        prefix: str = DEFAULT_PREFIX,
        limits: StreamLimits | None = None,
        publish_timeout: float = PUBLISH_TIMEOUT_S,
    ):
        self.prefix = prefix
        self.stream = stream_name(prefix)
        self.bucket = bucket_name(prefix)
        self.checkpoint_name = f"relay:{self.stream}"
        self.pool = pool
        self._nc = nc
        self._js = nc.jetstream()
        self._limits = limits or StreamLimits()
        # The bucket keeps two values a key for one reason: an ended composition's final
        # value under its delete marker, so a watcher the server had not yet sent it to when
        # the marker came still gets it. Every other write rolls up the key's earlier values
        # (a live key keeps one; a key deleted with no final value, its marker alone: else
        # the value under it would be the key's again once the marker's TTL took it away).
        marker_ttl = self._limits.marker_ttl_s
        final_ttl = min(marker_ttl, FINAL_VALUE_TTL_S) if marker_ttl else FINAL_VALUE_TTL_S
        self._put = _ROLLUP
        self._final = {**_ROLLUP, **_ttl_headers(final_ttl)}
        self._delete = _delete_headers(marker_ttl)
        self._delete_all = {**self._delete, **_ROLLUP}
        self._publish_timeout = publish_timeout
        self._kv: KeyValue | None = None
        self._checked = 0.0  # when the stream and bucket were last known to exist
        self._generation = 0  # bumped each time the bucket had to be made (again)
        self._folds: dict[str, _Fold] = {}
        self._ends: dict[str, _End] = {}  # cached; dropped whenever it may be stale
        self._checkpoints: dict[str, Progress] = {}
        self._synced: dict[str, int] = {}  # domain -> bucket generation its keys were put in
        self._told_empty: set[str] = set()  # domains whose stream lacks what was published
        self.foreign = ForeignMessages("relay")  # skipped in the stream (metrics set on_skip)
        self._foreign_counted: dict[str, int] = {}  # domain -> highest stream seq counted
        self.resyncs = 0  # batches refused because the domain's stream moved, then redone
        self.duplicates = 0  # events found in the stream past a lost checkpoint, not resent

    async def prepare(self) -> None:
        """Check the server, then create or update the stream and the bucket.

        Raises:
            UnsupportedServer: the server cannot take atomic batches.
        """
        version = self._nc.connected_server_version
        if (version.major, version.minor) < MIN_SERVER:
            wanted = ".".join(map(str, MIN_SERVER))
            raise UnsupportedServer(
                f"the event relay needs nats-server {wanted} or later (atomic batch publish); "
                f"connected to {version}"
            )
        await ensure_stream(self._js, self.prefix, self._limits)
        await self._ensure_bucket()
        self._checked = time.monotonic()

    # ---- the Sink protocol ----

    async def resume(self, domain: str) -> tuple[int, Progress]:
        """From the first event: the fold that renders KV values is rebuilt from the log."""
        async with self.pool.acquire() as conn:
            await conn.execute(follower_checkpoints.ENSURE, self.checkpoint_name, domain)
            row = await conn.fetchrow(follower_checkpoints.READ_HELD, self.checkpoint_name, domain)
            lost = not row["held"]
            checkpoint = (
                await self._start_again(conn, domain)
                if lost
                else Progress(row["version"], row["position"])
            )
        self._checkpoints[domain] = checkpoint
        self._folds[domain] = _Fold(View.empty(domain), 0)
        self._ends.pop(domain, None)
        # The bucket is reconciled with the log once the fold has caught up (`_rewrite`), at
        # every take-up: what relays before this one left may be another version's wording (an
        # upgrade, a rollback and back), a bucket made again, or values edited by hand.
        self._synced[domain] = -1
        await self._say_if_the_stream_lacks(domain, checkpoint)
        return 0, checkpoint

    async def _say_if_the_stream_lacks(self, domain: str, checkpoint: Progress) -> None:
        """Warn, once, when the stream holds none of a domain the relay published events of,
        and never dropped a message by its limits (its first sequence is still 1: a stream
        that aged out a quiet domain's events is no loss): a JetStream store lost, or a log
        restored onto a fresh data dir. The relay then goes on from its checkpoint (an operator
        who purged the stream on purpose wants no history back); docs/deployment.md says how
        to publish it again."""
        if not checkpoint.version or domain in self._told_empty:
            return
        try:
            end = await domain_end(self._js, self.prefix, domain, lambda _, __: None)
            first = (await self._js.stream_info(self.stream)).state.first_seq
        except Exception:  # NATS away: the publishing that follows says so
            return
        if end.seq or first > 1:
            return
        self._told_empty.add(domain)
        log.warning(
            "relay of domain %s: the stream holds none of the domain's events, though the relay "
            "published up to version %d (the JetStream store lost, or the log restored onto a "
            "fresh data dir?): a consumer from the start sees only what comes next. To publish "
            "the history again, put the relay's checkpoints back to 0 (docs/deployment.md, "
            "'When the JetStream store is lost')",
            domain,
            checkpoint.version,
        )

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        checkpoint = self._checkpoints[domain]
        fold = self._folds[domain]
        first = records[0]
        if fold.version and first.version == fold.version + 1 and first.prev_hash != fold.hash:
            log.warning(
                "relay of domain %s: the log no longer holds version %d that the relay folded "
                "(a failover to a standby without it?); folding the domain again",
                domain,
                fold.version,
            )
            raise Rewound
        state, folded, folded_hash, stalled = fold.state, fold.version, fold.hash, None
        changed: list[_Changed] = []
        for record in records:
            try:
                event = record.event()
            except Exception as exc:  # a newer engine's event, or damage: stop before it
                stalled = Stalled(checkpoint, record.position, f"{record.type}: {exc}")
                break
            before, state = state, kv_state.fold(state, event, record.recorded_at, record.position)
            folded, folded_hash = record.version, record.hash
            if record.version > checkpoint.version:
                changed.append((record.version, changes(before, state, event, record.position)))
        fresh = [r for r in records if checkpoint.version < r.version <= folded]
        if fresh:
            checkpoint = await self._relay(domain, fresh, state, changed)
        self._folds[domain] = _Fold(state, folded, folded_hash)
        if stalled is not None:
            stalled.progress = checkpoint
            raise stalled
        return checkpoint

    async def refresh(self, domain: str) -> None:
        """Quiet moments: a checkpoint reset by an operator means fold and put again; a bucket
        that vanished is made again and refilled."""
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(follower_checkpoints.READ_HELD, self.checkpoint_name, domain)
        if row is None or row["version"] < self._checkpoints.get(domain, Progress()).version:
            raise Rewound
        if not row["held"]:
            raise Rewound  # the log lost what the checkpoint names: the resume starts again
        if time.monotonic() - self._checked > CHECK_INTERVAL_S:
            await self.prepare()
        fold = self._folds.get(domain)
        if fold is not None and self._synced.get(domain) != self._generation:
            async with self.pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(follower_checkpoints.LOCK, self.checkpoint_name, domain)
                # Only a fold of everything relayed is the current state; one behind waits
                # for its next batch, which puts the keys once it has caught up.
                if row["version"] == fold.version:
                    await self._rewrite(domain, fold.state, row["position"])

    # ---- internals ----

    async def _relay(
        self,
        domain: str,
        records: list[RecordedEvent],
        state: View,
        changed: list[_Changed],
    ) -> Progress:
        """Publish what the stream lacks, put the keys, move the checkpoint: one step.

        Only the changes of versions past the stored checkpoint are put: the relay that moved
        it there put the keys as of that version, and anything older would take the bucket
        back (a released composition's key live again)."""
        if self._kv is None:
            await self.prepare()
        last = records[-1]
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    follower_checkpoints.LOCK_HELD, self.checkpoint_name, domain
                )
                done = Progress(row["version"], row["position"])
                if done.version < self._checkpoints[domain].version or not row["held"]:
                    raise Rewound  # moved back, or the log lost what it names: resume
                end = self._ends.get(domain)
                if end is None or done.version > self._checkpoints[domain].version:
                    end = await self._domain_end(conn, domain, done)  # another relay published?
                try:
                    end, found = await self._publish_unsent(domain, end, done, records)
                except StreamMoved:
                    # Something else was stored on the domain's subjects since its end was
                    # read: a foreign message (skipped when read again), or another relay's
                    # batch. Read the end again and go on: an expected case, not a failure.
                    end = await self._domain_end(conn, domain, done)
                    end, found = await self._publish_unsent(domain, end, done, records)
                # The batch's own changes first, as they come (an ended composition's final
                # value under its delete marker), then, when due, the rest reconciled.
                await self._write(
                    coalesce(c for version, cs in changed if version > done.version for c in cs)
                )
                if self._synced.get(domain) != self._generation and last.version >= done.version:
                    await self._rewrite(domain, state, last.position)  # else `state` is older
                saved = max(done, Progress(last.version, last.position), key=_version)
                await conn.execute(
                    follower_checkpoints.SAVE,
                    self.checkpoint_name,
                    domain,
                    saved.version,
                    saved.position,
                )
        except BaseException:
            self._ends.pop(domain, None)  # part of it may be stored: read where it ends
            raise
        self._ends[domain] = end
        self._checkpoints[domain] = saved
        self.duplicates += found
        return saved

    async def _publish_unsent(
        self, domain: str, end: _End, done: Progress, records: list[RecordedEvent]
    ) -> tuple[_End, int]:
        """Publish the records the stream lacks after `end`; the new end, and how many of
        the records it already held."""
        unsent = [r for r in records if r.version > max(done.version, end.version)]
        found = sum(done.version < r.version <= end.version for r in records)
        for start in range(0, len(unsent), ATOMIC_BATCH_MAX):
            end = await self._publish(domain, end, unsent[start : start + ATOMIC_BATCH_MAX])
        return end, found

    async def _domain_end(self, conn: asyncpg.Connection, domain: str, done: Progress) -> _End:
        """Where the domain's events end in the stream: the sequence of the last message on
        its subjects (what the next batch's guard expects) and the version of its last event
        (foreign messages skipped and counted; beyond the look-back, the relay's checkpoint:
        what it knows it published).

        A last event the log no longer holds (relayed before a failover to a standby without
        it, or before a restore from a backup) ends at the last version the stream and the log
        share (`_shared_with_stream`): the events the log holds after it are published after
        it (other ids: Nats-Msg-Id lets them through), and the domain's keys are put again in
        full."""
        passed: list[int] = []
        end = await domain_end(self._js, self.prefix, domain, lambda _, seq: passed.append(seq))
        self._count_foreign(domain, end.seq, passed)
        if end.event is None:
            return _End(end.seq, self._checkpoints[domain].version if end.seq else 0)
        last = end.event
        if Progress(last.version, last.position) == done:  # the event the (held) checkpoint names
            return _End(end.seq, last.version)
        if await conn.fetchval(_HASH_AT, domain, last.version) == last.hash:
            return _End(end.seq, last.version)
        shared = await self._shared_with_stream(conn, domain, done, end.seq)
        log.warning(
            "relay of domain %s: the stream ends at version %d, which the log no longer "
            "holds; publishing the log's events after version %d",
            domain,
            last.version,
            shared,
        )
        self._synced[domain] = -1
        return _End(end.seq, shared)

    def _count_foreign(self, domain: str, end_seq: int, passed: list[int]) -> None:
        """Count each foreign message once, however often the domain's end is read past it
        (a batch refused twice, a publish that timed out): those above the highest sequence
        counted before. A stream whose sequences start over (made again) starts it over."""
        counted = self._foreign_counted.get(domain, 0)
        if end_seq < counted:
            counted = 0
        for seq in sorted(passed):
            if seq > counted:
                self.foreign.skipped(domain, f"seq {seq} of {self.stream}")
        self._foreign_counted[domain] = max([counted, *passed])

    async def _shared_with_stream(
        self, conn: asyncpg.Connection, domain: str, done: Progress, end_seq: int
    ) -> int:
        """The last version the stream and the log share: at least `done` (the relay published
        it before it saved it), and on as far as the stream's events of the domain after it
        are the log's, hash for hash. Hashes chain, so the first that differs ends it. Read on
        from a minute before `done` was recorded; positions cannot say it, since a log
        restored from a backup gives its new events positions the stream already holds."""
        hashes = {
            row["version"]: row["hash"]
            for row in await conn.fetch(_HASHES_AFTER, domain, done.version)
        }
        recorded = await conn.fetchval(_RECORDED_AT, domain, done.version)
        config = (
            ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME,
                opt_start_time=recorded - timedelta(minutes=1),
            )
            if recorded is not None
            else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        shared = done.version
        subject = f"{self.prefix}.events.{domain}.*"
        sub = await self._js.subscribe(
            subject, stream=self.stream, ordered_consumer=True, config=config
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=self._publish_timeout)
                except NatsTimeoutError:  # nothing more of the domain in the stream
                    break
                event = stream_event(self.prefix, msg.subject, msg.data, msg.headers)
                if event is not None and event.version > shared:
                    if hashes.get(event.version) != event.hash or event.version != shared + 1:
                        break
                    shared = event.version
                if msg.metadata.sequence.stream >= end_seq:
                    break
        finally:
            await sub.unsubscribe()
        return shared

    async def _publish(self, domain: str, end: _End, records: list[RecordedEvent]) -> _End:
        """One atomic batch; the first message expects the domain's stream to end at `end`."""
        batch_id = uuid.uuid4().hex
        guard = {
            "Nats-Expected-Last-Subject-Sequence": str(end.seq),
            "Nats-Expected-Last-Subject-Sequence-Subject": f"{self.prefix}.events.{domain}.*",
        }
        for number, record in enumerate(records, 1):
            headers = {
                "Nats-Msg-Id": record.id,
                "Nats-Batch-Id": batch_id,
                "Nats-Batch-Sequence": str(number),
                **(guard if number == 1 else {}),
            }
            subject = event_subject(self.prefix, record)
            body = encode_envelope(Envelope.of(record))
            if number < len(records):
                await self._nc.publish(subject, body, headers=headers)
                continue
            headers["Nats-Batch-Commit"] = "1"
            try:
                reply = await self._nc.request(
                    subject, body, headers=headers, timeout=self._publish_timeout
                )
            except NatsTimeoutError as exc:
                raise RelayError(
                    f"no acknowledgement for {len(records)} events of {domain} in "
                    f"{self._publish_timeout:g} s"
                ) from exc
            ack = _decode_ack(reply.data or b"{}")
            error = ack.get("error")
            if error:
                moved = error.get("err_code") == _WRONG_LAST_SEQUENCE
                self.resyncs += moved
                raise (StreamMoved if moved else RelayError)(
                    f"{self.stream} refused {len(records)} events of {domain} "
                    f"(versions {records[0].version}-{record.version}): "
                    f"{error.get('description', error)}"
                )
            return _End(int(ack["seq"]), record.version)
        raise AssertionError("an empty batch")

    async def _start_again(self, conn: asyncpg.Connection, domain: str) -> Progress:
        """The log no longer holds the event the checkpoint names: move the checkpoint back to
        the last event they share (unless another relay did first). Where it stands then."""
        async with conn.transaction():
            row = await conn.fetchrow(follower_checkpoints.LOCK_HELD, self.checkpoint_name, domain)
            if row["held"]:
                return Progress(row["version"], row["position"])
            shared = await conn.fetchrow(follower_checkpoints.SHARED, domain, row["position"])
            back = Progress(shared["version"], shared["position"]) if shared else Progress()
            log.warning(
                "relay of domain %s: the log no longer holds version %d that the relay followed "
                "(a failover to a standby without it?); relaying the domain again after "
                "version %d",
                domain,
                row["version"],
                back.version,
            )
            await conn.execute(
                follower_checkpoints.SAVE, self.checkpoint_name, domain, back.version, back.position
            )
        return back

    async def _ensure_bucket(self) -> None:
        self._kv, made = await ensure_bucket(self._js, self.prefix, self._limits.replicas)
        if made:
            self._generation += 1  # every domain's keys are put again, in full

    async def _rewrite(self, domain: str, state: View, position: int) -> None:
        """Make the domain's keys what `state` renders (as of `position`): a key whose value
        differs in more than its position is put, a live key the state no longer has is
        deleted, and every other key is left as it is, its position and its history kept (an
        ended composition's final value under its delete marker among them)."""
        held = await bucket_entries(self._js, self.prefix, domain)
        rendered = coalesce(everything(state, position))
        writes = {
            key: values
            for key, values in rendered.items()
            if not _same_value(held.get(key), values[-1])
        }
        gone = [key for key in held if key not in rendered]
        for key in gone:
            writes[key] = [None]
        if held and writes:
            log.warning(
                "relay of domain %s: %d key(s) of the bucket differed from what this Trellis "
                "renders from the log (values another version wrote, or edited), and %d held "
                "what the log does not: put again, or deleted",
                domain,
                len(writes) - len(gone),
                len(gone),
            )
        await self._write(writes)
        self._synced[domain] = self._generation

    async def _write(self, writes: dict[str, list[bytes | None]]) -> None:
        """Put (or delete) the batch's keys: every key's first write, then every key's second
        (an ended composition's final value is acknowledged before its delete marker goes, and
        stays under it: the bucket keeps two values per key), and so on; each round
        KV_IN_FLIGHT writes at a time, published at once and acknowledged together. Every
        write is waited for, and the first error is raised after all of them."""
        assert self._kv is not None
        rounds = max((len(values) for values in writes.values()), default=0)
        for r in range(rounds):
            ops = [
                (key, values[r], self._headers(values, r))
                for key, values in writes.items()
                if r < len(values)
            ]
            for start in range(0, len(ops), KV_IN_FLIGHT):
                errors = await self._put_acknowledged(ops[start : start + KV_IN_FLIGHT])
                if errors:
                    self._kv = None  # the bucket may be gone: check it (and make it) again
                    raise RelayError(f"KV bucket {self.bucket}: {errors[0]}")

    def _headers(self, values: list[bytes | None], r: int) -> dict[str, str]:
        """The headers of a key's write `values[r]`: a value's, a final value's (one a delete
        follows), or a delete marker's, after a final value or alone."""
        if values[r] is None:
            return self._delete if r > 0 else self._delete_all
        if r + 1 < len(values) and values[r + 1] is None:
            return self._final
        return self._put

    async def _put_acknowledged(
        self, ops: list[tuple[str, bytes | None, dict[str, str]]]
    ) -> list[str]:
        """Publish every write (a put, or a delete marker for None) with a reply subject of
        its own under one inbox, then wait for all the bucket's acknowledgements: one
        subscription and one timer for the group, not a request (a future, a timer and an
        inbox token) per key, which was most of what the relay cost per event. Returns what
        went wrong, one line per write."""
        inbox = self._nc.new_inbox()
        acks: dict[int, Msg] = {}
        all_in = asyncio.get_running_loop().create_future()

        async def acknowledged(msg: Msg) -> None:
            acks[int(msg.subject.rpartition(".")[2])] = msg
            if len(acks) == len(ops) and not all_in.done():
                all_in.set_result(None)

        sub = await self._nc.subscribe(f"{inbox}.*", cb=acknowledged)
        try:
            for i, (key, value, headers) in enumerate(ops):
                subject, reply = f"$KV.{self.bucket}.{key}", f"{inbox}.{i}"
                await self._nc.publish(subject, value or b"", reply=reply, headers=headers)
            try:
                await asyncio.wait_for(all_in, self._publish_timeout)
            except TimeoutError:
                missing = len(ops) - len(acks)
                return [f"no acknowledgement for {missing} of {len(ops)} writes in "
                        f"{self._publish_timeout:g} s"]  # fmt: skip
        finally:
            await sub.unsubscribe()
        return [f"{ops[i][0]}: {why}" for i, msg in sorted(acks.items()) if (why := _refusal(msg))]


#: How long an ended composition's final value stays under its marker (at most the marker's
#: TTL): time for every live watcher to be sent it, not the day a marker stays.
FINAL_VALUE_TTL_S = 300
_ROLLUP = {"Nats-Rollup": "sub"}  # the key's earlier values go (KV buckets allow it)

_decode_ack = msgspec.json.Decoder(dict[str, Any]).decode  # JetStream's publish acknowledgement


def _delete_headers(marker_ttl_s: int) -> dict[str, str]:
    """A delete marker, as nats-py's KeyValue.delete writes it, that the server removes after
    `marker_ttl_s` seconds (0: never): else every ended composition's marker stays for ever."""
    return {"KV-Operation": "DEL", **_ttl_headers(marker_ttl_s)}


def _ttl_headers(ttl_s: int) -> dict[str, str]:
    """A message the server removes after `ttl_s` seconds (0: never)."""
    return {"Nats-TTL": f"{ttl_s}s"} if ttl_s > 0 else {}


def _refusal(ack: Msg) -> str:
    """Why the bucket did not store a write, from its acknowledgement ("" if it did)."""
    if not ack.data:  # a status message: no stream took the subject (503), or another failure
        status = (ack.headers or {}).get("Status", "")
        return f"no bucket took the write (status {status or 'unknown'})"
    answer = _decode_ack(ack.data)
    error = answer.get("error")
    if error:
        return str(error.get("description", error))
    return ""


def _version(progress: Progress) -> int:
    return progress.version


def _same_value(stored: bytes | None, rendered: bytes | None) -> bool:
    """Whether the bucket's value says what the rendered one does, its position aside (a
    value's position may be any from its key's last change to where the relay had reached)."""
    if stored is None or rendered is None:
        return stored is rendered
    try:
        before = msgspec.json.decode(stored)
    except msgspec.DecodeError:
        return False  # not even JSON: written by someone else
    after = msgspec.json.decode(rendered)
    if not isinstance(before, dict):
        return False
    before.pop("position", None)
    after.pop("position", None)
    return bool(before == after)
