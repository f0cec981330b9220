"""The Redfish service's accounts file (adapters/http/redfish/accounts.py): slow salted hashes
only, 0600, tenants required, sessions that expire."""

from __future__ import annotations

import asyncio
import json
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from trellis.adapters.http.redfish import accounts
from trellis.adapters.http.redfish.accounts import AccountError, AccountStore, admin_password
from trellis.adapters.http.redfish.session_timeout import SessionTimeout


async def test_stores_only_salted_scrypt_hashes_in_a_0600_file(tmp_path: Path) -> None:
    store = AccountStore(tmp_path / "accounts.json")
    store.ensure_admin("first-password")
    await store.create("alice", "alice-password", "Operator", "acme")
    await store.create("bob", "alice-password", "ReadOnly", "bolt")
    raw = (tmp_path / "accounts.json").read_text()
    assert "alice-password" not in raw and "first-password" not in raw
    rows = {a["user_name"]: a for a in json.loads(raw)}
    assert rows["alice"]["salt"] != rows["bob"]["salt"]
    assert rows["alice"]["hash"] != rows["bob"]["hash"]  # same password, other salt
    assert stat.S_IMODE((tmp_path / "accounts.json").stat().st_mode) == 0o600
    again = AccountStore(tmp_path / "accounts.json")
    assert again.check("alice", "alice-password") is not None
    assert again.check("alice", "wrong-password") is None
    assert again.check("nobody", "alice-password") is None
    assert not again.ensure_admin("another-password")  # made once
    assert again.check("admin", "first-password") is not None


async def test_refuses_tenant_roles_without_a_tenant_and_administrators_with_one(
    tmp_path: Path,
) -> None:
    store = AccountStore(tmp_path / "accounts.json")
    with pytest.raises(AccountError):
        await store.create("alice", "long-enough", "Operator", None)
    with pytest.raises(AccountError):
        await store.create("root2", "long-enough", "Administrator", "acme")
    with pytest.raises(AccountError):
        await store.create("alice", "short", "Operator", "acme")
    with pytest.raises(AccountError):
        await store.create("al ice", "long-enough", "Operator", "acme")
    with pytest.raises(AccountError):
        await store.create("alice", "long-enough", "Superuser", "acme")
    await store.create("alice", "long-enough", "Operator", "acme")
    with pytest.raises(AccountError):
        await store.create("alice", "long-enough", "Operator", "acme")


async def test_sessions_expire_and_end_with_a_password_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AccountStore(tmp_path / "accounts.json")
    alice = await store.create("alice", "alice-password", "Operator", "acme")
    session = store.open_session(alice)
    assert store.by_token(session.token) is not None
    await store.update("alice", password="new-password")
    assert store.by_token(session.token) is None
    later = store.open_session(alice)
    now = accounts.time.monotonic()
    monkeypatch.setattr(accounts.time, "monotonic", lambda: now + accounts.SESSION_TIMEOUT_S + 1)
    assert store.by_token(later.token) is None


def test_the_generated_admin_password_is_kept_in_a_0600_file(tmp_path: Path) -> None:
    password, path = admin_password(tmp_path, None)
    assert path is not None and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert admin_password(tmp_path, None) == (password, path)
    assert admin_password(tmp_path, "given-password") == ("given-password", None)


