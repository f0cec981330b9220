"""`trellis verify`'s version_gap finding names the versions the chain is missing
(engine/core/audit.py ChainCheck), not only the version before the gap."""

from __future__ import annotations

from datetime import UTC, datetime

from trellis.engine.core.audit import ChainCheck
from trellis.engine.core.records import GENESIS_HASH, RecordedEvent, chain_hash

D = "hall-1"


def chain(n: int) -> list[RecordedEvent]:
    events, prev = [], GENESIS_HASH
    for version in range(1, n + 1):
        fields = dict(
            id=f"e{version}",
            domain=D,
            version=version,
            type="ComponentDrained",
            schema_version=1,
            recorded_at=datetime(2026, 12, 1, 12, 0, version, tzinfo=UTC),
            actor="operator",
            causation_id=f"r{version}",
            correlation_id=f"r{version}",
            data=b'{"type":"ComponentDrained","component":"sw-1"}',
        )
        digest = chain_hash(prev, **fields)
        events.append(RecordedEvent(position=version * 10, prev_hash=prev, hash=digest, **fields))
        prev = digest
    return events


def gaps(events: list[RecordedEvent]) -> list[str]:
    check = ChainCheck(D)
    for event in events:
        check.feed(event)
    return [f.message for f in check.findings if f.check == "version_gap"]


def test_one_missing_version_is_named() -> None:
    events = chain(12)
    assert gaps(events[:9] + events[10:]) == [
        "event 11 (position 110): version 11 follows version 9: version 10 is missing"
    ]


def test_a_run_of_missing_versions_is_named_as_a_range() -> None:
    events = chain(14)
    assert gaps(events[:9] + events[12:]) == [
        "event 13 (position 130): version 13 follows version 9: versions 10-12 are missing"
    ]


def test_missing_first_versions_are_named() -> None:
    assert gaps(chain(4)[2:]) == [
        "event 3 (position 30): version 3 is the first: versions 1-2 are missing"
    ]


def test_a_version_that_goes_back_is_still_named_so() -> None:
    events = chain(3)
    assert gaps([events[0], events[1], events[1]]) == [
        "event 2 (position 20): version 2 repeats or goes back from version 2"
    ]
