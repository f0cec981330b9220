"""An outside auditor's check of a Trellis log, its stream and what clients were told.

Written against the published contract only: ARCHITECTURE.md §3-6, the as-built notes of
docs/architecture.md §11 and the payload shapes of schema/json/events.schema.json. It reads
the raw rows of `trellis_events` and `trellis_requests` (asyncpg, JSON), the messages of the
JetStream stream `TRELLIS_EVENTS` (nats-py, JSON), and the final answers the clients got. It
never calls the engine's fold (`engine.core.state.evolve`) nor decodes into the engine's Structs:
allocations are rebuilt here from the event payloads, so a bug in the engine's own bookkeeping
cannot hide itself from this check. It imports nothing of the project.

`check` counts every broken promise, by name (`PROMISES`):

- each acknowledged intent is in the log exactly once, its stored reply is the one its client
  got, and the log holds no write that no client was told of;
- no device is held by two live compositions at once, and a memory pool's slices fit in it;
- no link ever carries more reserved bandwidth than its capacity;
- no OCS port is in two circuits at once;
- each domain's versions run 1, 2, 3... without a gap and its sha256 hash chain holds;
- the stream holds every event of the log exactly once, as the log holds it, and in version
  order per domain.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
from nats.js import JetStreamContext

LOST = "acked intents lost"
DUPLICATED = "acked intents duplicated"
REPLY_DIFFERS = "replies unlike the log"
UNTOLD = "writes no client was told of"
DOUBLE_ALLOCATION = "double allocations"
LINK_OVER = "links over capacity"
PORT_TWICE = "OCS ports in two circuits"
NOT_LIVE = "events for compositions not live"
VERSION_GAP = "version gaps"
CHAIN_BREAK = "hash chain breaks"
STREAM_GAP = "stream gaps"
STREAM_DUPLICATE = "stream duplicates"
STREAM_ORDER = "stream out of order"
STREAM_UNLIKE = "stream copies unlike the log"

PROMISES = (
    LOST,
    DUPLICATED,
    REPLY_DIFFERS,
    UNTOLD,
    DOUBLE_ALLOCATION,
    LINK_OVER,
    PORT_TWICE,
    NOT_LIVE,
    VERSION_GAP,
    CHAIN_BREAK,
    STREAM_GAP,
    STREAM_DUPLICATE,
    STREAM_ORDER,
    STREAM_UNLIKE,
)

GENESIS_HASH = "0" * 64
# The engine's own actor (ARCHITECTURE §3: internal actors are no tenant's); its request ids
# (sagas' settlements, lease expiry) answer no client directly.
ENGINE_ACTOR = "engine"
# Rejections recorded as `CompositionRejected` (ARCHITECTURE §3); other refusals write nothing.
RECORDED_REJECTIONS = frozenset({"no_capacity", "no_path", "quota"})
# The event that records each verb's intent, once per request id.
RECORDING_EVENT = {
    "release": "CompositionReleased",
    "extend": "LeaseExtended",
    "import-topology": "TopologyImported",
}
# Reserved amounts are sums of floats: compare with this much slack.
EPSILON = 1e-6


@dataclass(frozen=True)
class LogRow:
    """One row of `trellis_events`; `recorded_at` as the hash covers it, `data` as stored."""

    position: int
    id: str
    domain: str
    version: int
    type: str
    schema_version: int
    recorded_at: str
    actor: str
    causation_id: str
    correlation_id: str
    data: str
    prev_hash: str
    hash: str

    def payload(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.data)
        return data


@dataclass(frozen=True)
class RequestRow:
    """One row of `trellis_requests`: a committed request id and its stored reply."""

    domain: str
    actor: str
    request_id: str
    verb: str
    reply: str
    position: int


@dataclass(frozen=True)
class Ack:
    """A final answer a client was given (a success or a recorded rejection; never a timeout
    or `unavailable`, which the client resends)."""

    domain: str
    actor: str
    verb: str
    request_id: str
    reply: dict[str, Any]


@dataclass(frozen=True)
class StreamMessage:
    """One message of the stream, in stream order: its `Nats-Msg-Id` header and JSON body."""

    sequence: int
    msg_id: str
    body: str


@dataclass
class Findings:
    """What `check` found: per promise, how often it broke (with the first examples), and what
    the log still holds at its end."""

    broken: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(PROMISES, 0)))
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    live_at_end: list[str] = field(default_factory=list)
    circuits_at_end: list[str] = field(default_factory=list)

    def broke(self, promise: str, example: str) -> None:
        assert promise in PROMISES, promise
        self.broken[promise] += 1
        if len(self.examples[promise]) < 5:
            self.examples[promise].append(example)

    def clean(self) -> bool:
        return not any(self.broken.values())

    def report(self) -> str:
        """Each broken promise with its count and first examples (empty when clean)."""
        lines = []
        for promise in PROMISES:
            if self.broken[promise]:
                lines.append(f"{promise}: {self.broken[promise]}")
                lines += [f"  - {example}" for example in self.examples[promise]]
        return "\n".join(lines)


def check(
    log: list[LogRow],
    requests: list[RequestRow],
    acks: Iterable[Ack],
    stream: list[StreamMessage] | None = None,
) -> Findings:
    """Audit the log, its request table and (when given) its stream against what clients were
    told. Every domain of the log is checked."""
    findings = Findings()
    by_domain: dict[str, list[LogRow]] = defaultdict(list)
    for row in sorted(log, key=lambda r: (r.domain, r.version, r.position)):
        by_domain[row.domain].append(row)
    for rows in by_domain.values():
        _check_chain(rows, findings)
        _check_allocations(rows, findings)
    _check_acks(log, requests, list(acks), findings)
    if stream is not None:
        _check_stream(log, stream, findings)
    return findings


# ---- the chain: gap-free versions, linked and correct hashes ----


def event_hash(row: LogRow) -> str:
    """The hash docs/architecture.md §11 defines: sha256 over the previous hash, the event's
    fields one per line, and the stored `data` text."""
    header = "\n".join(
        [
            row.prev_hash,
            row.id,
            row.domain,
            str(row.version),
            row.type,
            str(row.schema_version),
            row.recorded_at,
            row.actor,
            row.causation_id,
            row.correlation_id,
        ]
    )
    return hashlib.sha256(f"{header}\n{row.data}".encode()).hexdigest()


def _check_chain(rows: list[LogRow], findings: Findings) -> None:
    expected, prev_hash, prev_position = 1, GENESIS_HASH, 0
    for row in rows:
        if row.version != expected:
            findings.broke(
                VERSION_GAP, f"{row.domain}: version {row.version} where {expected} was due"
            )
        if row.prev_hash != prev_hash:
            findings.broke(CHAIN_BREAK, f"{row.domain} v{row.version}: prev_hash is not linked")
        elif row.hash != event_hash(row):
            findings.broke(CHAIN_BREAK, f"{row.domain} v{row.version}: hash does not match")
        if row.position <= prev_position:
            findings.broke(
                CHAIN_BREAK, f"{row.domain} v{row.version}: position {row.position} goes back"
            )
        expected, prev_hash, prev_position = row.version + 1, row.hash, row.position


# ---- allocations, rebuilt from the payloads ----


class _Ledger:
    """One domain's reservations as its events say them, checked at every event."""

    def __init__(self, findings: Findings) -> None:
        self.findings = findings
        self.link_capacity: dict[str, float] = {}
        self.memory_capacity: dict[str, float] = {}
        # composition -> device -> binding (as the payload holds it), for every live one
        self.live: dict[str, dict[str, dict[str, Any]]] = {}
        # device -> composition -> slice in GiB (None: the whole device)
        self.holders: dict[str, dict[str, float | None]] = defaultdict(dict)
        self.reserved: dict[str, float] = defaultdict(float)
        # (ocs, port) -> the circuit (ocs, a_port, b_port) that holds it
        self.ports: dict[tuple[str, int], tuple[str, int, int]] = {}

    def apply(self, row: LogRow) -> None:
        data, where = row.payload(), f"{row.domain} v{row.version} {row.type}"
        handler = getattr(self, f"_on_{row.type}", None)
        if handler is not None:
            handler(data, where)

    # topology: what capacity there is

    def _on_TopologyImported(self, data: dict[str, Any], where: str) -> None:
        self.link_capacity = {}
        self.memory_capacity = {}
        for node in data.get("nodes", []):
            self._node(node)
        for link in data.get("links", []):
            self.link_capacity[link["id"]] = float(link["capacity_gbps"])

    def _on_NodeAdded(self, data: dict[str, Any], where: str) -> None:
        self._node(data["node"])

    def _on_LinkAdded(self, data: dict[str, Any], where: str) -> None:
        self.link_capacity[data["link"]["id"]] = float(data["link"]["capacity_gbps"])

    def _on_ComponentRemoved(self, data: dict[str, Any], where: str) -> None:
        for link in [data["component"], *data.get("links", [])]:
            self.link_capacity.pop(link, None)
        self.memory_capacity.pop(data["component"], None)

    def _node(self, node: dict[str, Any]) -> None:
        if node.get("device_kind") == "memory":
            self.memory_capacity[node["id"]] = float(node.get("capacity_gib") or 0)

    # compositions: what is held

    def _on_CompositionRequested(self, data: dict[str, Any], where: str) -> None:
        self.live[data["composition_id"]] = {}

    def _on_DevicesReserved(self, data: dict[str, Any], where: str) -> None:
        cid = data["composition_id"]
        if self._is_live(cid, where):
            for binding in data["devices"]:
                self._take(cid, binding, where)

    def _on_PathRerouted(self, data: dict[str, Any], where: str) -> None:
        self._swap(data["composition_id"], data["device"], data["binding"], where)

    def _on_DeviceReplaced(self, data: dict[str, Any], where: str) -> None:
        self._swap(data["composition_id"], data["old_device"], data["binding"], where)

    def _on_CompositionReleased(self, data: dict[str, Any], where: str) -> None:
        self._end(data["composition_id"], where)

    def _on_CompositionFailed(self, data: dict[str, Any], where: str) -> None:
        self._end(data["composition_id"], where)

    def _on_CircuitCreated(self, data: dict[str, Any], where: str) -> None:
        circuit = (data["ocs"], int(data["a_port"]), int(data["b_port"]))
        for port in circuit[1:]:
            held = self.ports.get((circuit[0], port))
            if held is not None:
                self.findings.broke(
                    PORT_TWICE,
                    f"{where}: {circuit[0]} port {port} for {circuit[1]}-{circuit[2]} "
                    f"while in {held[1]}-{held[2]}",
                )
            self.ports[(circuit[0], port)] = circuit

    def _on_CircuitRemoved(self, data: dict[str, Any], where: str) -> None:
        circuit = (data["ocs"], int(data["a_port"]), int(data["b_port"]))
        for port in circuit[1:]:
            if self.ports.get((circuit[0], port)) == circuit:
                del self.ports[(circuit[0], port)]

    def _is_live(self, cid: str, where: str) -> bool:
        if cid not in self.live:
            self.findings.broke(NOT_LIVE, f"{where}: composition {cid} is not live")
            return False
        return True

    def _swap(self, cid: str, device: str, binding: dict[str, Any], where: str) -> None:
        if self._is_live(cid, where):
            self._give_back(cid, device)
            self._take(cid, binding, where)

    def _end(self, cid: str, where: str) -> None:
        if self._is_live(cid, where):
            for device in list(self.live[cid]):
                self._give_back(cid, device)
            del self.live[cid]

    def _take(self, cid: str, binding: dict[str, Any], where: str) -> None:
        device, gib = binding["device"], binding.get("capacity_gib")
        holders = self.holders[device]
        if cid in holders:
            self.findings.broke(DOUBLE_ALLOCATION, f"{where}: {cid} holds {device} twice")
            self._give_back(cid, device)
        holders[cid] = None if gib is None else float(gib)
        self.live[cid][device] = binding
        others = sorted(c for c in holders if c != cid)
        if others and (gib is None or any(holders[c] is None for c in others)):
            self.findings.broke(
                DOUBLE_ALLOCATION, f"{where}: {device} to {cid} while {', '.join(others)} hold it"
            )
        elif gib is not None:
            used = sum(g for g in holders.values() if g is not None)
            capacity = self.memory_capacity.get(device, 0.0)
            if used > capacity + EPSILON:
                self.findings.broke(
                    DOUBLE_ALLOCATION,
                    f"{where}: {device} slices of {used:g} GiB in {capacity:g} GiB",
                )
        bandwidth = float(binding.get("bandwidth_gbps") or 0)
        for link in binding.get("links", []):
            self.reserved[link] += bandwidth
            capacity = self.link_capacity.get(link, 0.0)
            if self.reserved[link] > capacity + EPSILON:
                self.findings.broke(
                    LINK_OVER,
                    f"{where}: {link} reserved {self.reserved[link]:g} of {capacity:g} Gbps",
                )

    def _give_back(self, cid: str, device: str) -> None:
        binding = self.live[cid].pop(device, None)
        self.holders[device].pop(cid, None)
        if binding is None:
            return
        bandwidth = float(binding.get("bandwidth_gbps") or 0)
        for link in binding.get("links", []):
            self.reserved[link] -= bandwidth


