"""The run starts with the tests marked `slow`, so none of them is the last one left.

pytest-xdist's worksteal gives each worker a contiguous share of the collected tests, and a
worker that runs out takes half of what another has not started. A minute-long test collected
near the end (the wheel's installs are in tests/integration) would then run alone at the end
while the other core idles. Started first, the slow tests overlap the many short ones, which
are what is left to share at the end.
"""

from __future__ import annotations

import pytest


def slow_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with the slow ones first, each group in its collected order."""
    return sorted(items, key=lambda item: item.get_closest_marker("slow") is None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = slow_first(items)
