"""Secure mode's credential issuing (adapters/nats/auth.py holds the identities themselves):
whether secure mode is on, the identities each of the engine's connections uses, issuing the
roles' and tenants' identities, and waiting for a reloaded nats-server to let new ones in
(connect.py's until_refused waits for it to refuse revoked ones)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from trellis.adapters.embedded.process import default_data_dir
from trellis.adapters.nats.auth import (
    CredentialsError,
    NkeyCredentials,
    Principal,
    SecureDir,
    tenant_name_problem,
)
from trellis.adapters.nats.connect import until_accepted
from trellis.adapters.settings import Settings, SettingsError
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