def _check_allocations(rows: list[LogRow], findings: Findings) -> None:
    ledger = _Ledger(findings)
    for row in rows:
        ledger.apply(row)
    domain = rows[0].domain
    findings.live_at_end += [f"{domain}/{cid}" for cid in sorted(ledger.live)]
    findings.circuits_at_end += sorted(
        {f"{domain}/{ocs}:{a}-{b}" for ocs, a, b in ledger.ports.values()}
    )


# ---- acknowledged intents against the log and the stored replies ----


def _same_reply(told: dict[str, Any], stored: str) -> bool:
    """The stored answer is what the client got; a resend's copy is marked `replayed` (a
    refusal's in its `details`)."""

    def comparable(reply: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in reply.items() if k != "replayed"}
        error = out.get("error")
        if isinstance(error, dict) and isinstance(error.get("details"), dict):
            details = {k: v for k, v in error["details"].items() if k != "replayed"}
            out["error"] = {**error, "details": details}
        return out

    return comparable(told) == comparable(json.loads(stored))


def _check_acks(
    log: list[LogRow], requests: list[RequestRow], acks: list[Ack], findings: Findings
) -> None:
    stored = {(r.domain, r.actor, r.request_id): r for r in requests}
    caused: dict[tuple[str, str, str], list[LogRow]] = defaultdict(list)
    requested: Counter[tuple[str, str]] = Counter()
    for row in log:
        caused[(row.domain, row.actor, row.causation_id)].append(row)
        if row.type == "CompositionRequested":
            requested[(row.domain, row.payload()["composition_id"])] += 1
    for (domain, cid), times in requested.items():
        if times > 1:
            findings.broke(DUPLICATED, f"{domain}: composition {cid} requested {times} times")

    def count(key: tuple[str, str, str], *types: str) -> int:
        return sum(row.type in types for row in caused[key])

    told: set[tuple[str, str, str]] = set()
    for ack in acks:
        key = (ack.domain, ack.actor, ack.request_id)
        what = f"{ack.domain}/{ack.actor} {ack.verb} {ack.request_id}"
        reply, error = ack.reply, ack.reply.get("error") or {}
        if not reply.get("ok") and error.get("code") not in (*RECORDED_REJECTIONS, "failed"):
            continue  # refused without a record: nothing to find in the log
        told.add(key)
        if key not in stored:
            findings.broke(LOST, f"{what}: no stored request id")
            continue
        answer = stored[key].reply
        if ack.verb == "compose":
            if reply.get("ok") or error.get("code") == "failed":
                cid = str((reply.get("result") or error.get("details") or {}).get("composition_id"))
                settle = (ack.domain, ENGINE_ACTOR, f"settle-{cid}")
                recorded = count(key, "CompositionRequested")
                settled = count(settle, "CompositionActivated", "CompositionFailed")
                # The compose is answered with its settlement (docs/architecture.md §11).
                answer = stored[settle].reply if settle in stored else answer
                _reply_is_the_log(ack, cid, caused[key], findings)
            else:
                recorded = settled = count(key, "CompositionRejected")
        else:
            recorded = settled = count(key, RECORDING_EVENT.get(ack.verb, ""))
            if ack.verb not in RECORDING_EVENT:
                recorded = settled = 1 if caused[key] else 0
        if min(recorded, settled) == 0:
            findings.broke(LOST, f"{what}: recorded {recorded} times, settled {settled} times")
        elif max(recorded, settled) > 1:
            findings.broke(
                DUPLICATED, f"{what}: recorded {recorded} times, settled {settled} times"
            )
        if not _same_reply(reply, answer):
            findings.broke(REPLY_DIFFERS, f"{what}: told {reply}, stored {answer}")
    for key, request in stored.items():
        if request.actor != ENGINE_ACTOR and key not in told:
            findings.broke(
                UNTOLD, f"{request.domain}/{request.actor} {request.verb} {request.request_id}"
            )


