"""The Redfish service's accounts and sessions: its one store of its own (ARCHITECTURE §11).

Accounts live in one JSON file in the data directory, written 0600 and replaced atomically
(write to a temporary file, fsync, rename), so a crash leaves the old file or the new one.
A file rather than a Postgres table: accounts are the Redfish front door's business, not the
engine's, and are needed before (and without) any query to the log. Passwords are stored only
as scrypt hashes (n=2**14, r=8, p=1) with a 16-byte random salt each; checking compares in
constant time.

Every account is an `Administrator` (the operator: no tenant, sees and acts on everything) or
belongs to one tenant with the role `Operator` (reads and changes that tenant's systems) or
`ReadOnly` (reads them). Sessions are kept in memory: a restart ends them, and clients log in
again, as they do when a session times out (`session_timeout_s` without use: SessionTimeout,
which an Administrator may PATCH; session_timeout.py keeps it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import msgspec

from trellis.engine.core.ids import is_valid_id

Role = Literal["Administrator", "Operator", "ReadOnly"]
ROLES: tuple[Role, ...] = ("Administrator", "Operator", "ReadOnly")
ADMIN = "admin"
SESSION_TIMEOUT_S = 1800  # SessionTimeout until an Administrator sets another
#: SessionTimeout's bounds: the CSDL's Validation.Minimum and Maximum.
SESSION_TIMEOUT_RANGE = (30, 86400)
MIN_PASSWORD = 8
MAX_PASSWORD = 256
_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 32}
#: Password checks hashing at once, in threads of their own (not the loop's default executor,
#: which others share): a flood of bad Basic credentials queues for these instead of taking
#: every core from the engine.
HASHING_AT_ONCE = max(1, (os.cpu_count() or 2) // 2)
_HASHER = ThreadPoolExecutor(HASHING_AT_ONCE, thread_name_prefix="redfish-password")
#: Credentials a hash proved are known again, without another hash, until this long after their
#: last use (a client sending Basic on every request pays one hash, not one per request, and
#: never queues behind a flood of wrong passwords); a changed password or a disabled account is
#: never matched.
PROVEN_S = 300.0
_PROVEN_MAX = 4096  # entries; past that the memory is cleared, and hashes prove them again
#: Live sessions per account: opening one more ends its least recently used (a client that
#: logs in per request and never out fills memory with sessions nobody uses).
SESSIONS_PER_ACCOUNT = 64
#: Privileges per role (DSP0266's standard roles).
PRIVILEGES: dict[Role, list[str]] = {
    "Administrator": ["Login", "ConfigureManager", "ConfigureUsers", "ConfigureSelf",
                      "ConfigureComponents"],
    "Operator": ["Login", "ConfigureSelf", "ConfigureComponents"],
    "ReadOnly": ["Login", "ConfigureSelf"],
}  # fmt: skip


class Account(msgspec.Struct, kw_only=True):
    id: str  # the Redfish Id in AccountService/Accounts (the user name)
    user_name: str
    role: Role
    tenant: str | None  # None: Administrator
    salt: str  # hex
    hash: str  # hex, scrypt
    enabled: bool = True
    version: int = 1  # bumped on every change: part of the account's ETag

    @property
    def admin(self) -> bool:
        return self.role == "Administrator"


class Session(msgspec.Struct, kw_only=True):
    id: str
    token: str
    user_name: str
    last_used: float  # monotonic seconds; it ends `session_timeout_s` after
    context: str = ""  # the client's own note on it (Session.Context), as it gave it


class AccountError(ValueError):
    """A refused account change; `field` names the property at fault."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class AccountGone(AccountError):
    """The account was deleted while its change was being made (its new password hashed)."""


class AccountChanged(AccountError):
    """The account changed while this change was being made: the caller's precondition (an
    `If-Match`) was judged on a version that is no longer the account's."""


class LastAdministrator(AccountError):
    """A change that would leave no enabled Administrator: nobody could manage accounts."""


