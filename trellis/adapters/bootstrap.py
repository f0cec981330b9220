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
attempt (adapters/nats/connect.py); cancelling the wait (Ctrl-C) stops the start cleanly. In
secure mode (adapters/nats/auth.py, issued by adapters/nats/issuing.py) the embedded
nats-server runs with the generated users, the engine connects as its own identity and the
fabric page as the operator. Once serving, it writes endpoints.json for local clients
(adapters/endpoints.py). `engine_on(settings)` is the same engine on servers already running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import asyncpg
import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from trellis.adapters import event_loop
from trellis.adapters.checkpoint_key import (
    KEY_FILE,
    KeyFileError,
    judge_kept_key,
    judge_new_key,
    load_or_create,
)
from trellis.adapters.clock import SystemClock
from trellis.adapters.embedded import watchdog
from trellis.adapters.embedded.nats_server import EmbeddedNats, reload_nats
from trellis.adapters.embedded.postgres_server import EmbeddedPostgres
from trellis.adapters.embedded.process import (
    EmbeddedServerDied,
    default_data_dir,
    hold_data_dir,
)
from trellis.adapters.endpoints import write_endpoints
from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.adapters.fabric.redfish.reachability import FabricGauges
from trellis.adapters.fabric.redfish.watch import FabricWatch
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.fabric.timed import TimedFabric
from trellis.adapters.follow_process import CommitSignal, FollowerProcess, follower_env
from trellis.adapters.health import FollowerGauges, FollowerHealth, stall_threshold
from trellis.adapters.http.fabric_page import FabricPage
from trellis.adapters.http.metrics import MetricsServer, problems_check
from trellis.adapters.http.redfish.accounts import admin_password
from trellis.adapters.http.redfish.serve import ACCOUNTS_FILE, RedfishOptions, serve_redfish
from trellis.adapters.instruments import EngineMetrics
from trellis.adapters.liveness import NatsCheck, StoreCheck
from trellis.adapters.nats.auth import (
    NkeyCredentials,
    Principal,
    SecureDir,
)
from trellis.adapters.nats.checkpoints import CheckpointPublisher
from trellis.adapters.nats.connect import (
    NatsUnreachable,
    close_nats,
    connect_nats,
    probe_nats,
    until_reachable,
)
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.intake import NatsIntake
from trellis.adapters.nats.issuing import (
    CHECKPOINTS_IDENTITY,
    ENGINE_IDENTITY,
    OPERATOR_IDENTITY,
    RELAY_IDENTITY,
    identity,
    issue,
    secure_dir,
    tenants_holding,
    until_issued_accepted,
)
from trellis.adapters.nats.jetstream import StreamLimits
from trellis.adapters.nats.relay import RelaySink
from trellis.adapters.nats.replies import AnyInbox, OwnInbox
from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.checkpoints import PostgresAuditTrail
from trellis.adapters.postgres.leases import PostgresLeases
from trellis.adapters.postgres.snapshots import PostgresSnapshots
from trellis.adapters.postgres.store import IDLE_IN_APPEND_S, PostgresEventStore, connect_pool
from trellis.adapters.settings import Settings, SettingsError, redacted
from trellis.engine.core.checkpoints import Signer
from trellis.engine.core.errors import StoreUnavailable
from trellis.engine.core.lag import LagTracker
from trellis.engine.service.follower import Followers
from trellis.engine.service.ownership import tick_of
from trellis.engine.service.ports import Clock, FabricDriver
from trellis.engine.service.router import Engine
from trellis.projections import PostgresReadModels, ProjectionSink
from trellis.projections.sink import rebuild_if_folds_changed

log = logging.getLogger(__name__)

FABRIC_STATE_FILE = "fabric-sim.json"
#: How long an asyncpg pool's identical reconnect failures are counted before said again.
REPEATS_EVERY_S = 60.0


