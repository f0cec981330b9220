"""Secure mode on the NATS side: nkey identities, what each may do, the server's config.

One identity per principal, each an nkey (an Ed25519 key pair; NATS users by public key),
each allowed only what its job needs (ARCHITECTURE §3):

- `engine`: the engine's intake. It subscribes to the request subjects and its forwarding
  subject, and publishes only replies (`_INBOX.>`) and requests it forwards to another engine
  (`<prefix>.engine.>`), never a stream, the bucket or another subject: a request that names
  some other reply subject cannot make it write there (adapters/nats/replies.py refuses it
  first; the server would too);
- `relay`: the only writer of the JetStream stream TRELLIS_EVENTS and the KV bucket
  TRELLIS_STATE (it creates them, publishes events and puts values), and of the internal commit
  signal the follower process wakes on;
- `checkpoints`: the only writer of the stream TRELLIS_CHECKPOINTS (signed tree heads);
- `operator`: publishes `<prefix>.admin.>` and `<prefix>.query.>`, and reads the JetStream
  stream TRELLIS_EVENTS and the KV bucket TRELLIS_STATE as the auditor does (the live fabric
  page, adapters/http/fabric_page.py, connects as the operator);
- `auditor`: read-only: publishes `<prefix>.query.>` and reads, but never changes, the
  JetStream streams TRELLIS_EVENTS and TRELLIS_CHECKPOINTS and the KV bucket TRELLIS_STATE;
- one per tenant: publishes `<prefix>.intent.*.<tenant>.>` and `<prefix>.view.*.<tenant>.>`.

The operator and the auditor may also ask the engine's NATS micro service (`$SRV.PING`, `INFO`
and `STATS` of `trellis-engine`), as the `nats micro` tooling does; tenants may not, since the
statistics count every tenant's requests.

Replies travel on the requester's inbox, so nobody but the engine may subscribe to `_INBOX.>`:
every identity subscribes only under its own inbox prefix, `_INBOX.<its public key>`
(`inbox_prefix`; nats-py `connect(inbox_prefix=...)`), and no one can read another's replies.
Each may publish there too (a message only it can read: roundtrip.py's echo).

nkeys rather than user/password: the server config then holds only public keys (a leaked
config grants nothing), a client proves itself by signing the server's nonce, and nats-py
speaks it through the small `nkeys` package. JWT `.creds` files (operator mode) would add an
account resolver for no gain on a single server.

Files under `<data_dir>/secure/` (the directory 0700, every file 0600)::

    auth.conf            the `authorization` block for nats-server (embedded: `--config`;
                         an external server `include`s it)
    secure.json          the subject prefix the permissions are written for
    engine.nk            nkey seeds, one per identity (the secret; `nats --nkey` reads them too)
    relay.nk
    checkpoints.nk
    operator.nk
    auditor.nk
    tenants/<name>.nk
    revoked/<name>.<public key>.nk   a revoked tenant's seed, kept aside (`trellis tenant revoke`)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import nkeys

from trellis.adapters.nats.jetstream import bucket_name, checkpoint_stream_name, stream_name
from trellis.adapters.nats.micro import SERVICE_NAME

Role = Literal["engine", "relay", "checkpoints", "operator", "auditor", "tenant"]
ROLES: tuple[Role, ...] = ("engine", "relay", "checkpoints", "operator", "auditor")
SECURE_DIR = "secure"
CONFIG_FILE = "auth.conf"
_SETTINGS_FILE = "secure.json"
_LOCK_FILE = ".lock"
REVOKED_DIR = "revoked"
# Whole-string match (no `$`: it would let a trailing newline through into a file name).
_TENANT = re.compile(r"[A-Za-z0-9_-]{1,64}")


class CredentialsError(ValueError):
    """A credentials file cannot be used, or a tenant name cannot be issued; says why."""


class UnknownTenant(CredentialsError):
    """A tenant named has no identity here."""


class Principal(msgspec.Struct, frozen=True):
    """Who an identity is: its role, and for a tenant its name."""

    role: Role
    name: str


def new_seed() -> str:
    """A fresh user nkey seed (`SU…`), from the OS's randomness."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode()


