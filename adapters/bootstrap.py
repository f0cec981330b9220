"""The one place that wires concrete adapters to the engine (cosmicpython's bootstrap).

`running_engine(settings)` brings up everything `trellis up` needs: the embedded servers when
no URLs are configured, the Postgres event store (migrated), the projections, the event relay
(log → JetStream stream and KV bucket), the engine with its state rebuilt from the log, and the
NATS intake. Leaving the context stops all of it, in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS

from adapters.clock import SystemClock
from adapters.embedded.servers import EmbeddedNats, EmbeddedPostgres, default_data_dir
from adapters.fabric.sim import SimulatedFabric
from adapters.nats.intake import NatsIntake
from adapters.nats.jetstream import StreamLimits
from adapters.nats.relay import EventRelay
from adapters.postgres.store import PostgresEventStore, connect_pool
from adapters.settings import Settings, SettingsError
from engine.ports import Clock, FabricDriver
from engine.service import Engine
from projections import PostgresReadModels, ProjectionRunner

log = logging.getLogger(__name__)

ENDPOINTS_FILE = "endpoints.json"
FABRIC_STATE_FILE = "fabric-sim.json"


class RunningEngine(msgspec.Struct, kw_only=True):
    engine: Engine
    fabric: FabricDriver
    store: PostgresEventStore
    projections: ProjectionRunner
    relay: EventRelay
    nc: NATS
    nats_url: str
    database_url: str
    subject_prefix: str


def nats_servers(url: str) -> list[str]:
    """The servers a TRELLIS_NATS_URL names: one URL, or several separated by commas.

    Raises:
        ValueError: it names none.
    """
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    return servers


async def connect_nats(url: str, name: str = "trellis") -> NATS:
    """A NATS connection that keeps reconnecting, so a NATS restart is a pause, not an exit.

    `url` may list several servers, comma-separated (the nodes of a cluster): the connection
    starts at one of them and moves to another when its server goes away. The nodes of a
    cluster also tell their clients about each other, so it can move to nodes it was not given;
    listing them all lets it start while any one of them is down.
    """
    nc = NATS()

    async def lost() -> None:
        if not (nc.is_closed or nc.is_draining):  # a close of our own is no loss
            log.warning("lost the NATS connection; reconnecting")

    async def back() -> None:
        log.warning("NATS connection restored")

    await nc.connect(
        nats_servers(url),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,  # type: ignore[arg-type]  # annotated int, takes seconds
        connect_timeout=5,
        error_cb=_nats_error,
        disconnected_cb=lost,
        reconnected_cb=back,
    )
    return nc


async def _nats_error(exc: Exception) -> None:
    # nats-py's default prints a traceback for every failed (re)connect attempt.
    log.debug("nats: %s", str(exc) or type(exc).__name__)


def _each(*callbacks: Callable[[], None]) -> Callable[[], None]:
    """One zero-argument callback that calls each of `callbacks` (the engine takes one)."""

    def call_each() -> None:
        for callback in callbacks:
            callback()

    return call_each


@contextlib.asynccontextmanager
async def embedded_or_configured(settings: Settings) -> AsyncIterator[tuple[str, str]]:
    """The (nats_url, database_url) to use, starting embedded servers for the unset ones."""
    data_dir = settings.data_dir or default_data_dir()
    with contextlib.ExitStack() as stack:
        nats_url, database_url = settings.nats_url, settings.database_url
        if not nats_url:
            server = stack.enter_context(EmbeddedNats(data_dir))
            await asyncio.to_thread(server.start)
            nats_url = server.url
        if not database_url:
            pg = stack.enter_context(EmbeddedPostgres(data_dir))
            await asyncio.to_thread(pg.start)
            database_url = pg.url
        yield nats_url, database_url


@contextlib.asynccontextmanager
async def engine_on(
    nats_url: str,
    database_url: str,
    *,
    schema: str | None = None,
    prefix: str = "trellis",
    domains: list[str] | None = None,
    clock: Clock | None = None,
    fabric: FabricDriver | None = None,
    saga_deadline: float = 10.0,
    stream_limits: StreamLimits | None = None,
) -> AsyncIterator[RunningEngine]:
    """The engine, its projections, its event relay and its NATS intake on given servers, until
    the context exits. Migrations run first; the engine's state is rebuilt from the log before
    it serves. Without a `fabric` driver the engine drives a SimulatedFabric (there is no
    hardware)."""
    async with contextlib.AsyncExitStack() as stack:
        store = await PostgresEventStore.open(database_url, schema=schema)
        stack.push_async_callback(store.close)
        # The projections commit on a pool of their own, so they never wait for an engine append.
        runner_pool = await connect_pool(database_url, schema=schema, max_size=4)
        runner = ProjectionRunner(runner_pool, store, owns_pool=True)
        stack.push_async_callback(runner.close)
        await runner.start()
        # The relay reads and publishes on connections of its own, so a burst (catching up after
        # downtime) never queues in front of the engine's appends or the intake's replies.
        relay_nc = await connect_nats(nats_url, name="trellis-relay")
        stack.push_async_callback(relay_nc.close)
        relay = await EventRelay.open(
            database_url, relay_nc.jetstream(), schema=schema, prefix=prefix, limits=stream_limits
        )
        stack.push_async_callback(relay.close)
        await relay.start()
        fabric = fabric if fabric is not None else SimulatedFabric()
        engine = Engine(
            store,
            clock or SystemClock(),
            fabric,
            saga_deadline=saga_deadline,
            domains=domains,
            read_models=PostgresReadModels(runner.pool, runner),
            on_commit=_each(runner.notify, relay.notify),
        )
        await engine.start()
        stack.push_async_callback(engine.close)
        nc = await connect_nats(nats_url, name="trellis-engine")
        # close, not drain: intake.stop() below has already unsubscribed and waited for every
        # request in flight, which is what a drain would do (and nats-py's drain can stall).
        stack.push_async_callback(nc.close)
        intake = NatsIntake(nc, engine, prefix=prefix, domains=domains)
        await intake.start()
        stack.push_async_callback(intake.stop)
        yield RunningEngine(
            engine=engine,
            fabric=fabric,
            store=store,
            projections=runner,
            relay=relay,
            nc=nc,
            nats_url=nats_url,
            database_url=database_url,
            subject_prefix=prefix,
        )


@contextlib.asynccontextmanager
async def running_engine(settings: Settings) -> AsyncIterator[RunningEngine]:
    """Start the engine as configured (embedded servers for unset URLs); serve until exit."""
    fabric = fabric_from_settings(settings)  # a bad state file stops us before any server starts
    async with contextlib.AsyncExitStack() as stack:
        nats_url, database_url = await stack.enter_async_context(embedded_or_configured(settings))
        running = await stack.enter_async_context(
            engine_on(
                nats_url,
                database_url,
                schema=settings.db_schema,
                prefix=settings.subject_prefix,
                domains=settings.domains,
                fabric=fabric,
                saga_deadline=settings.saga_deadline,
                stream_limits=settings.stream_limits,
            )
        )
        endpoints = _write_endpoints(settings, nats_url, database_url)
        stack.callback(endpoints.unlink, missing_ok=True)
        log.info("engine serving %s on %s", settings.subject_prefix, nats_url)
        yield running


def fabric_state_path(settings: Settings) -> Path:
    """Where the simulated fabric keeps what it has programmed."""
    return settings.fabric_state or (settings.data_dir or default_data_dir()) / FABRIC_STATE_FILE


def fabric_from_settings(settings: Settings) -> FabricDriver:
    """The fabric driver `settings` name. Only the simulator exists so far; it keeps its
    "hardware" in its state file, so that outlives the engine as real hardware would.

    Raises:
        SettingsError: The state file cannot be read.
    """
    match settings.fabric:
        case "sim":
            try:
                fabric = SimulatedFabric(
                    seed=settings.fabric_seed,
                    latency=settings.fabric_latency_ms / 1000,
                    failure_rate=settings.fabric_failure_rate,
                    hang_rate=settings.fabric_hang_rate,
                    state_file=fabric_state_path(settings),
                )
            except (OSError, ValueError) as exc:
                raise SettingsError(f"TRELLIS_FABRIC_STATE: {exc}") from None
            for fault in settings.fabric_script:
                fault.arm(fabric)
            return fabric


def _write_endpoints(settings: Settings, nats_url: str, database_url: str) -> Path:
    """Tell local CLI clients where a running engine listens (the embedded ports are random)."""
    path = (settings.data_dir or default_data_dir()) / ENDPOINTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    endpoints = {"nats_url": nats_url, "database_url": database_url}
    path.write_text(json.dumps({**endpoints, "subject_prefix": settings.subject_prefix}))
    return path


def find_endpoint(settings: Settings, name: str) -> str | None:
    """`name` ("nats_url" or "database_url") from the environment, else from what a local
    `trellis up` wrote, else None."""
    configured: str | None = getattr(settings, name)
    if configured:
        return configured
    path = (settings.data_dir or default_data_dir()) / ENDPOINTS_FILE
    try:
        return str(json.loads(path.read_text())[name])
    except (OSError, ValueError, KeyError):
        return None