class Repeats(logging.Filter):
    """One line for a run of identical failures, not a traceback each.

    asyncpg's pools log "Failed to restore the pool connection floor; retrying" with a whole
    traceback for every connection of every pool, every retry, while Postgres is away. The
    first is let through on one line with the error (a refused connection has nothing more
    to say); the same message and error again within `every_s` are counted, and the next one
    after that says how many there were.
    """

    def __init__(self, every_s: float = REPEATS_EVERY_S) -> None:
        super().__init__()
        self.every_s = every_s
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:  # a message that carries no failure is no retry's: said as it is
            return True
        message = record.getMessage()
        key = (message, repr(exc))
        now = time.monotonic()
        since, repeats = self._seen.get(key, (-self.every_s, 0))
        if now - since < self.every_s:
            self._seen[key] = (since, repeats + 1)
            return False
        self._seen[key] = (now, 0)
        said = f"{message}: {exc!r}" if exc is not None else message
        if repeats:
            said += f" ({repeats} more like it in the last {self.every_s:.0f} s)"
        record.msg, record.args = said, None
        if isinstance(exc, SERVER_AWAY):  # nothing more to say than the error: no traceback
            record.exc_info, record.exc_text = None, None
        return True


#: Failures that only say the server is away: a refused or reset connection, and
#: Postgres shutting down or closing the connection (asyncpg's own errors, not OSError).
SERVER_AWAY = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
)


#: The loggers that say the same failure on every retry while a server is away: asyncpg's
#: pools (each connection, each retry) and the writer leases' custody (each tick, with a
#: traceback, for as long as an external Postgres is down).
RETRYING_LOGGERS = ("asyncpg.pool", "trellis.engine.service.custody")


def quiet_pool_reconnects() -> None:
    """Install `Repeats` on the RETRYING_LOGGERS, once per process."""
    for name in RETRYING_LOGGERS:
        retrying = logging.getLogger(name)
        if not any(isinstance(f, Repeats) for f in retrying.filters):
            retrying.addFilter(Repeats())


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
    checkpoint_key_warning: str | None = None  # a key other than the log's signers'


class Endpoints(NamedTuple):
    """Where the engine's servers are: NATS, Postgres for the engine's role, and Postgres for
    the schema's owner (None: the engine's role migrates, see docs/security.md, Least privilege)."""

    nats_url: str
    database_url: str
    database_owner_url: str | None
    nats_monitor_url: str | None = None  # the embedded nats-server's HTTP monitoring
    #: The embedded servers that exited under the engine, one line each (/healthz's problems).
    problems: Callable[[], list[str]] = list


#: How often the embedded servers are checked for having exited.
SERVER_POLL_S = 0.2


@contextlib.asynccontextmanager
async def embedded_or_configured(
    settings: Settings, *, nats_config: Path | None = None
) -> AsyncIterator[Endpoints]:
    """The endpoints to use, starting embedded servers for the unset ones (the embedded
    Postgres brings an owner and an engine role of its own; an embedded nats-server reads
    `nats_config` too: secure mode's users).

    A watchdog process is started before the first server and told of each as it is spawned:
    if this process is killed, even while a server starts, it stops them, so a SIGKILLed
    `trellis up` leaves no orphaned server behind. An embedded server that exits while the
    context is open (a kill, a crash, the OOM killer) is logged once and ends the task that
    entered the context: leaving it raises EmbeddedServerDied with the server's log and its
    last lines (`trellis up` exits 1, docs/operations.md), after the engine stopped as on any
    stop.
    """
    data_dir = settings.data_dir or default_data_dir()
    main = asyncio.current_task()
    servers: list[EmbeddedNats | EmbeddedPostgres] = []
    with contextlib.ExitStack() as stack:
        nats_url, database_url = settings.nats_url, settings.database_url
        owner_url = settings.database_owner_url
        monitor_url = None
        dog: watchdog.Watchdog | None = None
        if not nats_url or not database_url:
            stack.callback(hold_data_dir(data_dir))
            dog = watchdog.Watchdog()
            # Ended last, after the servers stopped in order: a kill during that stop still
            # leaves it to finish.
            stack.callback(dog.end)
        if not nats_url:
            if nats_config is not None and settings.nats_monitor_port is not None:
                log.warning(
                    "TRELLIS_NATS_MONITOR_PORT is ignored in secure mode: nats-server's "
                    "monitoring has no authentication and lists every identity's inbox"
                )
            server = EmbeddedNats(
                data_dir,
                settings.nats_port,
                config=nats_config,
                monitor_port=settings.nats_monitor_port,
                monitor=nats_config is None,  # secure mode: no unauthenticated /connz
            )
            _watched_by(server, dog)
            stack.callback(server.stop)
            await asyncio.to_thread(server.start)
            servers.append(server)
            nats_url, monitor_url = server.url, server.monitor_url
        if not database_url:
            pg = EmbeddedPostgres(data_dir, settings.pg_port)
            _watched_by(pg, dog)
            stack.callback(pg.stop)
            await asyncio.to_thread(pg.start)
            servers.append(pg)
            database_url, owner_url = pg.url, pg.owner_url
        died: list[EmbeddedServerDied] = []

        def problems() -> list[str]:
            return [str(error) for error in died] or [
                how for how in (server.died() for server in servers) if how is not None
            ]

        async def watch_servers() -> None:
            while True:
                await asyncio.sleep(SERVER_POLL_S)
                for server in servers:
                    how = server.died()
                    if how is not None:
                        died.append(server.died_error(how))
                        log.error("%s: stopping the engine", how)
                        if main is not None:
                            main.cancel()
                        return

        watching = (
            asyncio.create_task(watch_servers(), name="embedded-servers") if servers else None
        )
        try:
            yield Endpoints(nats_url, database_url, owner_url, monitor_url, problems)
        except BaseException:
            if not died:
                # An engine that failed as a server was dying, before the next poll: that
                # server is why (its errors are the server's absence).
                died.extend(
                    server.died_error(how)
                    for server in servers
                    if (how := server.died()) is not None
                )
            if not died:
                raise
            # Whatever the engine's stop met (the cancel, a dead server's errors), this is why.
            if main is not None and main.cancelling():
                main.uncancel()
            raise died[0] from None
        finally:
            if watching is not None:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching
        # An engine that stopped on its own while a server was dying: say so all the same.
        if died:
            raise died[0]


