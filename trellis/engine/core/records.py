"""The log's envelope around an event: ids, versions, positions and the sha256 hash chain.

Hashing lives here, in the pure core, so the writer and every auditor compute it the same way.
The hash covers the exact JSON text of `data` as stored (a `json` column keeps it byte-exact).
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime

import msgspec

from trellis.engine.core.events import SCHEMA_VERSIONS, Event, encode
from trellis.engine.core.upcast import upcast

GENESIS_HASH = "0" * 64


class Head(msgspec.Struct, frozen=True):
    """Where a domain's stream ends: its last version, that event's position and hash."""

    version: int = 0
    position: int = 0
    hash: str = GENESIS_HASH


class PendingEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event decided but not yet appended; the store assigns position and chains the hash."""

    id: str
    type: str
    schema_version: int
    actor: str
    causation_id: str
    correlation_id: str
    recorded_at: datetime
    data: bytes

    @classmethod
    def of(
        cls, event: Event, *, actor: str, causation_id: str, correlation_id: str, at: datetime
    ) -> PendingEvent:
        name = type(event).__name__
        return cls(
            id=str(uuid.uuid4()),
            type=name,
            schema_version=SCHEMA_VERSIONS[name],
            actor=actor,
            causation_id=causation_id,
            correlation_id=correlation_id,
            recorded_at=at,
            data=encode(event),
        )


class RecordedEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event as it stands in the log (ARCHITECTURE §6)."""

    id: str
    domain: str
    version: int
    position: int
    type: str
    schema_version: int
    recorded_at: datetime
    actor: str
    causation_id: str
    correlation_id: str
    data: bytes
    prev_hash: str
    hash: str

    def event(self) -> Event:
        """The payload as today's Struct, upcast from older schema versions."""
        return upcast(self.type, self.schema_version, self.data)


_encode_time = msgspec.json.Encoder().encode


def format_time(at: datetime) -> str:
    """Canonical UTC timestamp with microseconds; what Postgres timestamptz round-trips exactly."""
    # On the hot paths of the writer and the relay the times are UTC already. msgspec writes a
    # UTC time as RFC 3339 with "Z", in C, five times faster than isoformat; it leaves out a
    # fraction of zero microseconds, which the canonical text keeps.
    if at.tzinfo is not UTC:
        at = at.astimezone(UTC)
    if at.microsecond:
        return _encode_time(at)[1:-1].decode()
    return at.isoformat(timespec="microseconds")[:-6] + "Z"


def chain_hash(
    prev_hash: str,
    *,
    id: str,
    domain: str,
    version: int,
    type: str,
    schema_version: int,
    recorded_at: datetime,
    actor: str,
    causation_id: str,
    correlation_id: str,
    data: bytes,
) -> str:
    """sha256 over the previous hash and every field of the event, in a fixed order."""
    header = "\n".join(
        [
            prev_hash,
            id,
            domain,
            str(version),
            type,
            str(schema_version),
            format_time(recorded_at),
            actor,
            causation_id,
            correlation_id,
        ]
    ).encode()
    return hashlib.sha256(header + b"\n" + data).hexdigest()


def hash_of(event: PendingEvent | RecordedEvent, prev_hash: str, domain: str, version: int) -> str:
    """`chain_hash` of an event (pending or recorded) placed at `version` of `domain`."""
    return chain_hash(
        prev_hash,
        id=event.id,
        domain=domain,
        version=version,
        type=event.type,
        schema_version=event.schema_version,
        recorded_at=event.recorded_at,
        actor=event.actor,
        causation_id=event.causation_id,
        correlation_id=event.correlation_id,
        data=event.data,
    )


def verify_chain(events: list[RecordedEvent], start: Head | None = None) -> int | None:
    """Return the version of the first event whose hash or link is wrong, or None if all hold."""
    head = start or Head()
    for ev in events:
        expected = hash_of(ev, head.hash, ev.domain, ev.version)
        if ev.version != head.version + 1 or ev.prev_hash != head.hash or ev.hash != expected:
            return ev.version
        head = Head(ev.version, ev.position, ev.hash)
    return None
