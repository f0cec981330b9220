"""The run starts with its slow tests (tests/ordering.py), each group in collected order.

A suite of its own, run with the ordering hook as its one plugin, lists what it would run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

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
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ordering",
         "--collect-only", str(tmp_path)],
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.rsplit("::", 1)[-1] for line in done.stdout.splitlines() if "::" in line]
    assert order == ["test_slow_a", "test_slow_b", "test_quick_a", "test_quick_b"], done.stdout
