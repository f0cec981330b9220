"""The canonical time text: it is hashed into the chain, so it must never change by a byte."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from trellis.engine.core.records import format_time

# What every log written so far hashed: strftime's text of the time in UTC.
_CANONICAL = "%Y-%m-%dT%H:%M:%S.%fZ"

_offsets = st.integers(min_value=-23 * 60, max_value=23 * 60).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)


@given(
    st.datetimes(min_value=datetime(1000, 1, 2), max_value=datetime(9999, 12, 30)),
    st.one_of(st.just(UTC), _offsets),
)
def test_any_aware_time_is_written_as_its_utc_strftime_text(
    naive: datetime, zone: timezone
) -> None:
    at = naive.replace(tzinfo=zone)
    assert format_time(at) == at.astimezone(UTC).strftime(_CANONICAL)


def test_whole_seconds_keep_their_six_zeros_and_the_z() -> None:
    assert format_time(datetime(2026, 12, 4, 15, 0, 0, tzinfo=UTC)) == "2026-12-04T15:00:00.000000Z"
