"""The one place that wires concrete adapters to the engine (cosmicpython's bootstrap).

`running_engine(settings)` brings up everything `trellis up` needs: the embedded servers when
no URLs are configured, the Postgres event store (migrated by the schema's owner), the
projections and the event relay (each domain's log followers: read models, JetStream stream and
KV bucket; with TRELLIS_FOLLOWERS=process, in a follower process of their own), the engine with
its state rebuilt from the log, and the NATS intake (also the engine's NATS micro service);
with a metrics port, the Prometheus metrics and health server (adapters/http/metrics.py)
and the instruments it reads; with an HTTP port, the live fabric page
(adapters/http/fabric_page.py). Leaving the context stops all of it, in reverse order.
A Postgres or NATS that cannot be reached yet is waited for, with backoff and a log line per
attempt; cancelling the wait (Ctrl-C) stops the start cleanly. In secure mode
(adapters/nats/auth.py) the embedded nats-server runs with the generated users, the engine
connects as its own identity and the fabric page as the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from trellis.adapters.checkpoint_key import KEY_FILE, KeyFileError, load_or_create
from trellis.adapters.clock import SystemClock
from trellis.adapters.embedded import watchdog
from trellis.adapters.embedded.servers import (
    EmbeddedNats,
    EmbeddedPostgres,
    default_data_dir,
    reload_nats,
)
from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.adapters.fabric.redfish.watch import FabricWatch
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.fabric.timed import TimedFabric
from trellis.adapters.follow_process import CommitSignal, FollowerProcess, follower_env
from trellis.adapters.health import FollowerGauges, FollowerHealth
from trellis.adapters.http.fabric_page import FabricPage
from trellis.adapters.http.metrics import MetricsServer
from trellis.adapters.http.redfish.accounts import admin_password
from trellis.adapters.http.redfish.serve import ACCOUNTS_FILE, RedfishOptions, serve_redfish
from trellis.adapters.instruments import EngineMetrics
from trellis.adapters.nats.auth import (
    CredentialsError,
    NkeyCredentials,
    Principal,
    SecureDir,
    tenant_name_problem,
)
from trellis.adapters.nats.checkpoints import CheckpointPublisher
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.intake import NatsIntake
from trellis.adapters.nats.jetstream import StreamLimits
from trellis.adapters.nats.relay import RelaySink
from trellis.adapters.nats.replies import AnyInbox, OwnInbox
from trellis.adapters.postgres.checkpoints import DEFAULT_EVERY, PostgresAuditTrail
from trellis.adapters.postgres.leases import PostgresLeases
from trellis.adapters.postgres.snapshots import PostgresSnapshots
from trellis.adapters.postgres.store import IDLE_IN_APPEND_S, PostgresEventStore, connect_pool
from trellis.adapters.settings import FollowersMode, Settings, SettingsError, redacted
from trellis.engine.core.checkpoints import Signer
from trellis.engine.core.errors import StoreUnavailable
from trellis.engine.core.lag import LagTracker
from trellis.engine.core.throttle import RateLimit
from trellis.engine.service.follower import Followers
from trellis.engine.service.ownership import tick_of
from trellis.engine.service.ports import Clock, FabricDriver
from trellis.engine.service.router import Engine
from trellis.projections import PostgresReadModels, ProjectionSink

log = logging.getLogger(__name__)

ENDPOINTS_FILE = "endpoints.json"
FABRIC_STATE_FILE = "fabric-sim.json"
# Waiting for a server: the first retry comes soon, later ones no more often than this.
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
_NATS_PROBE_TIMEOUT_S = 2.0
#: How long the health check waits for the store to answer.
HEALTH_CHECK_S = 2.0
#: How long a reload of nats-server may take to let a newly issued identity in (a loaded
#: machine takes seconds; the reload itself is one SIGHUP).
ACCEPT_TIMEOUT_S = 30.0

T = TypeVar("T")


class RunningEngine(msgspec.Struct, kw_only=True):
    engine: Engine
    fabric: FabricDriver
    store: PostgresEventStore
    followers: Followers  # each domain's projections and event relay (process mode: none)
    projections: ProjectionSink
    relay: RelaySink
    audit: PostgresAuditTrail  # signed checkpoints and proofs; also a follower sink
    nc: NATS
    nats_url: str
    database_url: str
    subject_prefix: str
    secure_dir: Path | None = None  # secure mode's identities and server config
    nats_monitor_url: str | None = None  # an embedded nats-server's HTTP monitoring
    follower_process: FollowerProcess | None = None  # TRELLIS_FOLLOWERS=process
    service_id: str = ""  # the NATS micro service's instance id ($SRV.*.trellis-engine.<id>)
    metrics_url: str | None = None  # Prometheus metrics and health, when served
    page_url: str | None = None  # the live fabric page, when served
    fabric_watch: FabricWatch | None = None  # the Redfish driver's timer, health and events
    page_token: str | None = None  # secure mode: the page's token (`<page_url>/?token=...`)
    redfish_url: str | None = None  # the northbound Redfish service, when served


ENGINE_IDENTITY = Principal("engine", "engine")
RELAY_IDENTITY = Principal("relay", "relay")
CHECKPOINTS_IDENTITY = Principal("checkpoints", "checkpoints")
OPERATOR_IDENTITY = Principal("operator", "operator")


def _identity(secure: SecureDir | None, who: Principal) -> NkeyCredentials | None:
    """Who a connection of the engine's process connects as: `who` in secure mode, else
    nobody in particular."""
    return secure.credentials(who) if secure is not None else None


def nats_servers(url: str) -> list[str]:
    """The servers a TRELLIS_NATS_URL names: one URL, or several separated by commas.

    Raises:
        ValueError: it names none.
    """
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    return servers


async def connect_nats(
    url: str,
    name: str = "trellis",
    *,
    credentials: NkeyCredentials | None = None,
    on_error: Callable[[Exception], Awaitable[None]] | None = None,
) -> NATS:
    """A NATS connection that keeps reconnecting, so a NATS restart is a pause, not an exit.

    `url` may list several servers, comma-separated (the nodes of a cluster): the connection
    starts at one of them and moves to another when its server goes away. The nodes of a
    cluster also tell their clients about each other, so it can move to nodes it was not given;
    listing them all lets it start while any one of them is down.

    Args:
        url: the server, or several comma-separated.
        name: the connection's name, as the server's monitoring shows it.
        credentials: the identity to connect as (secure mode); None: anonymous.
        on_error: called with each asynchronous error (refused credentials, a publish the
            server's permissions deny); by default they are logged.

    Raises:
        CredentialsError: `credentials` holds no usable nkey seed.
    """
    options = credentials.connect_options() if credentials is not None else {}
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
        error_cb=on_error or _nats_error,
        disconnected_cb=lost,
        reconnected_cb=back,
        **options,
    )
    return nc


async def _nats_error(exc: Exception) -> None:
    # nats-py's default prints a traceback for every failed (re)connect attempt. Refused
    # credentials or permissions are worth a warning: retrying will not fix them.
    text = str(exc) or type(exc).__name__
    log.log(logging.WARNING if "violation" in text.lower() else logging.DEBUG, "nats: %s", text)


async def until_accepted(
    url: str, creds: NkeyCredentials, timeout: float = ACCEPT_TIMEOUT_S
) -> None:
    """Return once the nats-server at `url` lets `creds` connect: after the reload (SIGHUP)
    that added that identity, which takes effect a moment after the signal.

    Every refusal until then counts as "not yet", whatever its form: before the reload the
    identity is unknown (`Authorization Violation`), and while the server reloads it drops
    every client that has not finished its handshake, valid or not (the same error, or a
    connection reset when it closes before the client's CONNECT). Once the new identity is
    accepted the reload has passed that point, so clients that connect afterwards are kept.

    Raises:
        TimeoutError: still refused after `timeout` seconds; says with what.
        CredentialsError: `creds` holds no usable nkey seed.
    """
    options = creds.connect_options()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            nc = await nats.connect(
                nats_servers(url),
                allow_reconnect=False,
                connect_timeout=_NATS_PROBE_TIMEOUT_S,
                error_cb=_ignore_refusal,
                **options,
            )
        except (nats.errors.Error, OSError) as exc:  # TimeoutError is an OSError
            if loop.time() > deadline:
                reason = str(exc) or type(exc).__name__
                raise TimeoutError(
                    f"the nats-server at {redacted(url)} still refuses {creds.path} "
                    f"after {timeout:.0f}s: {reason}"
                ) from None
            await asyncio.sleep(0.1)
        else:
            await nc.close()
            return


async def _ignore_refusal(exc: Exception) -> None:
    """nats-py reports each refused attempt to the error callback too; the caller retries."""


async def until_reachable(
    what: str,
    where: str,
    attempt: Callable[[], Awaitable[T]],
    unreachable: tuple[type[BaseException], ...],
) -> T:
    """`attempt()`'s result, retried with exponential backoff for as long as it raises one of
    `unreachable`; one warning per failed attempt names `what` and `where` (no secrets in it).
    Any other error ends the wait. Cancelling it (Ctrl-C) ends it too."""
    delay, failures = RETRY_FIRST_S, 0
    while True:
        try:
            result = await attempt()
        except unreachable as exc:
            failures += 1
            reason = str(exc) or type(exc).__name__
            log.warning(
                "waiting for %s at %s (attempt %d: %s); next try in %.2g s",
                what, where, failures, reason, delay,
            )  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            continue
        if failures:
            log.warning("%s at %s is reachable after %d failed attempts", what, where, failures)
        return result


class NatsUnreachable(ConnectionError):
    """No server of a NATS URL list answered with its INFO line."""


async def probe_nats(url: str) -> None:
    """Return once any server of `url` (comma-separated NATS URLs) greets a TCP client with its
    INFO line, as a NATS server does first thing: before TLS and before any credentials, so
    the probe needs neither. Websocket URLs are left to the client library.

    Raises:
        NatsUnreachable: No server answered.
    """
    reasons = []
    for one in (u.strip() for u in url.split(",")):
        parts = urllib.parse.urlsplit(one if "://" in one else f"nats://{one}")
        if parts.scheme in ("ws", "wss"):
            return
        host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        try:
            if (await _first_line(host, port)).startswith(b"INFO "):
                return
            reasons.append(f"{host}:{port}: no NATS greeting")
        except (OSError, TimeoutError) as exc:
            reasons.append(f"{host}:{port}: {str(exc) or type(exc).__name__}")
    raise NatsUnreachable("; ".join(reasons))


async def _first_line(host: str, port: int) -> bytes:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port), _NATS_PROBE_TIMEOUT_S
    )
    try:
        return await asyncio.wait_for(reader.readline(), _NATS_PROBE_TIMEOUT_S)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class Endpoints(NamedTuple):
    """Where the engine's servers are: NATS, Postgres for the engine's role, and Postgres for
    the schema's owner (None: the engine's role migrates, see docs/security.md, Least privilege)."""

    nats_url: str
    database_url: str
    database_owner_url: str | None
    nats_monitor_url: str | None = None  # the embedded nats-server's HTTP monitoring


@contextlib.asynccontextmanager
async def embedded_or_configured(
    settings: Settings, *, nats_config: Path | None = None
) -> AsyncIterator[Endpoints]:
    """The endpoints to use, starting embedded servers for the unset ones (the embedded
    Postgres brings an owner and an engine role of its own; an embedded nats-server reads
    `nats_config` too: secure mode's users)."""
    data_dir = settings.data_dir or default_data_dir()
    with contextlib.ExitStack() as stack:
        nats_url, database_url = settings.nats_url, settings.database_url
        owner_url = settings.database_owner_url
        watched: list[tuple[int, int]] = []
        monitor_url = None
        if not nats_url:
            if nats_config is not None and settings.nats_monitor_port is not None:
                log.warning(
                    "TRELLIS_NATS_MONITOR_PORT is ignored in secure mode: nats-server's "
                    "monitoring has no authentication and lists every identity's inbox"
                )
            server = stack.enter_context(
                EmbeddedNats(
                    data_dir,
                    settings.nats_port,
                    config=nats_config,
                    monitor_port=settings.nats_monitor_port,
                    monitor=nats_config is None,  # secure mode: no unauthenticated /connz
                )
            )
            await asyncio.to_thread(server.start)
            nats_url, monitor_url = server.url, server.monitor_url
            watched.append((_pid(server), signal.SIGTERM))
        if not database_url:
            pg = stack.enter_context(EmbeddedPostgres(data_dir, settings.pg_port))
            await asyncio.to_thread(pg.start)
            database_url, owner_url = pg.url, pg.owner_url
            watched.append((_pid(pg), signal.SIGINT))  # PostgreSQL's fast shutdown
        if watched:
            # Stopped before the servers on a clean exit; if this process is killed, it stops
            # them, so a SIGKILLed `trellis up` leaves no orphaned server behind.
            dog = watchdog.watch(watched)
            stack.callback(_end, dog)
        yield Endpoints(nats_url, database_url, owner_url, monitor_url)


def _pid(server: EmbeddedNats | EmbeddedPostgres) -> int:
    pid = server.pid
    if pid is None:
        raise StoreUnavailable(f"the embedded {server.name} stopped as it started")
    return pid


def _end(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait()


class Sinks(NamedTuple):
    """What follows the log (engine/service/follower.py): the projections, the event relay and the
    checkpoints, with the snapshots of the read models' pool."""

    projections: ProjectionSink
    relay: RelaySink
    audit: PostgresAuditTrail
    snapshots: PostgresSnapshots
    nc: NATS  # the relay's own connection


async def follower_sinks(
    stack: contextlib.AsyncExitStack,
    nats_url: str,
    database_url: str,
    *,
    schema: str | None,
    prefix: str,
    stream_limits: StreamLimits | None,
    secure: SecureDir | None,
    signer: Signer | None,
    checkpoint_every: int,
    snapshot_every: int,
) -> Sinks:
    """The log followers' sinks on pools and a NATS connection of their own (closed with
    `stack`), their JetStream stream, bucket and checkpoint stream made ready: what the engine
    follows inline and the follower process (adapters/entrypoints/follow.py) follows alone."""
    # The projections and the relay commit on pools of their own, so they never wait for
    # an engine append, and the relay publishes on a NATS connection of its own, so a burst
    # (catching up after downtime) never queues in front of the intake's replies.
    projection_pool = await connect_pool(database_url, schema=schema, max_size=4)
    stack.push_async_callback(projection_pool.close)
    relay_pool = await connect_pool(database_url, schema=schema, min_size=1, max_size=2)
    stack.push_async_callback(relay_pool.close)
    await until_reachable(
        "NATS", redacted(nats_url), lambda: probe_nats(nats_url), (NatsUnreachable,)
    )
    relay_nc = await connect_nats(
        nats_url, name="trellis-relay", credentials=_identity(secure, RELAY_IDENTITY)
    )
    stack.push_async_callback(relay_nc.close)
    projections = ProjectionSink(projection_pool, snapshot_every=snapshot_every)
    snapshots = PostgresSnapshots(projection_pool)
    relay = RelaySink(relay_pool, relay_nc, prefix=prefix, limits=stream_limits)
    # JetStream can be up before its stream has a leader (a cluster electing one): wait.
    await until_reachable(
        "the JetStream stream and bucket",
        redacted(nats_url),
        relay.prepare,
        (NatsTimeoutError, NoRespondersError, ServiceUnavailableError),
    )
    # In secure mode the checkpoints have an identity of their own, the only one that may
    # write their stream (adapters/nats/auth.py).
    checkpoint_nc = relay_nc
    if secure is not None:
        checkpoint_nc = await connect_nats(
            nats_url,
            name="trellis-checkpoints",
            credentials=secure.credentials(CHECKPOINTS_IDENTITY),
        )
        stack.push_async_callback(checkpoint_nc.close)
    checkpoints = CheckpointPublisher(
        checkpoint_nc, prefix=prefix, replicas=(stream_limits or StreamLimits()).replicas
    )
    await until_reachable(
        "the JetStream checkpoint stream",
        redacted(nats_url),
        checkpoints.prepare,
        (NatsTimeoutError, NoRespondersError, ServiceUnavailableError),
    )
    audit_pool = await connect_pool(database_url, schema=schema, min_size=1, max_size=2)
    stack.push_async_callback(audit_pool.close)
    if signer is None:
        log.info("checkpoints are signed with a key of this run only (no key file given)")
    audit = PostgresAuditTrail(
        audit_pool,
        signer or Signer.generate(),
        every=checkpoint_every,
        publish=checkpoints,
        follower=f"checkpoints:{checkpoints.stream}",
    )
    return Sinks(projections, relay, audit, snapshots, relay_nc)


@contextlib.asynccontextmanager
async def engine_on(
    nats_url: str,
    database_url: str,
    *,
    owner_url: str | None = None,
    schema: str | None = None,
    prefix: str = "trellis",
    domains: list[str] | None = None,
    clock: Clock | None = None,
    fabric: FabricDriver | None = None,
    saga_deadline: float = 10.0,
    stream_limits: StreamLimits | None = None,
    follow_options: dict[str, float] | None = None,
    secure: SecureDir | None = None,
    lease_ttl: float = 3.0,
    read_wait: float = 2.0,
    signer: Signer | None = None,
    checkpoint_every: int = DEFAULT_EVERY,
    snapshot_every: int = 10_000,
    followers: FollowersMode = "inline",
    checkpoint_key: Path | None = None,
    metrics_at: tuple[str, int] | None = None,
    page_at: tuple[str, int] | None = None,
    health: LagTracker | None = None,
    allowed_hosts: Sequence[str] = (),
    rate_limit: RateLimit | None = None,
    redfish: RedfishOptions | None = None,
) -> AsyncIterator[RunningEngine]:
    """The engine, its projections, its event relay and its NATS intake on given servers, until
    the context exits. Migrations run first, through `owner_url` when given (the schema's
    owner, who then grants `database_url`'s role the engine's privileges); the engine's state
    is rebuilt from the log before it serves. Postgres, then NATS, are waited for until they
    answer. Without a `fabric` driver the engine drives a SimulatedFabric (there is no
    hardware). `follow_options` tune the log followers (engine.service.follower.Follower);
    `secure`: secure mode's identities (each job connects as its own, adapters/nats/auth.py,
    and replies go only to the requester's own inbox); `lease_ttl`: seconds a
    writer lease lasts unrenewed (engine/service/ownership.py); `read_wait`: seconds a query waits
    for its `min_position`; `snapshot_every`: events between
    snapshots of a domain's state and read models (0: none); `signer`: the checkpoint key
    (None: a key of this run only, for tests; `trellis up` passes the data dir's), and a
    checkpoint every `checkpoint_every` events per domain. `followers="process"` runs the log
    followers in a process of their own (adapters/follow_process.py), which signs with the
    key in `checkpoint_key` (None: a key file of this run only, made for both). `metrics_at`
    (host, port; port 0: a free one) serves Prometheus metrics and a health check there
    (adapters/http/metrics.py), its followers judged by `health`'s bounds
    (engine/core/lag.py; default 60 s and 10,000 events). `page_at` (host, port; likewise) serves
    the live fabric page there (adapters/http/fabric_page.py), a NATS client of its own
    that connects as the operator in secure mode, where it asks a browser for the token it
    was given (`page_token`). Both answer only requests whose Host is their address or one of
    `allowed_hosts`. Each tenant's intents go through `rate_limit` (default:
    engine/core/throttle.py's;
    `RateLimit(0)`: none). `redfish` serves the northbound Redfish service
    (adapters/http/redfish/), a NATS client of its own (the operator in secure mode).

    Raises:
        SettingsError: the metrics, the page's or Redfish's address cannot be bound.
    """
    if followers == "process" and checkpoint_key is None and signer is not None:
        raise ValueError("followers='process' with a signer needs its checkpoint_key file")
    async with contextlib.AsyncExitStack() as stack:
        if followers == "process" and checkpoint_key is None:
            key_dir = tempfile.mkdtemp(prefix="trellis-key-")
            stack.callback(shutil.rmtree, key_dir, ignore_errors=True)
            checkpoint_key = Path(key_dir) / KEY_FILE
            signer = load_or_create(checkpoint_key)
        store = await until_reachable(
            "Postgres",
            redacted(database_url),
            lambda: PostgresEventStore.open(
                database_url,
                schema=schema,
                owner_dsn=owner_url,
                # A writer stopped inside an append (SIGSTOP, a stuck VM) keeps the lease row
                # locked (the log's fence check, schema/008) until the server ends its session,
                # and a takeover waits for that lock. Its lease runs out two ticks at the
                # earliest after the pause, so a session idle a tick in a transaction is ended
                # before then: the takeover waits for the lease only. (An event loop stalled a
                # tick mid-append loses that append, answered `unavailable` and resent; one
                # stalled two ticks can lose the lease itself.)
                idle_in_transaction_s=min(IDLE_IN_APPEND_S, tick_of(lease_ttl)),
            ),
            (StoreUnavailable,),
        )
        stack.push_async_callback(store.close)
        sinks = await follower_sinks(
            stack,
            nats_url,
            database_url,
            schema=schema,
            prefix=prefix,
            stream_limits=stream_limits,
            secure=secure,
            signer=signer,
            checkpoint_every=checkpoint_every,
            snapshot_every=snapshot_every,
        )
        projections, relay, audit = sinks.projections, sinks.relay, sinks.audit
        snapshots, projection_pool = sinks.snapshots, sinks.projections.pool
        process: FollowerProcess | None = None
        following: Followers
        if followers == "process":
            assert checkpoint_key is not None
            process = FollowerProcess(
                follower_env(
                    nats_url=nats_url,
                    database_url=database_url,
                    schema=schema,
                    prefix=prefix,
                    checkpoint_key=str(checkpoint_key),
                    checkpoint_every=checkpoint_every,
                    snapshot_every=snapshot_every,
                    stream_limits=msgspec.structs.astuple(stream_limits or StreamLimits()),
                    secure_data_dir=str(secure.root.parent) if secure is not None else None,
                )
            )
            await process.start()
            # Stopped after the engine: its SIGTERM drains the last commits to the stream.
            stack.push_async_callback(process.stop)
            following = CommitSignal(store, sinks.nc, prefix)
        else:
            following = Followers(store, [projections, relay, audit], **(follow_options or {}))
            # Closed after the engine: the last commits still reach the stream on a clean exit.
            stack.push_async_callback(following.close)
        fabric = fabric if fabric is not None else SimulatedFabric()
        metrics = EngineMetrics() if metrics_at is not None else None
        # Leases are taken and renewed on a pool of their own, never behind an append; a
        # renewal that cannot finish within the lease time is as good as lost.
        lease_pool = await connect_pool(
            database_url, schema=schema, max_size=2, command_timeout=lease_ttl / 2
        )
        stack.push_async_callback(lease_pool.close)
        engine = Engine(
            store,
            clock or SystemClock(),
            fabric if metrics is None else TimedFabric(fabric, metrics.fabric_operation),
            saga_deadline=saga_deadline,
            domains=domains,
            # In process mode a read waits on the checkpoints table (the follower process
            # moves it), for every projection's checkpoint.
            read_models=PostgresReadModels(
                projection_pool,
                following if process is None else None,
                projections=projections.checkpoint_names,
                log=store,
                snapshots=snapshots,
            ),
            followers=following,
            leases=PostgresLeases(lease_pool),
            name=f"{socket.gethostname()}:{os.getpid()}",
            lease_ttl=lease_ttl,
            read_wait=read_wait,
            audit=audit,
            snapshots=snapshots,
            snapshot_every=snapshot_every,
            telemetry=metrics,
            rate_limit=rate_limit or RateLimit(),
        )
        await engine.start()
        stack.push_async_callback(engine.close)
        watch = None
        if isinstance(fabric, RedfishFabric):  # its reconciliation timer and health
            stack.push_async_callback(fabric.close)
            watch = FabricWatch(fabric, engine)
            await watch.start()
            stack.push_async_callback(watch.close)
        nc = await connect_nats(
            nats_url, name="trellis-engine", credentials=_identity(secure, ENGINE_IDENTITY)
        )
        # close, not drain: intake.stop() below has already unsubscribed and waited for every
        # request in flight, which is what a drain would do (and nats-py's drain can stall).
        stack.push_async_callback(nc.close)
        intake = NatsIntake(
            nc,
            engine,
            prefix=prefix,
            domains=domains,
            observer=metrics,
            reply_rule=OwnInbox(secure.inboxes) if secure is not None else AnyInbox(),
        )
        await intake.start()
        stack.push_async_callback(intake.stop)
        metrics_url = None
        if metrics is not None and metrics_at is not None:
            metrics.watch(engine, following, projections=projections.name, relay=relay.name)
            relay.foreign.on_skip = metrics.foreign_message
            lag = FollowerHealth(
                projection_pool,
                lambda: _heads(engine),
                {
                    **{name: name for name in projections.checkpoint_names},
                    "relay": relay.checkpoint_name,
                },
                health or LagTracker(),
            )
            lag.start()
            stack.push_async_callback(lag.close)
            metrics.registry.register(FollowerGauges(lag))
            server = MetricsServer(
                metrics.registry,
                {
                    "intake": lambda: _true(intake.serving),
                    "nats": lambda: _true(nc.is_connected),
                    "store": lambda: _answers(store),
                    "followers": lambda: _true(lag.healthy()),
                },
                host=metrics_at[0],
                port=metrics_at[1],
                details=lambda: {"problems": lag.problems(), "domains": lag.domains()},
                allowed_hosts=allowed_hosts,
            )
            try:
                await server.start()
            except OSError as exc:
                where = f"{metrics_at[0]}:{metrics_at[1]}"
                raise SettingsError(f"metrics cannot listen on {where}: {exc}") from None
            stack.push_async_callback(server.close)
            metrics_url = server.url
        page_url = page_token = None
        if page_at is not None:
            page_token = secrets.token_urlsafe(24) if secure is not None else None
            page_url = await _serve_page(
                stack,
                nats_url,
                prefix,
                page_at,
                _identity(secure, OPERATOR_IDENTITY),
                metrics,
                allowed_hosts,
                page_token,
            )
        redfish_url = None
        if redfish is not None:
            try:
                redfish_url = await serve_redfish(
                    stack,
                    lambda: connect_nats(
                        nats_url,
                        name="trellis-redfish",
                        credentials=_identity(secure, OPERATOR_IDENTITY),
                    ),
                    prefix,
                    redfish,
                    store.domains,
                    allowed_hosts,
                    tenant_connection=(
                        None
                        if secure is None
                        else _tenant_connection(nats_url, secure)  # acts as each tenant
                    ),
                )
            except (OSError, ValueError) as exc:
                where = f"{redfish.host}:{redfish.port}"
                raise SettingsError(f"Redfish cannot serve on {where}: {exc}") from None
        yield RunningEngine(
            engine=engine,
            fabric=fabric,
            store=store,
            followers=following,
            follower_process=process,
            projections=projections,
            relay=relay,
            audit=audit,
            nc=nc,
            nats_url=nats_url,
            database_url=database_url,
            subject_prefix=prefix,
            service_id=intake.service.id,
            metrics_url=metrics_url,
            page_url=page_url,
            page_token=page_token,
            fabric_watch=watch,
            redfish_url=redfish_url,
        )


def _tenant_connection(nats_url: str, secure: SecureDir) -> Callable[[str], Awaitable[NATS | None]]:
    """Secure mode: a NATS connection as `tenant`'s identity, None while it has none (the
    Redfish service sends each tenant's intents over one, docs/redfish.md)."""

    async def connect(tenant: str) -> NATS | None:
        principal = Principal("tenant", tenant)
        if not secure.seed_path(principal).exists():
            return None
        return await connect_nats(
            nats_url, name=f"trellis-redfish-{tenant}", credentials=secure.credentials(principal)
        )

    return connect


async def _serve_page(
    stack: contextlib.AsyncExitStack,
    nats_url: str,
    prefix: str,
    at: tuple[str, int],
    credentials: NkeyCredentials | None,
    metrics: EngineMetrics | None,
    allowed_hosts: Sequence[str],
    token: str | None,
) -> str:
    """Serve the fabric page at `at` (closed with `stack`); its URL."""
    page_nc = await connect_nats(nats_url, name="trellis-page", credentials=credentials)
    stack.push_async_callback(page_nc.close)
    foreign = ForeignMessages("page", metrics.foreign_message if metrics is not None else None)
    page = FabricPage(
        page_nc,
        prefix=prefix,
        host=at[0],
        port=at[1],
        foreign=foreign,
        allowed_hosts=allowed_hosts,
        token=token,
    )
    try:
        await page.start()
    except OSError as exc:
        await page.close()
        raise SettingsError(f"the fabric page cannot listen on {at[0]}:{at[1]}: {exc}") from None
    stack.push_async_callback(page.close)
    return page.url


async def _true(value: bool) -> bool:
    return value


def _heads(engine: Engine) -> dict[str, tuple[int, int]]:
    """The log's head (version, position) of every domain `engine` writes now."""
    heads = {}
    for domain in engine.domains:
        head = engine.head(domain)
        if head is not None:
            heads[domain] = (head.version, head.position)
    return heads


async def _answers(store: PostgresEventStore) -> bool:
    """Whether the event store answers a query now (the health check's "store")."""
    try:
        await asyncio.wait_for(store.domains(), HEALTH_CHECK_S)
    except Exception:
        return False
    return True


@contextlib.asynccontextmanager
async def running_engine(
    settings: Settings, *, tenants: Iterable[str] = ()
) -> AsyncIterator[RunningEngine]:
    """Start the engine as configured (embedded servers for unset URLs); serve until exit.

    In secure mode the identities are made first (the roles, `tenants`, and later every tenant
    that holds a live composition in the log), and the engine connects as its own.
    """
    fabric = fabric_from_settings(settings)  # a bad state file stops us before any server starts
    signer = checkpoint_signer(settings)  # likewise a bad key file
    secure = secure_dir(settings)
    if secure is not None:
        _issue(secure, settings, tenants)
    async with contextlib.AsyncExitStack() as stack:
        nats_url, database_url, owner_url, monitor_url = await stack.enter_async_context(
            embedded_or_configured(
                settings, nats_config=secure.config_path if secure is not None else None
            )
        )
        running = await stack.enter_async_context(
            engine_on(
                nats_url,
                database_url,
                owner_url=owner_url,
                schema=settings.db_schema,
                prefix=settings.subject_prefix,
                domains=settings.domains,
                fabric=fabric,
                saga_deadline=settings.saga_deadline,
                stream_limits=settings.stream_limits,
                lease_ttl=settings.lease_ttl,
                read_wait=settings.read_wait,
                signer=signer,
                checkpoint_every=settings.checkpoint_every,
                snapshot_every=settings.snapshot_every,
                secure=secure,
                followers=settings.followers,
                checkpoint_key=checkpoint_key_path(settings),
                metrics_at=(
                    (settings.metrics_host, settings.metrics_port)
                    if settings.metrics_port is not None
                    else None
                ),
                page_at=(
                    (settings.http_host, settings.http_port)
                    if settings.http_port is not None
                    else None
                ),
                health=LagTracker(settings.health_stall_s, settings.health_max_behind),
                allowed_hosts=settings.allowed_hosts,
                rate_limit=settings.tenant_rate,
                redfish=_redfish_options(settings),
            )
        )
        running.nats_monitor_url = monitor_url
        if secure is not None:
            running.secure_dir = secure.root
            issued = _issue(secure, settings, _tenants_holding(running.engine))
            data_dir = settings.data_dir or default_data_dir()
            if issued and not settings.nats_url and reload_nats(data_dir):
                await _until_issued_accepted(nats_url, secure, issued)
        endpoints = _write_endpoints(settings, nats_url, database_url)
        stack.callback(endpoints.unlink, missing_ok=True)
        log.info("engine serving %s on %s", settings.subject_prefix, redacted(nats_url))
        yield running


def _redfish_options(settings: Settings) -> RedfishOptions | None:
    """The Redfish service's options, when `settings` ask for it (TRELLIS_REDFISH_PORT)."""
    if settings.redfish_port is None:
        return None
    data_dir = settings.data_dir or default_data_dir()
    password, _ = admin_password(data_dir, settings.redfish_admin_password)
    return RedfishOptions(
        host=settings.redfish_host,
        port=settings.redfish_port,
        accounts=data_dir / ACCOUNTS_FILE,
        admin_password=password,
        cert=settings.redfish_cert,
        key=settings.redfish_key,
    )


def redfish_password_file(settings: Settings) -> Path | None:
    """Where `admin`'s generated Redfish password is (None: it came from the environment)."""
    if settings.redfish_admin_password:
        return None
    return (settings.data_dir or default_data_dir()) / "redfish-admin-password"


async def _until_issued_accepted(nats_url: str, secure: SecureDir, tenants: list[str]) -> None:
    """Serve only once the reload lets the newly issued tenants in: a client that connected
    while it ran could be dropped, and one told "serving" expects to be let in."""
    for tenant in tenants:
        try:
            await until_accepted(nats_url, secure.credentials(Principal("tenant", tenant)))
        except TimeoutError as exc:
            log.warning("%s: tenant %s may be refused until the server reloads", exc, tenant)


def checkpoint_key_path(settings: Settings) -> Path:
    """The checkpoint signing key's file: TRELLIS_CHECKPOINT_KEY, else in the data dir."""
    return settings.checkpoint_key or (settings.data_dir or default_data_dir()) / KEY_FILE


def checkpoint_signer(settings: Settings) -> Signer:
    """The deployment's checkpoint signer, its key made on first use (adapters/checkpoint_key.py).

    Raises:
        SettingsError: the key file cannot be read or made.
    """
    try:
        return load_or_create(checkpoint_key_path(settings))
    except KeyFileError as exc:
        raise SettingsError(str(exc)) from None


def secure_dir(settings: Settings) -> SecureDir | None:
    """Secure mode's identities when it is on: asked for (`trellis up --secure`,
    TRELLIS_SECURE), or set up in the data dir before (once secured, a data dir stays so)."""
    secure = SecureDir(settings.data_dir or default_data_dir())
    return secure if settings.secure or secure.exists() else None


def _issue(secure: SecureDir, settings: Settings, tenants: Iterable[str]) -> list[str]:
    """Identities for the roles and `tenants`, and the config; the tenants that are new."""
    try:
        return secure.ensure(settings.subject_prefix, tenants)
    except (CredentialsError, OSError) as exc:
        raise SettingsError(f"secure mode ({secure.root}): {exc}") from None


def _tenants_holding(engine: Engine) -> list[str]:
    """Every tenant with a live composition that can have an identity (names from before
    secure mode that are no id, or name a role, get none: `trellis tenant add` says why)."""
    held = set()
    for domain in engine.domains:
        state = engine.state(domain)
        held |= {c.tenant for c in state.compositions.values()} if state else set()
    return sorted(t for t in held if tenant_name_problem(t) is None)


def fabric_state_path(settings: Settings) -> Path:
    """Where the simulated fabric keeps what it has programmed."""
    return settings.fabric_state or (settings.data_dir or default_data_dir()) / FABRIC_STATE_FILE


def fabric_from_settings(settings: Settings) -> FabricDriver:
    """The fabric driver `settings` name: the simulator, which keeps its "hardware" in its
    state file, so that outlives the engine as real hardware would; or a Redfish fabric
    manager (adapters/fabric/redfish/).

    Raises:
        SettingsError: The state file cannot be read.
    """
    match settings.fabric:
        case "redfish":
            assert settings.redfish_url is not None  # Settings checks it
            client = RedfishClient(
                settings.redfish_url, settings.redfish_user, settings.redfish_password
            )
            # Events need an address the service can reach: the one configured, else, for a
            # service on this machine, a free loopback port.
            local = urllib.parse.urlsplit(client.origin).hostname in (
                "127.0.0.1",
                "localhost",
                "::1",
            )
            events_at = settings.redfish_events or (("127.0.0.1", 0) if local else None)
            return RedfishFabric(client, fabric=settings.redfish_fabric, events_at=events_at)
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
    """Tell local CLI clients where a running engine listens (the embedded ports are random).
    Readable by this user only: the database URL carries the engine role's password."""
    path = (settings.data_dir or default_data_dir()) / ENDPOINTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    endpoints = {"nats_url": nats_url, "database_url": database_url, "pid": os.getpid()}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file may have been created more open
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**endpoints, "subject_prefix": settings.subject_prefix}))
    return path


def _endpoints(settings: Settings) -> dict[str, Any] | None:
    """What a local `trellis up` wrote, if that engine still runs; a file left by one that
    was killed is stale and ignored."""
    path = (settings.data_dir or default_data_dir()) / ENDPOINTS_FILE
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(written, dict):
        return None
    pid = written.get("pid")
    if isinstance(pid, int) and not _alive(pid):
        return None
    return written


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def running_engine_pid(settings: Settings) -> int | None:
    """The pid of the `trellis up` serving from this data dir, when one runs."""
    written = _endpoints(settings)
    pid = written.get("pid") if written else None
    return pid if isinstance(pid, int) and pid != os.getpid() else None


def find_endpoint(settings: Settings, name: str) -> str | None:
    """`name` ("nats_url" or "database_url") from the environment, else from what a local
    `trellis up` that still runs wrote, else None."""
    configured: str | None = getattr(settings, name)
    if configured:
        return configured
    written = _endpoints(settings)
    value = written.get(name) if written else None
    return str(value) if value is not None else None
