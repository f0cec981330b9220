"""The stream audit's judgement (adapters/nats/stream_audit.py), over made-up messages: what a
failover's lost tail leaves is explained, a copy or a rewrite is not."""

from __future__ import annotations

import uuid

import msgspec

from trellis.adapters.nats.jetstream import Envelope
from trellis.adapters.nats.stream_audit import LogEvent, StreamAudit
from trellis.engine.core.records import GENESIS_HASH

D = "hall-1"


def chain(n: int, start: int = 1, prev: str = GENESIS_HASH) -> list[Envelope]:
    """`n` envelopes from version `start`, each linked to the one before (hashes made up)."""
    out = []
    for version in range(start, start + n):
        h = uuid.uuid4().hex * 2
        out.append(
            Envelope(
                id=str(uuid.uuid4()), domain=D, version=version, position=version,
                type="NodeAdded", schema_version=1, recorded_at="2026-12-07T00:00:00.000000Z",
                actor="operator", causation_id="c", correlation_id="c",
                data=msgspec.Raw(b"{}"), prev_hash=prev, hash=h,
            )
        )  # fmt: skip
        prev = h
    return out


def run(stream: list[Envelope | None], log: list[Envelope]) -> StreamAudit:
    by_version = {e.version: LogEvent(e.id, e.hash, e.type) for e in log}
    audit = StreamAudit(D)
    for seq, event in enumerate(stream, 1):
        audit.feed(seq, event, by_version)
    return audit


def test_a_lost_tail_followed_by_the_logs_events_is_counted_not_found() -> None:
    log = chain(6)
    lost = chain(3, start=4, prev=log[2].hash)  # past where the log now ends, too
    audit = run([*log[:3], *lost, None, *log[3:]], log)
    assert audit.findings({}, 6) == []
    assert audit.rewritten == [(4, 4), (5, 5), (6, 6)]
    assert audit.foreign == [7]


def test_a_copy_of_a_lost_event_and_a_rewritten_event_are_found() -> None:
    log = chain(4)
    lost = chain(1, start=4, prev=log[2].hash)
    rewritten = msgspec.structs.replace(log[1], hash="f" * 64)
    audit = run([*log[:3], lost[0], lost[0], *log[3:], rewritten], log)
    found = {f.details["seq"]: f.message for f in audit.findings({}, 4)}
    assert set(found) == {5, 7}
    assert "second copy of the event at seq 4" in found[5]
    assert "the log's event id there but other content" in found[7]
