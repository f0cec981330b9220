"""A serving process freezes what start-up made and collects rarely (adapters/collector.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from trellis.adapters.collector import THRESHOLDS, settle_for_serving


@pytest.fixture
def collector_restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def _scanned(obj: object) -> bool:
    """Whether a collection of any generation would look at `obj`."""
    return any(o is obj for o in gc.get_objects())


@pytest.mark.usefixtures("collector_restored")
def test_what_start_up_made_is_frozen_and_collections_are_rarer() -> None:
    started = [[i] for i in range(3)]  # what a start-up leaves behind
    assert all(_scanned(s) for s in started)
    settle_for_serving()
    assert not any(_scanned(s) for s in started)
    made_after: list[list[int]] = [[]]
    assert _scanned(made_after)  # what serving makes is collected as ever
    assert gc.get_threshold() == THRESHOLDS
    assert THRESHOLDS[0] > 700  # CPython's: a young collection every 700 allocations
