"""Unique schemas and subject prefixes, so tests never see each other's data.

The fixtures in conftest.py use these once per test; code that needs a fresh pair more often
(the orchestration state machine wants one per hypothesis example) calls them directly.
"""

from __future__ import annotations

import contextlib
import uuid

import asyncpg
import nats
from nats.js.errors import NotFoundError

from adapters.bootstrap import nats_servers
from adapters.nats.jetstream import bucket_name, stream_name


def unique_schema_name() -> str:
    """A schema name nobody else uses: ``t_<12 hex>``."""
    return f"t_{uuid.uuid4().hex[:12]}"


def unique_subject_prefix() -> str:
    """A NATS subject token nobody else uses: ``t<12 hex>``."""
    return f"t{uuid.uuid4().hex[:12]}"


async def create_schema(database_url: str, name: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"create schema {name}")
    finally:
        await conn.close()


async def drop_schema(database_url: str, name: str) -> None:
    """Drop the schema with everything in it (a no-op when it is gone already)."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"drop schema if exists {name} cascade")
    finally:
        await conn.close()


async def delete_relay_targets(nats_url: str, prefix: str) -> None:
    """Delete the event stream and the state bucket the event relay made for `prefix`, where
    they exist, so the shared server does not fill up."""
    nc = await nats.connect(nats_servers(nats_url))
    try:
        js = nc.jetstream()
        for stream in (stream_name(prefix), f"KV_{bucket_name(prefix)}"):
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(stream)
    finally:
        await nc.close()
