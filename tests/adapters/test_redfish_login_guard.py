"""The budgets of failed logins (adapters/http/redfish/login_guard.py)."""

from __future__ import annotations

from trellis.adapters.http.redfish import login_guard
from trellis.adapters.http.redfish.login_guard import LoginGuard


def test_guessing_one_users_password_waits_and_other_users_are_left_alone() -> None:
    now = [100.0]
    guard = LoginGuard(clock=lambda: now[0])
    for _ in range(login_guard.USER_BURST):
        assert guard.wait_s("10.0.0.1", "bob") == 0
        guard.failed("10.0.0.1", "bob")
    assert guard.wait_s("10.0.0.1", "bob") == 1  # one failure back takes 1 s
    # The same address (every local client is 127.0.0.1) for another user: not slowed.
    assert guard.wait_s("10.0.0.1", "alice") == 0
    assert guard.wait_s("10.0.0.2", "bob") == 0
    now[0] += 1.0
    assert guard.wait_s("10.0.0.1", "bob") == 0
    guard.failed("10.0.0.1", "bob")
    assert guard.wait_s("10.0.0.1", "bob") == 1


def test_made_up_user_names_from_one_address_are_limited_as_one() -> None:
    now = [100.0]
    guard = LoginGuard(clock=lambda: now[0])
    for i in range(login_guard.ADDRESS_BURST):
        assert guard.wait_s("10.0.0.1", f"nobody{i}") == 0
        guard.failed("10.0.0.1", f"nobody{i}")
    assert guard.wait_s("10.0.0.1", "somebody-new") == 1
    assert guard.wait_s("10.0.0.2", "somebody-new") == 0
    now[0] += 0.2  # ten a second: two back
    assert guard.wait_s("10.0.0.1", "somebody-new") == 0


def test_many_addresses_do_not_reset_a_throttled_one() -> None:
    now = [100.0]
    guard = LoginGuard(clock=lambda: now[0])
    for _ in range(login_guard.USER_BURST):
        guard.failed("10.0.0.1", "bob")
    for i in range(login_guard._REMEMBERED * 2):  # each address one failure: nearly whole
        guard.failed(f"10.1.{i // 256}.{i % 256}", "bob")
    assert guard.wait_s("10.0.0.1", "bob") == 1
