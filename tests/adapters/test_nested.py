"""A pytest run inside the suite keeps its temp files under its own folder.

Sharing the suite's temp root, it made that root private again mid-run and the session's
PostgreSQL (its own user, when the tests run as root) lost its data dir (tests/nested.py).
"""

from __future__ import annotations

from pathlib import Path

from nested import nested_pytest

SUITE = """
def test_where(tmp_path):
    print("tmp_path:", tmp_path)
"""


def test_a_nested_run_keeps_its_temp_root_in_its_own_folder(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    done = nested_pytest(tmp_path, "-s", tmp_path / "test_suite.py")
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "tmp_path:" in line]
    used = Path(line.split("tmp_path:", 1)[1].strip())
    assert used.is_relative_to(tmp_path / "tmp"), used
