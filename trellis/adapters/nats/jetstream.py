"""The JetStream side of the contract (ARCHITECTURE §3, §6): names, configuration, envelope.

- Stream `TRELLIS_EVENTS` on subjects `<prefix>.events.>`, one message per event on
  `<prefix>.events.<domain>.<type>`, message id (`Nats-Msg-Id`) = event id, body = `Envelope`.
  File storage, a 2-minute duplicate window, discard-old limits (`StreamLimits`: 1 GiB and a
  week by default; the log in Postgres keeps everything), atomic batches allowed.
- KV bucket `TRELLIS_STATE`, file storage (values: adapters/nats/kv_state.py), history 2:
  an ended composition's final value stays under its delete marker, so a watcher that had
  not yet been sent the value when the marker came still gets it (with history 1 the marker
  replaced it first, and one watcher in 20-40 releases saw only the delete). Per-message TTLs
  allowed: a key's delete marker, and the final value beneath it, go after
  `StreamLimits.marker_ttl_s`.
- Both are kept on `StreamLimits.replicas` servers (TRELLIS_JS_REPLICAS; 1, or 3 on a
  cluster), set at creation and brought in line at every start (JetStream scales an existing
  stream up or down in place).

For the default subject prefix `trellis` the names are exactly those. Any other prefix (each
test uses its own) gets `TRELLIS_EVENTS_<prefix>` / `TRELLIS_STATE_<prefix>`, with every
character outside `[A-Za-z0-9_-]` (a dot, say) replaced by `_`. Two prefixes that map to the
same name cannot share a server: `ensure_stream` refuses a stream whose subjects are not its own.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from trellis.engine.core.records import RecordedEvent, chain_hash, format_time

log = logging.getLogger("trellis.relay")

DEFAULT_PREFIX = "trellis"
DUPLICATE_WINDOW_S = 120.0

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def stream_name(prefix: str = DEFAULT_PREFIX) -> str:
    """`TRELLIS_EVENTS`, or `TRELLIS_EVENTS_<prefix, sanitised>` for another subject prefix."""
    return _derived("TRELLIS_EVENTS", prefix)


def checkpoint_stream_name(prefix: str = DEFAULT_PREFIX) -> str:
    """`TRELLIS_CHECKPOINTS` (signed tree heads, ARCHITECTURE §6), derived as `stream_name`."""
    return _derived("TRELLIS_CHECKPOINTS", prefix)


def bucket_name(prefix: str = DEFAULT_PREFIX) -> str:
    """`TRELLIS_STATE`, or `TRELLIS_STATE_<prefix, sanitised>` for another subject prefix."""
    return _derived("TRELLIS_STATE", prefix)


def _derived(base: str, prefix: str) -> str:
    return base if prefix == DEFAULT_PREFIX else f"{base}_{_UNSAFE.sub('_', prefix)}"


def event_subject(prefix: str, record: RecordedEvent) -> str:
    return f"{prefix}.events.{record.domain}.{record.type}"


class StreamConfigError(RuntimeError):
    """The stream or the bucket cannot be set up as configured: the stream name is taken by a
    stream with other subjects (a prefix that sanitises to the same name, or a stream made by
    hand), or JetStream refuses the configuration (more replicas than it has servers up)."""


#: Values per key the bucket keeps: a key's current value, and for an ended composition its
#: final value under the delete marker.
BUCKET_HISTORY = 2


class StreamLimits(msgspec.Struct, frozen=True, kw_only=True):
    """How much of the log the stream keeps (the oldest events go first; 0 means no limit),
    on how many JetStream servers the stream and the KV bucket are kept, and how long a
    deleted key's marker stays in the bucket (0: for ever). Defaults suit a dev box
    (TRELLIS_EVENTS_MAX_BYTES, TRELLIS_EVENTS_MAX_AGE, TRELLIS_JS_REPLICAS,
    TRELLIS_KV_MARKER_TTL)."""

    max_bytes: int = 1 << 30  # 1 GiB
    max_age_s: float = 7 * 24 * 3600.0  # a week
    replicas: int = 1  # 3 on a 3-node cluster: a copy survives the loss of any one node
    # A marker tells a watcher that was away that the key ended; one that stays away longer
    # than this must watch anew (its first values are then the bucket's). A day.
    marker_ttl_s: int = 24 * 3600


class Envelope(msgspec.Struct, kw_only=True):
    """The body of a stream message: the event as the log holds it (ARCHITECTURE §6)."""

    id: Annotated[str, msgspec.Meta(extra_json_schema={"format": "uuid"})]
    domain: str
    version: int
    position: int
    type: str
    schema_version: int
    # UTC with microseconds and "Z", exactly as the hash covers it
    recorded_at: Annotated[str, msgspec.Meta(extra_json_schema={"format": "date-time"})]
    actor: str
    causation_id: str
    correlation_id: str
    # The stored JSON text, byte for byte, so the hash can be checked: an event payload
    # (events.schema.json; adapters/nats/contract.py puts its schema beside this one).
    data: Annotated[msgspec.Raw, msgspec.Meta(extra_json_schema={"$ref": "#/$defs/Event"})]
    prev_hash: str
    hash: str

    @classmethod
    def of(cls, record: RecordedEvent) -> Envelope:
        return cls(
            id=record.id,
            domain=record.domain,
            version=record.version,
            position=record.position,
            type=record.type,
            schema_version=record.schema_version,
            recorded_at=format_time(record.recorded_at),
            actor=record.actor,
            causation_id=record.causation_id,
            correlation_id=record.correlation_id,
            data=msgspec.Raw(record.data),
            prev_hash=record.prev_hash,
            hash=record.hash,
        )

    def computed_hash(self, recorded_at: datetime) -> str:
        """The chain hash of what the envelope carries (`recorded_at`: its time, parsed), to
        compare with the `hash` it claims."""
        return chain_hash(
            self.prev_hash,
            id=self.id,
            domain=self.domain,
            version=self.version,
            type=self.type,
            schema_version=self.schema_version,
            recorded_at=recorded_at,
            actor=self.actor,
            causation_id=self.causation_id,
            correlation_id=self.correlation_id,
            data=bytes(self.data),
        )


encode_envelope = msgspec.json.Encoder().encode
_decode_envelope = msgspec.json.Decoder(Envelope).decode


def stream_event(
    prefix: str, subject: str, data: bytes, headers: dict[str, str] | None
) -> Envelope | None:
    """The event a message of the stream carries, exactly as the relay publishes it; None for
    a foreign message (ARCHITECTURE §3: skipped and counted by every consumer, never a reason
    to stop). An event of the log is an envelope whose subject is `<prefix>.events.<its
    domain>.<its type>`, whose message id is its event id, and whose hash is its chain hash
    (engine.core.records.chain_hash) of its own fields."""
    try:
        envelope = _decode_envelope(data)
        recorded_at = datetime.fromisoformat(envelope.recorded_at)
    except (msgspec.DecodeError, ValueError):
        return None
    if subject != f"{prefix}.events.{envelope.domain}.{envelope.type}":
        return None
    if (headers or {}).get("Nats-Msg-Id") != envelope.id:
        return None
    return envelope if envelope.computed_hash(recorded_at) == envelope.hash else None


# Messages looked at, back from a foreign last one, for a domain's last event: JetStream has
# no "previous message on this subject".
SCAN_BACK = 1000


@dataclasses.dataclass(frozen=True)
class DomainEnd:
    """Where a domain's messages end in the stream: the last one's sequence (0: none), and
    the last event of the log among them (None: none within the look-back)."""

    seq: int
    event: Envelope | None


async def domain_end(
    js: JetStreamContext,
    prefix: str,
    domain: str,
    foreign: Callable[[str, int], None] | None = None,
) -> DomainEnd:
    """The end of `domain`'s subjects in the event stream. A foreign message on them (ARCHITECTURE
    §3) is passed over and told to `foreign(domain, its stream sequence)`; the search looks
    back SCAN_BACK messages at most."""
    stream, subjects = stream_name(prefix), f"{prefix}.events.{domain}."
    try:
        msg = await js.get_last_msg(stream, subjects + "*")
    except NotFoundError:
        return DomainEnd(0, None)
    seq = int(msg.seq or 0)
    for back in range(seq, max(0, seq - SCAN_BACK), -1):
        if back != seq:
            try:
                msg = await js.get_msg(stream, back)
            except NotFoundError:  # aged out or deleted
                continue
        subject = msg.subject or ""
        if not subject.startswith(subjects):
            continue
        event = stream_event(prefix, subject, msg.data or b"", msg.headers)
        if event is not None and event.domain == domain:
            return DomainEnd(seq, event)
        if foreign is not None:
            foreign(domain, back)
    return DomainEnd(seq, None)


async def ensure_stream(js: JetStreamContext, prefix: str, limits: StreamLimits) -> None:
    """Create the event stream, or bring an existing one's limits in line with `limits`.

    Raises:
        StreamConfigError: a stream of that name carries other subjects, or JetStream refuses
            the configuration (more replicas than servers).
    """
    name, subjects = stream_name(prefix), [f"{prefix}.events.>"]
    max_age = limits.max_age_s
    wanted = StreamConfig(
        name=name,
        description="Trellis event log, relayed from PostgreSQL (adapters/nats/relay.py)",
        subjects=subjects,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,  # a window on the log: never refuse a new event
        storage=StorageType.FILE,
        max_bytes=limits.max_bytes or -1,
        max_age=max_age,
        # The window may not exceed the age limit (the server refuses that).
        duplicate_window=min(DUPLICATE_WINDOW_S, max_age) if max_age else DUPLICATE_WINDOW_S,
        allow_atomic=True,  # the relay publishes each domain's batch as one atomic batch
        num_replicas=limits.replicas,
    )
    try:
        have = (await js.stream_info(name)).config
    except NotFoundError:
        await _configured(js.add_stream(wanted), f"stream {name}", limits.replicas)
        return
    if have.subjects != subjects:
        raise StreamConfigError(
            f"stream {name} carries {have.subjects}, not {subjects}: another subject prefix "
            "maps to the same stream name, or the stream was made by hand"
        )
    managed = (
        "max_bytes",
        "max_age",
        "duplicate_window",
        "discard",
        "allow_atomic",
        "num_replicas",
    )
    if any(getattr(have, f) != getattr(wanted, f) for f in managed):
        changed = dataclasses.replace(have, **{f: getattr(wanted, f) for f in managed})
        await _configured(js.update_stream(changed), f"stream {name}", limits.replicas)


async def ensure_bucket(
    js: JetStreamContext, prefix: str, replicas: int = 1
) -> tuple[KeyValue, bool]:
    """The state bucket on `replicas` servers, and whether it had to be made (then it holds
    nothing yet).

    Raises:
        StreamConfigError: JetStream refuses that many replicas.
    """
    bucket = bucket_name(prefix)
    made = False
    try:
        kv = await js.key_value(bucket)
    except BucketNotFoundError:
        created = js.create_key_value(
            bucket=bucket,
            description="Trellis current state per device, composition and host",
            history=BUCKET_HISTORY,
            storage=StorageType.FILE,
            replicas=replicas,
        )
        kv, made = await _configured(created, f"bucket {bucket}", replicas), True
    # A bucket is a stream underneath (KV_<bucket>); its replicas are that stream's. One made
    # by an older nats-py may not allow per-message TTLs (JetStream turns that on in place,
    # never off), and without them a delete marker's TTL is refused; one made by an older
    # Trellis keeps one value per key.
    have = (await js.stream_info(f"KV_{bucket}")).config
    changed = dataclasses.replace(
        have, num_replicas=replicas, allow_msg_ttl=True, max_msgs_per_subject=BUCKET_HISTORY
    )
    if changed != have:
        await _configured(js.update_stream(changed), f"bucket {bucket}", replicas)
    return kv, made


async def _configured(request: Awaitable[Any], what: str, replicas: int) -> Any:
    """Await a create or update; a refusal becomes a StreamConfigError that says why."""
    try:
        return await request
    except APIError as exc:
        raise StreamConfigError(
            f"JetStream refused {what} with {replicas} replica(s) (its settings: "
            f"TRELLIS_JS_REPLICAS, TRELLIS_EVENTS_MAX_BYTES, TRELLIS_EVENTS_MAX_AGE; and the "
            f"server's storage): {exc.description}"
        ) from exc
