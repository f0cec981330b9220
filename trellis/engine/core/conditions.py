"""A composition's conditions, Kubernetes style, derived purely from the log's events.

A DRA driver with binding conditions (KEP-5007) waits for a condition to be True before the
pod binds and gives up when a failure condition is True; an autoscaling planner wants to know
what is ready, what is degraded and why. Both read these from the KV value of a composition
(adapters/nats/kv_state.py). Every composition carries all five, in this order:

  Bound            its devices are reserved (DevicesReserved)
  PathEstablished  the fabric holds every device's path (one PathEstablished per device)
  Ready            it is active: usable as composed (CompositionActivated); False again while
                   impaired, after its lease expired, once released or failed
  Impaired         a component on its paths is unusable; `components` names them, oldest first
  Failed           the fabric could not establish it (CompositionFailed); `components` names
                   the devices whose paths were never established, `message` the engine's why

`last_transition_time` is the `recorded_at` of the event at which `status` last changed and
`observed_position` that event's log position: no wall clock, so a replay of the log renders
the same conditions. A change of reason or message alone keeps both (as in Kubernetes).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from trellis.engine.core.events import (
    CompositionActivated,
    CompositionFailed,
    CompositionImpaired,
    CompositionReleased,
    CompositionRequested,
    DeviceReplaced,
    DevicesReserved,
    Event,
    LeaseExpired,
    PathEstablished,
    PathRerouted,
)
from trellis.engine.core.records import format_time
from trellis.engine.core.results import Time
from trellis.engine.core.state import Composition

ConditionStatus = Literal["True", "False", "Unknown"]
ConditionType = Literal["Bound", "PathEstablished", "Ready", "Impaired", "Failed"]
TYPES: tuple[ConditionType, ...] = ("Bound", "PathEstablished", "Ready", "Impaired", "Failed")


class Condition(msgspec.Struct, frozen=True, kw_only=True):
    """One aspect of a composition's state, as a Kubernetes condition."""

    type: ConditionType
    status: ConditionStatus
    reason: str  # CamelCase, machine-readable
    message: str  # for people
    last_transition_time: Time  # recorded_at of the event that last changed `status`
    observed_position: int  # that event's log position
    components: list[str] = []  # Impaired: what impairs it; Failed: devices left without a path


Conditions = tuple[Condition, ...]  # one of each type, in TYPES order


class Track(msgspec.Struct, frozen=True, kw_only=True):
    """What the log has said so far about one composition's conditions."""

    conditions: Conditions = ()
    established: frozenset[str] = frozenset()  # devices a PathEstablished has named
    mended: tuple[str, ...] = ()  # the repairs since it was last active, said once it is again


def observe(
    track: Track | None, composition: Composition, event: Event, at: datetime, position: int
) -> Track:
    """The track after `event` (recorded `at`, at log `position`) about `composition`: its
    state after the event, or just before it for the event that ends it. Returns `track`
    itself when the event changes nothing in it."""
    track = track or Track()
    established, mended = track.established, track.mended
    if isinstance(event, PathEstablished):
        established = established | {event.device}
    elif isinstance(event, DeviceReplaced):
        # The replacement's path is set up by the repair that names it.
        if event.old_device in established:
            established = (established - {event.old_device}) | {event.binding.device}
        mended = (*mended, f"{event.old_device} replaced by {event.binding.device}")
    elif isinstance(event, PathRerouted):
        mended = (*mended, f"{event.device} rerouted")
    stamp = _Stamp(format_time(at), position)
    conditions = _next(track.conditions, composition, event, stamp, established, mended)
    if isinstance(event, CompositionActivated):
        mended = ()  # said, in Impaired's message
    if conditions is track.conditions and (established, mended) == (
        track.established,
        track.mended,
    ):
        return track
    return Track(conditions=conditions, established=established, mended=mended)


