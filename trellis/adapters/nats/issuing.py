"""Secure mode's credential issuing (adapters/nats/auth.py holds the identities themselves):
whether secure mode is on, the identities each of the engine's connections uses, issuing the
roles' and tenants' identities, and waiting for a reloaded nats-server to let new ones in, or
to refuse revoked ones."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

import nats

from trellis.adapters.embedded.process import default_data_dir
from trellis.adapters.nats.auth import (
    CredentialsError,
    NkeyCredentials,
    Principal,
    SecureDir,
    tenant_name_problem,
)
from trellis.adapters.nats.connect import ACCEPT_TIMEOUT_S, nats_servers, until_accepted
from trellis.adapters.settings import Settings, SettingsError, redacted
from trellis.engine.core.state import DomainState

log = logging.getLogger(__name__)

ENGINE_IDENTITY = Principal("engine", "engine")
RELAY_IDENTITY = Principal("relay", "relay")
CHECKPOINTS_IDENTITY = Principal("checkpoints", "checkpoints")
OPERATOR_IDENTITY = Principal("operator", "operator")


def identity(secure: SecureDir | None, who: Principal) -> NkeyCredentials | None:
    """Who a connection of the engine's process connects as: `who` in secure mode, else
    nobody in particular."""
    return secure.credentials(who) if secure is not None else None


def secure_dir(settings: Settings) -> SecureDir | None:
    """Secure mode's identities when it is on: asked for (`trellis up --secure`,
    TRELLIS_SECURE), or set up in the data dir before (once secured, a data dir stays so)."""
    secure = SecureDir(settings.data_dir or default_data_dir())
    return secure if settings.secure or secure.exists() else None


def issue(secure: SecureDir, settings: Settings, tenants: Iterable[str]) -> list[str]:
    """Identities for the roles and `tenants`, and the config; the tenants that are new.

    Raises:
        SettingsError: they cannot be made or written.
    """
    try:
        return secure.ensure(settings.subject_prefix, tenants)
    except (CredentialsError, OSError) as exc:
        raise SettingsError(f"secure mode ({secure.root}): {exc}") from None


class _Holder(Protocol):
    """What tenants_holding reads of an engine (engine.service.router.Engine)."""

    @property
    def domains(self) -> list[str]: ...

    def state(self, domain: str) -> DomainState | None: ...


def tenants_holding(engine: _Holder, secure: SecureDir) -> list[str]:
    """Every tenant with a live composition that can have an identity (names from before
    secure mode that are no id, or name a role, get none: `trellis tenant add` says why),
    but not one the operator revoked: a restart must not let it back in."""
    held = set()
    for domain in engine.domains:
        state = engine.state(domain)
        held |= {c.tenant for c in state.compositions.values()} if state else set()
    revoked = secure.revoked()
    return sorted(t for t in held if tenant_name_problem(t) is None and t not in revoked)


async def until_issued_accepted(nats_url: str, secure: SecureDir, tenants: list[str]) -> None:
    """Serve only once the reload lets the newly issued tenants in: a client that connected
    while it ran could be dropped, and one told "serving" expects to be let in."""
    for tenant in tenants:
        try:
            await until_accepted(nats_url, secure.credentials(Principal("tenant", tenant)))
        except TimeoutError as exc:
            log.warning("%s: tenant %s may be refused until the server reloads", exc, tenant)


async def until_refused(
    url: str, creds: NkeyCredentials, timeout: float = ACCEPT_TIMEOUT_S
) -> None:
    """Return once the nats-server at `url` refuses `creds` (`Authorization Violation`): after
    the reload (SIGHUP) that removed that identity. nats-server takes the new users before it
    checks any client against them, so a refusal, even of a client it dropped mid-handshake
    while reloading, means every later connection meets the new users; and the same check
    closes the connections the removed identity still had.

    Raises:
        TimeoutError: still let in (or not answering) after `timeout` seconds; says which.
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
                connect_timeout=2,
                error_cb=_ignore,
                **options,
            )
        except nats.errors.Error as exc:
            if "authorization violation" in str(exc).lower():
                return
            outcome = str(exc) or type(exc).__name__
        except OSError as exc:  # a reset mid-reload, or no answer: not a refusal yet
            outcome = str(exc) or type(exc).__name__
        else:
            await nc.close()
            outcome = "it was let in"
        if loop.time() > deadline:
            raise TimeoutError(
                f"the nats-server at {redacted(url)} does not refuse {creds.path} yet "
                f"after {timeout:.0f}s: {outcome}"
            )
        await asyncio.sleep(0.1)


async def _ignore(exc: Exception) -> None:
    """nats-py reports each refused attempt to the error callback too; the caller decides."""
