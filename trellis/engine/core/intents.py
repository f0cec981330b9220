"""Intents: the commands clients send (ARCHITECTURE §3-4), one Struct per verb.

The verb travels in the NATS subject, not in the body, so bodies carry no tag; `INTENTS` maps
each (family, verb) to its Struct and `decode_intent` is the single strict decoder.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec

from trellis.engine.core.actors import is_reserved
from trellis.engine.core.ids import (
    COMPONENT_REF_PATTERN,
    ID_PATTERN,
    PLAIN_TEXT,
    ComponentRef,
    Id,
    Labels,
    RequestId,
    Text,
)
from trellis.engine.core.model import (
    INT64_MAX,
    DeviceKind,
    LinkSpec,
    Name,
    NodeSpec,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
)

# Validation happens here, once: every body is decoded into its Struct, whose field types bound
# every id, number, string, list and map (engine.core.ids, engine.core.model); nesting cannot go
# deeper than the Structs, as no field takes arbitrary JSON. Decide only ever sees what passed.
MAX_BODY_BYTES = 1024 * 1024
# Above what a body of MAX_BODY_BYTES can carry; stated so the bound is the contract's.
MAX_TOPOLOGY_ITEMS = 100_000
# An import larger than one body is sent in parts (ImportTopology.upload): at most this many,
# and a domain of at most MAX_DOMAIN_ITEMS nodes and as many links (ARCHITECTURE §10, Size:
# 65,536 devices and their hosts, switches and cables, with room to spare).
MAX_UPLOAD_PARTS = 1024
MAX_DOMAIN_ITEMS = 1_048_576

Family = Literal["intent", "admin", "query"]


# A lease of up to 100 years: long enough for anything, short enough to stay on the calendar.
# A past moment: an ISO time with its zone, or a log position.
PointInTime = Annotated[datetime, msgspec.Meta(tz=True)] | NonNegInt
LEASE_SECONDS_RANGE = (1, 100 * 365 * 24 * 3600)  # a second to a hundred years
LeaseSeconds = Annotated[int, msgspec.Meta(ge=LEASE_SECONDS_RANGE[0], le=LEASE_SECONDS_RANGE[1])]


class Intent(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every intent carries a request_id; resending it returns the first answer."""

    request_id: RequestId


# ---- topology administration (trellis.admin.<domain>.<verb>) ----


class Upload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which part of an import in parts a body is: one import sent as `parts` bodies under one
    request_id, decided once, whole, when the last has arrived (docs/architecture.md, Size)."""

    part: Annotated[int, msgspec.Meta(ge=1, le=MAX_UPLOAD_PARTS)]
    parts: Annotated[int, msgspec.Meta(ge=1, le=MAX_UPLOAD_PARTS)]


class ImportTopology(Intent):
    nodes: Annotated[list[NodeSpec], msgspec.Meta(max_length=MAX_TOPOLOGY_ITEMS)] = []
    links: Annotated[list[LinkSpec], msgspec.Meta(max_length=MAX_TOPOLOGY_ITEMS)] = []
    reason: Text = ""
    # A part of an import too large for one body; absent: the whole import in this one.
    upload: Upload | None = None


class AddNode(Intent):
    node: NodeSpec
    reason: Text = ""


class AddLink(Intent):
    link: LinkSpec
    reason: Text = ""


class Remove(Intent):
    id: Id
    reason: Text = ""


class Drain(Intent):
    id: ComponentRef  # an OCS port (`ocs-1:3`) drains the cable on it
    reason: Text = ""
    force: bool = False


class Undrain(Intent):
    id: ComponentRef
    reason: Text = ""


class ReportFault(Intent):
    component: ComponentRef  # an OCS port (`ocs-1:3`) is recorded on the cable on it
    state: Literal["failed", "degraded", "healthy"]
    detail: Text = ""


# ---- quotas (trellis.admin.<domain>.<verb>; engine.core.quotas) ----


class SetQuota(Intent):
    """The tenant's whole quota for one device kind in this domain: each limit given holds, a
    limit left out is no limit. `count` counts devices (memory: slices); `capacity_gib` is
    memory's GiB."""

    tenant: Id
    kind: DeviceKind
    count: NonNegInt | None = None
    capacity_gib: NonNegFloat | None = None
    reason: Text = ""

    def __post_init__(self) -> None:
        # msgspec turns ValueError here into a ValidationError: `invalid` at the boundary.
        _check_quota_tenant(self.tenant)
        if self.count is None and self.capacity_gib is None:
            raise ValueError("give `count`, `capacity_gib` or both (clear-quota removes a quota)")
        if self.capacity_gib is not None and self.kind != "memory":
            raise ValueError(f"`capacity_gib` limits memory only; a {self.kind} quota is a `count`")