def public_key(seed: str) -> str:
    """The public key (`U…`) of a user nkey seed.

    Raises:
        CredentialsError: `seed` is no user nkey seed.
    """
    try:
        pair = nkeys.from_seed(bytearray(seed.strip().encode()))
        key: bytes = pair.public_key
    except (nkeys.NkeysError, ValueError) as exc:  # binascii.Error is a ValueError
        raise CredentialsError(f"not an nkey seed ({type(exc).__name__})") from None
    if not key.startswith(b"U"):
        raise CredentialsError("not a user nkey seed (a user seed starts with SU)")
    return key.decode()


def inbox_prefix(key: str) -> str:
    """The only inbox prefix the identity with public key `key` may subscribe under."""
    return f"_INBOX.{key}"


def tenant_name_problem(name: str) -> str | None:
    """Why `name` cannot be a tenant's identity, or None. It becomes a subject token and a file
    name, so it must be an id, and it may not be a role's name."""
    if not _TENANT.fullmatch(name):
        return f"tenant {name!r} is not an id (1-64 letters, digits, _ or -)"
    if name in ROLES:
        return f"{name!r} names an internal identity, not a tenant"
    return None


def permissions(principal: Principal, key: str, prefix: str) -> dict[str, Any]:
    """What `principal` (public key `key`) may publish and subscribe to. Every identity may
    publish under its own inbox prefix, which only it reads: the echo through the server that
    proves the server has read what came before (adapters/nats/roundtrip.py)."""
    inbox = [f"{inbox_prefix(key)}.>"]
    match principal.role:
        case "engine":
            publish = ["_INBOX.>", f"{prefix}.engine.>"]
            subscribe = [
                *inbox,
                *(f"{prefix}.{family}.>" for family in ("intent", "admin", "query", "view")),
                f"{prefix}.engine.>",
                "$SRV.>",
            ]
        case "relay":
            publish = [
                f"{prefix}.events.>",
                f"$KV.{bucket_name(prefix)}.>",
                f"{prefix}.internal.>",
                *_jetstream_writes([stream_name(prefix), f"KV_{bucket_name(prefix)}"]),
            ]
            subscribe = [*inbox, f"{prefix}.internal.>"]
        case "checkpoints":
            publish = [
                f"{prefix}.checkpoints.>",
                *_jetstream_writes([checkpoint_stream_name(prefix)]),
            ]
            subscribe = inbox
        case "operator":
            publish = [
                f"{prefix}.admin.>",
                f"{prefix}.query.>",
                *_jetstream_reads(prefix),
                *_discovery(),
            ]
            subscribe = inbox
        case "auditor":
            publish = [f"{prefix}.query.>", *_jetstream_reads(prefix), *_discovery()]
            subscribe = [*inbox, f"{prefix}.events.>", f"{prefix}.checkpoints.>"]
        case "tenant":
            publish = [
                f"{prefix}.intent.*.{principal.name}.>",
                f"{prefix}.view.*.{principal.name}.>",
            ]
            subscribe = inbox
    own = [] if principal.role == "engine" else inbox  # the engine's `_INBOX.>` holds its own
    return {"publish": {"allow": [*publish, *own]}, "subscribe": {"allow": subscribe}}


def _jetstream_writes(streams: list[str]) -> list[str]:
    """The JetStream API calls that make and keep `streams` (and read their last messages, as
    the relay does to resume); never delete or purge."""
    subjects = ["$JS.API.INFO"]
    for s in streams:
        subjects += [
            f"$JS.API.STREAM.INFO.{s}",
            f"$JS.API.STREAM.CREATE.{s}",
            f"$JS.API.STREAM.UPDATE.{s}",
            f"$JS.API.STREAM.MSG.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}.>",
        ]
    return subjects


def _discovery() -> list[str]:
    """The micro service's discovery subjects for the engine: all instances, or one by id."""
    return [
        f"$SRV.{verb}.{SERVICE_NAME}{one}"
        for verb in ("PING", "INFO", "STATS")
        for one in ("", ".*")
    ]


