"""CompositionService.ReservationDuration as Redfish writes it: ISO 8601 durations in days,
hours, minutes and whole seconds (tests/integration/test_redfish_service.py PATCHes it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trellis.adapters.http.redfish import reservation_duration
from trellis.adapters.http.redfish.reservation_duration import DEFAULT_SECONDS, ReservationDuration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("PT300S", 300), ("PT10M", 600), ("PT1H30M", 5400), ("P1D", 86400), ("P1DT2H", 93600),
     ("PT0S", 0), ("P", None), ("PT", None), ("P1DT", None), ("PT1.5S", None), ("-PT1S", None),
     ("P1M", None), ("P1Y", None), ("PT5s", None), ("300", None), ("PT300S ", None)],
)  # fmt: skip
def test_durations_in_days_hours_minutes_and_whole_seconds(text: str, seconds: int | None) -> None:
    assert reservation_duration.parse(text) == seconds


def test_the_duration_is_kept_in_its_file_and_defaults_to_the_engines(tmp_path: Path) -> None:
    path = tmp_path / "duration.json"
    assert ReservationDuration(path).seconds == DEFAULT_SECONDS
    ReservationDuration(path).set(600)
    assert ReservationDuration(path).seconds == 600
    assert path.stat().st_mode & 0o777 == 0o600
