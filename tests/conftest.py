"""Shared fixtures: real NATS and PostgreSQL servers, unique schemas and subject prefixes.

Set ``TRELLIS_NATS_URL`` / ``TRELLIS_DATABASE_URL`` (each on its own) to reuse running servers;
otherwise an embedded nats-server / PostgreSQL is started once per session on a free port.
Every test gets its own schema and subject prefix, so tests run in any order and in parallel
sessions against the same servers.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import NamedTuple

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.js.errors import NotFoundError

from adapters.embedded import EmbeddedNats, EmbeddedPostgres
from adapters.jetstream import bucket_name, stream_name


class Servers(NamedTuple):
    """Where the session's servers listen."""

    nats_url: str
    database_url: str


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """NATS and PostgreSQL for the whole session: reused from the environment or embedded.

    Sync on purpose: starting servers needs no event loop, and the async tests keep their own
    function-scoped loops.
    """
    started: list[EmbeddedNats | EmbeddedPostgres] = []
    try:
        nats_url = os.environ.get("TRELLIS_NATS_URL")
        if not nats_url:
            nats = EmbeddedNats(tmp_path_factory.mktemp("nats"))
            started.append(nats)
            nats.start()
            nats_url = nats.url
        database_url = os.environ.get("TRELLIS_DATABASE_URL")
        if not database_url:
            postgres = EmbeddedPostgres(tmp_path_factory.mktemp("postgres"))
            started.append(postgres)
            postgres.start()
            database_url = postgres.url
        yield Servers(nats_url=nats_url, database_url=database_url)
    finally:
        for server in reversed(started):
            server.stop()


@pytest.fixture(scope="session")
def nats_url(servers: Servers) -> str:
    """URL of the session's NATS server (JetStream enabled)."""
    return servers.nats_url


@pytest.fixture(scope="session")
def database_url(servers: Servers) -> str:
    """URL of the session's PostgreSQL database."""
    return servers.database_url


@pytest_asyncio.fixture
async def pg_schema(database_url: str) -> AsyncIterator[str]:
    """A fresh, empty schema (``t_<12 hex>``) that is dropped with everything in it afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"create schema {name}")
    finally:
        await conn.close()
    yield name
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"drop schema if exists {name} cascade")
    finally:
        await conn.close()


@pytest_asyncio.fixture
async def subject_prefix(nats_url: str) -> AsyncIterator[str]:
    """A unique NATS subject token (``t<12 hex>``) for every subject and stream a test uses.

    Afterwards the JetStream stream and KV bucket an engine made for it (the event relay's,
    named after the prefix) are deleted, so the shared server does not fill up.
    """
    prefix = f"t{uuid.uuid4().hex[:12]}"
    yield prefix
    await delete_relay_targets(nats_url, prefix)


async def delete_relay_targets(nats_url: str, prefix: str) -> None:
    """Delete the event stream and the state bucket of `prefix`, where they exist."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for stream in (stream_name(prefix), f"KV_{bucket_name(prefix)}"):
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(stream)
    finally:
        await nc.close()
