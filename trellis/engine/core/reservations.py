"""Reservations: preview, reserve, apply, cancel and expire, decided purely (like decide.py).

A compose chooses devices and takes them at once. Redfish's `Compose` action (ARCHITECTURE §11)
splits that in steps, and so does the engine:

- `preview` (a query, `trellis.query|view.<domain>[.<tenant>].preview`) chooses as a compose
  would, now, and records nothing;
- `reserve` chooses the same way and holds the chosen devices (whole devices, and the GiB of a
  memory slice) for the tenant for `duration_seconds`: `ReservationMade`. Nobody else may
  compose or reserve them meanwhile; they are not `free`. A reservation holds devices, not
  paths: the bandwidth, switches and circuits its paths would use stay free for others;
- `apply` turns the tenant's reservation into a composition of exactly those devices, over
  paths found now: `ReservationApplied`, then the compose's own events (the saga settles it as
  any compose). Or it composes a manifest directly, as `compose` does;
- `cancel-reservation` gives the devices back (`ReservationCancelled`); the engine's timer ends
  a reservation whose time is up (`ReservationExpired`), derived from state as lease expiry is.

A reserve that cannot be served (quota, no_capacity, no_path) is recorded as
`CompositionRejected` and answered as a compose is; so is an apply whose devices no path
reaches any more (the reservation then stays, until it is cancelled or expires). A reservation
counts in its tenant's holdings (quotas) as a composition does. Another tenant's reservation is
`not_found`, on intents and views alike; one of the tenant's own that has ended is `conflict`,
saying how it ended (`details.state`: `expired`, `cancelled` or `applied`).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

import msgspec

from trellis.engine.core.actors import OPERATOR
from trellis.engine.core.compose import (
    choose,
    compose,
    composition_events,
    composition_id,
    devices_of,
    recorded,
    unusable_host,
)
from trellis.engine.core.context import Context, Decision
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    Event,
    ReservationApplied,
    ReservationCancelled,
    ReservationExpired,
    ReservationMade,
)
from trellis.engine.core.intents import (
    Apply,
    CancelReservation,
    PreviewQuery,
    ReservationsQuery,
    Reserve,
)
from trellis.engine.core.placement import Rejection, place
from trellis.engine.core.records import format_time
from trellis.engine.core.results import (
    CancelReservationResult,
    PreviewResult,
    ReservationResult,
    ReservationsResult,
)
from trellis.engine.core.state import DomainState, Reservation, evolve


def reservation_id(domain: str, tenant: str, request_id: str) -> str:
    """Deterministic, as a composition id is, so a replayed decision names the same id."""
    digest = hashlib.sha256(f"reservation/{domain}/{tenant}/{request_id}".encode()).hexdigest()
    return f"rsv-{digest[:16]}"


def reserve(state: DomainState, intent: Reserve, ctx: Context) -> Decision:
    tenant = ctx.actor
    request = intent.manifest.compose(intent.request_id)
    chosen = choose(state, request, tenant)
    if isinstance(chosen, Rejection):
        return recorded(tenant, request, chosen)
    rid = reservation_id(ctx.domain, tenant, intent.request_id)
    if rid in state.reservations or rid in state.ended_reservations:
        raise IntentRejected("conflict", f"reservation {rid} already exists", {"id": rid})
    event = ReservationMade(
        reservation_id=rid,
        tenant=tenant,
        host=chosen.host,
        request=request,
        devices=chosen.bindings,
        made_at=ctx.now,
        expires_at=ctx.now + timedelta(seconds=intent.duration_seconds),
    )
    reservation = evolve(state, event).reservations[rid]
    return Decision([event], describe(reservation))


def apply(state: DomainState, intent: Apply, ctx: Context) -> Decision:
    """Compose from a reservation (its devices, its manifest) or from a manifest."""
    if intent.manifest is not None:
        return compose(state, intent.manifest.compose(intent.request_id), ctx)
    assert intent.reservation_id is not None  # the intent admits exactly one
    reservation = _live(state, intent.reservation_id, ctx)
    tenant = ctx.actor
    request = msgspec.structs.replace(reservation.request, request_id=intent.request_id)
    cid = composition_id(ctx.domain, tenant, intent.request_id)
    applied = ReservationApplied(reservation_id=reservation.id, composition_id=cid)
    # Placed as if the reservation had let go: its own devices are free to it alone.
    after = evolve(state, applied)
    chosen = unusable_host(after, reservation.host) or place(
        after, request, tenant, reservation.host, pinned=reservation.devices
    )
    if isinstance(chosen, Rejection):
        details = {**chosen.details, "reservation_id": reservation.id}
        return recorded(tenant, request, msgspec.structs.replace(chosen, details=details))
    # Each binding keeps the request entry it serves, for repairs (placement kept the order).
    bindings = [
        msgspec.structs.replace(b, entry=r.entry)
        for b, r in zip(chosen.bindings, reservation.devices, strict=True)
    ]
    chosen = msgspec.structs.replace(chosen, bindings=bindings)
    events, result = composition_events(after, request, ctx, cid, chosen)
    return Decision([applied, *events], result)


def cancel(state: DomainState, intent: CancelReservation, ctx: Context) -> Decision:
    reservation = _live(state, intent.reservation_id, ctx)
    event = ReservationCancelled(reservation_id=reservation.id, reason=intent.reason or "cancelled")
    result = CancelReservationResult(
        reservation_id=reservation.id,
        state="cancelled",
        devices=[b.device for b in reservation.devices],
    )
    return Decision([event], result)


def expire_reservations(state: DomainState, ctx: Context) -> Decision:
    """ReservationExpired for every reservation due at `ctx.now`, oldest first."""
    due = sorted(
        (r.expires_at, rid) for rid, r in state.reservations.items() if r.expires_at <= ctx.now
    )
    events: list[Event] = [ReservationExpired(reservation_id=rid) for _, rid in due]
    return Decision(events, {"expired": [rid for _, rid in due]})


def due_reservations(state: DomainState, now: datetime) -> list[str]:
    """The ids of the reservations whose time is up at `now` (the engine's timer asks)."""
    return sorted(rid for rid, r in state.reservations.items() if r.expires_at <= now)


# ---- queries ----


def preview(state: DomainState, query: PreviewQuery) -> PreviewResult:
    """What a compose of the manifest would take now; nothing is held or recorded.

    Raises:
        IntentRejected: as a compose would be refused (`invalid`, `not_found`, and here also
            `quota`, `no_capacity` and `no_path` with their why-not details), unrecorded.
    """
    tenant = query.tenant or OPERATOR
    chosen = choose(state, query.manifest.compose("preview"), tenant)
    if isinstance(chosen, Rejection):
        raise IntentRejected(chosen.code, chosen.message, chosen.details)  # type: ignore[arg-type]
    return PreviewResult(
        host=chosen.host,
        devices=devices_of(chosen.bindings),
        circuits=[f"{c.ocs}:{c.a_port}-{c.b_port}" for c in chosen.new_circuits],
    )


def reservations(state: DomainState, query: ReservationsQuery) -> ReservationsResult:
    """The live reservations, by id, of `tenant` and `id` when given."""
    rows = [
        describe(r)
        for rid, r in sorted(state.reservations.items())
        if (query.tenant is None or r.tenant == query.tenant)
        and (query.id is None or rid == query.id)
    ]
    return ReservationsResult(reservations=rows)


def describe(reservation: Reservation) -> ReservationResult:
    request = reservation.request
    return ReservationResult(
        reservation_id=reservation.id,
        tenant=reservation.tenant,
        host=reservation.host,
        state="held",
        made_at=reservation.made_at,
        expires_at=reservation.expires_at,
        devices=devices_of(reservation.devices),
        request_id=request.request_id,
        labels=dict(request.labels),
        reason=request.reason,
        lease_seconds=request.lease_seconds,
    )


# ---- whose, and whether it still holds ----


def unknown_reservation(rid: str) -> IntentRejected:
    """The one answer for a reservation that never existed and for another tenant's."""
    return IntentRejected("not_found", f"no reservation {rid!r}", {"id": rid})


def _live(state: DomainState, rid: str, ctx: Context) -> Reservation:
    """The actor's live reservation `rid`.

    Raises:
        IntentRejected: `not_found` for another tenant's or an unknown one; `conflict` for one
            of the actor's that has ended, or whose time is up though the expiry tick has not
            recorded it yet (both apply and cancel: a cancel then would record a different end).
    """
    reservation = state.reservations.get(rid)
    if reservation is not None and reservation.tenant == ctx.actor:
        if reservation.expires_at <= ctx.now:
            raise _ended(rid, "expired", format_time(reservation.expires_at))
        return reservation
    ended = state.ended_reservations.get(rid)
    if reservation is None and ended is not None and ended.tenant == ctx.actor:
        when = format_time(ended.expires_at)
        raise _ended(rid, ended.end, when, ended.composition_id)
    raise unknown_reservation(rid)


def _ended(rid: str, end: str, expires_at: str, cid: str | None = None) -> IntentRejected:
    how = {
        "expired": f"expired at {expires_at}",
        "cancelled": "was cancelled",
        "applied": f"was applied already (composition {cid})",
    }[end]
    details: dict[str, object] = {"reservation_id": rid, "state": end, "expires_at": expires_at}
    if cid is not None:
        details["composition_id"] = cid
    return IntentRejected(
        "conflict", f"reservation {rid} {how}; it holds nothing: reserve again", details
    )
