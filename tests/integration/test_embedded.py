"""The embedded default servers: real processes that start, answer, stop and come back."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import nats
import pytest
from harness import run_cli

from trellis.adapters.checkpoint_key import KEY_FILE, load_or_create
from trellis.adapters.embedded import process
from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.embedded.postgres_server import (
    PG_ENGINE_ROLE,
    PG_OWNER_ROLE,
    PG_SYSTEM_USER,
    DataDirVersionError,
    EmbeddedPostgres,
    postgres_bin_dir,
    postgres_major_version,
)
from trellis.adapters.embedded.process import (
    EmbeddedServerError,
    PortTakenError,
    default_data_dir,
    free_port,
)
from trellis.adapters.settings import redacted


async def _nats_round_trip(url: str) -> None:
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        subject = f"t{uuid.uuid4().hex[:12]}.ping"
        sub = await nc.subscribe(subject)
        await nc.publish(subject, b"hello")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"hello"
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()


async def _stream_count(url: str) -> int:
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        info = await nc.jetstream().account_info()
        return int(info.streams)
    finally:
        await nc.close()


def _accepts_tcp(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


async def test_nats_serves_jetstream_and_keeps_streams_across_a_restart(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path)
    with server:
        assert server.url == f"nats://127.0.0.1:{server.port}"
        await _nats_round_trip(server.url)
        nc = await nats.connect(server.url)
        try:
            await nc.jetstream().add_stream(name="KEEP", subjects=["keep.>"])
            await nc.jetstream().publish("keep.one", b"1")
        finally:
            await nc.close()
        port = server.port

        assert server.pid_path.read_text().strip() == str(server.pid)
        server.stop()
        server.stop()  # idempotent
        assert not server.running
        assert not _accepts_tcp(port)
        assert not server.pid_path.exists()  # nats-server leaves it; a clean stop does not

        server.start()
        assert server.port == port
        await _nats_round_trip(server.url)
        assert await _stream_count(server.url) == 1
    assert not server.running


async def test_postgres_serves_sql_and_keeps_data_across_a_restart(tmp_path: Path) -> None:
    server = EmbeddedPostgres(tmp_path)
    with server:
        assert (
            redacted(server.url) == f"postgresql://trellis_engine@127.0.0.1:{server.port}/trellis"
        )
        conn = await asyncpg.connect(server.owner_url)
        try:
            assert await conn.fetchval("select 1") == 1
            await conn.execute("create table survivor (id int primary key)")
            await conn.execute("insert into survivor values (42)")
        finally:
            await conn.close()
        port = server.port

        server.stop()
        server.stop()  # idempotent
        assert not server.running
        assert not _accepts_tcp(port)

        server.start()
        assert server.port == port
        conn = await asyncpg.connect(server.owner_url)
        try:
            assert await conn.fetchval("select id from survivor") == 42
        finally:
            await conn.close()
    assert not server.running


async def test_postgres_takes_only_password_logins_and_keeps_the_passwords_private(
    tmp_path: Path,
) -> None:
    with EmbeddedPostgres(tmp_path) as server:
        # The generated passwords are readable by this user alone.
        assert stat.S_IMODE(server.passwords_path.stat().st_mode) == 0o600
        assert set(json.loads(server.passwords_path.read_text())) == {
            "postgres", PG_OWNER_ROLE, PG_ENGINE_ROLE
        }  # fmt: skip
        for password in json.loads(server.passwords_path.read_text()).values():
            assert password not in repr(server)  # nor in the "ready at" log line
        # No role gets in without its password, the superuser least of all.
        for role in ("postgres", PG_OWNER_ROLE, PG_ENGINE_ROLE):
            for password in ("", ":wrong"):
                with pytest.raises(asyncpg.InvalidPasswordError):
                    await asyncpg.connect(
                        f"postgresql://{role}{password}@127.0.0.1:{server.port}/postgres"
                    )
        # With it, each is who it should be: the owner owns the database, the engine nothing.
        conn = await asyncpg.connect(server.url)
        try:
            assert await conn.fetchrow(
                "SELECT current_user, rolsuper, has_database_privilege(current_user, "
                "current_database(), 'CREATE') AS may_create, pg_get_userbyid(datdba) AS dba "
                "FROM pg_roles, pg_database WHERE rolname = current_user "
                "AND datname = current_database()"
            ) == (PG_ENGINE_ROLE, False, False, PG_OWNER_ROLE)  # fmt: skip
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("CREATE TABLE mine (id int)")
        finally:
            await conn.close()
        conn = await asyncpg.connect(server.superuser_url)
        try:
            assert await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        finally:
            await conn.close()


async def test_nats_comes_back_while_a_client_stays_connected(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path) as server:
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        nc = await nats.connect(
            server.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1,
            reconnected_cb=on_reconnect,
        )  # fmt: skip
        try:
            server.stop()
            server.start()
            await asyncio.wait_for(reconnected.wait(), timeout=10)
            sub = await nc.subscribe("back.again")
            await nc.publish("back.again", b"yes")
            assert (await sub.next_msg(timeout=5)).data == b"yes"
        finally:
            await nc.close()


def test_start_fails_clearly_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(EmbeddedServerError, match=f"port 127.0.0.1:{port} is already in use"):
            EmbeddedNats(tmp_path, port=port).start()


@pytest.mark.parametrize("taken", ["client", "monitoring"])
def test_a_first_start_chooses_again_when_a_port_it_chose_was_taken(
    tmp_path: Path, taken: str
) -> None:
    # The OS chose the ports at construction; another process binds one before the start (as
    # a parallel test's server or a client connection's source port can): the check before
    # the server runs finds either.
    server = EmbeddedNats(tmp_path)
    port = server.port if taken == "client" else server.monitor_port
    assert port is not None
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with server:
            assert port not in (server.port, server.monitor_port)
            assert server.monitor("healthz")["status"] == "ok"


def test_a_port_taken_after_the_check_is_found_in_the_servers_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The port is bound after the check before the server runs found it free (here: the check
    # is made to miss it), so nats-server itself meets it and exits; its log says so, and the
    # port still bound is the one named.
    server = EmbeddedNats(tmp_path)
    port = server.monitor_port
    assert port is not None
    checks = itertools.count()
    really_free = process.port_is_free
    monkeypatch.setattr(process, "port_is_free", lambda p: next(checks) < 2 or really_free(p))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with server:
            assert port not in (server.port, server.monitor_port)
    assert f"nats-server: port 127.0.0.1:{port} is already in use; starting" in caplog.text


def test_a_given_port_that_is_taken_fails_the_first_start_at_once(tmp_path: Path) -> None:
    # The monitoring port was given (TRELLIS_NATS_MONITOR_PORT): choosing another client port
    # would meet it again, so the start fails naming it, and nothing moves.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        given = squatter.getsockname()[1]
        server = EmbeddedNats(tmp_path, monitor_port=given)
        client_port = server.port
        with pytest.raises(PortTakenError, match=f"port 127.0.0.1:{given} is already in use"):
            server.start()
    assert (server.port, server.monitor_port) == (client_port, given)
    assert not (tmp_path / "nats.log").exists()  # refused before a server ran


def test_a_server_that_has_run_keeps_its_port(tmp_path: Path) -> None:
    # Its URL is known to clients by now: a restart on a taken port fails rather than moves.
    server = EmbeddedNats(tmp_path)
    with server:
        port = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(EmbeddedServerError, match=f"port 127.0.0.1:{port} is already in use"):
            server.start()
    assert server.port == port


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a LISTEN socket on ``port``, read from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net/tcp")
def test_servers_listen_on_loopback_only(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path / "n") as nats_server, EmbeddedPostgres(tmp_path / "p") as pg:
        for port in (nats_server.port, pg.port):
            # 127.0.0.1 in /proc's little-endian hex; no wildcard, no IPv6 listener.
            assert _listening_addresses(port) == {"0100007F"}


def test_free_port_returns_a_bindable_port() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_default_data_dir_honours_trellis_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(tmp_path / "here"))
    assert default_data_dir() == tmp_path / "here"
    monkeypatch.delenv("TRELLIS_DATA_DIR")
    assert default_data_dir().name == "trellis"
    assert os.fspath(default_data_dir()) != os.fspath(tmp_path / "here")


def test_servers_left_running_are_stopped_when_python_exits(tmp_path: Path) -> None:
    # The owner "forgets" stop(); the atexit hook must not leave orphans behind.
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from trellis.adapters.embedded.nats_server import EmbeddedNats\n"
        "from trellis.adapters.embedded.postgres_server import EmbeddedPostgres\n"
        f"d = Path({str(tmp_path)!r})\n"
        "n, p = EmbeddedNats(d), EmbeddedPostgres(d)\n"
        "n.start(); p.start()\n"
        "print(n.pid, p.pid, n.port, p.port)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    nats_pid, pg_pid, nats_port, pg_port = map(int, result.stdout.split())
    for pid in (nats_pid, pg_pid):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not _accepts_tcp(nats_port)
    assert not _accepts_tcp(pg_port)


# -- a data dir of another PostgreSQL major version ---------------------------------------------
#
# The stand-in for a data dir that pgserver's PostgreSQL 16 made: one the bundled PostgreSQL
# made, whose PG_VERSION file then says 16. That is faithful for what is tested here because
# PG_VERSION is what decides: PostgreSQL's own check (ValidatePgVersion, which refuses a data
# dir of another major before it reads anything else in it) compares that file's contents
# with its own major, and so does Trellis's. The first test runs the bundled postgres on the
# stand-in to show it refuses it for exactly that reason.


def _made_by(tmp_path: Path, version: str) -> EmbeddedPostgres:
    """A data dir the bundled PostgreSQL initialised and served once, relabelled `version`."""
    server = EmbeddedPostgres(tmp_path / "data")
    with server:
        pass
    (server.pgdata / "PG_VERSION").write_text(f"{version}\n")
    return server


def _snapshot(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every file and dir under `root`: mode, owner, mtime and content digest."""
    seen = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        seen[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_mtime_ns, digest)
    return seen