def _next(
    conditions: Conditions,
    composition: Composition,
    event: Event,
    now: _Stamp,
    established: frozenset[str],
    mended: tuple[str, ...],
) -> Conditions:
    match event:
        case CompositionRequested():
            waiting = "waiting for its devices to be reserved"
            return tuple(
                now.set(None, t, "False", "Requested" if t in _PHASES else "Pending", waiting)
                for t in TYPES
            )
        case DevicesReserved():
            out = _bound(conditions, composition, now, "DevicesReserved")
            out = _paths(out, composition, now, established)
            return _still_pending(out, now, "waiting for its paths to be established")
        case DeviceReplaced(old_device=old, binding=new, reason=why):
            # Still bound (no transition), to what the repair left it, and saying so: a repair
            # and the activation after it come in one batch, which the bucket shows as one value.
            said = f"{new.device} replaced {old}" + (f": {why}" if why else "")
            out = _bound(conditions, composition, now, "DeviceReplaced", said)
            return _still_impaired(out, composition, now)
        case PathRerouted(device=device, reason=why):
            said = f"{device} rerouted" + (f": {why}" if why else "")
            out = _paths(conditions, composition, now, established, "PathRerouted", said)
            return _still_impaired(out, composition, now)
        case PathEstablished():
            return _paths(conditions, composition, now, established)
        case CompositionActivated():
            out = _with(conditions, now, "Ready", "True", "Activated", "active")
            impaired = _get(out, "Impaired")
            if impaired.status == "True":
                usable = "every path is usable again" + (
                    f" ({'; '.join(mended)})" if mended else ""
                )
                out = _with(out, now, "Impaired", "False", "Repaired", usable)
            elif impaired.reason == "Pending":
                out = _with(out, now, "Impaired", "False", "PathsUsable", "every path is usable")
            if _get(out, "Failed").reason == "Pending":
                out = _with(out, now, "Failed", "False", "Established", "the fabric established it")
            return out
        case CompositionImpaired(reason=why):
            parts = list(composition.impaired_by)
            message = why or f"{', '.join(parts)} unusable"
            out = _with(conditions, now, "Impaired", "True", "ComponentUnusable", message, parts)
            return _with(out, now, "Ready", "False", "Impaired", message)
        case LeaseExpired():
            return _with(conditions, now, "Ready", "False", "LeaseExpired", "its lease ran out")
        case CompositionReleased(reason=why):
            expired = _get(conditions, "Ready").reason == "LeaseExpired"
            reason = "LeaseExpired" if expired else "Released"
            out = _with(conditions, now, "Ready", "False", reason, why or "released")
            return _let_go(out, now, "Released")
        case CompositionFailed(reason=why):
            missing = [b.device for b in composition.bindings if b.device not in established]
            message = why or "the fabric could not establish it"
            out = _with(conditions, now, "Failed", "True", "CompositionFailed", message, missing)
            out = _with(out, now, "Ready", "False", "Failed", message)
            return _let_go(out, now, "Failed")
        case _:
            return conditions


_PHASES = ("Bound", "PathEstablished")


def _still_impaired(conditions: Conditions, composition: Composition, now: _Stamp) -> Conditions:
    """After a move that mended some of its paths but not all: Impaired names only what still
    lies on them, as the state's `impaired_by` does (all mended: the activation says so)."""
    impaired = _get(conditions, "Impaired")
    parts = list(composition.impaired_by)
    if impaired.status != "True" or not parts or impaired.components == parts:
        return conditions
    message = f"{', '.join(parts)} unusable"
    return _with(conditions, now, "Impaired", "True", "ComponentUnusable", message, parts)


def _bound(
    conditions: Conditions,
    composition: Composition,
    now: _Stamp,
    reason: str,
    said: str = "",
) -> Conditions:
    devices = ", ".join(b.device for b in composition.bindings)
    count = len(composition.bindings)
    message = f"{count} device{'s' * (count != 1)} reserved: {devices}"
    return _with(
        conditions, now, "Bound", "True", reason, f"{message} ({said})" if said else message
    )


def _paths(
    conditions: Conditions,
    composition: Composition,
    now: _Stamp,
    established: frozenset[str],
    reason: str = "",
    said: str = "",
) -> Conditions:
    """PathEstablished as the fabric holds the paths now: how far it got, or all of them
    (`reason`, and `said` beside the message, when a repair put them there)."""
    done, count = len(established), len(composition.bindings)
    if done < count:
        message = f"{done} of {count} path{'s' * (count != 1)} established"
        return _with(conditions, now, "PathEstablished", "False", "Establishing", message)
    message = "the fabric holds its path" if count == 1 else f"the fabric holds all {count} paths"
    message = f"{message} ({said})" if said else message
    return _with(conditions, now, "PathEstablished", "True", reason or "PathsEstablished", message)


def _let_go(conditions: Conditions, now: _Stamp, reason: str) -> Conditions:
    """An ended composition holds no device and no path: the phases go False."""
    out = _with(conditions, now, "Bound", "False", reason, "its devices went back to the pool")
    return _with(out, now, "PathEstablished", "False", reason, "its paths were taken down")


def _still_pending(conditions: Conditions, now: _Stamp, message: str) -> Conditions:
    """The conditions still `Pending` since the request, told what they wait for now."""
    for type in TYPES:
        if _get(conditions, type).reason == "Pending":
            conditions = _with(conditions, now, type, "False", "Pending", message)
    return conditions


class _Stamp(msgspec.Struct, frozen=True):
    time: str
    position: int

    def set(
        self,
        old: Condition | None,
        type: ConditionType,
        status: ConditionStatus,
        reason: str,
        message: str,
        components: list[str] | None = None,
    ) -> Condition:
        """`old` with these fields; a new transition time only when the status changes."""
        time, position = self.time, self.position
        if old is not None and old.status == status:
            time, position = old.last_transition_time, old.observed_position
        return Condition(
            type=type,
            status=status,
            reason=reason,
            message=message,
            last_transition_time=time,
            observed_position=position,
            components=components if components is not None else [],
        )


def _get(conditions: Conditions, type: ConditionType) -> Condition:
    return conditions[TYPES.index(type)]


def _with(
    conditions: Conditions,
    now: _Stamp,
    type: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str,
    components: list[str] | None = None,
) -> Conditions:
    index = TYPES.index(type)
    updated = now.set(conditions[index], type, status, reason, message, components)
    if updated == conditions[index]:
        return conditions
    return (*conditions[:index], updated, *conditions[index + 1 :])