def _reply_is_the_log(ack: Ack, cid: str, rows: list[LogRow], findings: Findings) -> None:
    """A compose's reply names the composition its request recorded, with the devices (and
    their paths) the log reserved for it."""
    if not ack.reply.get("ok"):
        return
    requested = [r.payload() for r in rows if r.type == "CompositionRequested"]
    reserved = [r.payload() for r in rows if r.type == "DevicesReserved"]
    told = [(d["id"], d["path"]) for d in ack.reply["result"].get("devices", [])]
    logged = [(b["device"], b["path"]) for p in reserved for b in p["devices"]]
    if [p["composition_id"] for p in requested] != [cid] or told != logged:
        findings.broke(
            REPLY_DIFFERS, f"{ack.request_id}: told {cid} with {told}, the log holds {logged}"
        )


# ---- the stream against the log ----

_ENVELOPE_FIELDS = (
    "domain",
    "version",
    "position",
    "type",
    "schema_version",
    "recorded_at",
    "actor",
    "causation_id",
    "correlation_id",
    "prev_hash",
    "hash",
)


def _check_stream(log: list[LogRow], stream: list[StreamMessage], findings: Findings) -> None:
    logged = {row.id: row for row in log}
    copies: Counter[str] = Counter()
    last_version: dict[str, int] = {}
    for message in sorted(stream, key=lambda m: m.sequence):
        body = json.loads(message.body)
        row = logged.get(body.get("id", ""))
        if row is None or message.msg_id != row.id:
            findings.broke(STREAM_UNLIKE, f"seq {message.sequence}: {message.msg_id} not logged")
            continue
        copies[row.id] += 1
        if copies[row.id] > 1:
            findings.broke(STREAM_DUPLICATE, f"seq {message.sequence}: {row.domain} v{row.version}")
            continue
        unlike = [f for f in _ENVELOPE_FIELDS if body.get(f) != getattr(row, f)]
        if body.get("data") != row.payload():
            unlike.append("data")
        if unlike:
            findings.broke(
                STREAM_UNLIKE, f"seq {message.sequence}: {row.domain} v{row.version} {unlike}"
            )
        previous = last_version.get(row.domain, 0)
        if row.version < previous:
            findings.broke(
                STREAM_ORDER,
                f"seq {message.sequence}: {row.domain} v{row.version} after v{previous}",
            )
        last_version[row.domain] = max(previous, row.version)
    for row in log:
        if copies[row.id] == 0:
            findings.broke(
                STREAM_GAP, f"{row.domain} v{row.version} ({row.type}) not in the stream"
            )