async def test_a_changed_session_timeout_holds_for_live_sessions_and_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SessionService.SessionTimeout (an Administrator's PATCH) is every session's idle timeout
    from then on, those already open included, and a store made again on the file keeps it."""
    store = AccountStore(tmp_path / "accounts.json")
    path = tmp_path / "session-timeout.json"
    timeout = SessionTimeout(store, path)
    assert timeout.seconds == accounts.SESSION_TIMEOUT_S
    alice = await store.create("alice", "alice-password", "Operator", "acme")
    session = store.open_session(alice)
    timeout.set(30)
    now = accounts.time.monotonic()
    monkeypatch.setattr(accounts.time, "monotonic", lambda: now + 20)
    assert store.by_token(session.token) is not None  # used: its 30 s start again
    monkeypatch.setattr(accounts.time, "monotonic", lambda: now + 20 + 31)
    assert store.by_token(session.token) is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = AccountStore(tmp_path / "accounts.json")
    assert SessionTimeout(again, path).seconds == again.session_timeout_s == 30


async def test_proven_credentials_need_no_hash_until_the_password_or_account_changes(
    tmp_path: Path,
) -> None:
    store = AccountStore(tmp_path / "accounts.json")
    await store.create("alice", "alice-password", "Operator", "acme")
    assert store.proven("alice", "alice-password") is None  # nothing proven yet
    assert await store.verify("alice", "wrong-password") is None
    assert store.proven("alice", "wrong-password") is None  # a failure is never remembered
    assert await store.verify("alice", "alice-password") is not None
    assert store.proven("alice", "alice-password") is not None
    assert store.proven("alice", "alice-passwor") is None
    await store.update("alice", enabled=False)
    assert store.proven("alice", "alice-password") is None
    await store.update("alice", enabled=True)
    assert store.proven("alice", "alice-password") is not None
    await store.update("alice", password="other-password")
    assert store.proven("alice", "alice-password") is None
    assert await store.verify("alice", "alice-password") is None


async def test_an_account_keeps_its_most_recently_used_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that logs in per request and never out ended only its own oldest sessions:
    memory holds at most SESSIONS_PER_ACCOUNT of each account's."""
    store = AccountStore(tmp_path / "accounts.json")
    alice = await store.create("alice", "alice-password", "Operator", "acme")
    bob = await store.create("bob", "bob-password", "Operator", "bolt")
    bobs = store.open_session(bob)
    now = accounts.time.monotonic()
    opened = []
    for i in range(accounts.SESSIONS_PER_ACCOUNT + 2):
        monkeypatch.setattr(accounts.time, "monotonic", lambda i=i: now + i)
        opened.append(store.open_session(alice))
    monkeypatch.setattr(accounts.time, "monotonic", lambda: now + 100)
    assert [store.by_token(s.token) is not None for s in opened[:3]] == [False, False, True]
    assert all(store.by_token(s.token) is not None for s in opened[2:])
    assert store.by_token(bobs.token) is not None  # another account's are not touched
    assert len(store.sessions()) == accounts.SESSIONS_PER_ACCOUNT + 1


async def test_a_password_changed_while_the_old_one_is_hashed_lets_the_old_one_in_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check of the old password that began before a change and ended after it passed, and
    was remembered as proven against the new hash: the old password then opened sessions for
    five minutes more (the re-check probe)."""
    store = AccountStore(tmp_path / "accounts.json")
    await store.create("alice", "old-password", "Operator", "acme")
    entered, release = threading.Event(), threading.Event()

    class HeldAfterTheCheck(ThreadPoolExecutor):
        """The check is done (against the old hash) and its answer waits to be taken up; the
        change's own hash runs beside it."""

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if fn != store._checked:
                return super().submit(fn, *args, **kwargs)

            def held() -> Any:
                answer = fn(*args, **kwargs)
                entered.set()
                release.wait(5)
                return answer

            return super().submit(held)

    monkeypatch.setattr(accounts, "_HASHER", HeldAfterTheCheck(2))
    checking = asyncio.create_task(store.verify("alice", "old-password"))
    assert await asyncio.to_thread(entered.wait, 5)
    await store.update("alice", password="new-password")  # as a PATCH does
    release.set()
    assert await checking is None
    assert store.proven("alice", "old-password") is None
    assert await store.verify("alice", "old-password") is None
    assert await store.verify("alice", "new-password") is not None


async def test_proven_credentials_stay_proven_while_they_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy Basic client hashed again every five minutes, and met a flood's 429 then."""
    store = AccountStore(tmp_path / "accounts.json")
    await store.create("alice", "alice-password", "Operator", "acme")
    assert await store.verify("alice", "alice-password") is not None
    now = accounts.time.monotonic()
    for minutes in (4, 8, 12):
        monkeypatch.setattr(accounts.time, "monotonic", lambda m=minutes: now + 60 * m)
        assert store.proven("alice", "alice-password") is not None
    monkeypatch.setattr(accounts.time, "monotonic", lambda: now + 60 * 12 + accounts.PROVEN_S)
    assert store.proven("alice", "alice-password") is None  # unused for PROVEN_S
