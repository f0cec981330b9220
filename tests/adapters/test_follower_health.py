"""/healthz fails within TRELLIS_HEALTH_STALL_SECONDS of a follower's last move, though it
is only sampled every second (adapters/health.py; ARCHITECTURE §10: "within 60 s")."""

from __future__ import annotations

from typing import Any

import pytest

from trellis.adapters import health
from trellis.adapters.health import FollowerHealth, stall_threshold
from trellis.engine.core.lag import LagTracker


class Checkpoints:
    """The checkpoints table as the sampler reads it: the relay of `hall` at `version`."""

    def __init__(self) -> None:
        self.version = 5

    async def fetch(self, query: str, domains: list[str]) -> list[dict[str, Any]]:
        return [{"follower": "relay", "domain": "hall", "version": self.version, "position": 9}]


async def test_a_follower_that_stops_fails_health_within_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = Checkpoints()
    head = [6]
    sampler = FollowerHealth(
        table,  # type: ignore[arg-type]
        lambda: {"hall": (head[0], head[0])},
        {"relay": "relay"},
        LagTracker(stall_threshold(60.0)),
    )
    # The relay moved last at t=0 (version 5), just after a sample: the next sample, at
    # 0.99 s, is the first to see it there. The log keeps growing; samples every second.
    now = [0.99]
    monkeypatch.setattr(health.time, "monotonic", lambda: now[0])
    failed_at = None
    while now[0] <= 62.0 and failed_at is None:
        await sampler.sample()
        if sampler.problems():
            failed_at = now[0]
        head[0] += 1
        now[0] += health.EVERY_S
    assert failed_at is not None and failed_at <= 60.0, failed_at
    (problem,) = sampler.problems()
    assert problem.startswith("relay of domain hall: not moved for 58 s"), problem


def test_the_threshold_keeps_one_sample_at_least() -> None:
    assert stall_threshold(60.0) == 58.0
    assert stall_threshold(1.5) == health.EVERY_S
