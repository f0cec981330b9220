"""An engine served over real NATS and Postgres inside the test's own schema and subjects,
and a reader of the relay's KV bucket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from trellis.adapters.bootstrap import RunningEngine, engine_on
from trellis.adapters.fabric.redfish.watch import FabricWatch
from trellis.adapters.follow_process import FollowerProcess
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.jetstream import bucket_name
from trellis.adapters.nats.relay import RelaySink
from trellis.adapters.postgres.checkpoints import PostgresAuditTrail
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.adapters.settings import Settings
from trellis.engine.core.lag import LagTracker
from trellis.engine.core.records import PendingEvent, RecordedEvent
from trellis.engine.core.throttle import RateLimit
from trellis.engine.service.follower import Followers
from trellis.engine.service.ports import FabricDriver
from trellis.engine.service.router import Engine
from trellis.projections import ProjectionSink


class Harness(msgspec.Struct, kw_only=True):
    engine: Engine
    fabric: FabricDriver
    store: PostgresEventStore
    followers: Followers
    projections: ProjectionSink
    relay: RelaySink
    audit: PostgresAuditTrail
    client: TrellisClient
    follower_process: FollowerProcess | None = None  # followers="process"
    service_id: str = ""  # the engine's NATS micro service instance
    metrics_url: str | None = None  # with metrics_at=(host, port)
    page_url: str | None = None  # with page_at=(host, port)
    fabric_watch: FabricWatch | None = None  # with a Redfish fabric driver
    redfish_url: str | None = None  # with redfish=RedfishOptions(...)

    async def projected(self, domain: str, timeout: float = 5.0) -> int:
        """Until the domain's projections hold its whole log; the log's last position."""
        head = (await self.store.head(domain)).position
        assert await self.followers.wait_for("projections", domain, head, timeout), head
        return head

    async def relayed(self, domain: str, timeout: float = 5.0) -> int:
        """Until the stream and the bucket hold the domain's whole log; its last position."""
        head = (await self.store.head(domain)).position
        assert await self.followers.wait_for("relay", domain, head, timeout), head
        return head

    async def fabric_idle(self, domain: str, timeout: float = 5.0) -> None:
        """Until the engine's fabric holds what the domain's log says and no saga runs."""
        sync = self.engine.fabric_sync(domain)
        assert sync is not None, f"the engine has no fabric for {domain}"
        await asyncio.wait_for(sync.wait_idle(), timeout)


#: engine_on's own parameters: what Settings cannot carry, or what tests replace.
ENGINE_OVERRIDES = ("fabric", "clock", "signer", "secure", "follow_options", "redfish", "new_key")


def engine_settings(
    nats_url: str,
    database_url: str,
    *,
    schema: str | None = None,
    prefix: str = "trellis",
    owner_url: str | None = None,
    metrics_at: tuple[str, int] | None = None,
    page_at: tuple[str, int] | None = None,
    health: LagTracker | None = None,
    rate_limit: RateLimit | None = None,
    **fields: Any,
) -> Settings:
    """The Settings `trellis up` would read for an engine on these servers, from the names the
    tests use: `schema`, `prefix`, `owner_url`, `metrics_at` and `page_at` (host, port),
    `health` (its bounds), `rate_limit`; any other keyword is a Settings field. The followers
    run in the engine's loop unless `followers="process"`: tests wait on them and pause them
    (test_follower_process.py and the engines `trellis up` starts run the default)."""
    extra: dict[str, Any] = {"followers": fields.pop("followers", "inline")}
    if metrics_at is not None:
        extra.update(metrics_host=metrics_at[0], metrics_port=metrics_at[1])
    if page_at is not None:
        extra.update(http_host=page_at[0], http_port=page_at[1])
    if health is not None:
        extra.update(health_stall_s=health.stall_s, health_max_behind=health.max_behind)
    if rate_limit is not None:
        extra.update(tenant_rate=rate_limit)
    return Settings(
        nats_url=nats_url,
        database_url=database_url,
        database_owner_url=owner_url,
        db_schema=schema,
        subject_prefix=prefix,
        **extra,
        **fields,
    )


def engine_at(
    nats_url: str, database_url: str, **kwargs: Any
) -> contextlib.AbstractAsyncContextManager[RunningEngine]:
    """`engine_on` for tests: `kwargs` are engine_settings's, plus engine_on's overrides."""
    overrides = {name: kwargs.pop(name) for name in ENGINE_OVERRIDES if name in kwargs}
    return engine_on(engine_settings(nats_url, database_url, **kwargs), **overrides)


