"""What counts as the contract's in the stream and the bucket (adapters/nats/jetstream.py
`stream_event`, adapters/nats/kv_state.py `bucket_entry`): the relay's own messages, and
nothing else a client could publish there."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import msgspec
import pytest

from trellis.adapters.nats.jetstream import Envelope, encode_envelope, stream_event
from trellis.adapters.nats.kv_state import DeviceEntry, bucket_entry
from trellis.engine.core.records import GENESIS_HASH, RecordedEvent, chain_hash

AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def recorded() -> RecordedEvent:
    event_id, data = str(uuid.uuid4()), b'{"component":"sw-1"}'
    fields = {
        "id": event_id,
        "domain": "hall",
        "version": 1,
        "type": "ComponentDrained",
        "schema_version": 1,
        "recorded_at": AT,
        "actor": "operator",
        "causation_id": "r-1",
        "correlation_id": "r-1",
        "data": data,
    }
    digest = chain_hash(GENESIS_HASH, **fields)  # type: ignore[arg-type]
    return RecordedEvent(position=7, prev_hash=GENESIS_HASH, hash=digest, **fields)  # type: ignore[arg-type]


def test_an_event_as_the_relay_publishes_it_is_the_contracts() -> None:
    event = recorded()
    body = encode_envelope(Envelope.of(event))
    found = stream_event("p", "p.events.hall.ComponentDrained", body, {"Nats-Msg-Id": event.id})
    assert found is not None and (found.version, found.hash) == (1, event.hash)


@pytest.mark.parametrize(
    "change",
    ["subject", "message id", "no headers", "hash", "data", "not json", "a reply body"],
)
def test_anything_else_is_foreign(change: str) -> None:
    event = recorded()
    envelope = Envelope.of(event)
    subject, headers = "p.events.hall.ComponentDrained", {"Nats-Msg-Id": event.id}
    body = encode_envelope(envelope)
    match change:
        case "subject":
            subject = "p.events.hall.CompositionReleased"
        case "message id":
            headers = {"Nats-Msg-Id": str(uuid.uuid4())}
        case "no headers":
            headers = {}
        case "hash":
            body = encode_envelope(msgspec.structs.replace(envelope, hash="0" * 64))
        case "data":
            body = encode_envelope(msgspec.structs.replace(envelope, data=msgspec.Raw(b"{}")))
        case "not json":
            body = b"\xff"
        case "a reply body":
            body = b'{"ok":true,"result":{},"position":3,"replayed":false}'
    assert stream_event("p", subject, body, headers) is None


def test_a_bucket_value_is_the_contracts_only_under_a_key_of_its_kind() -> None:
    value = DeviceEntry(
        kind="gpu", model="H100", health="healthy", drained=False, owner=None, free=True,
        position=3,
    )  # fmt: skip
    device = msgspec.json.encode(value)
    assert bucket_entry("hall.device.gpu-1", device) == value
    assert bucket_entry("hall.host.gpu-1", device) is None  # not a host's value
    assert bucket_entry("hall.device.gpu-1", b"garbage") is None
    assert bucket_entry("hall.nonsense", b"{}") is None
    assert bucket_entry("hall.device.gpu 1", b"{}") is None
    assert bucket_entry("hall.composition.c-1", b'{"ok":true}') is None
    assert bucket_entry("hall.device.gpu-1", device[:-5]) is None  # cut short
