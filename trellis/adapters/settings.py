"""Configuration from the environment (docs/configuration.md)."""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Literal, get_args

import msgspec

from trellis.adapters import event_loop
from trellis.adapters.event_loop import EventLoopName
from trellis.adapters.fabric.redfish.client import service_base
from trellis.adapters.fabric.sim import ScriptedFault, parse_script
from trellis.adapters.nats.jetstream import StreamLimits
from trellis.engine.core.ids import is_valid_id
from trellis.engine.core.throttle import (
    DEFAULT_BURST,
    DEFAULT_PER_SECOND,
    DEFAULT_VIEW_BURST_S,
    DEFAULT_VIEW_SHARE,
    DEFAULT_VIEWS_IN_FLIGHT,
    RateLimit,
    ViewBudget,
)
from trellis.engine.service.follower import PASS_INTERVAL_S

# A follower that gathers longer than this leaves watchers a second or more behind every commit:
# a typo (seconds given as milliseconds), not a tuning.
MAX_FOLLOW_GATHER_MS = 1000.0

FabricDriverName = Literal["sim", "redfish"]
FollowersMode = Literal["inline", "process"]
FOLLOWERS_MODES: tuple[str, ...] = get_args(FollowersMode)
FABRIC_DRIVERS: tuple[str, ...] = get_args(FabricDriverName)
#: How the Redfish driver sends its credentials (adapters/fabric/redfish/client.py).
REDFISH_AUTH = ("basic", "session")
MAX_JS_REPLICAS = 5  # JetStream keeps a stream on at most 5 servers


