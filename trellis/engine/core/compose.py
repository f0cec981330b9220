"""Deciding the composition lifecycle: compose, release, extend (pure, like decide.py)."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import msgspec

from trellis.engine.core.context import Context, Decision
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CircuitCreated,
    CircuitRef,
    CircuitRemoved,
    CompositionRejected,
    CompositionReleased,
    CompositionRequested,
    DeviceBinding,
    DevicesReserved,
    Event,
    LeaseExpired,
    LeaseExtended,
)
from trellis.engine.core.intents import LEASE_SECONDS_RANGE, Compose, Extend, Release
from trellis.engine.core.placement import Placement, Rejection, hosts_of, place
from trellis.engine.core.quotas import over_quota
from trellis.engine.core.records import format_time
from trellis.engine.core.results import ComposedDevice, ComposeResult, ExtendResult, ReleaseResult
from trellis.engine.core.state import Composition, DomainState, evolve, usable
from trellis.engine.core.views import unknown_composition


def composition_id(domain: str, tenant: str, request_id: str) -> str:
    """Deterministic, so deciding is pure and a replayed decision names the same id."""
    digest = hashlib.sha256(f"{domain}/{tenant}/{request_id}".encode()).hexdigest()
    return f"c-{digest[:16]}"


def devices_of(bindings: list[DeviceBinding]) -> list[ComposedDevice]:
    return [
        ComposedDevice(
            id=b.device,
            kind=b.kind,
            path=b.path,
            hops=b.hops,
            latency_ns=b.latency_ns,
            bandwidth_gbps=b.bandwidth_gbps,
            capacity_gib=b.capacity_gib,
        )
        for b in bindings
    ]


def compose(state: DomainState, intent: Compose, ctx: Context) -> Decision:
    tenant = ctx.actor
    chosen = choose(state, intent, tenant)
    if isinstance(chosen, Rejection):
        return recorded(tenant, intent, chosen)
    cid = composition_id(ctx.domain, tenant, intent.request_id)
    events, result = composition_events(state, intent, ctx, cid, chosen)
    return Decision(events, result)


def choose(state: DomainState, intent: Compose, tenant: str) -> Placement | Rejection:
    """The host and devices a compose of `intent` by `tenant` would take now, or why not (a
    compose, a reservation and a preview choose alike).

    Raises:
        IntentRejected: the request is malformed or names what does not exist (`invalid`,
            `not_found`); nothing is recorded.
    """
    _check_shape(state, intent)
    # Quota first: what the tenant may hold does not depend on the fabric, and costs no search.
    over = over_quota(state, intent, tenant)
    if over is not None:
        return over
    hosts = _candidate_hosts(state, intent)
    if isinstance(hosts, Rejection):
        outcomes: list[Placement | Rejection] = [hosts]
    else:
        outcomes = [place(state, intent, tenant, host) for host in hosts]
    placements = [p for p in outcomes if isinstance(p, Placement)]
    if not placements:
        return _first_rejection(outcomes)
    # With a host_selector, the host whose paths are shortest (then fastest) wins; ids break ties.
    chosen = min(placements, key=lambda p: (*p.score, p.host))
    bindings = _with_entries(intent, chosen.bindings)
    return msgspec.structs.replace(chosen, bindings=bindings)


def composition_events(
    state: DomainState, intent: Compose, ctx: Context, cid: str, chosen: Placement
) -> tuple[list[Event], ComposeResult]:
    """The events that make composition `cid` of `chosen` pending, and the pending answer."""
    if cid in state.compositions:
        raise IntentRejected("conflict", f"composition {cid} already exists", {"id": cid})
    expires_at = ctx.now + timedelta(seconds=intent.lease_seconds) if intent.lease_seconds else None
    events: list[Event] = [
        CompositionRequested(
            composition_id=cid,
            tenant=ctx.actor,
            host=chosen.host,
            request=intent,
            requested_at=ctx.now,
            expires_at=expires_at,
        ),
        *(
            CircuitCreated(
                ocs=c.ocs, a_port=c.a_port, b_port=c.b_port, host=chosen.host, composition_id=cid
            )
            for c in chosen.new_circuits
        ),
        DevicesReserved(composition_id=cid, devices=chosen.bindings),
    ]
    # Pending until the fabric saga has programmed it (establish) or given up (fail).
    result = ComposeResult(
        composition_id=cid,
        host=chosen.host,
        state="pending",
        expires_at=expires_at,
        devices=devices_of(chosen.bindings),
    )
    return events, result


def recorded(tenant: str, intent: Compose, rejection: Rejection) -> Decision:
    """A refused compose, reserve or apply (quota, no_capacity, no_path), recorded as
    CompositionRejected so auditors see it; its error is the request's stored answer."""
    error = IntentRejected(rejection.code, rejection.message, rejection.details)  # type: ignore[arg-type]
    event = CompositionRejected(
        tenant=tenant,
        code=rejection.code,
        message=rejection.message,
        details=rejection.details,
        request=intent,
    )
    return Decision([event], error=error)


