"""Results: the `result` of every ok reply (ARCHITECTURE §3-4, §6), one Struct per shape.

Beside intents.py (what is asked) and events.py (what happened), this is the third part of the
wire contract in code. The engine, the projections and the audit trail build their answers as
these Structs and msgspec encodes them, so what is sent is what they say; engine/core/contract.py
names each subject's (`RESULTS`) and generates replies.schema.json from them. (The `fabric`
query's, `FabricReport`, lives with its answer in engine/service/fabric_report.py: it holds the
fabric driver's types, and ports.py, which defines them, imports this module.)

Replies may gain fields (the contract adds, never removes), so no result forbids fields it
does not name (a client validating with the schema keeps working when one is added); only a
compose's `constraints`, echoed as they were asked, keep the intent's closed schema. A field
that is sometimes left out, rather than null, is `UNSET` by default. Times the engine renders
itself are RFC 3339 text in UTC (`Time`), as are the datetimes msgspec encodes (`Moment`:
always with a zone).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from trellis.engine.core.fabric import FabricBinding, FabricCircuit
from trellis.engine.core.fabric_plan import Reconciliation
from trellis.engine.core.intents import Constraints, Moment
from trellis.engine.core.model import Health, LinkSpec, NodeSpec
from trellis.engine.core.state import CompositionState, Quota

Time = Annotated[str, msgspec.Meta(extra_json_schema={"format": "date-time"})]
Base64 = Annotated[str, msgspec.Meta(extra_json_schema={"contentEncoding": "base64"})]


# ---- compositions (trellis.intent.<domain>.<tenant>.<verb>) ----


class ComposedDevice(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    kind: str
    path: list[str]  # node ids, host first
    hops: int
    latency_ns: int
    bandwidth_gbps: float
    capacity_gib: float | None = None  # a memory slice; null for whole devices


class ComposeResult(msgspec.Struct, frozen=True, kw_only=True):
    composition_id: str
    host: str
    state: CompositionState
    expires_at: Moment | None  # null without a lease
    devices: list[ComposedDevice]


class ReleaseResult(msgspec.Struct, frozen=True, kw_only=True):
    composition_id: str
    state: CompositionState
    devices: list[str]
    circuits_removed: list[str]


class ExtendResult(msgspec.Struct, frozen=True, kw_only=True):
    composition_id: str
    expires_at: Moment


# ---- reservations (intent reserve / apply / cancel-reservation; query preview, reservations) ----


class PreviewResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a compose would take now (nothing is held): the host, each device with the path it
    would get, and the OCS circuits it would create (`<ocs>:<a>-<b>`)."""

    host: str
    devices: list[ComposedDevice]
    circuits: list[str]


class ReservationResult(msgspec.Struct, frozen=True, kw_only=True):
    """A live reservation: the devices it holds (with the paths chosen when it was made) until
    `expires_at`, and the manifest `apply` composes."""

    reservation_id: str
    tenant: str
    host: str
    state: Literal["held"]
    made_at: Moment
    expires_at: Moment
    devices: list[ComposedDevice]
    request_id: str  # the reserve's
    labels: dict[str, str]
    reason: str
    lease_seconds: int | None  # the lease the composition gets when applied


class ReservationsResult(msgspec.Struct, frozen=True, kw_only=True):
    reservations: list[ReservationResult]


class CancelReservationResult(msgspec.Struct, frozen=True, kw_only=True):
    reservation_id: str
    state: Literal["cancelled"]
    devices: list[str]  # what it gave back


# ---- topology administration (trellis.admin.<domain>.<verb>) ----


class UploadProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How much of an import in parts has arrived (the answer to each part but the last)."""

    part: int  # the one just received
    parts: int
    received: int  # parts received so far


class ImportResult(msgspec.Struct, frozen=True, kw_only=True):
    """What an import changed. The lists name at most MAX_LISTED ids each (an answer must fit
    one message); the counts are whole. To a part of an import in parts but its last, the
    answer is `upload`, what has arrived: nothing is decided or recorded yet."""

    domain: str
    unchanged: bool
    nodes: int
    links: int
    added: list[str] = []
    updated: list[str] = []
    removed: list[str] = []
    added_count: int = 0
    updated_count: int = 0
    removed_count: int = 0
    upload: UploadProgress | UnsetType = UNSET


#: Ids an import's answer lists per change (its counts are whole): 1,000 ids fit a message.
MAX_LISTED = 1000


class Moved(msgspec.Struct, frozen=True, kw_only=True):
    """A device of a composition the change moved off the component: onto another device
    (`to`, DeviceReplaced) or over another path (`to` is the device itself, PathRerouted)."""

    composition_id: str
    device: str
    to: str
    path: list[str]  # the path it has now, node ids
    links: list[str]  # its cables, in path order: a reroute may keep the nodes and change these


class ComponentResult(msgspec.Struct, frozen=True, kw_only=True):
    """add-node, add-link, remove, drain, undrain and report-fault."""

    component: str  # as asked: a node or link id, or an OCS port ("ocs-1:3")
    changed: bool
    link: str | None = None  # the cable an OCS port resolved to (the link that got the mark)
    health: Health = "healthy"
    drained: bool = False
    removed: list[str] = []
    impaired: list[str] = []  # compositions this change left impaired
    compositions: list[str] = []  # compositions this change impaired, moved or mended
    moved: list[Moved] = []  # what it moved, in the order the log records it


# ---- quotas (admin set-quota / clear-quota, query quotas) ----


class Usage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How much of a kind, as the wire shows it: GiB for memory only."""

    count: int
    capacity_gib: float | None = None


