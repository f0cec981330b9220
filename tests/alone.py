"""Tests marked `alone` run while no other test of the run runs, on pytest-xdist's workers too.

The chaos suites time the contract's promises (a writer taken over within 5 s, a frozen
engine's traffic moved within 10 s) on this machine's two cores; a second test beside them
would spend the cores those promises are measured on. So on a worker every test holds a lock
of the run (shared, or exclusive for `alone`) from its setup to its teardown. A turnstile in
front of it keeps an `alone` test that waits from being passed by the other worker's next
tests. The workers' parent, the controller, removes the two lock files at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest


def _locks(controller: int) -> tuple[Path, Path]:
    """The run's turnstile and room, named after the process that runs the workers."""
    stem = Path(tempfile.gettempdir()) / f"trellis-tests-{controller}"
    return stem.with_suffix(".turnstile"), stem.with_suffix(".room")


@contextlib.contextmanager
def _locked(path: Path, operation: int) -> Iterator[None]:
    with path.open("a") as held:
        fcntl.flock(held, operation)
        yield  # closing the file releases the lock


@contextlib.contextmanager
def _turn(alone: bool) -> Iterator[None]:
    """This test's turn: alone, or beside other tests that are not alone."""
    turnstile, room = _locks(os.getppid())
    with contextlib.ExitStack() as held:
        with _locked(turnstile, fcntl.LOCK_EX):
            held.enter_context(_locked(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH))
        yield


def _on_a_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker. Not read from PYTEST_XDIST_WORKER: a
    pytest that a test starts inherits that variable without being a worker."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    if not _on_a_worker(item.config):
        return (yield)  # one process runs one test at a time anyway
    with _turn(alone=item.get_closest_marker("alone") is not None):
        return (yield)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _on_a_worker(config):  # the controller, or a run without workers
        for lock in _locks(os.getpid()):
            lock.unlink(missing_ok=True)