# ---- reading what an auditor reads ----


def canonical_time(at: datetime) -> str:
    """`recorded_at` as the hash covers it: UTC, microseconds, "Z"."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def read_log(url: str, schema: str | None = None) -> tuple[list[LogRow], list[RequestRow]]:
    """Every event and stored request of the database at `url` (in `schema`), as raw rows."""
    settings = {"search_path": schema} if schema else {}
    conn = await asyncpg.connect(url, server_settings=settings)
    try:
        events = await conn.fetch("SELECT * FROM trellis_events ORDER BY position")
        stored = await conn.fetch(
            "SELECT domain, actor, request_id, verb, reply, position FROM trellis_requests"
        )
    finally:
        await conn.close()
    log = [
        LogRow(
            position=r["position"],
            id=str(r["id"]),
            domain=r["domain"],
            version=r["version"],
            type=r["type"],
            schema_version=r["schema_version"],
            recorded_at=canonical_time(r["recorded_at"]),
            actor=r["actor"],
            causation_id=r["causation_id"],
            correlation_id=r["correlation_id"],
            data=r["data"],
            prev_hash=r["prev_hash"],
            hash=r["hash"],
        )
        for r in events
    ]
    return log, [RequestRow(**dict(r)) for r in stored]


async def read_stream(js: JetStreamContext, stream: str, subjects: str) -> list[StreamMessage]:
    """Every message of `stream` on `subjects`, in stream order, read with an ordered
    consumer from the first."""
    info = await js.stream_info(stream)
    count = int(info.state.messages)
    sub = await js.subscribe(subjects, ordered_consumer=True)
    try:
        messages = [await sub.next_msg(timeout=5) for _ in range(count)]
    finally:
        await sub.unsubscribe()
    return [
        StreamMessage(
            sequence=m.metadata.sequence.stream,
            msg_id=(m.headers or {}).get("Nats-Msg-Id", ""),
            body=m.data.decode(),
        )
        for m in messages
    ]