class SettingsError(ValueError):
    """A TRELLIS_* variable holds a value Trellis cannot use; the message names it."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str | None = None
    database_url: str | None = None
    # The schema owner's DSN, for migrations and the engine role's grants (docs/security.md,
    # Least privilege).
    database_owner_url: str | None = None
    data_dir: Path | None = None
    domains: list[str] | None = None
    subject_prefix: str = "trellis"
    db_schema: str | None = None
    fabric: FabricDriverName = "sim"
    fabric_state: Path | None = None  # None: fabric-sim.json in the data dir
    saga_deadline: float = 10.0
    lease_ttl: float = 3.0  # seconds a domain's writer lease lasts unrenewed
    # The most domains one engine writes (engine/core/spread.py's cap); 0: its balanced share.
    max_domains_per_engine: int = 0
    # Seconds a query waits for its domain's log to reach its `min_position`, then `unavailable`.
    read_wait: float = 2.0
    # Snapshot a domain's state and read models every this many events (engine/service/snapshots.py,
    # projections/past.py); 0: never (every start and past answer folds from the first event).
    snapshot_every: int = 10_000
    # The simulated fabric's knobs (adapters.fabric.sim.SimulatedFabric).
    fabric_seed: int = 0
    fabric_latency_ms: float = 0.0
    fabric_failure_rate: float = 0.0
    fabric_hang_rate: float = 0.0
    fabric_script: list[ScriptedFault] = []
    # The Redfish driver (adapters/fabric/redfish/): the fabric manager's base URL (with or
    # without /redfish/v1), its credentials and how they are sent ("basic", or "session": a
    # login, then its token), the fabric to drive (None: the one named like the domain, else
    # the only one), and where to receive its events (None: health is polled).
    redfish_url: str | None = None
    redfish_user: str | None = None
    redfish_password: str | None = None
    redfish_auth: str = "basic"
    redfish_fabric: str | None = None
    redfish_events: tuple[str, int] | None = None
    # What the JetStream event stream keeps (adapters/nats/jetstream.py); 0: no limit.
    stream_limits: StreamLimits = StreamLimits()
    # Secure mode (adapters/nats/auth.py): NATS users and permissions. Also on whenever the
    # data dir holds its identities already (`trellis up --secure` once is enough).
    secure: bool = False
    # Signed Merkle checkpoints (adapters/postgres/checkpoints.py): one every N events per
    # domain, signed with the key in this file (None: checkpoint-key.pem in the data dir).
    checkpoint_every: int = 1000
    checkpoint_key: Path | None = None
    new_checkpoint_key: bool = False  # a new key although other keys signed the log
    # Where the log followers run (adapters/follow_process.py): in a follower process of their
    # own that the engine starts and keeps running (the default: the projections' and the
    # relay's work then stays off the event loop that answers intents), or in that loop.
    followers: FollowersMode = "process"
    # How long a log follower gathers commits into one pass (engine/service/follower.py): the
    # most the stream and the KV bucket trail a commit by, besides the pass itself; a reader
    # that waits for a position cuts it short.
    follow_gather_s: float = PASS_INTERVAL_S
    # The event loop of the engine and its follower process (adapters/event_loop.py): uvloop
    # where it is installed, else asyncio's.
    event_loop: EventLoopName = msgspec.field(default_factory=event_loop.default)
    # The embedded servers' ports (None: a free one at each start).
    nats_port: int | None = None
    nats_monitor_port: int | None = None
    pg_port: int | None = None
    # Prometheus metrics and /healthz (adapters/http/metrics.py): off unless a port is
    # given (0: a free one, printed at start); on loopback unless another address is named.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # /healthz fails when a log follower (a projection, the relay) of a domain has not moved
    # for this many seconds while the log is ahead of it, or trails it by more than this many
    # events (adapters/health.py).
    health_stall_s: float = 60.0
    health_max_behind: int = 10_000
    # Each tenant's intents a second, and in a burst (engine/core/throttle.py); 0 a second: no
    # limit.
    tenant_rate: RateLimit = RateLimit()
    # What each tenant's views may cost the engine that answers them: a share of its time, a
    # burst of seconds, views in flight (engine/core/throttle.py); a share of 0: no limit.
    view_budget: ViewBudget = ViewBudget()
    # The live fabric page (adapters/http/fabric_page.py): likewise off unless a port is
    # given, and on loopback unless another address is named. It is an operator's view.
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    # Names (besides the bound address) that the page, its API and /metrics answer to in a
    # request's Host (adapters/http/server.py): e.g. the name of a proxy in front.
    allowed_hosts: list[str] = []
    # The northbound Redfish service (adapters/http/redfish/, docs/redfish.md): off unless a
    # port is given, on loopback unless another address is named, TLS with a cert and key;
    # `admin`'s first password (None: generated into the data dir, 0600).
    redfish_port: int | None = None
    redfish_host: str = "127.0.0.1"
    redfish_admin_password: str | None = None
    redfish_cert: Path | None = None
    redfish_key: Path | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Read TRELLIS_* variables; unset URLs mean "start the embedded servers".

        Raises:
            SettingsError: A variable is set to something unusable.
        """
        env = dict(os.environ if env is None else env)
        listed = env.get("TRELLIS_DOMAINS", "")
        domains = [d.strip() for d in listed.split(",")] if listed.strip() else []
        bad = [repr(d) for d in domains if not is_valid_id(d)]  # "" too: ",,," meant every domain
        if bad:
            raise SettingsError(f"TRELLIS_DOMAINS holds invalid ids: {', '.join(bad)}")
        fabric = env.get("TRELLIS_FABRIC") or "sim"
        if fabric not in FABRIC_DRIVERS:
            valid = ", ".join(FABRIC_DRIVERS)
            raise SettingsError(f"TRELLIS_FABRIC={fabric!r} names no fabric driver; valid: {valid}")
        try:
            script = parse_script(env.get("TRELLIS_FABRIC_SCRIPT", ""))
        except ValueError as exc:
            raise SettingsError(f"TRELLIS_FABRIC_SCRIPT: {exc}") from None
        redfish_url = env.get("TRELLIS_REDFISH_URL") or None
        if fabric == "redfish" and not redfish_url:
            raise SettingsError("TRELLIS_FABRIC=redfish needs TRELLIS_REDFISH_URL")
        if redfish_url:
            try:
                service_base(redfish_url)
            except ValueError as exc:
                raise SettingsError(f"TRELLIS_REDFISH_URL: {exc}") from None
        redfish_auth = env.get("TRELLIS_REDFISH_AUTH") or "basic"
        if redfish_auth not in REDFISH_AUTH:
            valid = ", ".join(REDFISH_AUTH)
            raise SettingsError(f"TRELLIS_REDFISH_AUTH={redfish_auth!r}: valid are {valid}")
        followers = env.get("TRELLIS_FOLLOWERS") or "process"
        if followers not in FOLLOWERS_MODES:
            valid = ", ".join(FOLLOWERS_MODES)
            raise SettingsError(f"TRELLIS_FOLLOWERS={followers!r}: valid are {valid}")
        loop = env.get("TRELLIS_EVENT_LOOP") or event_loop.default()
        if loop not in event_loop.EVENT_LOOPS:
            valid = ", ".join(event_loop.EVENT_LOOPS)
            raise SettingsError(f"TRELLIS_EVENT_LOOP={loop!r}: valid are {valid}")
        if loop == "uvloop" and event_loop.default() != "uvloop":
            raise SettingsError("TRELLIS_EVENT_LOOP=uvloop, but uvloop is not installed")
        database_url = _postgres_url(env, "TRELLIS_DATABASE_URL")
        database_owner_url = _postgres_url(env, "TRELLIS_DATABASE_OWNER_URL")
        if database_owner_url and not database_url:
            raise SettingsError(
                "TRELLIS_DATABASE_OWNER_URL is set but TRELLIS_DATABASE_URL is not: the engine "
                "needs a URL of its own (the embedded Postgres brings both)"
            )
        data_dir = env.get("TRELLIS_DATA_DIR")
        fabric_state = env.get("TRELLIS_FABRIC_STATE")
        checkpoint_key = env.get("TRELLIS_CHECKPOINT_KEY")
        checkpoint_every = _integer(env, "TRELLIS_CHECKPOINT_EVERY", 1000)
        if checkpoint_every < 1:
            raise SettingsError(
                f"TRELLIS_CHECKPOINT_EVERY must be a number of events, 1 or more; "
                f"got {checkpoint_every}"
            )
        pinned = _embedded_ports(env)
        return cls(
            nats_url=_nats_url(env.get("TRELLIS_NATS_URL", "")),
            database_url=database_url,
            database_owner_url=database_owner_url,
            data_dir=Path(data_dir) if data_dir else None,
            domains=domains or None,
            subject_prefix=_subject_prefix(env),
            db_schema=_db_schema(env),
            fabric=fabric,  # type: ignore[arg-type]  # checked above
            fabric_state=Path(fabric_state) if fabric_state else None,
            snapshot_every=_snapshot_every(env),
            max_domains_per_engine=_cap(env, "TRELLIS_MAX_DOMAINS_PER_ENGINE"),
            lease_ttl=_float(
                env,
                "TRELLIS_LEASE_TTL",
                3.0,
                lambda v: 0.5 <= v <= MAX_LEASE_TTL_S,
                f"a number of seconds, 0.5 to {MAX_LEASE_TTL_S}",
            ),
            saga_deadline=_float(
                env, "TRELLIS_SAGA_DEADLINE", 10.0, lambda v: v > 0, "a number of seconds above 0"
            ),
            read_wait=_float(
                env, "TRELLIS_READ_WAIT", 2.0, lambda v: v >= 0, "a number of seconds, 0 or more"
            ),
            fabric_seed=_integer(env, "TRELLIS_FABRIC_SEED", 0),
            fabric_latency_ms=_float(
                env, "TRELLIS_FABRIC_LATENCY_MS", 0.0, lambda v: v >= 0, "milliseconds, 0 or more"
            ),
            fabric_failure_rate=_probability(env, "TRELLIS_FABRIC_FAILURE_RATE"),
            fabric_hang_rate=_probability(env, "TRELLIS_FABRIC_HANG_RATE"),
            fabric_script=script,
            redfish_url=redfish_url,
            redfish_user=env.get("TRELLIS_REDFISH_USER") or None,
            redfish_password=env.get("TRELLIS_REDFISH_PASSWORD") or None,
            redfish_auth=redfish_auth,
            redfish_fabric=env.get("TRELLIS_REDFISH_FABRIC") or None,
            redfish_events=_address(env, "TRELLIS_REDFISH_EVENTS"),
            stream_limits=_stream_limits(env),
            secure=_flag(env, "TRELLIS_SECURE"),
            checkpoint_every=checkpoint_every,
            checkpoint_key=Path(checkpoint_key) if checkpoint_key else None,
            new_checkpoint_key=_flag(env, "TRELLIS_NEW_CHECKPOINT_KEY"),
            followers=followers,  # type: ignore[arg-type]  # checked above
            follow_gather_s=_float(
                env,
                "TRELLIS_FOLLOW_GATHER_MS",
                PASS_INTERVAL_S * 1000,
                lambda v: 0 <= v <= MAX_FOLLOW_GATHER_MS,
                f"milliseconds, 0 to {MAX_FOLLOW_GATHER_MS:g}",
            )
            / 1000,
            event_loop=loop,  # type: ignore[arg-type]  # checked above
            nats_port=pinned["TRELLIS_NATS_PORT"],
            nats_monitor_port=pinned["TRELLIS_NATS_MONITOR_PORT"],
            pg_port=pinned["TRELLIS_PG_PORT"],
            metrics_port=metrics_port(env.get("TRELLIS_METRICS_PORT", ""), "TRELLIS_METRICS_PORT"),
            metrics_host=env.get("TRELLIS_METRICS_HOST", "").strip() or "127.0.0.1",
            health_stall_s=_float(
                env, "TRELLIS_HEALTH_STALL_SECONDS", 60.0, lambda v: v > 0, "seconds, above 0"
            ),
            health_max_behind=_positive(env, "TRELLIS_HEALTH_MAX_BEHIND", 10_000),
            tenant_rate=RateLimit(
                _float(
                    env,
                    "TRELLIS_TENANT_RATE",
                    DEFAULT_PER_SECOND,
                    lambda v: v >= 0,
                    "intents a second, 0 (no limit) or more",
                ),
                _positive(env, "TRELLIS_TENANT_BURST", DEFAULT_BURST),
            ),
            view_budget=ViewBudget(
                _float(
                    env,
                    "TRELLIS_VIEW_SHARE",
                    DEFAULT_VIEW_SHARE,
                    lambda v: 0 <= v <= 1,
                    "a share of the engine's time from 0 (no limit) to 1",
                ),
                _float(
                    env,
                    "TRELLIS_VIEW_BURST_SECONDS",
                    DEFAULT_VIEW_BURST_S,
                    lambda v: v > 0,
                    "seconds, above 0",
                ),
                _positive(env, "TRELLIS_VIEWS_IN_FLIGHT", DEFAULT_VIEWS_IN_FLIGHT),
            ),
            http_port=metrics_port(env.get("TRELLIS_HTTP_PORT", ""), "TRELLIS_HTTP_PORT"),
            http_host=env.get("TRELLIS_HTTP_HOST", "").strip() or "127.0.0.1",
            allowed_hosts=[
                name.strip()
                for name in env.get("TRELLIS_ALLOWED_HOSTS", "").split(",")
                if name.strip()
            ],
            redfish_port=metrics_port(env.get("TRELLIS_REDFISH_PORT", ""), "TRELLIS_REDFISH_PORT"),
            redfish_host=env.get("TRELLIS_REDFISH_HOST", "").strip() or "127.0.0.1",
            redfish_admin_password=env.get("TRELLIS_REDFISH_ADMIN_PASSWORD") or None,
            redfish_cert=_path(env, "TRELLIS_REDFISH_CERT"),
            redfish_key=_path(env, "TRELLIS_REDFISH_KEY"),
        )