def _with_entries(intent: Compose, bindings: list[DeviceBinding]) -> list[DeviceBinding]:
    """Remember which request entry each binding serves, so a repair can find a stand-in.
    Placement serves `devices` entries in order, count by count, then `device_ids`."""
    entries = [i for i, entry in enumerate(intent.devices) for _ in range(entry.count)]
    entries += [-1] * len(intent.device_ids)
    return [msgspec.structs.replace(b, entry=e) for b, e in zip(bindings, entries, strict=True)]


def expire_leases(state: DomainState, ctx: Context) -> Decision:
    """LeaseExpired + CompositionReleased for every lease due at `ctx.now`, oldest first."""
    due = sorted(
        (c.expires_at, cid)
        for cid, c in state.compositions.items()
        if c.expires_at is not None and c.expires_at <= ctx.now and c.state != "pending"
    )
    events: list[Event] = []
    for _, cid in due:
        composition = state.compositions[cid]
        ending: list[Event] = [
            LeaseExpired(composition_id=cid),
            CompositionReleased(composition_id=cid, reason="lease expired"),
        ]
        ending += circuit_teardown(state, composition, "lease expired")
        for event in ending:
            state = evolve(state, event)
        events += ending
    return Decision(events, {"expired": [cid for _, cid in due]})


def release(state: DomainState, intent: Release, ctx: Context) -> Decision:
    composition = _owned(state, intent.composition_id, ctx)
    if composition.state == "pending":
        raise IntentRejected(
            "conflict",
            f"composition {composition.id} is still being established; release it once it is",
            {"id": composition.id, "state": "pending"},
        )
    events: list[Event] = [
        CompositionReleased(composition_id=composition.id, reason=intent.reason or "released")
    ]
    removed = unused_circuits(state, composition)
    events += circuit_teardown(state, composition, "unused")
    result = ReleaseResult(
        composition_id=composition.id,
        state="released",
        devices=[b.device for b in composition.bindings],
        circuits_removed=[f"{c.ocs}:{c.a_port}-{c.b_port}" for c in removed],
    )
    return Decision(events, result)


#: The furthest a lease may end from now, however many extensions add up to it: the longest
#: lease one intent may ask for. Without it, extensions ran the deadline past year 9999,
#: which no datetime holds, and the engine answered `unavailable` to a request no retry mends.
LONGEST_LEASE = timedelta(seconds=LEASE_SECONDS_RANGE[1])


def extend(state: DomainState, intent: Extend, ctx: Context) -> Decision:
    """The lease runs `lease_seconds` longer, counted from the later of now and its deadline,
    and ends at most LONGEST_LEASE from now (`conflict` past that)."""
    composition = _owned(state, intent.composition_id, ctx)
    base = max(ctx.now, composition.expires_at) if composition.expires_at else ctx.now
    if base - ctx.now + timedelta(seconds=intent.lease_seconds) > LONGEST_LEASE:
        raise IntentRejected(
            "conflict",
            f"composition {composition.id} would then run past {LONGEST_LEASE.days // 365}"
            " years from now, the longest a lease may run",
            {"id": composition.id, "expires_at": format_time(base)},
        )
    expires_at = base + timedelta(seconds=intent.lease_seconds)
    event = LeaseExtended(composition_id=composition.id, expires_at=expires_at)
    return Decision([event], ExtendResult(composition_id=composition.id, expires_at=expires_at))


