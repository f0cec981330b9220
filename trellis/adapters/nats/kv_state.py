"""What the KV bucket TRELLIS_STATE holds: one small JSON value per device, composition, host
and reservation.

Keys are `<domain>.device.<id>`, `<domain>.composition.<id>` and `<domain>.host.<id>`
(ARCHITECTURE §3), and `<domain>.reservation.<id>` for reservations (engine/core/reservations.py;
a reservation that ends gets its final value, then is deleted, as a composition). Values are
rendered from engine.core.state.DomainState, the fold the engine itself decides on, so a
scheduler watching the bucket sees exactly what the engine believes. Every value carries the
log `position` of the event that wrote it, to line it up with the stream.

`changes(before, after, event, position)` (two `View`s) lists the keys one event changed, with
their new values. It finds them by identity: `evolve` (and `fold`) replace exactly the entries
an event touches and share everything else, so a map that is the same object before and after
is skipped at once, and an entry that is the same object (or an equal one) did not change
(`ext.changed_keys`, compiled: one pass over each map in C). No per-event-type table to keep in
step with `evolve`. `coalesce` reduces a batch of changes to the writes that matter: the bucket
holds current state, and a watcher may not see every step (the stream has them).

A composition value also carries `conditions` (engine/core/conditions.py), Kubernetes-style, for a
DRA driver's binding conditions and an autoscaler; they need the time and position of the
events, which `evolve` does not keep, so the renderer folds a `View`: the engine's state plus
each live composition's conditions (`fold`, one event at a time, as the relay and
`trellis verify` both do).

A composition that ends (released or failed) leaves `evolve`'s state; its key gets its final
value, `state` "released" or "failed", and is then deleted. A watcher sees the end and why, and
the bucket holds live compositions only, not every composition there ever was. A node that is
removed from the fabric has its key deleted. The delete marker itself goes after a day
(TRELLIS_KV_MARKER_TTL, adapters/nats/relay.py): a watcher that was away longer must watch
anew, since the key's end is no longer in the bucket to resume through.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

import msgspec

from trellis.engine.core.conditions import Condition, Track, observe
from trellis.engine.core.events import CompositionFailed, DeviceBinding, Event
from trellis.engine.core.ids import Labels, is_valid_id
from trellis.engine.core.model import Health
from trellis.engine.core.records import format_time
from trellis.engine.core.results import Time
from trellis.engine.core.state import (
    Composition,
    CompositionState,
    DomainState,
    NodeState,
    Reservation,
    evolve,
    sliced_gib,
    usable,
)
from trellis.ext import changed_keys

KeyChange = tuple[str, bytes | None]  # (key, JSON value), or (key, None): delete the key


class DeviceEntry(msgspec.Struct, kw_only=True):
    """`<domain>.device.<id>`: a pooled device and who holds it."""

    kind: str  # gpu, memory, nic, nvme, accelerator
    model: str | None
    health: Health
    drained: bool
    owner: str | None  # the composition holding it whole
    # What the `free` query would list: healthy, undrained, held and reserved by nobody, GiB
    # left in a pool.
    free: bool
    capacity_gib: float | None = None  # memory pools only: the pool's size...
    free_gib: float | None = None  # ...and what is not sliced out of it (or reserved)
    position: int
    reservation: str | None = None  # the reservation holding it whole


ReservationValue = Literal["held", "applied", "cancelled", "expired"]


class ReservationEntry(msgspec.Struct, kw_only=True):
    """`<domain>.reservation.<id>`: a live reservation (`held`), or the final state of one that
    ended (`applied`, with the composition it became; `cancelled`; `expired`), just before
    its delete."""

    tenant: str
    host: str
    state: ReservationValue
    expires_at: Time
    devices: list[BoundDevice]  # the paths chosen when it was made
    position: int
    composition_id: str | None = None


class BoundDevice(msgspec.Struct, kw_only=True):
    id: str
    kind: str
    path: list[str]  # node ids, host first
    capacity_gib: float | None = None  # a memory slice; null for whole devices


class CompositionEntry(msgspec.Struct, kw_only=True):
    """`<domain>.composition.<id>`: a live composition, or the final state of one that ended."""

    tenant: str
    host: str
    state: CompositionState  # released or failed: its last value, just before the delete
    expires_at: Time | None  # UTC, microseconds, "Z"; null without a lease
    devices: list[BoundDevice]
    impaired_by: list[str]  # the components whose faults impair it, oldest first
    position: int
    # Bound, PathEstablished, Ready, Impaired, Failed, in that order (engine/core/conditions.py).
    conditions: list[Condition] = []
    labels: Labels = {}  # the compose request's, to select by (as kubectl -l does)


class HostEntry(msgspec.Struct, kw_only=True):
    """`<domain>.host.<id>`: a host and the live compositions on it."""

    health: Health
    drained: bool
    compositions: list[str]  # ids, sorted
    position: int


Entry = DeviceEntry | CompositionEntry | HostEntry | ReservationEntry
_ENTRIES: dict[str, msgspec.json.Decoder[Any]] = {
    "device": msgspec.json.Decoder(DeviceEntry),
    "composition": msgspec.json.Decoder(CompositionEntry),
    "host": msgspec.json.Decoder(HostEntry),
    "reservation": msgspec.json.Decoder(ReservationEntry),
}


def bucket_entry(key: str, value: bytes) -> Entry | None:
    """The value of a bucket key as the contract has it; None for a key or a value that is not
    the contract's (ARCHITECTURE §3: a consumer skips and counts it, and goes on)."""
    domain, _, rest = key.partition(".")
    kind, _, name = rest.partition(".")
    decoder = _ENTRIES.get(kind)
    if decoder is None or not (is_valid_id(domain) and is_valid_id(name)):
        return None
    try:
        entry: Entry = decoder.decode(value)
    except msgspec.DecodeError:  # ValidationError is one
        return None
    return entry