def _float(
    env: dict[str, str], name: str, default: float, valid: Callable[[float], bool], expected: str
) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and valid(value)):
        raise SettingsError(f"{name} must be {expected}; got {text!r}")
    return value


def _embedded_ports(env: dict[str, str]) -> dict[str, int | None]:
    """The embedded servers' pinned ports, each its own (one port given twice was tried by
    both servers, and the second said it was taken, as if by another program)."""
    names = ("TRELLIS_NATS_PORT", "TRELLIS_NATS_MONITOR_PORT", "TRELLIS_PG_PORT")
    ports = {name: _port(env, name) for name in names}
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            if ports[first] is not None and ports[first] == ports[second]:
                raise SettingsError(f"{first} and {second} are both {ports[first]}")
    return ports


def _snapshot_every(env: dict[str, str]) -> int:
    every = _integer(env, "TRELLIS_SNAPSHOT_EVERY", 10_000)
    if every < 0:
        raise SettingsError(f"TRELLIS_SNAPSHOT_EVERY must be 0 or more; got {every}")
    return every


NATS_SCHEMES = ("nats", "tls", "ws", "wss")
POSTGRES_SCHEMES = ("postgresql", "postgres")
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
#: A writer lease of a day: failing over takes that long. Past it PostgreSQL's interval
#: overflowed at some length, and every append then failed `unavailable`.
MAX_LEASE_TTL_S = 24 * 3600