def _jetstream_reads(prefix: str) -> list[str]:
    """The JetStream API calls that read the streams and the bucket: info, message gets, and
    consumers of one's own (create, read, ack, flow control). Never stream create, update,
    delete, purge or message delete, and no consumer delete (others' cursors stay)."""
    subjects = ["$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST"]
    streams = [stream_name(prefix), checkpoint_stream_name(prefix), f"KV_{bucket_name(prefix)}"]
    for s in streams:
        subjects += [
            f"$JS.API.STREAM.INFO.{s}",
            f"$JS.API.STREAM.MSG.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}.>",
            f"$JS.API.CONSUMER.CREATE.{s}",
            f"$JS.API.CONSUMER.CREATE.{s}.>",
            # nats-py's add_consumer with a durable name and no name asks on the older subject
            f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.*",
            f"$JS.API.CONSUMER.INFO.{s}.*",
            f"$JS.API.CONSUMER.NAMES.{s}",
            f"$JS.API.CONSUMER.LIST.{s}",
            f"$JS.API.CONSUMER.MSG.NEXT.{s}.*",
            f"$JS.ACK.{s}.>",
            f"$JS.FC.{s}.>",
        ]
    return subjects


def authorization_config(users: Iterable[tuple[Principal, str]], prefix: str) -> str:
    """The nats-server `authorization` block for `users` (principal, public key).

    JSON inside the block is valid nats-server configuration, and quoting every subject keeps
    `$JS…` from being read as a variable.
    """
    entries = []
    for principal, key in users:
        entries.append({"nkey": key, "permissions": permissions(principal, key, prefix)})
    block = json.dumps({"users": entries}, indent=2)
    return (
        "# Trellis secure mode: NATS users (nkeys) and their permissions for subject prefix\n"
        f"# {prefix!r}. Written by `trellis up --secure` and `trellis tenant add`/`revoke`; edits\n"
        "# are overwritten. Reload nats-server after a change (SIGHUP).\n"
        f"authorization: {block}\n"
    )


class NkeyCredentials(msgspec.Struct, frozen=True):
    """A file holding one user nkey seed: how a client connects as that identity."""

    path: Path

    def seed(self) -> str:
        """The seed in the file.

        Raises:
            CredentialsError: the file cannot be read or holds no user nkey seed.
        """
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialsError(f"cannot read credentials {self.path}: {exc}") from None
        if "BEGIN NATS USER JWT" in text:
            raise CredentialsError(
                f"{self.path} is a JWT .creds file; Trellis secure mode uses nkey seed files"
            )
        try:
            public_key(text)
        except CredentialsError as exc:
            raise CredentialsError(f"{self.path}: {exc}") from None
        return text.strip()

    def connect_options(self) -> dict[str, Any]:
        """nats-py `connect` keywords: sign the server's nonce with the seed (re-read at every
        reconnect), and take replies under this identity's own inbox prefix.

        Raises:
            CredentialsError: the file holds no usable seed.
        """
        key = public_key(self.seed())
        return {"nkeys_seed": str(self.path), "inbox_prefix": inbox_prefix(key)}