class View(msgspec.Struct, frozen=True, kw_only=True):
    """What the bucket renders: the engine's state and each live composition's conditions."""

    state: DomainState
    tracks: dict[str, Track] = {}
    ended: dict[str, Track] = {}  # the final tracks of the compositions the last event ended

    @classmethod
    def empty(cls, domain: str) -> View:
        return cls(state=DomainState(domain=domain))


def fold(view: View, event: Event, at: datetime, position: int) -> View:
    """`view` after `event`, recorded `at` at log `position`: evolve, then the conditions."""
    state = evolve(view.state, event)
    cid = getattr(event, "composition_id", "")
    live = state.compositions.get(cid)
    gone = None if live is not None else view.state.compositions.get(cid)
    tracks, ended = view.tracks, {}
    if live is not None:
        track = observe(tracks.get(cid), live, event, at, position)
        if track is not tracks.get(cid):
            tracks = {**tracks, cid: track}
    elif gone is not None:
        ended = {cid: observe(tracks.get(cid), gone, event, at, position)}
        tracks = {k: v for k, v in tracks.items() if k != cid}
    if state is view.state and tracks is view.tracks and not (ended or view.ended):
        return view
    return View(state=state, tracks=tracks, ended=ended)


_encode = msgspec.json.Encoder().encode


def everything(view: View, position: int) -> list[KeyChange]:
    """Every key of `view`, with its value as of log `position`: a bucket filled afresh."""
    return changes(View.empty(view.state.domain), view, None, position)