def _watched_by(server: EmbeddedNats | EmbeddedPostgres, dog: watchdog.Watchdog | None) -> None:
    """Tell `dog` of each process `server` spawns, the moment it is spawned (so set before
    `server` starts)."""
    if dog is not None:
        server.spawned = lambda pid: dog.add(pid, server.stop_signal)


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
    # (catching up after downtime) never queues in front of the intake's replies. Their
    # commits do not wait for the disk: what they write is rebuilt from the log, and a crash
    # that loses their last commits sends them back to the checkpoint before. The engine's
    # appends, which would otherwise share each WAL flush with them, commit sooner.
    quiet_pool_reconnects()
    projection_pool = await connect_pool(
        database_url,
        schema=schema,
        max_size=4,
        durable_commits=False,
        application_name=sessions.PROJECTIONS,
    )
    stack.push_async_callback(projection_pool.close)
    relay_pool = await connect_pool(
        database_url,
        schema=schema,
        min_size=1,
        max_size=2,
        durable_commits=False,
        application_name=sessions.RELAY,
    )
    stack.push_async_callback(relay_pool.close)
    await until_reachable(
        "NATS", redacted(nats_url), lambda: probe_nats(nats_url), (NatsUnreachable,)
    )
    relay_nc = await connect_nats(
        nats_url, name="trellis-relay", credentials=identity(secure, RELAY_IDENTITY)
    )
    stack.push_async_callback(close_nats, relay_nc)
    if signer is None:
        log.info("checkpoints and snapshots are signed with a key of this run only (no key file)")
        signer = Signer.generate()
    # The checkpoint key seals the snapshots too (engine/service/snapshots.py).
    projections = ProjectionSink(projection_pool, snapshot_every=snapshot_every, signer=signer)
    snapshots = PostgresSnapshots(projection_pool, signer)
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
        stack.push_async_callback(close_nats, checkpoint_nc)
    checkpoints = CheckpointPublisher(
        checkpoint_nc, prefix=prefix, replicas=(stream_limits or StreamLimits()).replicas
    )
    await until_reachable(
        "the JetStream checkpoint stream",
        redacted(nats_url),
        checkpoints.prepare,
        (NatsTimeoutError, NoRespondersError, ServiceUnavailableError),
    )
    audit_pool = await connect_pool(
        database_url, schema=schema, min_size=1, max_size=2, application_name=sessions.AUDIT
    )
    stack.push_async_callback(audit_pool.close)
    audit = PostgresAuditTrail(
        audit_pool,
        signer,
        every=checkpoint_every,
        publish=checkpoints,
        follower=f"checkpoints:{checkpoints.stream}",
    )
    return Sinks(projections, relay, audit, snapshots, relay_nc)


