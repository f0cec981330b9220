"""bench/replay.py judges the rebuild against the raw read only when the raw read, measured
before and after the other steps, is a steady baseline (bench/intents.py's NOISY_DRIFT, as
for its floors); otherwise it shows the rebuild against each read and judges nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.intents import NOISY_DRIFT
from bench.replay import baseline_noise, table


def step(events_per_s: float) -> dict[str, float]:
    events = 200_000
    return {"events": events, "seconds": events / events_per_s, "events_per_s": events_per_s}


def result(first_read: float, second_read: float, rebuild: float) -> dict[str, Any]:
    return {
        "events": 200_000,
        "schema": "bench_replay_200000",
        "raw_read": step(first_read),
        "read_decode": step(first_read / 2),
        "fold": step(first_read / 4),
        "rebuild": step(rebuild),
        "raw_read_again": step(second_read),
    }


def test_a_raw_read_that_moved_2x_is_no_baseline_for_the_rebuild() -> None:
    noisy = result(190_398, 395_826, rebuild=31_000)
    assert "2.1x" in baseline_noise(noisy)
    text = table(noisy)
    assert "of 1st read" in text and "of 2nd read" in text
    verdict = text.splitlines()[-1]
    assert "16.3% of the first raw read, 7.8% of the second" in verdict
    assert "not judged" in verdict and "too noisy" in verdict
    assert "met" not in verdict and "missed" not in verdict


def test_a_steady_raw_read_judges_the_rebuild_on_their_mean() -> None:
    steady = result(300_000, 300_000 * NOISY_DRIFT, rebuild=60_000)
    assert baseline_noise(steady) == ""
    text = table(steady)
    assert "of 2nd read" not in text
    assert text.splitlines()[-1] == "rebuild: 16.0% of the raw read (target ≥ 30%): missed"
    steady["rebuild"] = step(120_000)
    assert table(steady).splitlines()[-1].endswith("32.0% of the raw read (target ≥ 30%): met")