@contextlib.asynccontextmanager
async def serving(
    nats_url: str, database_url: str, schema: str, prefix: str, **engine_kwargs: object
) -> AsyncIterator[Harness]:
    """Run the engine as `trellis up` wires it; `client` talks to it as any client would."""
    async with (
        engine_at(nats_url, database_url, schema=schema, prefix=prefix, **engine_kwargs) as running,
        TrellisClient.connected(nats_url, prefix=prefix, name="test-client") as client,
    ):
        await answering(client)
        yield Harness(
            engine=running.engine,
            fabric=running.fabric,
            store=running.store,
            followers=running.followers,
            projections=running.projections,
            relay=running.relay,
            audit=running.audit,
            client=client,
            follower_process=running.follower_process,
            service_id=running.service_id,
            metrics_url=running.metrics_url,
            page_url=running.page_url,
            fabric_watch=running.fabric_watch,
            redfish_url=running.redfish_url,
        )


async def answering(client: TrellisClient, within: float = 10.0) -> None:
    """Until an engine answers `client` (any answer: a query of a domain nobody created is
    `not_found`). CI once saw a test's first request after `serving` answered "no responders"
    by the server, though the engine had subscribed and flushed before it; this waits for the
    engine to be reachable from the client's own connection, and says so if it never is."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            await client.query("harness-readiness", "free")
            return
        except nats.errors.NoRespondersError:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(
                    f"no engine answered the test's client within {within} s"
                ) from None
            await asyncio.sleep(0.05)


class ManualClock:
    """A Clock the test moves by hand (leases fall due when the test says)."""

    def __init__(self, at: datetime | None = None) -> None:
        self.at = at or datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

    def now(self) -> datetime:
        return self.at

    def advance(self, seconds: float) -> None:
        self.at += timedelta(seconds=seconds)


def undecodable_event(event_id: str = "00000000-0000-4000-8000-000000000001") -> PendingEvent:
    """An event of a type this engine does not know (a newer engine's, say), to append."""
    return PendingEvent(
        id=event_id,
        type="EventFromTheFuture",
        schema_version=1,
        actor="operator",
        causation_id="r-future",
        correlation_id="r-future",
        # Now: not before the events a test wrote before it (the log refuses time going back).
        recorded_at=datetime.now(UTC),
        data=b"{}",
    )


async def bucket_values(js: JetStreamContext, prefix: str) -> dict[str, bytes]:
    """Every live key of the relay's bucket for `prefix`, with its value.

    The keys come from the bucket's stream (one request, answered from what is stored), not
    from nats-py's `KeyValue.keys()`: that one watches the bucket and stops at the watcher's
    "no more pending" marker, which it can emit before entries already on their way (nats.py
    issue 842), and then answers NoKeysError or a part of the keys for a full bucket.
    """
    bucket = bucket_name(prefix)
    kv = await js.key_value(bucket)
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.>")
    values = {}
    for subject in info.state.subjects or {}:
        key = subject.removeprefix(f"$KV.{bucket}.")
        with contextlib.suppress(KeyNotFoundError):  # its last message deletes it
            entry = await kv.get(key)
            values[key] = entry.value or b""
    return values


def without_positions(values: dict[str, bytes]) -> dict[str, Any]:
    """The bucket's values (`bucket_values`) less the position stamped on each: a full
    rewrite stamps its own."""
    decoded = {key: msgspec.json.decode(value) for key, value in values.items()}
    return {
        key: {f: v for f, v in value.items() if f != "position"} for key, value in decoded.items()
    }


def cli_env(
    data_dir: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    **more: str,
) -> dict[str, str]:
    """The environment of a `trellis` CLI (or `trellis up`) pointed at this test's servers,
    schema and subjects, with none of the caller's TRELLIS_* settings; `more` adds settings,
    e.g. TRELLIS_DOMAIN="hall"."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
        "TRELLIS_DATA_DIR": str(data_dir),
        "TRELLIS_NATS_URL": nats_url,
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DB_SCHEMA": pg_schema,
        "TRELLIS_SUBJECT_PREFIX": subject_prefix,
        **more,
    }


async def run_cli(env: dict[str, str], *args: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """The `trellis` CLI in a subprocess, so the engine serving in this event loop answers it:
    its exit code, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        # A command that hangs (a `trellis up` that serves where the test expected it to
        # refuse) is not left running after the test that gave up on it.
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class CountingLog:
    """The store, counting the events a fold reads from it."""

    def __init__(self, store: Any):
        self._store = store
        self.read_events = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def read(
        self, domain: str, after_version: int = 0, limit: int | None = None
    ) -> AsyncIterator[RecordedEvent]:
        async for event in self._store.read(domain, after_version, limit):
            self.read_events += 1
            yield event