def hash_password(password: str, salt: bytes | None = None) -> tuple[str, str]:
    """(salt, hash) as hex: scrypt of `password` with `salt` (a fresh one when None)."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, **_SCRYPT)
    return salt.hex(), digest.hex()


async def _hashed(password: str) -> tuple[str, str]:
    """`hash_password(password)` in a hashing thread: its tens of ms would stall the event
    loop the engine runs on, for every domain, at each password set."""
    return await asyncio.get_running_loop().run_in_executor(_HASHER, hash_password, password)


def _check_password(password: str) -> None:
    if not isinstance(password, str) or not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
        raise AccountError(
            f"a password has {MIN_PASSWORD} to {MAX_PASSWORD} characters", "Password"
        )


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, readable by this user alone, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class AccountStore:
    """Accounts in the 0600 file `path`; `admin_password` sets `admin`'s when it is made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._accounts: dict[str, Account] = {}
        self._sessions: dict[bytes, Session] = {}  # by the SHA-256 of the token
        self._proof_key = secrets.token_bytes(32)
        self._proven: dict[bytes, tuple[str, str, float]] = {}  # (user, hash, until) by proof
        #: The idle timeout of every session, read at each use: a change holds at once.
        self.session_timeout_s = SESSION_TIMEOUT_S
        self._load()

    def _load(self) -> None:
        if self.path.exists():
            accounts = msgspec.json.decode(self.path.read_bytes(), type=list[Account])
            self._accounts = {a.user_name: a for a in accounts}

    def _save(self) -> None:
        data = msgspec.json.format(msgspec.json.encode(list(self._accounts.values())))
        write_private(self.path, data)

    def ensure_admin(self, password: str) -> bool:
        """Make `admin` with `password` unless it exists; whether it was made."""
        if ADMIN in self._accounts:
            return False
        _check_password(password)
        salt, digest = hash_password(password)
        self._accounts[ADMIN] = Account(
            id=ADMIN, user_name=ADMIN, role="Administrator", tenant=None, salt=salt, hash=digest
        )
        self._save()
        return True

    # ---- accounts ----

    def all(self) -> list[Account]:
        return sorted(self._accounts.values(), key=lambda a: a.user_name)

    def get(self, user_name: str) -> Account | None:
        return self._accounts.get(user_name)

    async def create(self, user_name: str, password: str, role: str, tenant: str | None) -> Account:
        """A new account; its password hashed in a hashing thread, off the event loop.

        Raises:
            AccountError: a bad or taken name, a short password, an unknown role, or a tenant
                missing (Operator, ReadOnly) or given (Administrator).
        """
        if not isinstance(user_name, str) or not is_valid_id(user_name):
            raise AccountError("a UserName is 1-64 letters, digits, '-' or '_'", "UserName")
        if user_name in self._accounts:
            raise AccountError(f"account {user_name} exists", "UserName")
        _check_password(password)
        if role not in ROLES:
            raise AccountError(f"RoleId is one of {', '.join(ROLES)}", "RoleId")
        if role == "Administrator":
            if tenant is not None:
                raise AccountError("an Administrator belongs to no tenant", "Oem/Trellis/Tenant")
        elif not isinstance(tenant, str) or not is_valid_id(tenant):
            raise AccountError(
                f"an {role} account needs Oem.Trellis.Tenant, a tenant id", "Oem/Trellis/Tenant"
            )
        salt, digest = await _hashed(password)
        if user_name in self._accounts:  # made while the hash ran
            raise AccountError(f"account {user_name} exists", "UserName")
        account = Account(
            id=user_name,
            user_name=user_name,
            role=role,  # type: ignore[arg-type]
            tenant=tenant,
            salt=salt,
            hash=digest,
        )
        self._accounts[user_name] = account
        self._save()
        return account

    async def update(
        self,
        user_name: str,
        *,
        password: str | None = None,
        enabled: bool | None = None,
        unchanged_since: int | None = None,
    ) -> Account:
        """`user_name`'s account with a new password (hashed in a hashing thread, off the
        event loop) and/or enabled state; unchanged (its version too) when neither is given or
        `enabled` is what it was. With `unchanged_since`, only if the account's version is
        still that one when the change is made (after the hash: two changes judged on one
        version must not both succeed).

        Raises:
            AccountError: a bad password.
            AccountGone: the account was deleted while the hash ran.
            AccountChanged: the account is no longer at version `unchanged_since`.
            LastAdministrator: disabling the last enabled Administrator.
        """
        account = self._accounts[user_name]
        hashed = None
        if password is not None:
            _check_password(password)
            hashed = await _hashed(password)
            if self._accounts.get(user_name) is not account:
                raise AccountGone(f"account {user_name} was deleted meanwhile")
        if unchanged_since is not None and account.version != unchanged_since:
            raise AccountChanged(f"account {user_name} was changed meanwhile")
        if enabled is False and account.enabled and self._last_administrator(account):
            raise LastAdministrator("the last enabled Administrator stays enabled", "Enabled")
        changed = False
        if hashed is not None:
            account.salt, account.hash = hashed
            self._end_sessions(user_name)
            changed = True
        if enabled is not None and enabled != account.enabled:
            account.enabled = enabled
            if not enabled:
                self._end_sessions(user_name)
            changed = True
        if changed:
            account.version += 1
            self._save()
        return account

    def delete(self, user_name: str) -> None:
        if user_name == ADMIN:
            raise AccountError("the first Administrator stays", "UserName")
        account = self._accounts[user_name]
        if account.enabled and self._last_administrator(account):
            raise LastAdministrator("the last enabled Administrator stays", "UserName")
        del self._accounts[user_name]
        self._end_sessions(user_name)
        self._save()

    def _last_administrator(self, account: Account) -> bool:
        """Whether `account` is the one enabled Administrator."""
        enabled = [a for a in self._accounts.values() if a.admin and a.enabled]
        return enabled == [account]

    def check(self, user_name: str, password: str) -> Account | None:
        """The enabled account with that name and password, else None (in about the same
        time either way: an unknown name still costs one hash)."""
        account, _ = self._checked(user_name, password)
        return account

    def _checked(self, user_name: str, password: str) -> tuple[Account | None, str]:
        """`check`, with the stored hash it compared against: in a hashing thread, a password
        change on the loop may replace it meanwhile."""
        account = self._accounts.get(user_name)
        if account is None:
            hash_password(password, b"\0" * 16)
            return None, ""
        expected = account.hash
        _, digest = hash_password(password, bytes.fromhex(account.salt))
        if not account.enabled or not hmac.compare_digest(digest, expected):
            return None, expected
        return account, expected

    async def verify(self, user_name: str, password: str) -> Account | None:
        """`proven`, or `check` in a hashing thread, so its hash (tens of ms; scrypt releases
        the GIL) never stalls the event loop the engine runs on. A password changed (or the
        account disabled or deleted) while the hash ran is a failure: the old password was
        right only before, and must neither pass nor be remembered as proven."""
        account = self.proven(user_name, password)
        if account is not None:
            return account
        loop = asyncio.get_running_loop()
        account, compared = await loop.run_in_executor(_HASHER, self._checked, user_name, password)
        if (
            account is None
            or self._accounts.get(account.user_name) is not account
            or not account.enabled
            or account.hash != compared
        ):
            return None
        if len(self._proven) >= _PROVEN_MAX:
            self._proven.clear()
        until = time.monotonic() + PROVEN_S
        self._proven[self._proof(user_name, password)] = (account.user_name, compared, until)
        return account

    def proven(self, user_name: str, password: str) -> Account | None:
        """The enabled account these credentials were proven for in the last `PROVEN_S`, its
        password unchanged since; else None. No hash: a keyed digest of them is looked up."""
        proof = self._proof(user_name, password)
        known = self._proven.get(proof)
        if known is None:
            return None
        name, password_hash, until = known
        account = self._accounts.get(name)
        if account is None or not account.enabled or account.hash != password_hash:
            return None
        now = time.monotonic()
        if now >= until:
            return None
        self._proven[proof] = (name, password_hash, now + PROVEN_S)  # its time starts again
        return account

    def _proof(self, user_name: str, password: str) -> bytes:
        """A digest of the credentials under a key of this process: never the password, and of
        no use outside it."""
        given = f"{len(user_name)}:{user_name}{password}".encode(errors="surrogatepass")
        return hmac.new(self._proof_key, given, hashlib.sha256).digest()

    # ---- sessions ----

    def open_session(self, account: Account, context: str = "") -> Session:
        """A new session of `account`; past `SESSIONS_PER_ACCOUNT`, its least recently used
        one ends."""
        self._expire()
        own = [
            (s.last_used, k) for k, s in self._sessions.items() if s.user_name == account.user_name
        ]
        for _, key in sorted(own)[: max(0, len(own) - SESSIONS_PER_ACCOUNT + 1)]:
            del self._sessions[key]
        session = Session(
            id=secrets.token_hex(8),
            token=secrets.token_hex(32),
            user_name=account.user_name,
            last_used=time.monotonic(),
            context=context,
        )
        self._sessions[_token_key(session.token)] = session
        return session

    def by_token(self, token: str) -> tuple[Session, Account] | None:
        """The live session of `token` (its timeout starts again), with its account."""
        self._expire()
        session = self._sessions.get(_token_key(token))
        if session is None:
            return None
        account = self._accounts.get(session.user_name)
        if account is None or not account.enabled:
            return None
        session.last_used = time.monotonic()
        return session, account

    def has_session(self, token: str) -> bool:
        """Whether `token`'s session is live (without starting its timeout again)."""
        self._expire()
        return _token_key(token) in self._sessions

    def sessions(self) -> list[Session]:
        self._expire()
        return sorted(self._sessions.values(), key=lambda s: s.id)

    def session(self, session_id: str) -> Session | None:
        return next((s for s in self.sessions() if s.id == session_id), None)

    def close_session(self, session_id: str) -> bool:
        for key, session in list(self._sessions.items()):
            if session.id == session_id:
                del self._sessions[key]
                return True
        return False

    def _end_sessions(self, user_name: str) -> None:
        for key, session in list(self._sessions.items()):
            if session.user_name == user_name:
                del self._sessions[key]

    def _expire(self) -> None:
        now = time.monotonic()
        for key, session in list(self._sessions.items()):
            if session.last_used + self.session_timeout_s <= now:
                del self._sessions[key]


def _token_key(token: str) -> bytes:
    """Sessions are found by the SHA-256 of their token: one lookup, whose time says nothing
    of the tokens held (a loop of constant-time compares took a scan of every session)."""
    return hashlib.sha256(token.encode(errors="surrogatepass")).digest()


def admin_password(data_dir: Path, given: str | None) -> tuple[str, Path | None]:
    """`admin`'s first password: `given` (TRELLIS_REDFISH_ADMIN_PASSWORD), else the one in the
    0600 file `redfish-admin-password` of `data_dir`, made on first use; with the file's path
    when it came from one."""
    if given:
        return given, None
    path = data_dir / "redfish-admin-password"
    if path.exists():
        return path.read_text().strip(), path
    data_dir.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(18)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password, path
