"""Tables of a suite's promised zeros, printed at the end of the run, even under `pytest -q`.

A suite fills a table as it goes (`zeros("hostile input").add("events written", n)`); the
terminal-summary hook in tests/conftest.py prints every table that was used, so a reader sees
the zeros the suite promised, and the counts behind them, whatever the verbosity.
"""

from __future__ import annotations

from collections import Counter


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