def _postgres_url(env: dict[str, str], name: str) -> str | None:
    """A PostgreSQL URL, as asyncpg takes one (a URI); checked here, so a typo is one line at
    once, not an endless wait for a server that URL can never name."""
    text = env.get(name, "").strip()
    if not text:
        return None
    parts = urllib.parse.urlsplit(text)
    # `postgres:/db` (a slash short) had no host, and reached whatever listens on the default
    # socket; `postgresql:///db` names that socket on purpose, and stays.
    if (
        parts.scheme not in POSTGRES_SCHEMES
        or not text.startswith(f"{parts.scheme}://")
        or any(c.isspace() for c in text)
    ):
        raise SettingsError(
            f"{name} is not a PostgreSQL URL (the scheme must be postgresql or postgres, no "
            "spaces); expected postgresql://role@host:port/database"
        )
    return text


def _db_schema(env: dict[str, str]) -> str | None:
    """TRELLIS_DB_SCHEMA: one PostgreSQL name as written unquoted (it becomes the search_path;
    a space there was an internal error from PostgreSQL, exit 70)."""
    schema = env.get("TRELLIS_DB_SCHEMA", "").strip()
    if not schema:
        return None
    if not _SCHEMA_NAME.fullmatch(schema):
        raise SettingsError(
            f"TRELLIS_DB_SCHEMA must be a schema name: a lower-case letter or '_', then up to "
            f"62 lower-case letters, digits or '_'; got {schema!r}"
        )
    return schema