@contextlib.asynccontextmanager
async def engine_on(
    settings: Settings,
    *,
    fabric: FabricDriver | None = None,
    clock: Clock | None = None,
    signer: Signer | None = None,
    secure: SecureDir | None = None,
    follow_options: dict[str, float] | None = None,
    redfish: RedfishOptions | None = None,
    server_problems: Callable[[], list[str]] = list,
    new_key: bool = False,
) -> AsyncIterator[RunningEngine]:
    """The engine, its projections, its event relay and its NATS intake on the servers
    `settings` names (`nats_url` and `database_url` must be set: `running_engine` starts
    embedded ones first), until the context exits. Migrations run first, through
    `database_owner_url` when given (the schema's owner, who then grants `database_url`'s role
    the engine's privileges); the engine's state is rebuilt from the log before it serves.
    Postgres, then NATS, are waited for until they answer.

    Everything else is read from `settings` as `trellis up` reads it (docs/configuration.md):
    the schema and subject prefix, the domains, the saga deadline, the writer lease
    (engine/service/ownership.py), a query's wait for its `min_position`, the snapshot and
    checkpoint intervals, the stream limits, the tenant rate limit (engine/core/throttle.py;
    `RateLimit(0)`: none), where the log followers run (`followers="process"`: a process of
    their own, adapters/follow_process.py, which signs with the key in `checkpoint_key`; None:
    a key file of this run only, made for both), the Prometheus metrics and health check
    (`metrics_port`, adapters/http/metrics.py; followers judged by the `health_*` bounds,
    engine/core/lag.py) and the live fabric page (`http_port`, adapters/http/fabric_page.py:
    a NATS client of its own that connects as the operator in secure mode, where it asks a
    browser for the token it was given, `page_token`). Both answer only requests whose Host
    is their address or one of `allowed_hosts`.

    What `settings` cannot carry, or what tests replace:
        fabric: the fabric driver; None: an in-memory SimulatedFabric (there is no hardware;
            `trellis up` passes the one `fabric_from_settings` makes).
        clock: the engine's clock; None: the system's.
        signer: the checkpoint key; None: a key of this run only (`trellis up` passes the
            data dir's).
        secure: secure mode's identities (each job connects as its own,
            adapters/nats/auth.py, and replies go only to the requester's own inbox).
        follow_options: tuning of the log followers (engine.service.follower.Follower).
        redfish: the northbound Redfish service (adapters/http/redfish/), a NATS client of
            its own (the operator in secure mode); None: none (`trellis up` passes the one
            `TRELLIS_REDFISH_PORT` asks for, its accounts and password in the data dir).
        server_problems: the embedded servers that exited, first in /healthz's problems.
        new_key: this start made the checkpoint key in `checkpoint_key`: it is judged against
            the log's checkpoints before anything is signed (adapters/checkpoint_key.py).

    Raises:
        ValueError: `settings` names no NATS or no Postgres.
        SettingsError: the metrics, the page's or Redfish's address cannot be bound; or a new
            checkpoint key on a log other keys signed, not allowed (TRELLIS_NEW_CHECKPOINT_KEY).
    """
    quiet_pool_reconnects()
    if not (settings.nats_url and settings.database_url):
        raise ValueError("engine_on needs settings with nats_url and database_url")
    nats_url, database_url = settings.nats_url, settings.database_url
    owner_url, schema = settings.database_owner_url, settings.db_schema
    prefix, lease_ttl = settings.subject_prefix, settings.lease_ttl
    followers, checkpoint_key = settings.followers, settings.checkpoint_key
    stream_limits = settings.stream_limits
    checkpoint_every, snapshot_every = settings.checkpoint_every, settings.snapshot_every
    metrics_at = (
        (settings.metrics_host, settings.metrics_port)
        if settings.metrics_port is not None
        else None
    )
    page_at = (settings.http_host, settings.http_port) if settings.http_port is not None else None
    allowed_hosts = settings.allowed_hosts
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
        # Before anything follows the log: tables an older fold wrote are folded again.
        await rebuild_if_folds_changed(projections.pool, store, await store.domains())
        key_warning = None
        if new_key and checkpoint_key is not None and signer is not None:
            # Before any follower signs: a new key on a log other keys signed is key loss or
            # the wrong data dir, refused unless the operator says otherwise.
            try:
                key_warning = judge_new_key(
                    checkpoint_key, signer, await audit.signers(),
                    allowed=settings.new_checkpoint_key,
                )  # fmt: skip
            except KeyFileError as exc:
                raise SettingsError(str(exc)) from None
        elif settings.checkpoint_key is not None and signer is not None:
            key_warning = judge_kept_key(settings.checkpoint_key, signer, await audit.signers())
        snapshots, projection_pool = sinks.snapshots, sinks.projections.pool
        metrics = EngineMetrics() if metrics_at is not None else None
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
                    event_loop=event_loop.running(),
                    gather_s=settings.follow_gather_s,
                ),
                # Its counters (the relay's foreign messages) on this engine's /metrics.
                counted=metrics.follower_counted if metrics is not None else None,
            )
            # Stopped after the engine: its SIGTERM drains the last commits to the stream. A
            # start cancelled while it is spawned stops it as well.
            await stack.enter_async_context(process)
            following = CommitSignal(store, sinks.nc, prefix)
        else:
            options: dict[str, Any] = {
                "pass_interval": settings.follow_gather_s,
                **(follow_options or {}),
            }
            following = Followers(store, [projections, relay, audit], **options)
            # Closed after the engine: the last commits still reach the stream on a clean exit.
            stack.push_async_callback(following.close)
        fabric = fabric if fabric is not None else SimulatedFabric()
        # Leases are taken and renewed on a pool of their own, never behind an append. The
        # ownership loop bounds each call by a lease time (ownership.within), and tells a
        # paused process from a slow store; a driver's timeout would not, and would fail the
        # first call after a pause.
        lease_pool = await connect_pool(
            database_url, schema=schema, max_size=2, application_name=sessions.LEASES
        )
        stack.push_async_callback(lease_pool.close)
        if isinstance(fabric, RedfishFabric) and fabric.deployment is None:
            # Recorded beside the epochs on the fabric manager: another log's engines are
            # refused there (schema/022, docs/fabric-drivers.md §3.6).
            fabric.deployment = str(await lease_pool.fetchval(DEPLOYMENT))
        engine = Engine(
            store,
            clock or SystemClock(),
            fabric if metrics is None else TimedFabric(fabric, metrics.fabric_operation),
            saga_deadline=settings.saga_deadline,
            domains=settings.domains,
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
            domain_cap=settings.max_domains_per_engine,
            read_wait=settings.read_wait,
            audit=audit,
            snapshots=snapshots,
            snapshot_every=snapshot_every,
            telemetry=metrics,
            rate_limit=settings.tenant_rate,
            view_budget=settings.view_budget,
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
            nats_url, name="trellis-engine", credentials=identity(secure, ENGINE_IDENTITY)
        )
        # close, not drain: intake.stop() below has already unsubscribed and waited for every
        # request in flight, which is what a drain would do (and nats-py's drain can stall).
        stack.push_async_callback(close_nats, nc)
        intake = NatsIntake(
            nc,
            engine,
            prefix=prefix,
            domains=settings.domains,
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
                LagTracker(stall_threshold(settings.health_stall_s), settings.health_max_behind),
            )
            lag.start()
            stack.push_async_callback(lag.close)
            metrics.registry.register(FollowerGauges(lag))
            if watch is not None:
                metrics.registry.register(FabricGauges(watch.reach, lambda: engine.domains))
            server = MetricsServer(
                metrics.registry,
                {
                    "intake": lambda: _true(intake.serving),
                    "nats": NatsCheck(nc),
                    "store": StoreCheck(store.domains),
                    # A store that answers reads may still take no writes (a full disk, a
                    # synchronous standby gone): the lease ticks write, and say so.
                    # Each check that names problems reads its source once, for both its
                    # result and its lines in `problems` (a lease problem depends on the time
                    # it is asked: read twice, the body could contradict itself).
                    "leases": problems_check(lambda: [engine.lease_problem()]),
                    "followers": problems_check(lag.problems),
                    # A fabric manager that does not answer fails every compose (the
                    # simulated fabric always answers).
                    "fabric": problems_check(lambda: watch.problems() if watch is not None else []),
                },
                host=metrics_at[0],
                port=metrics_at[1],
                details=lambda: {"problems": server_problems(), "domains": lag.domains()},
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
                identity(secure, OPERATOR_IDENTITY),
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
                        credentials=identity(secure, OPERATOR_IDENTITY),
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
                    on_foreign=metrics.foreign_message if metrics is not None else None,
                    observer=metrics,
                )
            except (OSError, ValueError) as exc:
                where = f"{redfish.host}:{redfish.port}"
                raise SettingsError(f"Redfish cannot serve on {where}: {exc}") from None
        yield RunningEngine(
            checkpoint_key_warning=key_warning,
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
    stack.push_async_callback(close_nats, page_nc)
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


@contextlib.asynccontextmanager
async def running_engine(
    settings: Settings, *, tenants: Iterable[str] = ()
) -> AsyncIterator[RunningEngine]:
    """Start the engine as configured (embedded servers for unset URLs); serve until exit.

    In secure mode the identities are made first (the roles, `tenants`, and later every tenant
    that holds a live composition in the log), and the engine connects as its own.
    """
    fabric = fabric_from_settings(settings)  # a bad state file stops us before any server starts
    new_key = not checkpoint_key_path(settings).exists()  # judged once the log is reachable
    signer = checkpoint_signer(settings)  # likewise a bad key file
    secure = secure_dir(settings)
    if secure is not None:
        issue(secure, settings, tenants)
    async with contextlib.AsyncExitStack() as stack:
        (
            nats_url,
            database_url,
            owner_url,
            monitor_url,
            server_problems,
        ) = await stack.enter_async_context(
            embedded_or_configured(
                settings, nats_config=secure.config_path if secure is not None else None
            )
        )
        served = msgspec.structs.replace(
            settings,
            nats_url=nats_url,
            database_url=database_url,
            database_owner_url=owner_url,
            checkpoint_key=checkpoint_key_path(settings),
        )
        running = await stack.enter_async_context(
            engine_on(
                served,
                fabric=fabric,
                signer=signer,
                secure=secure,
                redfish=_redfish_options(settings),
                server_problems=server_problems,
                new_key=new_key,
            )
        )
        running.nats_monitor_url = monitor_url
        if secure is not None:
            running.secure_dir = secure.root
            issued = issue(secure, settings, tenants_holding(running.engine, secure))
            data_dir = settings.data_dir or default_data_dir()
            if issued and not settings.nats_url and reload_nats(data_dir):
                await until_issued_accepted(nats_url, secure, issued)
        endpoints = write_endpoints(settings, nats_url, database_url)
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


def checkpoint_key_path(settings: Settings) -> Path:
    """The checkpoint signing key's file: TRELLIS_CHECKPOINT_KEY, else in the data dir."""
    return settings.checkpoint_key or (settings.data_dir or default_data_dir()) / KEY_FILE


def checkpoint_signer(settings: Settings) -> Signer:
    """The deployment's checkpoint signer, its key made on first use (adapters/checkpoint_key.py).

    Raises:
        SettingsError: the key file cannot be read or made.
    """
    try:
        # The data dir's default place is made; a TRELLIS_CHECKPOINT_KEY's folder is not.
        make_folder = settings.checkpoint_key is None
        return load_or_create(checkpoint_key_path(settings), make_folder=make_folder)
    except KeyFileError as exc:
        raise SettingsError(str(exc)) from None


DEPLOYMENT = "SELECT id FROM trellis_deployment"


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
                settings.redfish_url,
                settings.redfish_user,
                settings.redfish_password,
                auth=settings.redfish_auth,
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
                # Name the setting the path came from: the file's own, else the data dir's.
                source = "TRELLIS_FABRIC_STATE" if settings.fabric_state else "TRELLIS_DATA_DIR"
                raise SettingsError(f"{source}: {exc}") from None
            for fault in settings.fabric_script:
                fault.arm(fabric)
            return fabric