class QuotaRow(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant and kind: its quota (None: none) and what it holds."""

    tenant: str
    kind: str
    limit: Quota | None
    held: Usage
    over: bool  # holds more than the quota allows (it was lowered): new composes are refused


class QuotaResult(QuotaRow, frozen=True, kw_only=True):
    changed: bool  # False: the quota already was this; nothing recorded


class QuotasResult(msgspec.Struct, frozen=True, kw_only=True):
    quotas: list[QuotaRow]


# ---- the fabric (query topology, free, blast-radius) ----


class TopologyNode(NodeSpec, kw_only=True, forbid_unknown_fields=False):
    """A node as imported, with its marks (`detail` only when a report gave one)."""

    health: Health
    drained: bool
    detail: str = ""


class TopologyLink(LinkSpec, kw_only=True, forbid_unknown_fields=False):
    """A link as imported, with its marks and the bandwidth no composition reserves."""

    health: Health
    drained: bool
    detail: str = ""
    free_gbps: float  # 0 when the link is not usable


class TopologyCircuit(msgspec.Struct, frozen=True, kw_only=True):
    ocs: str
    a_port: int
    b_port: int
    host: str  # the host whose compositions own it


class TopologyResult(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[TopologyNode]
    links: list[TopologyLink]
    circuits: list[TopologyCircuit]
    # More items follow (the answer is paged: engine/core/paging.py): ask with `offset: next`.
    next: int | UnsetType = UNSET


class FreeDevice(NodeSpec, kw_only=True, forbid_unknown_fields=False):
    """A usable device nobody holds whole; a memory pool with GiB left says how many."""

    free_gib: float | UnsetType = UNSET


class FreeResult(msgspec.Struct, frozen=True, kw_only=True):
    devices: list[FreeDevice]
    # More items follow (the answer is paged: engine/core/paging.py): ask with `offset: next`.
    next: int | UnsetType = UNSET


class HitComposition(msgspec.Struct, frozen=True, kw_only=True):
    composition_id: str
    tenant: str
    host: str
    state: CompositionState
    devices: list[str]  # those whose paths use the component


class BlastRadiusResult(msgspec.Struct, frozen=True, kw_only=True):
    link: str | UnsetType = UNSET  # asked for an OCS port: the cable on it
    compositions: list[HitComposition]
    tenants: list[str]


# ---- history-bearing queries (composition, connections, why, history) ----


class ChainEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One event of a `chain`."""

    type: str
    position: int
    time: Time
    actor: str
    request_id: str


class Impairment(msgspec.Struct, frozen=True, kw_only=True):
    component: str
    reason: str


class CompositionResult(ComposeResult, frozen=True, kw_only=True):
    """The compose result, plus who asked, why, and the events that made it what it is."""

    tenant: str
    labels: dict[str, str]
    reason: str
    request_id: str
    created_at: Moment
    impaired_by: list[Impairment]
    chain: list[ChainEntry]


class Requested(msgspec.Struct, frozen=True, kw_only=True):
    """The request behind a connection (the `why` of ARCHITECTURE §4). A log that reserves for
    a composition it never requested gives only what the event's envelope knows."""

    request_id: str
    actor: str
    reason: str | UnsetType = UNSET
    labels: dict[str, str] | UnsetType = UNSET
    constraints: Constraints | UnsetType = UNSET
    position: int | UnsetType = UNSET


class Connection(msgspec.Struct, frozen=True, kw_only=True):
    """One connected device."""

    device: str
    host: str
    composition_id: str
    tenant: str
    path: list[str]
    bandwidth_gbps: float
    capacity_gib: float | None
    since: Time
    why: Requested


class ConnectionsResult(msgspec.Struct, frozen=True, kw_only=True):
    connections: list[Connection]
    # More items follow (the answer is paged: engine/core/paging.py): ask with `offset: next`.
    next: int | UnsetType = UNSET


WhyKind = Literal["composition", "device", "host", "switch", "ocs", "link"]


class WhyResult(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    kind: WhyKind
    connected_to: list[Connection]
    chain: list[ChainEntry]
    text: str  # one plain-language sentence


EndReason = Literal["released", "lease_expired", "failed", "replaced"]


class Interval(msgspec.Struct, frozen=True, kw_only=True):
    """One interval a device was bound to a composition (`end` null: it still is)."""

    device: str
    kind: str
    model: str | None
    host: str
    composition_id: str
    tenant: str
    start: Time
    end: Time | None
    end_reason: EndReason | None
    bandwidth_gbps: float
    capacity_gib: float | None
    cost_per_hour: float | None
    start_position: int
    end_position: int | None


class HistoryResult(msgspec.Struct, frozen=True, kw_only=True):
    intervals: list[Interval]
    # More items follow (the answer is paged: engine/core/paging.py): ask with `offset: next`.
    next: int | UnsetType = UNSET


# ---- the audit trail (admin checkpoint; query proof, consistency, checkpoint-key) ----


class CheckpointResult(msgspec.Struct, frozen=True, kw_only=True):
    domain: str
    size: int
    root: Base64
    recorded_at: Time
    note: str  # the C2SP signed note


class ProofResult(msgspec.Struct, frozen=True, kw_only=True):
    """An RFC 9162 inclusion proof."""

    leaf_index: int
    tree_size: int
    root: Base64
    path: list[Base64]
    checkpoint: str | None  # the signed note of that size, when one was recorded


class ConsistencyResult(msgspec.Struct, frozen=True, kw_only=True):
    """An RFC 9162 consistency proof."""

    from_size: int
    to_size: int
    from_root: Base64
    to_root: Base64
    path: list[Base64]


class CheckpointKeyResult(msgspec.Struct, frozen=True, kw_only=True):
    verifier_key: str  # `<name>+<key hash>+<base64 key>`, a C2SP note verifier key


class FabricReport(msgspec.Struct, frozen=True, kw_only=True):
    """The `fabric` query's result.

    `circuits` and `bindings` are what the hardware holds. `differences` lists what would
    bring it in step with the log, in the order the engine would do it: `unbind` and `remove`
    (held, and the log does not say so), `create` and `bind` (the log says so, the hardware
    lacks it), and `pending`, compositions whose compose saga has not settled yet (their
    circuits and bindings are the saga's business, not differences). `in_step` is true when
    the four operation lists are empty. `settling` is true while the engine is still
    programming the domain's fabric (a saga runs or a pass is due): differences seen then may
    be on their way out. `findings` is what the driver saw on the fabric and cannot explain
    (engine.core.fabric.FabricSnapshot), never a difference the engine would change.
    """

    domain: str
    circuits: list[FabricCircuit]
    bindings: list[FabricBinding]
    in_step: bool
    settling: bool
    differences: Reconciliation
    findings: list[str] = []
