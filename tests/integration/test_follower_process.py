"""TRELLIS_FOLLOWERS=process: the log followers in a process of their own (issue 11 item 2).

The engine runs no follower; the follower process keeps the projections, the JetStream stream
and KV bucket and the signed checkpoints up to date, woken by the engine's commit signal. A
client still reads its own writes (the engine waits on the checkpoints table), and a follower
process killed outright is restarted and catches up with nothing lost or doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import psutil
import pytest
import pytest_asyncio
from engines import Fleet
from fabrics import expect_ok, fabric
from follower_rig import unreachable_follower_env, until
from harness import Harness, bucket_values, cli_env, engine_at, serving
from isolation import unique_subject_prefix
from nats.aio.client import Client as NATS

from trellis.adapters import bootstrap, event_loop
from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.event_loop import EVENT_LOOPS
from trellis.adapters.follow_process import (
    SIGNAL_EVERY_S,
    CommitSignal,
    FollowerProcess,
)
from trellis.adapters.nats.auth import Principal, SecureDir
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import close_nats, connect_nats
from trellis.adapters.nats.jetstream import Envelope, checkpoint_stream_name, stream_name
from trellis.adapters.postgres import sessions
from trellis.adapters.settings import Settings, SettingsError

HALL = "hall-1"
GPU = {"host": "host-01", "devices": [{"kind": "gpu"}]}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, followers="process", checkpoint_every=5
    ) as harness:
        yield harness


def process_of(h: Harness) -> FollowerProcess:
    assert isinstance(h.followers, CommitSignal), "the engine follows inline"
    keeper = h.follower_process
    assert keeper is not None and keeper.pid is not None
    return keeper


async def followed(h: Harness, names: list[str], timeout: float = 20.0) -> int:
    """Until every checkpoint in `names` holds the domain's whole log; its last position."""
    head = (await h.store.head(HALL)).position
    pool = h.store._pool  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        reached = await pool.fetchval(
            "SELECT min(position) FROM trellis_follower_checkpoints"
            " WHERE follower = ANY($1::text[]) AND domain = $2 HAVING count(*) = $3",
            names,
            HALL,
            len(names),
        )
        if reached is not None and reached >= head:
            return head
        assert loop.time() < deadline, f"followers {names} stopped before {head}: {reached}"
        await asyncio.sleep(0.05)


async def stream_events(nats_url: str, prefix: str, nc: NATS | None = None) -> list[Envelope]:
    """Every event in the prefix's stream, read on `nc` (None: a connection of its own)."""
    conn = nc or await connect_nats(nats_url, name="test-scheduler")
    try:
        js = conn.jetstream()
        stream = stream_name(prefix)
        last = (await js.stream_info(stream)).state.last_seq
        messages = [await js.get_msg(stream, seq) for seq in range(1, last + 1)]
        return [msgspec.json.decode(m.data or b"", type=Envelope) for m in messages]
    finally:
        if nc is None:
            await conn.close()


async def test_the_follower_process_keeps_read_models_stream_bucket_and_checkpoints(
    h: Harness, nats_url: str, subject_prefix: str
) -> None:
    keeper = process_of(h)
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))

    # Read-your-writes: the answers right after the compose include it.
    composed = expect_ok(await h.client.intent(HALL, "acme", "compose", GPU))
    cid, gpu = composed["composition_id"], composed["devices"][0]["id"]
    connections = expect_ok(await h.client.query(HALL, "connections", {"tenant": "acme"}))
    assert [c["composition_id"] for c in connections["connections"]] == [cid]
    why = expect_ok(await h.client.query(HALL, "why", {"id": gpu}))
    assert cid in str(why)
    expect_ok(await h.client.intent(HALL, "acme", "release", {"composition_id": cid}))

    # The stream gets every event of the log, in order; the bucket the devices and hosts.
    for _ in range(3):
        done = expect_ok(await h.client.intent(HALL, "globex", "compose", GPU))
        cid2 = done["composition_id"]
        expect_ok(await h.client.intent(HALL, "globex", "release", {"composition_id": cid2}))
    relay = f"relay:{stream_name(subject_prefix)}"
    await followed(h, [relay])
    log = [r async for r in h.store.read(HALL)]
    assert [e.id for e in await stream_events(nats_url, subject_prefix)] == [r.id for r in log]
    nc = await connect_nats(nats_url, name="test-kv")
    try:
        bucket = await bucket_values(nc.jetstream(), subject_prefix)
        assert f"{HALL}.device.{gpu}" in bucket and f"{HALL}.host.host-01" in bucket
    finally:
        await nc.close()

    # A signed checkpoint every 5 events, recorded by the follower process.
    await followed(h, [f"checkpoints:{checkpoint_stream_name(subject_prefix)}"], 20)
    pool = h.store._pool  # type: ignore[attr-defined]
    sizes = [r["size"] for r in await pool.fetch("SELECT size FROM trellis_checkpoints")]
    assert sorted(sizes) == list(range(5, len(log) + 1, 5))
    # The checkpoint queries still answer in the engine.
    key = expect_ok(await h.client.query(HALL, "checkpoint-key"))["verifier_key"]
    assert key
    assert expect_ok(await h.client.query(HALL, "proof", {"event_id": log[0].id}))["tree_size"]
    assert keeper.restarts == 0


