"""The budget of failed logins per client address (adapters/http/redfish/login_guard.py)."""

from __future__ import annotations

from trellis.adapters.http.redfish.login_guard import LoginGuard


def test_an_address_past_its_failures_waits_until_its_budget_refills() -> None:
    now = [100.0]
    guard = LoginGuard(burst=3, refill_per_s=0.5, clock=lambda: now[0])
    for _ in range(3):
        assert guard.wait_s("10.0.0.1") == 0
        guard.failed("10.0.0.1")
    assert guard.wait_s("10.0.0.1") == 2  # one failure back takes 2 s at 0.5 a second
    assert guard.wait_s("10.0.0.2") == 0  # another address has its own budget
    now[0] += 1.0
    assert guard.wait_s("10.0.0.1") == 1
    now[0] += 1.0
    assert guard.wait_s("10.0.0.1") == 0
    guard.failed("10.0.0.1")
    assert guard.wait_s("10.0.0.1") == 2
    now[0] += 60.0  # refilled, and never past the burst
    for _ in range(3):
        assert guard.wait_s("10.0.0.1") == 0
        guard.failed("10.0.0.1")
    assert guard.wait_s("10.0.0.1") > 0