def circuit_teardown(state: DomainState, leaving: Composition, reason: str) -> list[Event]:
    return [
        CircuitRemoved(
            ocs=c.ocs,
            a_port=c.a_port,
            b_port=c.b_port,
            host=leaving.host,
            reason=reason,
            composition_id=leaving.id,
        )
        for c in unused_circuits(state, leaving)
    ]


def unused_circuits(state: DomainState, leaving: Composition) -> list[CircuitRef]:
    """Circuits of `leaving` that no other live composition of the same host passes."""
    still_used = {
        (c.ocs, c.a_port, c.b_port)
        for cid, comp in state.compositions.items()
        if cid != leaving.id and comp.host == leaving.host
        for b in comp.bindings
        for c in b.circuits
    }
    seen: dict[tuple[str, int, int], CircuitRef] = {}
    for b in leaving.bindings:
        for c in b.circuits:
            key = (c.ocs, c.a_port, c.b_port)
            if key not in still_used:
                seen.setdefault(key, c)
    return [seen[k] for k in sorted(seen)]


def _owned(state: DomainState, cid: str, ctx: Context) -> Composition:
    """The actor's live composition `cid`. Another tenant's is answered exactly as one that
    does not exist, as views answer (ARCHITECTURE §3), so no tenant learns another's ids."""
    composition = state.compositions.get(cid)
    if composition is None or composition.tenant != ctx.actor:
        raise unknown_composition(cid)
    return composition


def _check_shape(state: DomainState, intent: Compose) -> None:
    """Rules the Struct types cannot say: one way to name the host, something to compose."""
    if (intent.host is None) == (intent.host_selector is None):
        raise IntentRejected("invalid", "give exactly one of `host` and `host_selector`")
    if not intent.devices and not intent.device_ids:
        raise IntentRejected("invalid", "nothing to compose: give `devices` or `device_ids`")
    for i, entry in enumerate(intent.devices):
        if (entry.kind == "memory") != (entry.capacity_gib is not None):
            raise IntentRejected(
                "invalid",
                f"devices[{i}]: `capacity_gib` is required for memory and only valid for memory",
            )
    if len(set(intent.device_ids)) != len(intent.device_ids):
        raise IntentRejected("invalid", "`device_ids` lists a device twice")
    for device in intent.device_ids:
        node = state.nodes.get(device)
        if node is None or node.spec.kind != "device":
            raise IntentRejected("not_found", f"no device {device!r}", {"id": device})
    if intent.host is not None:
        node = state.nodes.get(intent.host)
        if node is None or node.spec.kind != "host":
            raise IntentRejected("not_found", f"no host {intent.host!r}", {"id": intent.host})


def unusable_host(state: DomainState, host: str) -> Rejection | None:
    """The `no_path` rejection for a host that cannot carry paths now, or None."""
    node = state.nodes.get(host)
    if node is not None and usable(node):
        return None
    why = "gone" if node is None else "drained" if node.drained else node.health
    details = {"host": host, "funnel": []}
    return Rejection(code="no_path", message=f"host {host} is {why}", details=details)


def _candidate_hosts(state: DomainState, intent: Compose) -> list[str] | Rejection:
    if intent.host is not None:
        return unusable_host(state, intent.host) or [intent.host]
    wanted = intent.host_selector.labels if intent.host_selector else {}
    hosts = [
        host
        for host in hosts_of(state)
        if usable(state.nodes[host])
        and all(state.nodes[host].spec.labels.get(k) == v for k, v in wanted.items())
    ]
    if not hosts:
        message = f"no usable host matches the selector {wanted}"
        return Rejection(
            code="no_capacity", message=message, details={"selector": wanted, "funnel": []}
        )
    return hosts


def _first_rejection(outcomes: list[Placement | Rejection]) -> Rejection:
    """One host: its reason. Several: the first host's reason, naming how many were tried."""
    rejections = [o for o in outcomes if isinstance(o, Rejection)]
    first = rejections[0]
    if len(rejections) == 1:
        return first
    hosts = [r.details.get("host") for r in rejections]
    details = {**first.details, "hosts_tried": hosts}
    message = f"none of {len(hosts)} matching hosts can serve it; on {hosts[0]}: {first.message}"
    return Rejection(code=first.code, message=message, details=details)
