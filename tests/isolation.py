"""Unique schemas and subject prefixes, so tests never see each other's data.

The fixtures in conftest.py use these once per test; code that needs a fresh pair more often
(the orchestration state machine wants one per hypothesis example) calls them directly.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import NamedTuple

import asyncpg
import nats
from nats.js.errors import NotFoundError

from trellis.adapters.nats.connect import nats_servers
from trellis.adapters.nats.jetstream import bucket_name, checkpoint_stream_name, stream_name
from trellis.adapters.postgres.migrations import prepare_schema


def unique_schema_name() -> str:
    """A schema name nobody else uses: ``t_<12 hex>``."""
    return f"t_{uuid.uuid4().hex[:12]}"


def unique_subject_prefix() -> str:
    """A NATS subject token nobody else uses: ``t<12 hex>``."""
    return f"t{uuid.uuid4().hex[:12]}"


class Database(NamedTuple):
    """A Postgres database as the tests use it: the engine's URL, the schema owner's URL and
    their roles (one and the same when the database gives a single URL)."""

    url: str
    owner_url: str
    engine_role: str
    owner_role: str


async def current_user(url: str) -> str:
    """The role `url` logs in as."""
    conn = await asyncpg.connect(url)
    try:
        role: str = await conn.fetchval("select current_user")
        return role
    finally:
        await conn.close()


async def create_schema(db: Database, name: str) -> None:
    """Create schema `name` as its owner, migrate it and grant the engine's role what it needs,
    as `trellis up` does before the engine serves (so engines in tests run least-privileged)."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        await conn.execute(f"create schema {name}")
    finally:
        await conn.close()
    await prepare_schema(db.owner_url, name, db.engine_role)


async def drop_schema(db: Database, name: str) -> None:
    """Drop the schema with everything in it (a no-op when it is gone already)."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        await conn.execute(f"drop schema if exists {name} cascade")
    finally:
        await conn.close()


async def delete_relay_targets(nats_url: str, prefix: str) -> None:
    """Delete the event stream, the state bucket and the checkpoint stream the engine made for
    `prefix`, where they exist, so the shared server does not fill up."""
    nc = await nats.connect(nats_servers(nats_url))
    try:
        js = nc.jetstream()
        streams = (stream_name(prefix), f"KV_{bucket_name(prefix)}", checkpoint_stream_name(prefix))
        for stream in streams:
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(stream)
    finally:
        await nc.close()
