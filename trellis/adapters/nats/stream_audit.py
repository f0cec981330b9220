"""The stream side of `trellis verify`: every message of a domain in TRELLIS_EVENTS against the
log.

A message that is no event of the log's form (`jetstream.stream_event` says None: ARCHITECTURE
§3) is foreign: counted, never a finding. Every other message claims to be the log's event at
its version, and must be, but for one documented exception. What is a finding:

- a second copy of an event the stream already carried (same id, or the log's event at a
  version the stream already carried the log's event of): the relay publishes each event once;
- an event with the id of the log's event at its version but another hash (a log row edited
  in place under its old hash is the chain check's: this side compares hashes);
- an event the log does not hold (another id or hash than the log's at its version, or a
  version past the log's head) that no failover explains.

The exception (docs/deployment.md §3, adapters/nats/relay.py): after a failover that lost the
log's tail, the stream keeps the lost events and the relay publishes the log's own events at
those versions after them. A run of events the log does not hold is explained so when each
chains onto the one before it in the stream (or onto the log's event before its version), and
a later message is the log's own event at a version no higher: the relay's republication.
Those are counted (`rewritten`), not findings. A forged event published the same way (chained
onto the stream's last event, before the engine writes that version) looks exactly like a lost
one: in plain mode anyone may publish into the stream, which only secure mode prevents
(docs/security.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

import asyncpg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy

from trellis.adapters.nats.jetstream import Envelope, stream_event, stream_name
from trellis.engine.core.audit import Finding
from trellis.engine.core.records import GENESIS_HASH

CHUNK = 1000  # stream messages checked against one read of the log
MAX_FINDINGS = 20  # named per domain; the rest are counted
READ_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class LogEvent:
    """What the audit needs of the log's event at a version."""

    id: str
    hash: str
    type: str


@dataclasses.dataclass
class _Seen:
    seq: int
    event: Envelope


class StreamAudit:
    """One domain's messages, in stream order, against the log (pure: the caller reads both)."""

    def __init__(self, domain: str):
        self.domain = domain
        self.events = 0
        self.foreign: list[int] = []  # their sequences
        self.rewritten: list[tuple[int, int]] = []  # (seq, version) explained by a lost tail
        self._findings: list[Finding] = []
        self._prev: Envelope | None = None  # the domain's last event so far in the stream
        self._carried = 0  # the highest version at which the stream carried the log's event
        self._ids: dict[str, int] = {}  # id -> seq of every event the log does not hold
        self._pending: list[_Seen] = []  # events the log does not hold, not yet explained

    def feed(self, seq: int, event: Envelope | None, log: Mapping[int, LogEvent]) -> None:
        """The message at `seq` (None: foreign); `log` holds the log's events at its version
        and the one before (absent: the log holds none there)."""
        if event is None:
            self.foreign.append(seq)
            return
        self.events += 1
        prev, self._prev = self._prev, event
        mine = log.get(event.version)
        if mine is not None and mine.hash == event.hash:
            if event.version <= self._carried:
                self._find(seq, event, "is a second copy of the log's event at that version")
                return
            self._carried = event.version
            # The relay's republication after a lost tail: what it wrote again is explained.
            still = [p for p in self._pending if p.event.version < event.version]
            self.rewritten += [(p.seq, p.event.version) for p in self._pending if p not in still]
            self._pending = still
            return
        if mine is not None and mine.id == event.id:
            self._find(seq, event, f"has the log's event id there but other content ({mine.hash})")
            return
        if (first := self._ids.get(event.id)) is not None:
            self._find(seq, event, f"is a second copy of the event at seq {first}")
            return
        self._ids[event.id] = seq
        before = log.get(event.version - 1)
        onto = {GENESIS_HASH} if event.version == 1 else {before.hash} if before else set()
        if prev is not None and prev.version == event.version - 1:
            onto.add(prev.hash)
        if event.prev_hash not in onto:
            self._find(seq, event, "does not chain onto the event before its version")
            return
        self._pending.append(_Seen(seq, event))

    def findings(self, log: Mapping[int, LogEvent], head: int) -> list[Finding]:
        """Every finding, once every message is fed; `log` holds the log's events at the
        versions of the events still unexplained (`unexplained`), `head` is the log's head."""
        for p in self._pending:
            mine = log.get(p.event.version)
            if mine is None:
                what = f"is not the log's: the log ends at version {head}"
            else:
                differs = ["id", "hash"] + (["type"] if mine.type != p.event.type else [])
                what = (
                    f"is not the log's: its {', '.join(differs)} differ from the log's event "
                    f"there (id {mine.id}, {mine.type}, hash {mine.hash})"
                )
            self._find(p.seq, p.event, what)
        self._pending = []
        named = self._findings[:MAX_FINDINGS]
        if len(self._findings) > MAX_FINDINGS:
            named.append(
                Finding(
                    check="stream",
                    domain=self.domain,
                    message=f"{len(self._findings) - MAX_FINDINGS} more messages of the stream "
                    "are not the log's events",
                )
            )
        return named

    def unexplained(self) -> list[int]:
        """The versions of the events the log does not hold that no republication followed."""
        return [p.event.version for p in self._pending]

    @property
    def carried(self) -> int:
        """The highest version at which the stream carries the log's own event."""
        return self._carried

    def _find(self, seq: int, event: Envelope, what: str) -> None:
        self._findings.append(
            Finding(
                check="stream",
                domain=self.domain,
                position=event.position,
                version=event.version,
                message=f"seq {seq} of the stream ({event.type}, version {event.version}, id "
                f"{event.id}) {what}",
                details={"seq": seq, "id": event.id, "type": event.type, "hash": event.hash},
            )
        )


