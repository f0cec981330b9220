"""The scheduler feed's wire formats as JSON Schema, beside the engine's (engine/contract.py).

- stream.schema.json: a message of the JetStream stream TRELLIS_EVENTS, the event envelope
  (ARCHITECTURE §6; its `data` is the event payload of events.schema.json);
- kv.schema.json: a value of the KV bucket TRELLIS_STATE; `#/$defs/DeviceEntry`,
  `CompositionEntry` and `HostEntry` are the values of `<domain>.device.<id>`,
  `<domain>.composition.<id>` and `<domain>.host.<id>`.
"""

from __future__ import annotations

from adapters.nats.jetstream import Envelope
from adapters.nats.kv_state import CompositionEntry, DeviceEntry, HostEntry
from engine.contract import document, json_schemas, pretty


def contract_files() -> dict[str, bytes]:
    """Every file of schema/json: the engine's schemas and the feed's."""
    stream = document("stream.schema.json", Envelope, "A message of the event stream.")
    kv = document(
        "kv.schema.json",
        [DeviceEntry, CompositionEntry, HostEntry],
        "A value of the state bucket, by the kind its key names.",
    )
    return {
        **json_schemas(),
        "stream.schema.json": pretty(stream),
        "kv.schema.json": pretty(kv),
    }
