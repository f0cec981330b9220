"""`trellis up` processes, and clients of a NATS cluster, for the tests that kill, pause and
restart engines and servers.

Each engine runs this checkout's code in a process of its own, its output collected in a file;
a Fleet is several of them on the same servers, schema, subjects and fabric state file, as a
deployment runs them. Which one writes a domain is read from the writer lease table.
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

import asyncpg
import pytest
from isolation import Database, create_schema, unique_schema_name
from nats.aio.client import Client as NATS

from trellis.adapters.embedded.cluster import NatsCluster
from trellis.adapters.embedded.postgres_server import (
    PG_ENGINE_ROLE,
    PG_OWNER_ROLE,
    EmbeddedPostgres,
)
from trellis.adapters.nats.client import TrellisClient

REPO = Path(__file__).resolve().parents[1]
WAIT_WITHIN_S = 60.0


class EngineProcess:
    """One `trellis up`, its output collected in a file."""

    def __init__(self, number: int, proc: asyncio.subprocess.Process, output: Path) -> None:
        self.number = number
        self.proc = proc
        self.output = output

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def said(self) -> str:
        return self.output.read_text(errors="replace")

    async def serving(self, within: float = WAIT_WITHIN_S) -> None:
        """Until it says it serves; fails with its output if it exits or takes too long."""
        deadline = time.monotonic() + within
        while "trellis engine up" not in self.said():
            if not self.alive or time.monotonic() > deadline:
                pytest.fail(
                    f"engine {self.number} did not come up; it said:\n{self.said()[-3000:]}"
                )
            await asyncio.sleep(0.05)

    async def kill(self) -> None:
        """SIGKILL: no shutdown, no cleanup, whatever it was doing."""
        self.proc.kill()
        await self.proc.wait()

    async def stop(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                await self.kill()


async def fleet_env(
    nats_url: str, postgres: EmbeddedPostgres, data: Path, **more: str
) -> dict[str, str]:
    """The environment of `trellis up` processes over these servers, in a fresh schema of
    their own, with none of the caller's TRELLIS_* settings; `more` adds settings."""
    schema = unique_schema_name()
    db = Database(postgres.url, postgres.owner_url, PG_ENGINE_ROLE, PG_OWNER_ROLE)
    await create_schema(db, schema)
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
        "TRELLIS_NATS_URL": nats_url,
        "TRELLIS_DATABASE_URL": postgres.url,
        "TRELLIS_DB_SCHEMA": schema,
        "TRELLIS_DATA_DIR": str(data / "data"),
        **more,
    }


class Fleet:
    """Engines all on the same servers, schema, subjects and fabric state file (`env`)."""

    def __init__(self, env: dict[str, str], logs: Path, domain: str) -> None:
        self.env = env
        self.logs = logs
        self.domain = domain
        self.engines: list[EngineProcess] = []

    async def start_one(self) -> EngineProcess:
        """Start one more `trellis up` and return it once it serves."""
        number = len(self.engines) + 1
        output = self.logs / f"engine-{number}.log"
        with output.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trellis.adapters.entrypoints.cli", "-v", "up",
                cwd=REPO, env=self.env, stdout=out, stderr=out,
            )  # fmt: skip
        engine = EngineProcess(number, proc, output)
        self.engines.append(engine)
        await engine.serving()
        return engine

    async def writer(self) -> tuple[EngineProcess, int]:
        """The engine that holds the domain's writer lease now, and the lease's epoch (waits
        for one: right after a takeover nobody may hold it for a moment)."""
        deadline = time.monotonic() + WAIT_WITHIN_S
        while True:
            holder = await self.holder()
            if holder is not None:
                pid, epoch = holder
                for engine in self.engines:
                    if engine.alive and engine.proc.pid == pid:
                        return engine, epoch
            if time.monotonic() > deadline:
                pytest.fail(f"no running engine holds the writer lease of {self.domain}")
            await asyncio.sleep(0.05)

    async def holder(self) -> tuple[int, int] | None:
        """(pid, epoch) of the engine holding the domain's writer lease (the lease table)."""
        return (await self.leases()).get(self.domain)

    async def leases(self) -> dict[str, tuple[int, int]]:
        """domain -> (pid, epoch) of the engine holding its writer lease now."""
        rows = await self.fetch(
            "SELECT l.domain, e.name, l.epoch FROM trellis_writer_leases l "
            "JOIN trellis_engines e ON e.id = l.holder WHERE l.expires_at > clock_timestamp()"
        )
        # An engine's name is host:pid.
        return {r["domain"]: (int(r["name"].rsplit(":", 1)[1]), int(r["epoch"])) for r in rows}

    async def fetch(self, sql: str) -> list[asyncpg.Record]:
        """`sql`'s rows, read in the fleet's schema."""
        conn = await asyncpg.connect(
            self.env["TRELLIS_DATABASE_URL"],
            server_settings={"search_path": self.env["TRELLIS_DB_SCHEMA"]},
        )
        try:
            return await conn.fetch(sql)
        finally:
            await conn.close()

    async def stop(self) -> None:
        for engine in self.engines:
            await engine.stop()


@contextlib.asynccontextmanager
async def client_at(
    cluster: NatsCluster, index: int, *, prefix: str, timeout: float, name: str = "test-client"
) -> AsyncIterator[TrellisClient]:
    """A client connection that starts at node `index` and moves to the others when it dies."""
    first = cluster.urls[index]
    nc = NATS()
    await nc.connect(
        [first, *(u for u in cluster.urls if u != first)],
        name=f"{name}-{index}",
        dont_randomize=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,  # type: ignore[arg-type]  # annotated int, takes seconds
        connect_timeout=2,
    )
    try:
        yield TrellisClient(nc, prefix=prefix, timeout=timeout)
    finally:
        await nc.close()
