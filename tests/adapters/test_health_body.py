"""/healthz's body never contradicts itself: each check's entry in `checks` and its lines in
`problems` come from one reading of what it checks (adapters/http/metrics.py).

During a Postgres stall the lease check read `engine.lease_problem()` and found nothing, and a
moment later the body's `problems` read it again and found "writer leases: every tick failed
for 6 s": `checks.leases` was true beside a lease problem. The problem sources here change
between calls, as that one did.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from trellis.adapters.http.metrics import MetricsServer, Verdict, health_body, problems_check

LEASE_PROBLEM = "writer leases: every tick failed for 6 s (writer lease tick failed: stall)"


async def _true() -> bool:
    return True


class Flipping:
    """A problem source whose answer changes at every call, from `answers` on (the last one
    repeats): the lease problem crossing its patience between two reads."""

    def __init__(self, *answers: str | None) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self) -> list[str | None]:
        self.calls += 1
        return [self.answers[min(self.calls, len(self.answers)) - 1]]


def server(checks: dict[str, Any], details: Any = None) -> MetricsServer:
    return MetricsServer(CollectorRegistry(), checks, details=details)


def agrees(body: dict[str, Any], check: str, problem: str) -> bool:
    """The check fails exactly when its problem is in `problems`."""
    return (not body["checks"][check]) == (problem in body["problems"])


@pytest.mark.parametrize(
    "answers",
    [(None, LEASE_PROBLEM), (LEASE_PROBLEM, None)],
    ids=["problem-appears", "problem-clears"],
)
async def test_the_lease_check_and_its_problem_come_from_one_reading(
    answers: tuple[str | None, ...],
) -> None:
    source = Flipping(*answers)
    metrics = server({"intake": _true, "leases": problems_check(source)})

    for _ in range(3):
        healthy, body = await metrics.health()
        assert agrees(body, "leases", LEASE_PROBLEM), body
        assert healthy == body["checks"]["leases"] == (body["status"] == "ok")
    assert source.calls == 3  # once per answer


async def test_what_checks_read_and_the_details_are_read_before_any_check_awaits() -> None:
    """A check that takes its time (the store's query) does not let the followers' report
    change between the followers check and the details that show it per domain."""
    report = ["relay of domain hall-1: not moved for 61 s"]
    slow_started = asyncio.Event()

    async def store() -> bool:
        slow_started.set()
        await asyncio.sleep(0.05)
        return True

    def details() -> dict[str, Any]:
        return {"problems": [], "domains": {"hall-1": {"ok": not report}}}

    metrics = server({"store": store, "followers": problems_check(lambda: report)}, details)
    answer = asyncio.create_task(metrics.health())
    await slow_started.wait()
    report = []  # the next sample: caught up, while the store check is still awaited
    healthy, body = await answer
    assert not healthy
    assert body["checks"]["followers"] is False
    assert body["domains"]["hall-1"]["ok"] is False
    assert body["problems"] == ["relay of domain hall-1: not moved for 61 s"]


def test_the_body_lists_the_details_problems_then_each_checks_in_order() -> None:
    results: dict[str, bool | Verdict | BaseException] = {
        "intake": True,
        "store": False,
        "leases": Verdict.of([LEASE_PROBLEM]),
        "followers": Verdict.of(["a", None, "b"]),
        "fabric": RuntimeError("raised"),
    }
    healthy, body = health_body(results, {"problems": ["nats-server exited"], "domains": {}})
    assert not healthy
    assert body == {
        "status": "unavailable",
        "checks": {
            "intake": True,
            "store": False,
            "leases": False,
            "followers": False,
            "fabric": False,
        },
        "problems": ["nats-server exited", LEASE_PROBLEM, "a", "b"],
        "domains": {},
    }
    assert list(body) == ["status", "checks", "problems", "domains"]


def test_a_check_with_no_problems_passes() -> None:
    results: dict[str, bool | Verdict | BaseException] = {
        "leases": Verdict.of([None]),
        "fabric": Verdict.of([]),
    }
    assert health_body(results, {}) == (
        True,
        {"status": "ok", "checks": {"leases": True, "fabric": True}, "problems": []},
    )
