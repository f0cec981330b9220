"""A test marked `alone` runs while no other test runs, on two pytest-xdist workers too.

A suite of its own, run with two workers and the lock hooks (tests/alone.py) as its one
plugin: six tests that take a moment each and one marked `alone` append to one file as they
begin and end, and that record must show no test begun while the `alone` one ran.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from nested import nested_pytest

TESTS = Path(__file__).resolve().parents[1]

SUITE = """
import time
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("record.txt")


def visit(name: str) -> None:
    with RECORD.open("a") as record:
        record.write(f"begin {name}\\n")
    time.sleep(0.2)
    with RECORD.open("a") as record:
        record.write(f"end {name}\\n")


@pytest.mark.alone
def test_alone() -> None:  # first: each worker's first test starts at once
    visit("alone")


@pytest.mark.parametrize("n", range(6))
def test_beside(n: int) -> None:
    visit(f"beside-{n}")
"""


def suite_run(where: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The suite run in a pytest of its own, with the lock hooks and its own temp folder."""
    (where / "test_suite.py").write_text(SUITE)
    (where / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: alone\n")
    done = nested_pytest(
        where, "-p", "alone", *args, where,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS), **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def locks_left(where: Path) -> list[Path]:
    return list((where / "tmp").glob("trellis-tests-*"))


def test_an_alone_test_runs_while_no_other_runs(tmp_path: Path) -> None:
    suite_run(tmp_path, "-n", "2", "--dist", "load")
    assert locks_left(tmp_path) == []  # the controller removed them
    record = (tmp_path / "record.txt").read_text().split("\n")[:-1]
    assert len(record) == 14, record
    begun = record.index("begin alone")
    assert record[begun + 1] == "end alone", record  # nothing began or ended in between
    running = {line.split()[1] for line in record[:begun] if line.startswith("begin")}
    ended = {line.split()[1] for line in record[:begun] if line.startswith("end")}
    assert running == ended, record  # and nothing was still running when it began


def test_a_pytest_a_test_starts_takes_no_lock(tmp_path: Path) -> None:
    """It inherits the worker's PYTEST_XDIST_WORKER, yet is no worker: nothing to lock."""
    suite_run(tmp_path, PYTEST_XDIST_WORKER="gw0")
    assert locks_left(tmp_path) == []