async def test_each_postgres_session_says_what_it_is_for(h: Harness, subject_prefix: str) -> None:
    """pg_stat_activity names the engine's sessions and the follower process's, each for
    what it does (adapters/postgres/sessions.py)."""
    keeper = process_of(h)
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await followed(h, [f"relay:{stream_name(subject_prefix)}"])
    pool = h.store._pool  # type: ignore[attr-defined]
    async with pool.acquire() as conn:
        own = await conn.fetchval(
            "SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
        server_port = await conn.fetchval("SELECT inet_server_port()")
        named = {
            r["client_port"]: r["application_name"]
            for r in await conn.fetch(
                "SELECT client_port, application_name FROM pg_stat_activity"
                " WHERE datname = current_database() AND client_port IS NOT NULL"
            )
        }
    assert own == sessions.ENGINE
    ports = {
        c.laddr.port
        for c in psutil.Process(keeper.pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == server_port
    }
    followers = {named[port] for port in ports if port in named}
    assert followers == set(sessions.FOLLOWERS), followers


async def test_a_killed_follower_process_is_restarted_and_catches_up(
    h: Harness, nats_url: str, subject_prefix: str
) -> None:
    keeper = process_of(h)
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    held = expect_ok(await h.client.intent(HALL, "acme", "compose", GPU))["composition_id"]
    expect_ok(await h.client.intent(HALL, "acme", "release", {"composition_id": held}))
    first = keeper.pid
    assert first is not None

    # When: the follower process is killed outright, and the engine goes on writing.
    os.kill(first, signal.SIGKILL)
    for _ in range(3):
        done = expect_ok(await h.client.intent(HALL, "globex", "compose", GPU))
        expect_ok(
            await h.client.intent(
                HALL, "globex", "release", {"composition_id": done["composition_id"]}
            )
        )

    # Then: a new process catches up; the stream holds every event exactly once, in order,
    # and a query sees the latest writes.
    names = ["compositions", "connections", "devices", "history"]
    await followed(h, [*names, f"relay:{stream_name(subject_prefix)}"])
    assert keeper.restarts >= 1 and keeper.pid != first
    log = [r async for r in h.store.read(HALL)]
    assert [e.id for e in await stream_events(nats_url, subject_prefix)] == [r.id for r in log]
    connections = expect_ok(await h.client.query(HALL, "connections", {"tenant": "globex"}))
    assert connections["connections"] == []


def test_the_followers_mode_is_read_from_the_environment() -> None:
    assert Settings.from_env({}).followers == "process"
    assert Settings.from_env({"TRELLIS_FOLLOWERS": "inline"}).followers == "inline"
    with pytest.raises(SettingsError, match="TRELLIS_FOLLOWERS"):
        Settings.from_env({"TRELLIS_FOLLOWERS": "thread"})


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def loaded(pid: int, package: str) -> bool:
    """Whether process `pid` has a compiled module of `package` mapped."""
    maps = Path(f"/proc/{pid}/maps")
    return maps.exists() and f"/{package}/" in maps.read_text()


def gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rpartition(")")[2].split()[0] == "Z"


async def test_trellis_up_runs_its_followers_in_a_process_and_leaves_none_behind(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    env = cli_env(
        tmp_path / "data",
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        TRELLIS_FABRIC_STATE=str(tmp_path / "fabric-sim.json"),
        TRELLIS_FOLLOWERS="process",
    )
    fleet = Fleet(env, tmp_path, HALL)
    nc = await connect_nats(nats_url, name="test-client")
    try:
        engine = await fleet.start_one()
        [follower] = children(engine.proc.pid)
        # Both on the default event loop, uvloop (adapters/event_loop.py).
        assert "event loop: uvloop" in engine.said()
        await until("the follower process runs on uvloop", lambda: loaded(follower, "uvloop"))
        client = TrellisClient(nc, prefix=subject_prefix, timeout=20)
        expect_ok(await client.admin(HALL, "import-topology", fabric()))
        composed = expect_ok(await client.intent(HALL, "acme", "compose", GPU))
        connections = expect_ok(await client.query(HALL, "connections", {"tenant": "acme"}))
        assert [c["composition_id"] for c in connections["connections"]] == [
            composed["composition_id"]
        ]
        # A clean stop stops the follower process with it.
        await engine.stop()
        await until("the follower outlived its engine's stop", lambda: gone(follower))
        # A killed engine leaves no follower behind either.
        engine = await fleet.start_one()
        [follower] = children(engine.proc.pid)
        await engine.kill()
        await until("the follower outlived its killed engine", lambda: gone(follower))
    finally:
        await fleet.stop()
        await nc.close()


# The engine's side of a follower process that cannot reach its servers: it starts it, prints
# its pid, and waits to be killed.
ENGINE_OF_A_WAITING_FOLLOWER = """
import os, subprocess, sys, time
env = {**os.environ, "TRELLIS_FOLLOWER_PARENT": str(os.getpid())}
follower = subprocess.Popen(
    [sys.executable, "-m", "trellis.adapters.entrypoints.follow"], env=env,
    stdout=subprocess.DEVNULL,  # not our pipe: the test reads that to its end
)
print(follower.pid, flush=True)
time.sleep(600)
"""


def test_the_follower_process_runs_on_its_engines_kind_of_event_loop(tmp_path: Path) -> None:
    for loop in EVENT_LOOPS:
        assert Settings.from_env(unreachable_follower_env(tmp_path, loop)).event_loop == loop


def test_the_follower_process_gathers_commits_as_long_as_its_engine_says(
    tmp_path: Path,
) -> None:
    for gather_s in (0.0, 0.01, 0.05, 0.25):
        env = unreachable_follower_env(tmp_path, gather_s=gather_s)
        assert Settings.from_env(env).follow_gather_s == pytest.approx(gather_s)


def test_the_follower_process_reads_the_migrations_its_engine_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRELLIS_SCHEMA_DIR (docs/configuration.md) went the way of every TRELLIS_* variable the
    engine does not hand over: a follower process then checked the log against the package's
    migrations, found some pending that its role may not apply, and restarted for ever."""
    monkeypatch.setenv("TRELLIS_SCHEMA_DIR", str(tmp_path / "schema"))
    assert unreachable_follower_env(tmp_path)["TRELLIS_SCHEMA_DIR"] == str(tmp_path / "schema")
    monkeypatch.delenv("TRELLIS_SCHEMA_DIR")
    assert "TRELLIS_SCHEMA_DIR" not in unreachable_follower_env(tmp_path)


async def test_a_follower_process_still_waiting_for_its_servers_leaves_with_its_engine(
    tmp_path: Path,
) -> None:
    """An engine killed while its follower process waited for Postgres (the servers went with
    it, as embedded ones do) once left that process retrying for ever; and a stop asked for
    then had to wait for the SIGKILL after the grace period."""
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ENGINE_OF_A_WAITING_FOLLOWER,
        env=unreachable_follower_env(tmp_path), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert engine.stdout is not None
    follower = int(await asyncio.wait_for(engine.stdout.readline(), 30))
    try:
        await asyncio.sleep(1.0)  # well into its wait for Postgres
        assert not gone(follower)
        engine.kill()
        await engine.wait()
        await until("the waiting follower outlived its killed engine", lambda: gone(follower))
    finally:
        if not gone(follower):  # a gone one's pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower, signal.SIGKILL)
    # Its own child this time: SIGTERM ends the wait at once, and the process exits cleanly.
    waiting = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.follow",
        env=unreachable_follower_env(tmp_path), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert waiting.stderr is not None
    # In its wait, and so past setting its handlers: a second after it started, a busy machine
    # had not got that far, and SIGTERM's default ended it (-15).
    while b"waiting for Postgres" not in await asyncio.wait_for(waiting.stderr.readline(), 30):
        pass
    assert waiting.returncode is None
    waiting.terminate()
    await asyncio.wait_for(waiting.communicate(), 5)
    assert waiting.returncode == 0


async def test_the_follower_process_is_batch_work_beside_the_intents(tmp_path: Path) -> None:
    """Its passes took the cores from the intents committed meanwhile (the serial tail): as
    SCHED_BATCH a follower waking for its pass no longer preempts them."""
    follower = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.follow",
        env=unreachable_follower_env(tmp_path),
    )  # fmt: skip
    try:
        await until(
            "the follower process never became batch work",
            lambda: os.sched_getscheduler(follower.pid) == os.SCHED_BATCH,
        )
        # Its threads too (the event loop's own thread, and any made later, inherit it).
        tasks = Path(f"/proc/{follower.pid}/task").iterdir()
        assert {os.sched_getscheduler(int(t.name)) for t in tasks} == {os.SCHED_BATCH}
    finally:
        follower.terminate()
        await asyncio.wait_for(follower.wait(), 5)


async def test_in_secure_mode_the_follower_process_connects_as_the_relay(
    tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    prefix = unique_subject_prefix()
    secure = SecureDir(tmp_path)
    secure.ensure(prefix, ["acme"])
    server = EmbeddedNats(tmp_path, config=secure.config_path)
    await asyncio.to_thread(server.start)
    try:
        async with engine_at(
            server.url,
            database_url,
            schema=pg_schema,
            prefix=prefix,
            secure=secure,
            followers="process",
        ) as running:
            operator = await connect_nats(
                server.url, credentials=secure.credentials(Principal("operator", "operator"))
            )
            acme = await connect_nats(
                server.url, credentials=secure.credentials(Principal("tenant", "acme"))
            )
            try:
                admin = TrellisClient(operator, prefix=prefix)
                tenant = TrellisClient(acme, prefix=prefix)
                expect_ok(await admin.admin(HALL, "import-topology", fabric()))
                composed = expect_ok(await tenant.intent(HALL, "acme", "compose", GPU))
                # The follower process, connected as the relay, folded the read models (the
                # tenant's view) and relayed the log to the stream.
                mine = expect_ok(await tenant.view(HALL, "acme", "connections"))
                assert [c["composition_id"] for c in mine["connections"]] == [
                    composed["composition_id"]
                ]
                head = (await running.store.head(HALL)).position
                deadline = time.monotonic() + 20
                while True:
                    envelopes = await stream_events(server.url, prefix, operator)
                    if envelopes and envelopes[-1].position >= head:
                        break
                    assert time.monotonic() < deadline, "the follower process relayed nothing"
                    await asyncio.sleep(0.05)
            finally:
                await operator.close()
                await acme.close()
    finally:
        await asyncio.to_thread(server.stop)


async def test_commit_signals_go_out_at_most_once_per_interval() -> None:
    """Every signal is a send on the intent path's loop: a burst of commits makes one at once
    and one when the interval is up, naming every domain that committed meanwhile."""

    class Published:
        def __init__(self) -> None:
            self.subjects: list[tuple[float, str]] = []

        async def publish(self, subject: str, payload: bytes) -> None:
            self.subjects.append((asyncio.get_running_loop().time(), subject))

    nc = Published()
    signal_ = CommitSignal(None, nc, "p")  # type: ignore[arg-type]
    signal_.notify("a")
    await asyncio.sleep(0)
    for domain in ["a", "b", "a", "b", "c"]:
        signal_.notify(domain)
        await asyncio.sleep(0.001)
    await asyncio.sleep(3 * SIGNAL_EVERY_S)

    first, *rest = nc.subjects
    assert first[1] == "p.internal.committed.a"
    assert sorted(s for _, s in rest) == [f"p.internal.committed.{d}" for d in "abc"]
    assert min(at for at, _ in rest) - first[0] >= SIGNAL_EVERY_S * 0.9


async def test_a_start_cancelled_as_its_follower_process_spawns_stops_that_process(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C early in `trellis up` lands as the follower process is spawned: the start's
    unwinding stops that process too (SIGTERM, waited for). It was left behind, and said
    "the engine (pid N) is gone; stopping" after the engine had said it stopped."""
    spawned: list[int] = []

    class CancelledAsItSpawns(FollowerProcess):
        async def start(self) -> None:
            await super().start()
            assert self.pid is not None
            spawned.append(self.pid)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # the signal handler's cancel of the start, as `trellis up` has it
            await asyncio.sleep(0)

    monkeypatch.setattr(bootstrap, "FollowerProcess", CancelledAsItSpawns)
    with pytest.raises(asyncio.CancelledError):
        async with engine_at(
            nats_url, database_url, schema=pg_schema, prefix=subject_prefix, followers="process"
        ):
            pytest.fail("the engine served after its start was cancelled")
    (pid,) = spawned
    left = not gone(pid)
    if left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the follower process {pid} outlived its engine's cancelled start"


@pytest.mark.parametrize("loop", EVENT_LOOPS)
def test_closing_a_connection_whose_server_was_killed_raises_nothing(
    tmp_path: Path, loop: event_loop.EventLoopName
) -> None:
    """The chaos probe killed the embedded nats-server: the follower process ended in a
    traceback from nats-py's close (uvloop's RuntimeError on the closed transport; asyncio's
    BrokenPipeError), flushing what it held onto the dead socket."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()

    async def close_after_the_kill() -> None:
        nc = await connect_nats(server.url, name="doomed")
        for _ in range(200):
            await nc.publish("doomed.x", b"x" * 1000)
        os.kill(int(server.pid_path.read_text()), signal.SIGKILL)
        await asyncio.sleep(0.3)
        for _ in range(20):  # queued for a server that is gone
            await nc.publish("doomed.x", b"x" * 1000)
        await close_nats(nc)
        assert nc.is_closed

    try:
        event_loop.run(close_after_the_kill(), loop)
    finally:
        server.stop()