class SecureDir:
    """The identities of one data dir and the server config written from them."""

    def __init__(self, data_dir: Path):
        self.root = Path(data_dir) / SECURE_DIR

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def tenants_dir(self) -> Path:
        return self.root / "tenants"

    def exists(self) -> bool:
        """True once secure mode was set up here (the config was written)."""
        return self.config_path.is_file()

    def prefix(self) -> str | None:
        """The subject prefix the config was written for; None before the first write."""
        try:
            return str(json.loads((self.root / _SETTINGS_FILE).read_text())["subject_prefix"])
        except (OSError, ValueError, KeyError):
            return None

    def seed_path(self, principal: Principal) -> Path:
        if principal.role == "tenant":
            return self.tenants_dir / f"{principal.name}.nk"
        return self.root / f"{principal.role}.nk"

    def credentials(self, principal: Principal) -> NkeyCredentials:
        return NkeyCredentials(self.seed_path(principal))

    def inboxes(self) -> tuple[str, str, dict[str, str]]:
        """The inbox prefixes of the operator, the auditor and every tenant (by name): where
        the engine may answer each (adapters/nats/replies.py's OwnInbox)."""

        def of(principal: Principal) -> str:
            return inbox_prefix(public_key(self.credentials(principal).seed()))

        return (
            of(Principal("operator", "operator")),
            of(Principal("auditor", "auditor")),
            {name: of(Principal("tenant", name)) for name in self.tenants()},
        )

    def tenants(self) -> list[str]:
        """Every tenant with an identity here, sorted."""
        if not self.tenants_dir.is_dir():
            return []
        return sorted(p.stem for p in self.tenants_dir.glob("*.nk") if _TENANT.fullmatch(p.stem))

    def revoked(self) -> set[str]:
        """The tenants whose identity was revoked and not issued again (`tenant revoke`
        without a later `tenant add`)."""
        aside = self.root / REVOKED_DIR
        if not aside.is_dir():
            return set()
        names = {p.name.split(".", 1)[0] for p in aside.glob("*.nk")}
        return names - set(self.tenants())

    def identities(self) -> list[tuple[str, str, Path]]:
        """Every tenant with an identity here, sorted: its name, public key and seed file.

        Raises:
            CredentialsError: a tenant's seed file cannot be read.
        """
        found = []
        for name in self.tenants():
            creds = self.credentials(Principal("tenant", name))
            found.append((name, public_key(creds.seed()), creds.path))
        return found

    def revoke(self, name: str, prefix: str) -> Path:
        """Take tenant `name`'s identity away: its seed moves to `revoked/<name>.<public
        key>.nk` and the config for `prefix` is written without its user. Returns where the
        seed went. Any other identity, and the config on error, is left as it was.

        Raises:
            UnknownTenant: `name` has no identity here.
            CredentialsError: `name` cannot be a tenant, or its seed cannot be read.
            OSError: the seed cannot be moved or the config written.
        """
        problem = tenant_name_problem(name)
        if problem:
            raise CredentialsError(problem)
        principal = Principal("tenant", name)
        seed = self.seed_path(principal)
        with self._locked():
            if not seed.is_file():
                raise UnknownTenant(f"tenant {name!r} has no identity in {self.tenants_dir}")
            key = public_key(self.credentials(principal).seed())
            # Kept, not deleted: which key was revoked stays on record (to match a leaked
            # seed or a server log against), one file per key however often a name is revoked.
            aside = self.root / REVOKED_DIR / f"{name}.{key}.nk"
            aside.parent.mkdir(mode=0o700, exist_ok=True)
            seed.replace(aside)
            try:
                self._write_config(prefix)
            except BaseException:
                aside.replace(seed)  # the user is still in the config: so is its seed
                raise
        return aside

    def ensure(self, prefix: str, tenants: Iterable[str] = ()) -> list[str]:
        """Create whatever identity is missing (the three roles, then `tenants`) and write the
        config for `prefix`. Existing seeds are kept. Returns the tenants that are new.

        Raises:
            CredentialsError: a tenant name cannot be issued.
        """
        wanted = sorted(set(tenants))
        for name in wanted:
            problem = tenant_name_problem(name)
            if problem:
                raise CredentialsError(problem)
        with self._locked():
            for role in ROLES:
                self._issue(Principal(role, role))
            new = [name for name in wanted if self._issue(Principal("tenant", name))]
            self._write_config(prefix)
        return new

    def _issue(self, principal: Principal) -> bool:
        """Write a fresh seed for `principal` unless it has one; True if it was written."""
        path = self.seed_path(principal)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(new_seed() + "\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def _write_config(self, prefix: str) -> None:
        principals = [Principal(role, role) for role in ROLES]
        principals += [Principal("tenant", name) for name in self.tenants()]
        keyed = [(p, public_key(self.credentials(p).seed())) for p in principals]
        _write_private(self.config_path, authorization_config(keyed, prefix))
        _write_private(self.root / _SETTINGS_FILE, json.dumps({"subject_prefix": prefix}) + "\n")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time (two `tenant add` at once must not drop each other's user)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        fd = os.open(self.root / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock


def _write_private(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a leftover file
    tmp.replace(path)
