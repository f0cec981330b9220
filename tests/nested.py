"""pytest run inside the suite, in a process of its own and with a temp root of its own.

A pytest session that finds its temp root (/tmp/pytest-of-<user>) open to others makes it
private again (mode 0700). When the tests run as root the embedded PostgreSQL servers run as
a user of their own (PostgreSQL refuses root), and their data dirs under that root must stay
traversable for it: a nested pytest sharing the root took that away mid-run, and the session's
PostgreSQL stopped ("could not stat data directory ...: Permission denied"). So a nested run
gets `TMPDIR` inside its own folder.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def nested_pytest(
    where: Path,
    *args: str | Path,
    python: str | Path = sys.executable,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """`python -m pytest -q -p no:cacheprovider *args` in `cwd` (else `where`), its temp root
    in `where/tmp`; `env` (else a bare PATH and these tests on PYTHONPATH, for their plugins)."""
    tmp = where / "tmp"
    tmp.mkdir(exist_ok=True)
    base = dict(env) if env is not None else {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS)}
    return subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, args)],
        cwd=cwd or where, env={**base, "TMPDIR": str(tmp)},
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
