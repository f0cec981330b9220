"""Tables of a suite's promised zeros, printed at the end of the run, even under `pytest -q`.

A suite fills a table as it goes (`zeros("hostile input").add("events written", n)`); the
terminal-summary hook below (tests/conftest.py takes it in) prints every table that was used,
so a reader sees the zeros the suite promised, and the counts behind them, whatever the
verbosity. Under pytest-xdist each worker fills its own tables and hands them to the
controller when it finishes, and the controller prints their sums.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest


class ZeroTable:
    """Counts that must stay 0 (`add`), beside counts that say how much was tried (`tried`)."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.must_be_zero: Counter[str] = Counter()
        self.work: Counter[str] = Counter()

    def add(self, name: str, count: int = 1) -> None:
        self.must_be_zero[name] += count

    def promise(self, *names: str) -> None:
        """Name zeros up front, so they show even when nothing went wrong."""
        for name in names:
            self.must_be_zero[name] += 0

    def tried(self, name: str, count: int = 1) -> None:
        self.work[name] += count

    def lines(self) -> list[str]:
        width = max(map(len, [*self.must_be_zero, *self.work, "x"]))
        rows = [f"{self.title}:"]
        rows += [f"  {name:<{width}}  {n:>8}" for name, n in sorted(self.work.items())]
        rows += [
            f"  {name:<{width}}  {n:>8}  {'ok' if n == 0 else 'NOT ZERO'}"
            for name, n in sorted(self.must_be_zero.items())
        ]
        return rows


_TABLES: dict[str, ZeroTable] = {}


def zeros(title: str) -> ZeroTable:
    """The run's table named `title` (made on first use)."""
    return _TABLES.setdefault(title, ZeroTable(title))


def tables() -> list[ZeroTable]:
    return list(_TABLES.values())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: send the tables this worker filled to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["zeros"] = [(t.title, dict(t.must_be_zero), dict(t.work)) for t in tables()]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown to a run without it
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the controller: add each worker's counts to its own tables, before they print."""
    for title, must_be_zero, work in getattr(node, "workeroutput", {}).get("zeros", []):
        table = zeros(title)
        table.must_be_zero.update(must_be_zero)
        table.work.update(work)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print every table the suites filled, even under `pytest -q`."""
    for table in tables():
        terminalreporter.write_sep("-", table.title)
        for line in table.lines()[1:]:
            terminalreporter.write_line(line)