class ClearQuota(Intent):
    """The tenant has no quota for that kind any more (no limit)."""

    tenant: Id
    kind: DeviceKind
    reason: Text = ""

    def __post_init__(self) -> None:
        _check_quota_tenant(self.tenant)


def _check_quota_tenant(tenant: str) -> None:
    if is_reserved(tenant):
        raise ValueError(f"{tenant!r} is reserved for Trellis's internal actors, not a tenant")


# ---- checkpoints (trellis.admin.<domain>.checkpoint; engine/core/checkpoints.py) ----


class RecordCheckpoint(Intent):
    """Sign and record a checkpoint of the domain's log at its head now, and publish it on
    `<prefix>.checkpoints.<domain>` (the engine also does so every N events). Making one twice
    at the same head gives the same checkpoint."""


# ---- compositions (trellis.intent.<domain>.<tenant>.<verb>) ----


MAX_DEVICES = 4096  # per `devices` entry, and named in `device_ids`
MAX_DEVICE_REQUESTS = 64  # `devices` entries in one compose or manifest


class DeviceRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: DeviceKind
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_DEVICES)] = 1
    models: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    min_generation: NonNegInt | None = None
    min_memory_gib: NonNegFloat | None = None
    capacity_gib: PositiveFloat | None = None
    bandwidth_gbps: NonNegFloat = 0.0


class Constraints(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_hops: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)] | None = None
    max_latency_ns: NonNegInt | None = None
    isolation: Literal["shared", "exclusive"] = "shared"
    labels: Labels = {}


