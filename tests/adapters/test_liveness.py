"""The health checks that ask a server now (adapters/liveness.py): the store check answers
within its bound whatever the query does, and keeps one query in flight at a time."""

from __future__ import annotations

import asyncio
import gc

import pytest

from trellis.adapters import liveness
from trellis.adapters.http.metrics import Verdict
from trellis.adapters.liveness import StoreCheck


@pytest.fixture(autouse=True)
def short_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "HEALTH_CHECK_S", 0.2)


async def test_a_stalled_query_is_reported_in_time_and_not_sent_again() -> None:
    """A frozen Postgres: the query neither returns nor lets itself be cancelled promptly
    (asyncpg's cancel is a request the frozen server does not answer either)."""
    thawed = asyncio.Event()
    sent = 0

    async def query() -> None:
        nonlocal sent
        sent += 1
        while not thawed.is_set():
            try:
                await thawed.wait()
            except asyncio.CancelledError:
                continue  # a cancel that does not take, as against a frozen server

    check = StoreCheck(query)
    first = await asyncio.wait_for(check(), 1.0)
    assert not first.ok and first.problems[0].startswith("store: a query has had no answer for")
    second = await asyncio.wait_for(check(), 1.0)  # waits for the same query again
    assert not second.ok and sent == 1
    thawed.set()  # the server wakes: the query sent before answers, then a new one
    assert await check() == Verdict(True) and sent == 1
    assert await check() == Verdict(True) and sent == 2


async def test_a_failed_query_names_its_failure() -> None:
    async def query() -> None:
        raise ConnectionRefusedError("connection refused")

    verdict = await StoreCheck(query)()
    assert verdict == Verdict(False, ("store: a query failed: connection refused",))


async def test_a_query_that_ended_between_two_checks_is_asked_again_not_reported() -> None:
    """The re-check probe: a query left running by a check during an outage failed later;
    the first check after the store had recovered (30 s later) reported that old failure."""
    thawed = asyncio.Event()
    answers: list[str] = []

    async def query() -> None:
        if not thawed.is_set():
            await thawed.wait()
            answers.append("failed")
            raise TimeoutError  # what the frozen server's query ended with, later
        answers.append("ok")

    check = StoreCheck(query)
    assert not (await check()).ok  # during the outage
    thawed.set()
    await asyncio.sleep(0.05)  # the old query fails meanwhile, no check waiting for it
    assert answers == ["failed"]
    unread: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unread.append(context))
    assert await check() == Verdict(True) and answers == ["failed", "ok"]
    gc.collect()  # a failure never read is logged when its task is collected
    assert unread == []
