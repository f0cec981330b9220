"""bench/scale.py's pure helpers: the balance it waits for before a fleet phase, and its ratios."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scale import ratio, spread_of


def test_balance_is_the_largest_difference_between_two_engines() -> None:
    assert spread_of({}) == 0
    assert spread_of({1: 24}) == 0
    assert spread_of({1: 8, 2: 8, 3: 8}) == 0
    assert spread_of({1: 7, 2: 8, 3: 9}) == 2
    assert spread_of({1: 6, 2: 6, 3: 6, 4: 5}) == 1


def test_a_ratio_over_nothing_is_no_figure() -> None:
    assert ratio(3.0, 1.5) == 2.0
    assert math.isnan(ratio(3.0, 0.0))
    assert math.isnan(ratio(3.0, -0.01))  # a baseline within the noise of nothing
