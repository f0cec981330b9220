"""An engine started before its servers waits for them, says so, and serves once they are up.

Issue 9 item 9. `trellis up` runs as a process of its own against configured URLs where
nothing listens yet; real servers are started on those ports afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric
from isolation import delete_relay_targets, unique_subject_prefix

from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.embedded.postgres_server import EmbeddedPostgres
from trellis.adapters.embedded.process import free_port
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.settings import redacted

REPO = Path(__file__).resolve().parents[2]
DOMAIN = "hall-1"


class Engine:
    """`trellis up` in a subprocess, its output collected in a file."""

    def __init__(self, proc: asyncio.subprocess.Process, output: Path) -> None:
        self.proc = proc
        self.output = output

    def text(self) -> str:
        return self.output.read_text()

    async def says(self, line: str, times: int = 1, within: float = 30) -> None:
        """Until the output holds `line` `times` times; fail with the output otherwise."""
        deadline = time.monotonic() + within
        while self.text().count(line) < times:
            if self.proc.returncode is not None or time.monotonic() > deadline:
                pytest.fail(f"no {line!r} (x{times}) from the engine; it said:\n{self.text()}")
            await asyncio.sleep(0.05)

    async def stopped_by_sigint(self, within: float = 30) -> int:
        self.proc.send_signal(signal.SIGINT)
        return await asyncio.wait_for(self.proc.wait(), within)


@pytest_asyncio.fixture
async def start_engine(tmp_path: Path) -> AsyncIterator[object]:
    """Start `trellis up` with the given TRELLIS_* settings; killed at the end if still up."""
    started: list[asyncio.subprocess.Process] = []

    async def start(**settings: str) -> Engine:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
        env.update(settings, TRELLIS_DATA_DIR=str(tmp_path / "data"))
        output = tmp_path / f"engine-{len(started)}.log"
        with output.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trellis.adapters.entrypoints.cli", "up",
                cwd=REPO, env=env, stdout=out, stderr=out,
            )  # fmt: skip
        started.append(proc)
        return Engine(proc, output)

    yield start
    for proc in started:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
async def test_trellis_up_waits_for_postgres_then_nats_and_then_serves(
    tmp_path: Path, start_engine: object
) -> None:
    # Given: a Postgres that has been set up once but is down, and a NATS never started; their
    # ports are fixed, so their URLs are known while nothing listens there. (Postgres's is
    # the OS's offer, moved if another process takes it before the first start; once it has
    # run, it stays.)
    postgres = EmbeddedPostgres(tmp_path / "pg")
    await asyncio.to_thread(postgres.start)
    await asyncio.to_thread(postgres.stop)
    nats = EmbeddedNats(tmp_path / "nats", port=free_port())
    prefix = unique_subject_prefix()

    # When: the engine starts first.
    engine = await start_engine(  # type: ignore[operator]
        TRELLIS_NATS_URL=nats.url,
        TRELLIS_DATABASE_URL=postgres.url,
        TRELLIS_DATABASE_OWNER_URL=postgres.owner_url,
        TRELLIS_SUBJECT_PREFIX=prefix,
    )
    try:
        # Then: it waits for Postgres, saying so on each attempt (with backoff)...
        await engine.says(f"waiting for Postgres at {redacted(postgres.url)}", times=3)
        await asyncio.to_thread(postgres.start)
        # ...then for NATS...
        await engine.says(f"waiting for NATS at {nats.url}", times=2)
        assert engine.proc.returncode is None
        await asyncio.to_thread(nats.start)
        # ...and serves once both are up: a client's intent succeeds.
        await engine.says("trellis engine up")
        await engine.says(f"serving {prefix}.* for every domain (writing now: none yet)")
        async with TrellisClient.connected(nats.url, prefix=prefix, name="test-client") as client:
            expect_ok(await client.admin(DOMAIN, "import-topology", fabric()))
        assert await engine.stopped_by_sigint() == 0
        said = engine.text()
        assert "Postgres" in said and "is reachable after" in said
        assert "Traceback" not in said
        for password in (postgres.url, postgres.owner_url):  # the URLs carry passwords
            assert password.split(":")[2].split("@")[0] not in said
        await delete_relay_targets(nats.url, prefix)
    finally:
        await asyncio.to_thread(nats.stop)
        await asyncio.to_thread(postgres.stop)


async def test_ctrl_c_while_trellis_up_waits_stops_it_cleanly(start_engine: object) -> None:
    # Given: an engine waiting for a Postgres that is not there.
    database_url = f"postgresql://trellis_engine:secret@127.0.0.1:{free_port()}/trellis"
    engine = await start_engine(  # type: ignore[operator]
        TRELLIS_NATS_URL=f"nats://127.0.0.1:{free_port()}", TRELLIS_DATABASE_URL=database_url
    )
    await engine.says(f"waiting for Postgres at {redacted(database_url)}")

    # When: Ctrl-C.
    code = await engine.stopped_by_sigint()

    # Then: it stops at once, says so, and shows no traceback.
    said = engine.text()
    assert code == 0, said
    assert "trellis engine stopped before it served" in said
    assert "Traceback" not in said and "secret" not in said


async def test_trellis_up_does_not_wait_out_a_wrong_password(
    start_engine: object, nats_url: str, database_url: str
) -> None:
    wrong = database_url.replace("@", "x@", 1)  # the engine role's password, one letter longer
    engine = await start_engine(  # type: ignore[operator]
        TRELLIS_NATS_URL=nats_url, TRELLIS_DATABASE_URL=wrong
    )
    code = await asyncio.wait_for(engine.proc.wait(), 30)
    said = engine.text()
    assert code == 1, said
    assert "trellis: refused: Postgres refused the connection" in said
    assert "waiting for" not in said and "Traceback" not in said