def _subject_prefix(env: dict[str, str]) -> str:
    """TRELLIS_SUBJECT_PREFIX: one subject token, which also names the streams and bucket (a
    space, a dot or a wildcard there made JetStream refuse them, said as a replicas problem)."""
    prefix = env.get("TRELLIS_SUBJECT_PREFIX", "").strip() or "trellis"
    if not is_valid_id(prefix):
        raise SettingsError(
            f"TRELLIS_SUBJECT_PREFIX must be one subject token: 1-64 letters, digits, '_' or "
            f"'-'; got {prefix!r}"
        )
    return prefix


def _nats_url(text: str) -> str | None:
    """TRELLIS_NATS_URL: one NATS URL or several, comma-separated; unset or blank: embedded.
    Checked here, so a typo is one line at once, not a connection timeout 10 s later."""
    if not text.strip():
        return None
    for server in (part.strip() for part in text.split(",")):
        problem = _nats_url_problem(server)
        if problem:
            raise SettingsError(
                f"TRELLIS_NATS_URL {text.strip()!r} is not a NATS URL ({problem}); expected "
                "nats://host:port, several comma-separated"
            )
    return text.strip()


def _nats_url_problem(server: str) -> str | None:
    if not server:
        return "an empty server between commas"
    if any(c.isspace() for c in server):
        return "it holds a space"
    parts = urllib.parse.urlsplit(server)
    if parts.scheme not in NATS_SCHEMES:
        return f"the scheme must be one of {', '.join(NATS_SCHEMES)}"
    try:
        port = parts.port
    except ValueError:
        return "its port is not a number from 1 to 65535"
    if not parts.hostname:
        return "it names no host"
    if port is not None and not 1 <= port <= 65535:
        return "its port is not a number from 1 to 65535"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "it has a path, a query or a fragment"
    return None


def _positive(env: dict[str, str], name: str, default: int) -> int:
    value = _integer(env, name, default)
    if value < 1:
        raise SettingsError(f"{name} must be 1 or more; got {value}")
    return value


def _cap(env: dict[str, str], name: str) -> int:
    value = _integer(env, name, 0)
    if value < 0:
        raise SettingsError(f"{name} must be 0 (no cap) or more; got {value}")
    return value


def _probability(env: dict[str, str], name: str) -> float:
    return _float(env, name, 0.0, lambda v: 0 <= v <= 1, "a probability within [0, 1]")


