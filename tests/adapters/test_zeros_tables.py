"""The zeros tables (tests/zeros.py) print what every pytest-xdist worker counted, summed.

`make test` runs the suite on two workers; each fills its own tables, and only the
controller prints. A small suite of two tests, each counting into one table, is run on two
workers in a pytest of its own, with the tables' hooks as its one plugin.
"""

from __future__ import annotations

from pathlib import Path

from nested import nested_pytest

COUNTING = """
from zeros import zeros


def test_{n}() -> None:
    table = zeros("promised")
    table.tried("tries", {tries})
    table.promise("failures")
"""


def test_two_workers_tables_are_printed_once_with_their_sums(tmp_path: Path) -> None:
    (tmp_path / "test_first.py").write_text(COUNTING.format(n="first", tries=3))
    (tmp_path / "test_second.py").write_text(COUNTING.format(n="second", tries=4))
    done = nested_pytest(
        tmp_path, "-p", "zeros", "-n", "2", "--dist", "load", "--rootdir", tmp_path, tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout
    assert done.stdout.count(" promised ") == 1, done.stdout  # one table, from the controller
    lines = done.stdout.splitlines()
    assert any(line.split() == ["tries", "7"] for line in lines), done.stdout
    assert any(line.split() == ["failures", "0", "ok"] for line in lines), done.stdout