def changes(before: View, after: View, event: Event | None, position: int) -> list[KeyChange]:
    """The keys `event` (at log `position`) changed between `before` and `after`, with values.

    Order: compositions, then reservations, then devices, then hosts, each by id; an ended
    composition's (or reservation's) final value comes right before its delete.
    """
    out: list[KeyChange] = []
    hosts: set[str] = set()
    was, now = before.state, after.state
    touched = changed_keys(was.compositions, now.compositions)
    touched |= changed_keys(before.tracks, after.tracks)
    for cid in sorted(touched):
        key = f"{now.domain}.composition.{cid}"
        live = now.compositions.get(cid)
        if live is not None:
            out.append((key, _encode(composition_entry(live, after.tracks.get(cid), position))))
            if cid not in was.compositions:
                hosts.add(live.host)
            continue
        ended = "failed" if isinstance(event, CompositionFailed) else "released"
        final = msgspec.structs.replace(was.compositions[cid], state=ended)
        last = composition_entry(final, after.ended.get(cid), position)
        out += [(key, _encode(last)), (key, None)]
        hosts.add(final.host)

    for rid in sorted(changed_keys(was.reservations, now.reservations)):
        key = f"{now.domain}.reservation.{rid}"
        held = now.reservations.get(rid)
        if held is not None:
            out.append((key, _encode(reservation_entry(held, "held", position))))
            continue
        how = now.ended_reservations.get(rid)
        end: ReservationValue = how.end if how is not None else "cancelled"
        applied_as = how.composition_id if how is not None else None
        gone = reservation_entry(was.reservations[rid], end, position, applied_as)
        out += [(key, _encode(gone)), (key, None)]

    devices: set[str] = set()
    for node_id in changed_keys(was.nodes, now.nodes):
        kind = (now.nodes.get(node_id) or was.nodes[node_id]).spec.kind
        if kind == "device":
            devices.add(node_id)
        elif kind == "host":
            hosts.add(node_id)
    devices |= changed_keys(was.device_owner, now.device_owner)
    devices |= changed_keys(was.memory_used, now.memory_used)
    devices |= changed_keys(was.reserved_by, now.reserved_by)
    devices |= changed_keys(was.reserved_gib, now.reserved_gib)

    for device in sorted(devices):
        node = now.nodes.get(device)
        entry = None if node is None else _encode(device_entry(now, node, position))
        out.append((f"{now.domain}.device.{device}", entry))
    for host in sorted(hosts):
        node = now.nodes.get(host)
        entry = None if node is None else _encode(host_entry(now, node, position))
        out.append((f"{now.domain}.host.{host}", entry))
    return out


def coalesce(changed: Iterable[KeyChange]) -> dict[str, list[bytes | None]]:
    """The writes a batch of changes comes down to, by key in first-touched order: each key's
    last value, followed by a delete when the key ends deleted (so a composition that ended
    still shows its final state first). The bucket holds current state; the stream has every
    step in between."""
    out: dict[str, list[bytes | None]] = {}
    for key, value in changed:
        if value is not None:
            out[key] = [value]
        else:
            out[key] = [*(v for v in out.get(key, []) if v is not None), None]
    return out


def device_entry(state: DomainState, node: NodeState, position: int) -> DeviceEntry:
    spec = node.spec
    owner = state.device_owner.get(spec.id)
    reservation = state.reserved_by.get(spec.id)
    capacity = free_gib = None
    whole = owner is not None or reservation is not None
    free = not whole and usable(node)
    if spec.device_kind == "memory":
        capacity = spec.capacity_gib or 0.0
        free_gib = 0.0 if whole else max(0.0, capacity - sliced_gib(state, spec.id))
        free = free and free_gib > 1e-9
    return DeviceEntry(
        kind=spec.device_kind or "",
        model=spec.model,
        health=node.health,
        drained=node.drained,
        owner=owner,
        free=free,
        capacity_gib=capacity,
        free_gib=free_gib,
        position=position,
        reservation=reservation,
    )


def reservation_entry(
    reservation: Reservation, state: ReservationValue, position: int, cid: str | None = None
) -> ReservationEntry:
    return ReservationEntry(
        tenant=reservation.tenant,
        host=reservation.host,
        state=state,
        expires_at=format_time(reservation.expires_at),
        devices=[_bound(b) for b in reservation.devices],
        position=position,
        composition_id=cid,
    )


def composition_entry(
    composition: Composition, track: Track | None, position: int
) -> CompositionEntry:
    return CompositionEntry(
        tenant=composition.tenant,
        host=composition.host,
        state=composition.state,
        expires_at=format_time(composition.expires_at) if composition.expires_at else None,
        devices=[_bound(b) for b in composition.bindings],
        impaired_by=list(composition.impaired_by),
        position=position,
        conditions=list(track.conditions) if track is not None else [],
        labels=composition.request.labels,
    )


def host_entry(state: DomainState, node: NodeState, position: int) -> HostEntry:
    # A scan of the live compositions: only hosts whose compositions came or went get here.
    on_host = sorted(c.id for c in state.compositions.values() if c.host == node.spec.id)
    return HostEntry(
        health=node.health, drained=node.drained, compositions=on_host, position=position
    )


def _bound(binding: DeviceBinding) -> BoundDevice:
    return BoundDevice(
        id=binding.device,
        kind=binding.kind,
        path=list(binding.path),
        capacity_gib=binding.capacity_gib,
    )
