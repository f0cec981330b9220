"""Quotas per tenant and device kind (issue 9 item 5), decided purely like decide.py.

The operator sets a tenant's quota for a kind in a domain (`set-quota`, recorded as QuotaSet)
or removes it (`clear-quota`, QuotaCleared). A quota limits what the tenant's live compositions
(pending, active, impaired) hold at once: `count` devices of the kind (a memory slice counts as
one), and for memory `capacity_gib` GiB. A compose that would take the tenant over a limit is
refused with `quota` and recorded as CompositionRejected, before any placement is tried.

What a tenant holds is an index `evolve` keeps (DomainState.held), so a check never scans the
compositions. Only composes are checked: a repair that replaces a device takes one of the same
kind and the same GiB for the one it gives back, so it never changes what the tenant holds and
is never refused. A quota set below what the tenant holds takes nothing away; it refuses new
composes of that kind until the tenant is under it again.
"""

from __future__ import annotations

from typing import Any

import msgspec

from trellis.engine.core.context import Decision
from trellis.engine.core.events import QuotaCleared, QuotaSet
from trellis.engine.core.intents import ClearQuota, Compose, SetQuota
from trellis.engine.core.placement import Rejection
from trellis.engine.core.results import QuotaResult, QuotaRow, Usage
from trellis.engine.core.state import DomainState, Held, Quota

# GiB are summed as floats; a limit is met, not exceeded, within this much.
_GIB_SLACK = 1e-9


def set_quota(state: DomainState, intent: SetQuota) -> Decision:
    """Record the tenant's new quota for the kind; setting the same one again records nothing.
    (The intent's own checks have refused a reserved tenant, no limit, and GiB for non-memory.)"""
    limit = Quota(count=intent.count, capacity_gib=intent.capacity_gib)
    changed = state.quotas.get(intent.tenant, {}).get(intent.kind) != limit
    event = QuotaSet(
        tenant=intent.tenant,
        kind=intent.kind,
        count=intent.count,
        capacity_gib=intent.capacity_gib,
        reason=intent.reason,
    )
    result = _result(state, intent.tenant, intent.kind, limit, changed)
    return Decision([event] if changed else [], result)


def clear_quota(state: DomainState, intent: ClearQuota) -> Decision:
    """The tenant has no quota for the kind any more; clearing none records nothing."""
    changed = intent.kind in state.quotas.get(intent.tenant, {})
    event = QuotaCleared(tenant=intent.tenant, kind=intent.kind, reason=intent.reason)
    result = _result(state, intent.tenant, intent.kind, None, changed)
    return Decision([event] if changed else [], result)


def over_quota(state: DomainState, intent: Compose, tenant: str) -> Rejection | None:
    """The `quota` rejection of a compose that would take `tenant` over a quota, or None.

    Kinds are checked in the order the request first names them, the count before the GiB.
    `_check_shape` has run: every `device_ids` entry names a device, every memory entry GiB.
    """
    limits = state.quotas.get(tenant)
    if not limits:
        return None
    held = state.held.get(tenant, {})
    for kind, asked in _asked(state, intent).items():
        limit = limits.get(kind)
        if limit is None:
            continue
        has = held.get(kind, Held())
        if limit.count is not None and has.count + asked.count > limit.count:
            what, cap = "count", f"{limit.count} {kind}"
            holds, more = f"{has.count} {kind}", f"{asked.count}"
        elif (
            limit.capacity_gib is not None
            and has.capacity_gib + asked.capacity_gib > limit.capacity_gib + _GIB_SLACK
        ):
            what, cap = "capacity_gib", f"{limit.capacity_gib:g} GiB of {kind}"
            holds, more = f"{has.capacity_gib:g} GiB of {kind}", f"{asked.capacity_gib:g} GiB"
        else:
            continue
        details: dict[str, Any] = {
            "tenant": tenant,
            "kind": kind,
            "exceeds": what,
            "limit": msgspec.to_builtins(limit),
            "held": msgspec.to_builtins(_usage(kind, has)),
            "asked": msgspec.to_builtins(_usage(kind, asked)),
        }
        message = (
            f"tenant {tenant} holds {holds} and asks for {more} more; its quota in domain "
            f"{state.domain} is {cap}"
        )
        return Rejection(code="quota", message=message, details=details)
    return None


def _asked(state: DomainState, intent: Compose) -> dict[str, Held]:
    """What a compose asks for, per kind: devices (a slice counts as one) and memory's GiB."""
    wanted: dict[str, Held] = {}

    def add(kind: str, count: int, gib: float) -> None:
        before = wanted.get(kind, Held())
        wanted[kind] = Held(count=before.count + count, capacity_gib=before.capacity_gib + gib)

    for entry in intent.devices:
        gib = (entry.capacity_gib or 0.0) * entry.count if entry.kind == "memory" else 0.0
        add(entry.kind, entry.count, gib)
    for device in intent.device_ids:
        spec = state.nodes[device].spec
        kind = spec.device_kind or "gpu"
        add(kind, 1, (spec.capacity_gib or 0.0) if kind == "memory" else 0.0)  # taken whole
    return wanted


def quotas(
    state: DomainState, tenant: str | None = None, kind: str | None = None
) -> list[QuotaRow]:
    """Every tenant and kind with a quota or holdings (filtered), by tenant, then kind."""
    pairs = {(t, k) for t, limits in state.quotas.items() for k in limits}
    pairs |= {(t, k) for t, held in state.held.items() for k in held}
    return [
        _row(state, t, k, state.quotas.get(t, {}).get(k))
        for t, k in sorted(pairs)
        if (tenant is None or t == tenant) and (kind is None or k == kind)
    ]


def _row(state: DomainState, tenant: str, kind: str, limit: Quota | None) -> QuotaRow:
    held = state.held.get(tenant, {}).get(kind, Held())
    return QuotaRow(
        tenant=tenant,
        kind=kind,
        limit=limit,
        held=_usage(kind, held),
        over=limit is not None and _over(held, limit),
    )


def _result(
    state: DomainState, tenant: str, kind: str, limit: Quota | None, changed: bool
) -> QuotaResult:
    row = _row(state, tenant, kind, limit)
    return QuotaResult(**msgspec.structs.asdict(row), changed=changed)


def _over(held: Held, limit: Quota) -> bool:
    return (limit.count is not None and held.count > limit.count) or (
        limit.capacity_gib is not None and held.capacity_gib > limit.capacity_gib + _GIB_SLACK
    )


def _usage(kind: str, amount: Held) -> Usage:
    return Usage(count=amount.count, capacity_gib=amount.capacity_gib if kind == "memory" else None)