def _integer(env: dict[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise SettingsError(f"{name} must be an integer; got {text!r}") from None


def _port(env: dict[str, str], name: str) -> int | None:
    """A TCP port to pin an embedded server to; unset: a free one at each start."""
    if not env.get(name, "").strip():
        return None
    port = _integer(env, name, 0)
    if not 1 <= port <= 65535:
        raise SettingsError(f"{name} must be a TCP port (1-65535); got {port}")
    return port


def _address(env: dict[str, str], name: str) -> tuple[str, int] | None:
    """HOST:PORT to listen on (port 0: a free one); unset: none."""
    text = env.get(name, "").strip()
    if not text:
        return None
    host, _, port = text.rpartition(":")
    number = metrics_port(port, name) if host else None
    if number is None:
        raise SettingsError(f"{name} must be HOST:PORT to listen on; got {text!r}")
    return host.strip("[]"), number


def _path(env: dict[str, str], name: str) -> Path | None:
    value = env.get(name, "").strip()
    return Path(value) if value else None


def metrics_port(text: str, name: str) -> int | None:
    """The port of an HTTP endpoint (metrics, the fabric page) `text` names (`name` says where
    it came from, for the error); empty: none (that endpoint is off); 0: a free port.

    Raises:
        SettingsError: `text` is no TCP port.
    """
    text = text.strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise SettingsError(f"{name} must be a TCP port (0-65535, 0: any free one); got {text!r}")
    return port


def _flag(env: dict[str, str], name: str) -> bool:
    text = env.get(name, "").strip().lower()
    if text in ("", "0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise SettingsError(f"{name} must be 1 or 0 (true or false); got {env[name]!r}")


#: JetStream keeps a stream's byte limit as a signed 64-bit number.
MAX_STREAM_BYTES = 2**63 - 1
#: JetStream keeps a stream's age limit as a Go duration (nanoseconds in 64 bits: about 292
#: years; 1e300 seconds overflowed converting it, exit 70); below a second it refuses it.
MAX_STREAM_AGE_S = 100 * 365 * 24 * 3600
# nats-server reads a per-message TTL as a Go duration and refuses one past about 292 years:
# it would refuse every delete marker, and the relay would stall. Ten years is a round bound
# well inside that.
MAX_MARKER_TTL_S = 10 * 365 * 24 * 3600


def _stream_limits(env: dict[str, str]) -> StreamLimits:
    default = StreamLimits()
    max_bytes = _integer(env, "TRELLIS_EVENTS_MAX_BYTES", default.max_bytes)
    if not 0 <= max_bytes <= MAX_STREAM_BYTES:
        raise SettingsError(
            f"TRELLIS_EVENTS_MAX_BYTES must be 0 (no limit) to {MAX_STREAM_BYTES}; got {max_bytes}"
        )
    max_age = _float(
        env,
        "TRELLIS_EVENTS_MAX_AGE",
        default.max_age_s,
        lambda v: v == 0 or 1 <= v <= MAX_STREAM_AGE_S,
        f"seconds: 0 (no limit), or 1 to {MAX_STREAM_AGE_S}",
    )
    replicas = _integer(env, "TRELLIS_JS_REPLICAS", default.replicas)
    if not 1 <= replicas <= MAX_JS_REPLICAS:
        raise SettingsError(
            f"TRELLIS_JS_REPLICAS must be within 1..{MAX_JS_REPLICAS} (JetStream's limit); "
            f"got {replicas}"
        )
    marker_ttl = _integer(env, "TRELLIS_KV_MARKER_TTL", default.marker_ttl_s)
    if not 0 <= marker_ttl <= MAX_MARKER_TTL_S:
        raise SettingsError(
            f"TRELLIS_KV_MARKER_TTL must be whole seconds within 0..{MAX_MARKER_TTL_S} "
            f"(0 keeps markers; ten years at most); got {marker_ttl}"
        )
    return StreamLimits(
        max_bytes=max_bytes, max_age_s=max_age, replicas=replicas, marker_ttl_s=marker_ttl
    )


def redacted(url: str) -> str:
    """`url` (or a comma-separated list of them) without secrets, fit for logs and terminals:
    no password in the user part or a `password` query parameter, and no NATS token (a user
    part without a password)."""
    return ",".join(_without_password(one) for one in url.split(","))


def _without_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        is_token = not colon and not parts.scheme.startswith("postgres")
        netloc = f"{'***' if is_token else user}@{host}"
    query = urllib.parse.urlencode(
        [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "password"]
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
