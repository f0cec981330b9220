"""Shared fixtures: real NATS and PostgreSQL servers, unique schemas and subject prefixes.

Set ``TRELLIS_NATS_URL`` / ``TRELLIS_DATABASE_URL`` (each on its own) to reuse running servers
(with ``TRELLIS_DATABASE_OWNER_URL`` for the schema owner, as ``trellis up`` takes them);
otherwise an embedded nats-server / PostgreSQL is started once per session on a free port.
Every test gets its own schema and subject prefix, so tests run in any order and in parallel
sessions against the same servers. The schema is migrated by its owner and the engine's role
is granted only what ``trellis up`` grants it, so every engine in the tests runs with least
privilege: ``database_url`` logs in as that role, ``owner_url`` as the owner.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NamedTuple

import asyncpg
import pytest
import pytest_asyncio

# Hooks from alone.py (`alone` tests run with no other beside them), ordering.py (slow tests
# first) and zeros.py (the zeros tables print at the end, summed over pytest-xdist's workers).
from alone import pytest_runtest_protocol, pytest_unconfigure  # noqa: F401
from isolation import (
    Database,
    create_schema,
    current_user,
    delete_relay_targets,
    drop_schema,
    unique_schema_name,
    unique_subject_prefix,
)
from ordering import pytest_collection_modifyitems  # noqa: F401
from zeros import pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown  # noqa: F401

from trellis.adapters.embedded.cluster import NatsCluster
from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.embedded.postgres_server import EmbeddedPostgres
from trellis.adapters.embedded.process import log_tail
from trellis.adapters.postgres.store import connect_pool

# The embedded servers this session started, watched after each test (below).
SESSION_SERVERS: list[EmbeddedNats | EmbeddedPostgres] = []


class Servers(NamedTuple):
    """Where the session's servers listen."""

    nats_url: str
    database: Database


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
            SESSION_SERVERS.append(nats)
            nats.start()
            nats_url = nats.url
        database_url = os.environ.get("TRELLIS_DATABASE_URL")
        owner_url = os.environ.get("TRELLIS_DATABASE_OWNER_URL") or database_url
        if not database_url:
            postgres = EmbeddedPostgres(tmp_path_factory.mktemp("postgres"))
            started.append(postgres)
            SESSION_SERVERS.append(postgres)
            postgres.start()
            database_url, owner_url = postgres.url, postgres.owner_url
        assert owner_url is not None
        roles = [asyncio.run(current_user(url)) for url in (database_url, owner_url)]
        yield Servers(nats_url=nats_url, database=Database(database_url, owner_url, *roles))
    finally:
        for server in reversed(started):
            server.stop()
            SESSION_SERVERS.remove(server)


@pytest.fixture(autouse=True)
def _session_servers_outlive_the_test() -> Iterator[None]:
    """A session server that died fails the test it died in (or the first after it), with how
    it exited and its log's last lines, so the one cause is named once, not guessed from a
    hundred refused connections. (PostgreSQL notices a lost data-dir lock within a minute.)"""
    yield
    for server in SESSION_SERVERS:
        how = server.died()
        if how is not None:
            said = f"the session's {how}; the tail of {server.log_path}:\n"
            pytest.fail(said + log_tail(server.log_path, 15), pytrace=False)


@pytest.fixture(scope="session")
def nats_url(servers: Servers) -> str:
    """URL of the session's NATS server (JetStream enabled)."""
    return servers.nats_url


@pytest.fixture(scope="session")
def database(servers: Servers) -> Database:
    """The session's PostgreSQL database: its URLs and the engine's role."""
    return servers.database


@pytest.fixture(scope="session")
def database_url(servers: Servers) -> str:
    """URL of the session's PostgreSQL database, as the engine's least-privileged role."""
    return servers.database.url


@pytest.fixture(scope="session")
def owner_url(servers: Servers) -> str:
    """URL of the session's PostgreSQL database, as the role that owns the test schemas."""
    return servers.database.owner_url


@pytest_asyncio.fixture
async def pg_schema(database: Database) -> AsyncIterator[str]:
    """A fresh schema (``t_<12 hex>``), migrated by its owner with the engine's role granted,
    that is dropped with everything in it afterwards."""
    name = unique_schema_name()
    await create_schema(database, name)
    yield name
    await drop_schema(database, name)


@pytest_asyncio.fixture
async def subject_prefix(nats_url: str) -> AsyncIterator[str]:
    """A unique NATS subject token (``t<12 hex>``) for every subject and stream a test uses.

    Afterwards the JetStream stream and KV bucket an engine made for it (the event relay's,
    named after the prefix) are deleted, so the shared server does not fill up.
    """
    prefix = unique_subject_prefix()
    yield prefix
    await delete_relay_targets(nats_url, prefix)


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A 3-node nats-server cluster with JetStream, the test's own (tests kill its nodes):
    formed before the test begins, stopped after it."""
    with NatsCluster(tmp_path / "nats-cluster") as cluster:
        yield cluster


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A Postgres of the test's own, to stop and start (never the session's)."""
    server = EmbeddedPostgres(tmp_path / "pg")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def pool(database_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the test's schema, as the engine makes one."""
    p = await connect_pool(database_url, schema=pg_schema, max_size=4)
    yield p
    await p.close()