class HostSelector(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    labels: Labels = {}


class Compose(Intent):
    host: Id | None = None
    host_selector: HostSelector | None = None
    devices: Annotated[list[DeviceRequest], msgspec.Meta(max_length=MAX_DEVICE_REQUESTS)] = []
    device_ids: Annotated[list[Id], msgspec.Meta(max_length=MAX_DEVICES)] = []
    constraints: Constraints = Constraints()
    lease_seconds: LeaseSeconds | None = None
    labels: Labels = {}
    reason: Text = ""


class Release(Intent):
    composition_id: Id
    reason: Text = ""


class Extend(Intent):
    composition_id: Id
    lease_seconds: LeaseSeconds


class ExpireLeases(Intent):
    """Internal: end every composition whose lease fell due (the engine's own timer sends it,
    deriving the due leases from state, so expiry survives restarts). No subject carries it."""


class EstablishComposition(Intent):
    """Internal: the fabric now holds every circuit and binding of a pending composition.
    Sent by the fabric saga under the request id `settle_request_id(composition_id)`."""

    composition_id: Id


class FailComposition(Intent):
    """Internal: the fabric could not program a pending composition (an error or the saga's
    deadline); what it had programmed is undone. Shares the request id of EstablishComposition,
    so a composition is settled once, one way."""

    composition_id: Id
    step: Text  # the fabric operation that failed, e.g. "bind"
    target: Text = ""  # what it was programming: a device, or "<ocs>:<a>-<b>"
    component: Text = ""  # the part the fabric blamed, when it named one
    error: Text = ""


# ---- reservations (trellis.intent.<domain>.<tenant>.<verb>; engine/core/reservations.py) ----


#: How long a reservation holds its devices when `reserve` names no `duration_seconds` (the
#: default `ReservationDuration` of Redfish's CompositionService, ARCHITECTURE §11).
RESERVATION_SECONDS = 300


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a compose asks for, without its request_id: the body of `compose` as a value, so
    `preview`, `reserve` and `apply` carry the same request a compose does (section 4)."""

    host: Id | None = None
    host_selector: HostSelector | None = None
    devices: Annotated[list[DeviceRequest], msgspec.Meta(max_length=MAX_DEVICE_REQUESTS)] = []
    device_ids: Annotated[list[Id], msgspec.Meta(max_length=MAX_DEVICES)] = []
    constraints: Constraints = Constraints()
    lease_seconds: LeaseSeconds | None = None
    labels: Labels = {}
    reason: Text = ""

    def compose(self, request_id: str) -> Compose:
        """The compose this manifest asks for, under `request_id`."""
        return Compose(request_id=request_id, **msgspec.structs.asdict(self))


class Reserve(Intent):
    """Hold the devices a compose of `manifest` would take (and a memory slice's GiB) for
    `duration_seconds`; nobody else may take them meanwhile. `apply` composes them."""

    manifest: Manifest
    duration_seconds: LeaseSeconds = RESERVATION_SECONDS


class Apply(Intent):
    """Compose: from a reservation of the tenant (its devices, its manifest), or directly from
    a manifest (as `compose` does). Exactly one of the two."""

    reservation_id: Id | None = None
    manifest: Manifest | None = None

    def __post_init__(self) -> None:
        if (self.reservation_id is None) == (self.manifest is None):
            raise ValueError("give exactly one of `reservation_id` and `manifest`")


class CancelReservation(Intent):
    """Give the reservation's devices back before it expires."""

    reservation_id: Id
    reason: Text = ""


class ExpireReservations(Intent):
    """Internal: end every reservation whose time is up (the engine's own timer sends it,
    deriving the due ones from state, as ExpireLeases). No subject carries it."""


def reservation_expiry_request_id(reservation_ids: Iterable[str]) -> str:
    """Named by the reservations it ends, so a resend after a crash replays, not re-decides."""
    digest = hashlib.sha256(",".join(sorted(reservation_ids)).encode()).hexdigest()[:24]
    return f"reservation-expiry-{digest}"


def settle_request_id(composition_id: str) -> str:
    return f"settle-{composition_id}"


def lease_expiry_request_id(composition_ids: Iterable[str]) -> str:
    """Named by the compositions it ends, so a resend after a crash replays, not re-decides."""
    digest = hashlib.sha256(",".join(sorted(composition_ids)).encode()).hexdigest()[:24]
    return f"lease-expiry-{digest}"


# ---- read-only queries (trellis.query.<domain>.<what>); no request_id needed ----


class Query(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Queries change nothing, so they carry no request_id.

    Every query may name a past moment, `at` (an ISO time or a log position), and is then
    answered as it would have been at the last event recorded at or before it. `min_position`
    asks the answer to include at least that log position (read your own writes)."""

    at: PointInTime | None = None
    min_position: NonNegInt | None = None

    def __post_init__(self) -> None:
        if isinstance(self.at, datetime):
            _in_utc_range(self.at, "at")


class PagedQuery(Query):
    """A query whose answer can be larger than one message: it comes in pages
    (engine/core/paging.py).
    `offset`: how many items of the answer's lists (in their order) the asker has already; an
    answer with `next` has more, asked for with `offset: next` and the first page's position
    as `at`, so every page is of the same moment."""

    offset: NonNegInt = 0


class TopologyQuery(PagedQuery):
    pass


class CompositionQuery(Query):
    id: Id


class ConnectionsQuery(PagedQuery):
    host: Id | None = None
    tenant: Id | None = None
    device: Id | None = None


class WhyQuery(Query):
    id: Id


class FreeQuery(PagedQuery):
    kind: DeviceKind | None = None


class PreviewQuery(Query):
    """What a compose of `manifest` would take now, written nowhere. `tenant`: whose compose
    (isolation, quota); a tenant's view previews as that tenant, the operator's query as the
    operator unless it names one."""

    manifest: Manifest
    tenant: Id | None = None


class ReservationsQuery(Query):
    """The live reservations, of `tenant` (a view: the asking tenant's own) and `id`."""

    tenant: Id | None = None
    id: Id | None = None


class BlastRadiusQuery(Query):
    id: ComponentRef


class QuotasQuery(Query):
    tenant: Id | None = None
    kind: DeviceKind | None = None


class FabricQuery(Query):
    """What the domain's hardware holds and how it differs from the log
    (engine/service/fabric_report.py); an operator's query, with no tenant view. The hardware keeps
    no history, so it answers for now only: a past moment (`at`) is refused."""

    def __post_init__(self) -> None:
        if self.at is not None:
            raise ValueError(
                "the fabric query answers for now only: the hardware keeps no history "
                "(`topology` and `connections` take `at`)"
            )


# A tree size (number of events): at least one, since no checkpoint is of an empty log.
TreeSize = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]


class ProofQuery(Query):
    """An RFC 9162 inclusion proof of an event in the domain's tree of `size` leaves (default:
    the latest checkpoint's size)."""

    event_id: uuid.UUID
    size: TreeSize | None = None


class ConsistencyQuery(Query):
    """An RFC 9162 consistency proof: the tree of `from_size` leaves is a prefix of the tree of
    `to_size`."""

    from_size: TreeSize
    to_size: TreeSize


class CheckpointKeyQuery(Query):
    """The C2SP note verifier key of the deployment's checkpoint signer."""


# RFC 3339 with an offset: a time without one names no moment.
Moment = Annotated[datetime, msgspec.Meta(tz=True)]


def _in_utc_range(moment: datetime, name: str) -> None:
    """Refuse a moment whose offset takes it out of the years a datetime holds (0001-01-01
    at +14:00 is in year 0 in UTC): the log, kept in UTC, could not be asked about it, and
    the store's error came back as `unavailable`."""
    try:
        moment.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"`{name}` is outside the years 1 to 9999 in UTC") from None


class HistoryQuery(PagedQuery):
    """Who held which device when: the intervals of `id` (a device, host or composition) and
    `tenant` that overlap [since, until] (either end open when left out)."""

    id: Id | None = None
    tenant: Id | None = None
    since: Moment | None = None
    until: Moment | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("since", "until"):
            if (moment := getattr(self, name)) is not None:
                _in_utc_range(moment, name)
        if self.since is not None and self.until is not None and self.since > self.until:
            raise ValueError("`since` is after `until`")


INTENTS: dict[tuple[Family, str], type[Intent] | type[Query]] = {
    ("intent", "compose"): Compose,
    ("intent", "release"): Release,
    ("intent", "extend"): Extend,
    ("intent", "reserve"): Reserve,
    ("intent", "apply"): Apply,
    ("intent", "cancel-reservation"): CancelReservation,
    ("admin", "import-topology"): ImportTopology,
    ("admin", "add-node"): AddNode,
    ("admin", "add-link"): AddLink,
    ("admin", "remove"): Remove,
    ("admin", "drain"): Drain,
    ("admin", "undrain"): Undrain,
    ("admin", "report-fault"): ReportFault,
    ("admin", "set-quota"): SetQuota,
    ("admin", "clear-quota"): ClearQuota,
    ("admin", "checkpoint"): RecordCheckpoint,
    ("query", "topology"): TopologyQuery,
    ("query", "composition"): CompositionQuery,
    ("query", "connections"): ConnectionsQuery,
    ("query", "why"): WhyQuery,
    ("query", "free"): FreeQuery,
    ("query", "blast-radius"): BlastRadiusQuery,
    ("query", "quotas"): QuotasQuery,
    ("query", "fabric"): FabricQuery,
    ("query", "proof"): ProofQuery,
    ("query", "consistency"): ConsistencyQuery,
    ("query", "checkpoint-key"): CheckpointKeyQuery,
    ("query", "history"): HistoryQuery,
    ("query", "preview"): PreviewQuery,
    ("query", "reservations"): ReservationsQuery,
}

_DECODERS: dict[tuple[Family, str], msgspec.json.Decoder[Intent | Query]] = {
    key: msgspec.json.Decoder(cls) for key, cls in INTENTS.items()
}


class InvalidIntent(ValueError):
    """The body could not be decoded into the verb's Struct; the message says why."""


def decode_intent(family: Family, verb: str, body: bytes) -> Intent | Query:
    """Decode a request body strictly into the Struct for `family`/`verb`: an Intent (it
    carries a request_id) for the `intent` and `admin` families, a Query for `query`.

    Raises:
        InvalidIntent: unknown verb, body too large, malformed JSON, unknown fields, wrong types
            or ids outside the allowed alphabet.
    """
    decoder = _DECODERS.get((family, verb))
    if decoder is None:
        known = sorted(v for f, v in INTENTS if f == family)
        raise InvalidIntent(f"unknown {family} verb {verb!r}; expected one of {', '.join(known)}")
    if len(body) > MAX_BODY_BYTES:
        raise InvalidIntent(f"body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    if family == "query" and not body.strip():
        body = b"{}"  # an empty query body means "no filters"
    try:
        decoded = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidIntent(f"invalid {verb} body: {_readable(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise InvalidIntent(f"{verb} body is not valid JSON: {_not_json(body, exc)}") from None
    twice = _named_twice(body)
    if twice is not None:
        raise InvalidIntent(f"invalid {verb} body: {twice!r} is named twice in one object")
    return decoded


def _not_json(body: bytes, exc: msgspec.DecodeError) -> str:
    """Why `body` is not JSON: msgspec's reason, unless the body is JSON but for a lone
    surrogate escape (`\\ud800`, no character), which msgspec calls truncated or an unexpected
    end (Python's json takes lone surrogates, and little else msgspec refuses)."""
    if _SURROGATE.search(body):
        try:
            json.loads(body, parse_constant=_no_constant)
        except ValueError:
            return str(exc)
        return "a \\u escape is a lone surrogate, which stands for no character"
    return str(exc)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class _Twice(Exception):
    """A key an object names twice (its argument)."""


def _refuse_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    named = dict(pairs)
    if len(named) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Twice(key)
            seen.add(key)
    return named


def _named_twice(body: bytes) -> str | None:
    """A key an object of `body` names twice, if any. msgspec keeps the last one silently;
    a gateway that kept the first would then see another intent than the engine decided
    (RFC 8259 leaves it open, I-JSON forbids it). About 8 µs for a compose's body."""
    try:
        json.loads(body, object_pairs_hook=_refuse_twice)
    except _Twice as twice:
        return str(twice)
    return None


_PATTERN_WORDS = {
    f"Expected `str` matching regex {ID_PATTERN!r}": (
        "Expected an id (1-64 letters, digits, '_' or '-')"
    ),
    f"Expected `str` matching regex {COMPONENT_REF_PATTERN!r}": (
        "Expected an id (1-64 letters, digits, '_' or '-'), or `<ocs id>:<port>` for one port"
    ),
    f"Expected `str` matching regex {PLAIN_TEXT!r}": (
        "Expected text without control or bidirectional-control characters"
    ),
}


def _readable(message: str) -> str:
    """Say what our id and text patterns mean instead of quoting the regex."""
    for regex, words in _PATTERN_WORDS.items():
        message = message.replace(regex, words)
    return message