def test_the_stand_in_is_refused_by_postgresql_itself_for_its_pg_version(tmp_path: Path) -> None:
    server = _made_by(tmp_path, "16")
    bundled = postgres_major_version(postgres_bin_dir())
    # Root's groups dropped as well: a group match with no permission bits denies access.
    root = os.geteuid() == 0
    as_server_user = {"user": PG_SYSTEM_USER, "group": PG_SYSTEM_USER, "extra_groups": []}
    refused = subprocess.run(
        [postgres_bin_dir() / "postgres", "--single", "-D", server.pgdata, "postgres"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        cwd=server.pgdata, **(as_server_user if root else {}),
    )  # fmt: skip
    assert refused.returncode != 0
    says = (
        f"initialized by PostgreSQL version 16, which is not compatible with this version {bundled}"
    )
    assert says in refused.stderr, refused.stderr


@pytest.mark.parametrize("made_by", ["older", "newer"])
def test_postgres_refuses_a_data_dir_of_another_major_and_changes_nothing(
    tmp_path: Path, made_by: str
) -> None:
    bundled = postgres_major_version(postgres_bin_dir())
    # Older: pgserver's PostgreSQL 16. Newer: a data dir from a later Trellis, then downgraded.
    found = "16" if made_by == "older" else str(int(bundled) + 1)
    assert found != bundled
    server = _made_by(tmp_path, found)
    before = _snapshot(server.data_dir)

    again = EmbeddedPostgres(server.data_dir)
    with pytest.raises(DataDirVersionError) as refused:
        again.start()

    error = refused.value
    assert (error.pgdata, error.found, error.bundled) == (again.pgdata, found, bundled)
    assert f"{again.pgdata} was made by PostgreSQL {found}" in str(error)
    assert f"which the bundled PostgreSQL {bundled} cannot start" in str(error)
    assert str(again.pgdata) in error.hint and "move" in error.hint
    assert ("pg_upgrade" in error.hint) == (made_by == "older")
    assert not again.running and not _accepts_tcp(again.port)
    assert _snapshot(server.data_dir) == before  # no chown, chmod, password or log line


async def test_trellis_up_on_a_postgresql_16_data_dir_is_one_line_naming_both_versions(
    tmp_path: Path,
) -> None:
    server = _made_by(tmp_path, "16")
    load_or_create(server.data_dir / KEY_FILE)  # as an engine that served there made it
    bundled = postgres_major_version(postgres_bin_dir())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
    env["TRELLIS_DATA_DIR"] = str(server.data_dir)

    code, out, err = await run_cli(env, "up")
    assert "serving" not in out, out

    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert lines[0].startswith(
        f"trellis: incompatible: the PostgreSQL data dir {server.pgdata} was made by "
        f"PostgreSQL 16, which the bundled PostgreSQL {bundled} cannot start"
    ), lines[0]
    assert "(hint: move " in lines[0] and "pg_upgrade" in lines[0], lines[0]
    assert (server.pgdata / "PG_VERSION").read_text() == "16\n"
