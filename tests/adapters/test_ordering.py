"""The run starts with its slow tests (tests/ordering.py), each group in collected order.

A suite of its own, run with the ordering hook as its one plugin, lists what it would run."""

from __future__ import annotations

from pathlib import Path

from nested import nested_pytest

SUITE = """
import pytest


def test_quick_a() -> None:
    pass


@pytest.mark.slow
def test_slow_a() -> None:
    pass


def test_quick_b() -> None:
    pass


@pytest.mark.slow
def test_slow_b() -> None:
    pass
"""


def test_the_slow_tests_are_collected_first_and_in_order(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    done = nested_pytest(tmp_path, "-p", "ordering", "--collect-only", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.rsplit("::", 1)[-1] for line in done.stdout.splitlines() if "::" in line]
    assert order == ["test_slow_a", "test_slow_b", "test_quick_a", "test_quick_b"], done.stdout
