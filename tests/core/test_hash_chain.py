"""The sha256 chain: every field counts, and a broken link is found at its version."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import msgspec

from trellis.engine.core.records import GENESIS_HASH, Head, RecordedEvent, chain_hash, verify_chain


def chain(n: int) -> list[RecordedEvent]:
    events, prev = [], GENESIS_HASH
    for version in range(1, n + 1):
        fields = dict(
            id=str(uuid.uuid4()),
            domain="d1",
            version=version,
            type="ComponentDrained",
            schema_version=1,
            recorded_at=datetime(2026, 11, 30, 12, 0, version, 123456, tzinfo=UTC),
            actor="operator",
            causation_id=f"r{version}",
            correlation_id=f"r{version}",
            data=b'{"type":"ComponentDrained","component":"sw-1"}',
        )
        digest = chain_hash(prev, **fields)
        events.append(RecordedEvent(position=version * 10, prev_hash=prev, hash=digest, **fields))
        prev = digest
    return events


def test_an_untouched_chain_verifies() -> None:
    assert verify_chain(chain(5)) is None


def test_altering_any_field_breaks_the_chain_at_that_event() -> None:
    events = chain(5)
    for field, value in [("data", b"{}"), ("actor", "mallory"), ("type", "X"), ("version", 9)]:
        tampered = [*events]
        tampered[2] = msgspec.structs.replace(events[2], **{field: value})
        assert verify_chain(tampered) == tampered[2].version


def test_dropping_an_event_breaks_the_chain_after_the_gap() -> None:
    events = chain(5)
    assert verify_chain(events[:2] + events[3:]) == 4


def test_a_chain_can_be_verified_from_a_known_head() -> None:
    events = chain(5)
    head = Head(events[1].version, events[1].position, events[1].hash)
    assert verify_chain(events[2:], start=head) is None
