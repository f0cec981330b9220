"""Failures said on every retry while a server is away are said once a minute, counted
(adapters/bootstrap.py `Repeats`): asyncpg's pool reconnects, and the writer lease's tick,
which logged a traceback every tick for as long as an external Postgres was down."""

from __future__ import annotations

import logging

import asyncpg
import pytest

from trellis.adapters import bootstrap
from trellis.adapters.bootstrap import RETRYING_LOGGERS, quiet_pool_reconnects
from trellis.engine.core.errors import StoreUnavailable


@pytest.mark.parametrize("name", RETRYING_LOGGERS)
def test_a_failure_said_each_retry_is_said_once_a_minute_with_a_count(
    name: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(bootstrap.time, "monotonic", lambda: now[0])
    quiet_pool_reconnects()
    quiet_pool_reconnects()  # once per process, however often it is asked
    retrying = logging.getLogger(name)
    assert sum(isinstance(f, bootstrap.Repeats) for f in retrying.filters) == 1
    failure = StoreUnavailable("cannot reach Postgres")
    with caplog.at_level(logging.ERROR, logger=name):
        for _ in range(5):
            retrying.error("writer lease tick failed", exc_info=failure)
            now[0] += 1
        now[0] += bootstrap.REPEATS_EVERY_S
        retrying.error("writer lease tick failed", exc_info=failure)
        retrying.error("writer lease tick failed")  # no failure with it: not counted
        retrying.error("writer lease tick failed")
    said = [r.getMessage() for r in caplog.records if r.name == name]
    assert len(said) == 4, said
    assert "cannot reach Postgres" in said[0]
    assert said[1].endswith("(4 more like it in the last 60 s)"), said


@pytest.mark.parametrize(
    "away",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        asyncpg.CannotConnectNowError("the database system is shutting down"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    ],
    ids=repr,
)
def test_a_server_that_is_away_is_said_in_one_line_without_a_traceback(
    away: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """A Postgres fast shutdown under a pool printed asyncpg's whole traceback: its errors
    for a server going away are not OSErrors."""
    repeats = bootstrap.Repeats()
    record = logging.LogRecord(
        "asyncpg.pool", logging.WARNING, __file__, 1, "Failed to restore the pool", None,
        (type(away), away, None),
    )  # fmt: skip
    assert repeats.filter(record)
    assert record.exc_info is None and repr(away) in record.getMessage()
    bug = ValueError("a bug")
    record = logging.LogRecord(
        "asyncpg.pool", logging.WARNING, __file__, 1, "Failed", None, (ValueError, bug, None)
    )
    assert repeats.filter(record)
    assert record.exc_info is not None  # anything else keeps its traceback
