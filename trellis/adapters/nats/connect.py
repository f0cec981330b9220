"""Connecting to NATS: a client connection that keeps reconnecting, a probe that tells whether a
server answers at all, waiting with backoff for a server to be reachable, and waiting for a
nats-server to let a newly issued identity in (secure mode, after its reload)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS

from trellis.adapters.nats.auth import NkeyCredentials
from trellis.adapters.settings import redacted

log = logging.getLogger(__name__)

# Waiting for a server: the first retry comes soon, later ones no more often than this.
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
_NATS_PROBE_TIMEOUT_S = 2.0
#: How long a reload of nats-server may take to let a newly issued identity in (a loaded
#: machine takes seconds; the reload itself is one SIGHUP).
ACCEPT_TIMEOUT_S = 30.0

T = TypeVar("T")


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


async def close_nats(nc: NATS) -> None:
    """Close `nc`. After its server died (a SIGKILL, the stop of a failed engine) nats-py's
    close still flushes what it holds onto the dead socket and raises from the transport
    (BrokenPipeError, or uvloop's RuntimeError on a closed handle): the connection is gone
    either way, and a shutdown should not end in a traceback."""
    try:
        await nc.close()
    except (OSError, RuntimeError) as exc:
        log.debug("closing the NATS connection %s: %r", nc.options.get("name"), exc)


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
    await _until_the_server(url, creds, timeout, accepts=True)


async def until_refused(
    url: str, creds: NkeyCredentials, timeout: float = ACCEPT_TIMEOUT_S
) -> None:
    """Return once the nats-server at `url` refuses `creds` (`Authorization Violation`): after
    the reload (SIGHUP) that removed that identity. nats-server takes the new users before it
    checks any client against them, so a refusal, even of a client it dropped mid-handshake
    while reloading, means every later connection meets the new users; and the same check
    closes the connections the removed identity still had. A reset mid-reload, or no answer,
    is not a refusal yet.

    Raises:
        TimeoutError: still let in (or not answering) after `timeout` seconds; says which.
        CredentialsError: `creds` holds no usable nkey seed.
    """
    await _until_the_server(url, creds, timeout, accepts=False)


async def _until_the_server(
    url: str, creds: NkeyCredentials, timeout: float, *, accepts: bool
) -> None:
    """Connect with `creds` every 0.1 s until the server `accepts` them (or, False, refuses
    them as unknown), or `timeout` seconds have passed."""
    options = creds.connect_options()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await _connect_once(url, options)
            failure: BaseException | None = None
        except (nats.errors.Error, OSError) as exc:  # TimeoutError is an OSError
            failure = exc
        refused = isinstance(failure, nats.errors.Error) and (
            "authorization violation" in str(failure).lower()
        )
        if (failure is None) if accepts else refused:
            return
        if loop.time() > deadline:
            outcome = "it was let in" if failure is None else str(failure) or type(failure).__name__
            still = "still refuses" if accepts else "does not refuse"
            raise TimeoutError(
                f"the nats-server at {redacted(url)} {still} {creds.path}"
                f"{'' if accepts else ' yet'} after {timeout:.0f}s: {outcome}"
            ) from None
        await asyncio.sleep(0.1)


async def accepts_anonymous(url: str) -> bool:
    """Whether the nats-server at `url` lets a client with no credentials connect (a server
    that secure mode's users were never included in, or not reloaded since)."""
    try:
        await _connect_once(url, {})
    except (nats.errors.Error, OSError):
        return False
    return True


async def _connect_once(url: str, options: dict[str, Any]) -> None:
    """Connect to `url` with `options` (credentials) once, then leave; raises the refusal."""
    nc = await nats.connect(
        nats_servers(url),
        allow_reconnect=False,
        connect_timeout=_NATS_PROBE_TIMEOUT_S,
        error_cb=_ignore_refusal,
        **options,
    )
    await nc.close()


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
