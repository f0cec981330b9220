"""The scheduler feed's wire formats as JSON Schema, beside the engine's (engine/core/contract.py),
and an AsyncAPI 3 document that names every subject with them.

- stream.schema.json: a message of the JetStream stream TRELLIS_EVENTS, the event envelope
  (ARCHITECTURE §6); its `data`, `#/$defs/Event`, is the event payload of events.schema.json,
  whose schemas it holds too, so the file stands alone;
- kv.schema.json: a value of the KV bucket TRELLIS_STATE; `#/$defs/DeviceEntry`,
  `CompositionEntry`, `HostEntry` and `ReservationEntry` are the values of
  `<domain>.device.<id>`, `<domain>.composition.<id>`, `<domain>.host.<id>` and
  `<domain>.reservation.<id>`;
- asyncapi.json: every subject (ARCHITECTURE §3) as a channel, with the operation the engine
  performs on it and the schema of each message, request and reply, by reference to the
  files above.
"""

from __future__ import annotations

from typing import Any

import msgspec

from trellis.adapters.nats.jetstream import Envelope
from trellis.adapters.nats.kv_state import (
    CompositionEntry,
    DeviceEntry,
    HostEntry,
    ReservationEntry,
)
from trellis.engine.core.contract import HEADER, document, json_schemas, pretty, sent, subjects
from trellis.engine.core.events import AnyEvent

SCHEMA_FORMAT = "application/schema+json;version=draft-2020-12"
# The tokens of a subject, as AsyncAPI channel parameters.
PARAMETERS = {
    "prefix": {"description": "TRELLIS_SUBJECT_PREFIX", "default": "trellis"},
    "domain": {"description": "the fabric domain (an id)"},
    "tenant": {"description": "the tenant asking (an id)"},
    "type": {"description": "the event type, e.g. CompositionActivated"},
    "kind": {
        "description": "device, composition, host or reservation",
        "enum": ["device", "composition", "host", "reservation"],
    },
    "id": {"description": "the device, composition, host or reservation id"},
}


def contract_files() -> dict[str, bytes]:
    """Every file of schema/json: the engine's schemas and the feed's."""
    stream = document("stream.schema.json", Envelope, "A message of the event stream.")
    (event,), events = msgspec.json.schema_components([AnyEvent])
    stream["$defs"] |= {**events, "Event": {"description": "An event payload.", **event}}
    sent(stream["$defs"], [Envelope])
    values = [DeviceEntry, CompositionEntry, HostEntry, ReservationEntry]
    kv = document(
        "kv.schema.json", values, "A value of the state bucket, by the kind its key names."
    )
    sent(kv["$defs"], values)
    return {
        **json_schemas(),
        "stream.schema.json": pretty(stream),
        "kv.schema.json": pretty(kv),
        "asyncapi.json": pretty(asyncapi()),
    }


def asyncapi() -> dict[str, Any]:
    """Every subject as an AsyncAPI 3 channel: requests the engine receives and answers on the
    request's reply subject, the events it sends to the stream, the values it puts in the
    bucket."""
    reply_messages: dict[str, Any] = {}
    channels: dict[str, Any] = {
        "reply": {
            "address": None,
            "description": "The request's NATS reply subject (an inbox); each operation names "
            "the reply it gets there.",
            "messages": reply_messages,
        }
    }
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for name in subjects():
        family, verb = name.split(".", 1)
        who = "{domain}.{tenant}" if family in ("intent", "view") else "{domain}"
        address = f"{{prefix}}.{family}.{who}.{verb}"
        channels[name] = {
            "address": address,
            "parameters": _parameters(address),
            "messages": {"request": {"$ref": f"#/components/messages/{name}"}},
        }
        messages[name] = _message(f"intents.schema.json#/$defs/{name}", f"A {name} request")
        messages[f"{name}.reply"] = _message(
            f"replies.schema.json#/$defs/{name}", f"The reply to a {name} request"
        )
        reply_messages[name] = {"$ref": f"#/components/messages/{name}.reply"}
        operations[name] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{name}"},
            "messages": [{"$ref": f"#/channels/{name}/messages/request"}],
            "reply": {
                "address": {"location": "$message.header#/replyTo"},
                "channel": {"$ref": "#/channels/reply"},
                "messages": [{"$ref": f"#/channels/reply/messages/{name}"}],
            },
        }
    note = {"type": "string", "description": "A C2SP signed note of a tlog-checkpoint"}
    for name, address, payload, what in (
        ("events", "{prefix}.events.{domain}.{type}", "stream.schema.json", "An event"),
        ("checkpoints", "{prefix}.checkpoints.{domain}", note, "A signed checkpoint"),
        ("state", "$KV.TRELLIS_STATE.{domain}.{kind}.{id}", "kv.schema.json", "A state value"),
    ):
        channels[name] = {
            "address": address,
            "parameters": _parameters(address),
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
        }
        messages[name] = _message(payload, what)
        operations[name] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{name}"},
            "messages": [{"$ref": f"#/channels/{name}/messages/{name}"}],
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Trellis",
            "version": "1.0.0",
            "description": f"The Trellis wire contract (ARCHITECTURE §3-6). {HEADER}",
            "license": {"name": "Apache-2.0"},
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "A local trellis up (the embedded server's port is in "
                "endpoints.json)",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    }


def _message(payload: str | dict[str, Any], title: str) -> dict[str, Any]:
    """A message whose payload is the schema at `payload` (a reference), or text."""
    if isinstance(payload, dict):  # text, not JSON: a signed checkpoint note
        return {"title": title, "contentType": "text/plain", "payload": payload}
    schema = {"schemaFormat": SCHEMA_FORMAT, "schema": {"$ref": payload}}
    return {"title": title, "payload": schema}


def _parameters(address: str) -> dict[str, Any]:
    return {name: spec for name, spec in PARAMETERS.items() if f"{{{name}}}" in address}
