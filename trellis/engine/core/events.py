"""Events: immutable facts in the log (ARCHITECTURE §6), a tagged union keyed by `type`.

Stored events are contracts forever: add fields only, with defaults; never rename or retype.
A change that cannot be additive bumps `SCHEMA_VERSIONS[type]` and adds an upcaster in
`engine.core.upcast`, so old payloads stay readable.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import msgspec

from trellis.engine.core.ids import Id
from trellis.engine.core.intents import Compose
from trellis.engine.core.model import LinkSpec, Name, NodeSpec, NonNegFloat


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    """Base of every event; the class name is the `type` tag."""


# ---- topology ----


class TopologyImported(Event):
    """The domain's topology now equals this document; added/updated/removed say what moved.

    An import too large for one message of the event stream is recorded as `parts` events of
    one batch, numbered `part` 1..`parts`, each with its share of the nodes, links and of the
    added/updated/removed ids: together they are one import, and the topology equals their
    document once the last part is folded (ARCHITECTURE §6; docs/architecture.md, "Size").
    Events recorded before parts existed are whole: part 1 of 1."""

    nodes: list[NodeSpec]
    links: list[LinkSpec]
    added: list[str] = []
    updated: list[str] = []
    removed: list[str] = []
    reason: str = ""
    part: int = 1
    parts: int = 1


class NodeAdded(Event):
    node: NodeSpec
    reason: str = ""


class LinkAdded(Event):
    link: LinkSpec
    reason: str = ""


class ComponentRemoved(Event):
    """A node or link left the fabric; removing a node also removes the `links` attached to it."""

    component: str
    kind: Literal["node", "link"]
    links: list[str] = []
    reason: str = ""


class ComponentDrained(Event):
    component: str
    reason: str = ""


class ComponentUndrained(Event):
    component: str
    reason: str = ""


class ComponentFaulted(Event):
    component: str
    state: Literal["failed", "degraded"]
    detail: str = ""


class ComponentRecovered(Event):
    component: str
    detail: str = ""


# ---- quotas ----


class QuotaSet(Event):
    """The tenant's quota for one device kind is now this (None: no limit on that measure)."""

    tenant: Id
    kind: str
    count: int | None = None
    capacity_gib: float | None = None
    reason: str = ""


class QuotaCleared(Event):
    """The tenant has no quota for that device kind any more."""

    tenant: Id
    kind: str
    reason: str = ""


# ---- compositions ----


class CircuitRef(msgspec.Struct, frozen=True, kw_only=True):
    """A cross-connect inside an OCS between two of its ports (a_port < b_port)."""

    ocs: str
    a_port: int
    b_port: int


class DeviceBinding(msgspec.Struct, frozen=True, kw_only=True):
    """One device reached over one reserved path.

    `path` is node ids, host first; `links` the cables in path order; `circuits` the OCS
    cross-connects the path passes. Memory devices carry the slice in `capacity_gib`.

    Schema version 2 (of DevicesReserved, PathRerouted and DeviceReplaced, the events that
    carry a binding): `model` and `cost_per_hour` are the device's as the topology described
    it when the binding was made, so the event alone says what was taken and at what price
    (a later re-import may change the price; a bill charges the one agreed). Both keys are
    required from v2 on (null: the device has none). Version 1 bindings lacked them;
    `engine.core.upcast` lifts those with nulls, which readers treat as "not recorded: take the
    topology in force at that position" (projections/history.py does).
    """

    device: str
    kind: str
    model: Name | None
    cost_per_hour: NonNegFloat | None
    path: list[str]
    links: list[str]
    circuits: list[CircuitRef] = []
    hops: int
    latency_ns: int
    bandwidth_gbps: float = 0.0
    capacity_gib: float | None = None
    entry: int = -1  # index into the request's `devices`; -1: named in `device_ids`


class CompositionRequested(Event):
    composition_id: Id
    tenant: Id
    host: str
    request: Compose
    requested_at: datetime
    expires_at: datetime | None = None


class CompositionRejected(Event):
    tenant: Id
    code: str
    message: str
    details: dict[str, Any] = {}
    request: Compose | None = None