async def audit(
    js: Any, conn: asyncpg.Connection, prefix: str, domain: str, upto_seq: int
) -> StreamAudit:
    """Every message of `domain` in the stream up to sequence `upto_seq`, checked against the
    log read on `conn`; the audit, to take its findings from."""
    checked = StreamAudit(domain)
    chunk: list[tuple[int, Envelope | None]] = []
    async for seq, event in _messages(js, prefix, domain, upto_seq):
        chunk.append((seq, event))
        if len(chunk) >= CHUNK:
            await _feed(checked, conn, chunk)
            chunk = []
    await _feed(checked, conn, chunk)
    return checked


async def log_events(
    conn: asyncpg.Connection, domain: str, versions: set[int]
) -> dict[int, LogEvent]:
    rows = await conn.fetch(
        "SELECT version, id::text AS id, hash, type FROM trellis_events "
        "WHERE domain = $1 AND version = ANY($2::bigint[])",
        domain,
        sorted(versions),
    )
    return {r["version"]: LogEvent(r["id"], r["hash"], r["type"]) for r in rows}


async def _feed(
    checked: StreamAudit, conn: asyncpg.Connection, chunk: list[tuple[int, Envelope | None]]
) -> None:
    versions = {v for _, e in chunk if e is not None for v in (e.version, e.version - 1)}
    log = await log_events(conn, checked.domain, versions) if versions else {}
    for seq, event in chunk:
        checked.feed(seq, event, log)


async def _messages(
    js: Any, prefix: str, domain: str, upto_seq: int
) -> AsyncIterator[tuple[int, Envelope | None]]:
    """(stream sequence, the event it carries or None) for each message on the domain's
    subjects, oldest first, up to `upto_seq`."""
    if upto_seq <= 0:
        return
    sub = await js.subscribe(
        f"{prefix}.events.{domain}.*",
        stream=stream_name(prefix),
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
            except NatsTimeoutError:
                return  # what was there up to `upto_seq` aged out meanwhile
            seq = msg.metadata.sequence.stream
            if seq > upto_seq:
                return
            yield seq, stream_event(prefix, msg.subject, msg.data, msg.headers)
            if seq >= upto_seq:
                return
    finally:
        await sub.unsubscribe()
