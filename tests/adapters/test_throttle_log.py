"""Who is throttled is said in the log, once a minute at most (adapters/nats/throttle_log.py)."""

from __future__ import annotations

import logging

import pytest

from trellis.adapters.nats.throttle_log import ThrottleLog


def test_the_log_names_the_tenants_throttled_with_their_counts_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    scheduled: list[tuple[float, object]] = []
    throttles = ThrottleLog(clock=lambda: now[0], later=lambda s, f: scheduled.append((s, f)))
    with caplog.at_level(logging.WARNING, logger="trellis.adapters.nats.throttle_log"):
        throttles.throttled("intent", "acme")  # the onset is said at once
        for _ in range(4708):
            throttles.throttled("intent", "acme")
        for _ in range(12):
            throttles.throttled("view", "acme")
        throttles.throttled("intent", "bolt")
        now[0] = 59.0
        throttles.throttled("intent", "acme")
        assert len(caplog.records) == 1  # not again within the minute...
        assert [s for s, _ in scheduled] == [60.0]  # ...but told when it is up, flood or not
        now[0] = 60.0
        throttles.tell()
        throttles.tell()  # nothing since: no line
    first, second = (r.getMessage() for r in caplog.records)
    assert "tenant 'acme' 1 intent;" in first, first
    assert "tenant 'acme' 4709 intents, tenant 'acme' 12 views, tenant 'bolt' 1 intent;" in second
    assert "nothing was written for them" in second


def test_past_a_thousand_tenants_the_rest_are_summed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    throttles = ThrottleLog(clock=lambda: now[0], later=lambda s, f: None)
    throttles.throttled("intent", "first")
    for i in range(1500):
        throttles.throttled("intent", f"t{i}")
    caplog.clear()  # the onset's line
    with caplog.at_level(logging.WARNING, logger="trellis.adapters.nats.throttle_log"):
        now[0] = 61.0
        throttles.throttled("intent", "t0")
    (line,) = (r.getMessage() for r in caplog.records)
    assert "tenant 't0' 2 intents" in line and "1495 more of other tenants" in line, line