class CircuitCreated(Event):
    ocs: str
    a_port: int
    b_port: int
    host: str
    composition_id: str = ""


class DevicesReserved(Event):
    composition_id: Id
    devices: list[DeviceBinding]


class CircuitRemoved(Event):
    ocs: str
    a_port: int
    b_port: int
    host: str
    reason: str = ""
    composition_id: str = ""  # the composition whose release left the circuit unused


class PathEstablished(Event):
    composition_id: Id
    device: str
    path: list[str]


class CompositionActivated(Event):
    composition_id: Id


class CompositionImpaired(Event):
    composition_id: Id
    component: str
    reason: str = ""


class PathRerouted(Event):
    composition_id: Id
    device: str
    old_path: list[str]
    binding: DeviceBinding
    reason: str = ""


class DeviceReplaced(Event):
    composition_id: Id
    old_device: str
    binding: DeviceBinding
    reason: str = ""


class LeaseExtended(Event):
    composition_id: Id
    expires_at: datetime


class LeaseExpired(Event):
    composition_id: Id


class CompositionReleased(Event):
    """The composition is gone; every reservation it held returns to the pool."""

    composition_id: Id
    reason: str = ""


class CompositionFailed(Event):
    """The composition could not be established; every reservation it held is returned."""

    composition_id: Id
    reason: str = ""


# ---- reservations (engine/core/reservations.py) ----


class ReservationMade(Event):
    """The tenant holds these devices (a memory slice: its GiB of the pool) until `expires_at`:
    no one else may compose or reserve them. `devices` are the bindings a compose of `request`
    chose when it was made (paths included, as a preview shows them); the reservation holds the
    devices and slices only, not the paths' bandwidth or circuits, which `apply` places again."""

    reservation_id: Id
    tenant: Id
    host: str
    request: Compose
    devices: list[DeviceBinding]
    made_at: datetime
    expires_at: datetime


class ReservationApplied(Event):
    """The reservation became composition `composition_id` (recorded right before its
    CompositionRequested): what it held passes to the composition."""

    reservation_id: Id
    composition_id: Id


class ReservationCancelled(Event):
    """The tenant gave the reservation's devices back."""

    reservation_id: Id
    reason: str = ""


class ReservationExpired(Event):
    """The reservation's time ran out unapplied; its devices are free again."""

    reservation_id: Id


AnyEvent = (
    TopologyImported
    | NodeAdded
    | LinkAdded
    | ComponentRemoved
    | ComponentDrained
    | ComponentUndrained
    | ComponentFaulted
    | ComponentRecovered
    | QuotaSet
    | QuotaCleared
    | CompositionRequested
    | CompositionRejected
    | DevicesReserved
    | CircuitCreated
    | CircuitRemoved
    | PathEstablished
    | CompositionActivated
    | CompositionImpaired
    | PathRerouted
    | DeviceReplaced
    | LeaseExtended
    | LeaseExpired
    | CompositionReleased
    | CompositionFailed
    | ReservationMade
    | ReservationApplied
    | ReservationCancelled
    | ReservationExpired
)

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in AnyEvent.__args__}  # type: ignore[attr-defined]

# Current schema version of each event type's payload; bump together with an upcaster.
SCHEMA_VERSIONS: dict[str, int] = {
    **dict.fromkeys(EVENT_TYPES, 1),
    # v2: every DeviceBinding records the device's model and cost_per_hour (see DeviceBinding).
    "DevicesReserved": 2,
    "PathRerouted": 2,
    "DeviceReplaced": 2,
}

decode_event = msgspec.json.Decoder(AnyEvent).decode
encode = msgspec.json.Encoder().encode

# Every event must fit one message of the event stream, whose server refuses a message larger
# than its max_payload (NATS's default: 1 MiB), envelope and headers included. An event that
# would be larger is refused before commit (`invalid`; engine/service/writer.py), except an import,
# which is recorded in parts of at most PART_BYTES each (TopologyImported.part).
MAX_EVENT_BYTES = 900_000
PART_BYTES = 512 * 1024
