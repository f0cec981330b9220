"""bench/pathcheck.py shows a tail percentile, and a ratio from it, only when its sample count
can tell it from the maximum (the economics demo's rule: p99 wants 100 samples, p99.9 1,000)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.pathcheck import HIDDEN, figures_of, growth_of, ratios_of, refused_figures, table


def us(n: int, scale: float = 1.0) -> list[float]:
    """`n` distinct timings, the largest far above the rest."""
    return [scale * (i + 1) for i in range(n - 1)] + [scale * 1e6]


def mode(compiled: list[float], reference: list[float]) -> dict[str, Any]:
    return {
        "compiled": figures_of(compiled),
        "reference": figures_of(reference),
        "compiled_vs_reference": ratios_of(reference, compiled[: len(reference)]),
        "mismatches": {"reference": 0},
    }


def fabric(compiled: int, reference: int, scale: float = 1.0) -> dict[str, Any]:
    return {
        "modes": {
            "single": mode(us(compiled, scale), us(reference, 1000 * scale)),
            "choice": mode(us(compiled, scale), us(reference, 1000 * scale)),
        }
    }


def test_a_tail_needs_the_samples_to_show_it() -> None:
    for n, p99_shown, p999_shown in ((1, False, False), (36, False, False), (175, True, False)):
        figures = figures_of(us(n))
        assert figures["p50_us"] is not None
        assert (figures["p99_us"] is not None) == p99_shown, n
        assert (figures["p999_us"] is not None) == p999_shown, n
    assert figures_of(us(1000))["p999_us"] is not None


def test_no_p99_ratio_from_a_hidden_p99() -> None:
    one = ratios_of(us(1, 1000), us(1))
    assert one["p50"] == pytest.approx(1000)
    assert one["p99"] is None
    assert ratios_of(us(100, 1000), us(100))["p99"] == pytest.approx(1000)


def test_the_table_shows_a_dash_for_a_hidden_cell_and_says_once_what_it_means() -> None:
    text = table({"65,536 devices": fabric(compiled=1000, reference=1)})
    reference_rows = [line.split() for line in text.splitlines() if " reference " in line]
    assert len(reference_rows) == 2
    for row in reference_rows:
        # fabric (2 words), query (2), implementation, n, p50, p99, p99.9, p50 ratio, p99 ratio
        assert row[5] == "1"
        assert row[7:9] == ["-", "-"]  # p99 and p99.9 of one sample
        assert row[9].endswith("x")  # the median of one request is that request
        assert row[10] == "-"  # and no p99 ratio from it
    compiled_rows = [line.split() for line in text.splitlines() if " compiled " in line]
    assert all("-" not in row for row in compiled_rows)  # 1,000 samples show every tail
    assert text.count(HIDDEN) == 1
    assert text.splitlines()[-1] == HIDDEN


def test_growth_judges_no_target_on_a_tail_its_refusals_cannot_show() -> None:
    results = {"4,096 devices": fabric(1000, 10), "65,536 devices": fabric(1000, 10, scale=2)}
    refused = {
        "4,096 devices": refused_figures({"n": 175, "p50": 0.3, "p99": 2.3, "p99.9": 2.4}),
        "65,536 devices": refused_figures({"n": 36, "p50": 0.9, "p99": 0.6, "p99.9": 0.6}),
    }
    growth = growth_of(results, refused)
    figures = growth["figures"]
    assert figures["refused_p50"] == {"ratio": pytest.approx(3.0), "target": 4.0}
    assert figures["refused_p99"]["ratio"] is None  # p99 of 36 refusals
    assert figures["refused_p999"]["ratio"] is None  # p99.9 of 175 and of 36
    assert figures["single_p999"]["ratio"] == pytest.approx(2.0)  # 1,000 samples on both fabrics
    refused_lines = [line for line in growth["lines"] if "refused compose (why-not)" in line]
    assert "3.00x (target ≤ 4x: met)" in refused_lines[0]
    for line in refused_lines[1:]:
        assert line.split()[-1] == "-", line
