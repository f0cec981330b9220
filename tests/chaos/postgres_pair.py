"""A PostgreSQL primary with a synchronous standby, from the embedded binaries (issue 25).

The primary is the embedded default (`EmbeddedPostgres`: roles, passwords, the `trellis`
database). The standby is `pg_basebackup`'s copy of it, streaming, named in the primary's
`synchronous_standby_names`, with `synchronous_commit = on`: the settings docs/deployment.md
gives for Patroni (`synchronous_mode_strict`), without a failover manager. The test kills,
stops and promotes by hand what Patroni would.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

from trellis.adapters.embedded.postgres_server import (
    PG_DATABASE,
    PG_ENGINE_ROLE,
    PG_OWNER_ROLE,
    PG_SUPERUSER,
    PG_SYSTEM_USER,
    EmbeddedPostgres,
)
from trellis.adapters.embedded.process import HOST

SETTINGS = {"synchronous_standby_names": "'*'", "synchronous_commit": "'on'"}


class Standby(EmbeddedPostgres):
    """A streaming copy of `primary`, made once by pg_basebackup; read-only until promoted."""

    name = "postgres standby"

    def __init__(self, data_dir: Path, primary: EmbeddedPostgres) -> None:
        super().__init__(data_dir)
        self.primary = primary

    def _prepare(self) -> None:
        if os.geteuid() == 0:
            self._user = pwd.getpwnam(PG_SYSTEM_USER)
        if (self.pgdata / "PG_VERSION").exists():
            return  # made already: started again after a stop
        shutil.copy(self.primary.passwords_path, self.passwords_path)
        password = self._password(PG_SUPERUSER)
        conninfo = (
            f"host={HOST} port={self.primary.port} user={PG_SUPERUSER} "
            f"password={password} application_name=standby"
        )
        self.pgdata.mkdir(mode=0o700, parents=True)
        if self._user is not None:
            os.chown(self.pgdata, self._user.pw_uid, self._user.pw_gid)
        subprocess.run(
            [
                str(self._bin / "pg_basebackup"),
                f"--dbname={conninfo}",
                f"--pgdata={self.pgdata}",
                "--wal-method=stream",
                "--checkpoint=fast",
                "--write-recovery-conf",
            ],
            env={"PATH": os.environ.get("PATH", ""), "LANG": "C"},
            capture_output=True,
            check=True,
            **self._as_server_user(),
        )

    def _after_ready(self) -> None:
        pass  # a standby takes no roles or databases: they come from the primary

    def promote(self) -> None:
        """Make it the primary (what a failover manager does once the primary is lost)."""
        self._psql("SELECT pg_promote(true, 60)", "postgres")


class PostgresPair:
    """A primary and its synchronous standby; `url`/`owner_url` name both hosts, so asyncpg
    connects to whichever is the primary (target_session_attrs=read-write)."""

    def __init__(self, data_dir: Path) -> None:
        self.primary = EmbeddedPostgres(data_dir / "primary")
        self.standby = Standby(data_dir / "standby", self.primary)

    def start(self) -> None:
        self.primary.start()
        hba = self.primary.pgdata / "pg_hba.conf"
        hba.write_text(
            hba.read_text() + f"host replication {PG_SUPERUSER} {HOST}/32 scram-sha-256\n"
        )
        self.primary._psql("SELECT pg_reload_conf()", "postgres")
        self.standby.start()
        settings = "".join(f"ALTER SYSTEM SET {k} = {v};\n" for k, v in SETTINGS.items())
        self.primary._psql(settings + "SELECT pg_reload_conf();", "postgres")
        self.wait_until_synchronous()

    def wait_until_synchronous(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.primary_query("SELECT sync_state FROM pg_stat_replication")
            if state == "sync":
                return
            time.sleep(0.1)
        raise AssertionError("the standby never became synchronous")

    def primary_query(self, sql: str) -> str:
        """One value, as the superuser, from the primary."""
        result = subprocess.run(
            [
                str(self.primary._bin / "psql"),
                "--no-psqlrc", "--tuples-only", "--no-align", f"--host={HOST}",
                f"--port={self.primary.port}", f"--username={PG_SUPERUSER}", "--dbname=postgres",
                f"--command={sql}",
            ],
            env={"PATH": os.environ["PATH"], "PGPASSWORD": self.primary._password(PG_SUPERUSER)},
            capture_output=True,
            text=True,
            check=False,
        )  # fmt: skip
        return result.stdout.strip()

    def kill_primary(self) -> None:
        """kill -9 of the primary's postmaster (its backends end when they notice)."""
        pid = self.primary.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        self.primary._proc.wait(timeout=30)  # type: ignore[union-attr]

    def kill_standby(self) -> None:
        pid = self.standby.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        self.standby._proc.wait(timeout=30)  # type: ignore[union-attr]

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            server.stop()

    def _url(self, role: str) -> str:
        password = self.primary._password(role)
        hosts = f"{HOST}:{self.primary.port},{HOST}:{self.standby.port}"
        return (
            f"postgresql://{role}:{password}@{hosts}/{PG_DATABASE}?target_session_attrs=read-write"
        )

    @property
    def url(self) -> str:
        return self._url(PG_ENGINE_ROLE)

    @property
    def owner_url(self) -> str:
        return self._url(PG_OWNER_ROLE)
