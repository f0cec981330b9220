"""The scheduler feed's wire formats as JSON Schema, beside the engine's (engine/contract.py),
and an AsyncAPI 3 document that names every subject with them.

- stream.schema.json: a message of the JetStream stream TRELLIS_EVENTS, the event envelope
  (ARCHITECTURE §6; its `data` is the event payload of events.schema.json);
- kv.schema.json: a value of the KV bucket TRELLIS_STATE; `#/$defs/DeviceEntry`,
  `CompositionEntry` and `HostEntry` are the values of `<domain>.device.<id>`,
  `<domain>.composition.<id>` and `<domain>.host.<id>`;
- asyncapi.json: every subject (ARCHITECTURE §3) as a channel, with the operation the engine
  performs on it and the schema of each message, by reference to the files above.
"""

from __future__ import annotations

from typing import Any

from trellis.adapters.nats.jetstream import Envelope
from trellis.adapters.nats.kv_state import CompositionEntry, DeviceEntry, HostEntry
from trellis.engine.contract import HEADER, document, json_schemas, pretty
from trellis.engine.intents import INTENTS

SCHEMA_FORMAT = "application/schema+json;version=draft-2020-12"
# The tokens of a subject, as AsyncAPI channel parameters.
PARAMETERS = {
    "prefix": {"description": "TRELLIS_SUBJECT_PREFIX", "default": "trellis"},
    "domain": {"description": "the fabric domain (an id)"},
    "tenant": {"description": "the tenant asking (an id)"},
    "type": {"description": "the event type, e.g. CompositionActivated"},
    "kind": {
        "description": "device, composition or host",
        "enum": ["device", "composition", "host"],
    },
    "id": {"description": "the device, composition or host id"},
}


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
        "asyncapi.json": pretty(asyncapi()),
    }


def asyncapi() -> dict[str, Any]:
    """Every subject as an AsyncAPI 3 channel: requests the engine receives and answers on the
    request's reply subject, the events it sends to the stream, the values it puts in the
    bucket."""
    channels: dict[str, Any] = {
        "reply": {
            "address": None,
            "description": "The request's NATS reply subject (an inbox).",
            "messages": {"reply": {"$ref": "#/components/messages/reply"}},
        }
    }
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {"reply": _message("replies.schema.json", "The reply envelope")}
    subjects: list[tuple[str, str, str]] = [(f"{f}.{v}", f, v) for f, v in INTENTS]
    subjects += [(f"view.{verb}", "view", verb) for family, verb in INTENTS if family == "query"]
    for name, family, verb in subjects:
        who = "{domain}.{tenant}" if family in ("intent", "view") else "{domain}"
        address = f"{{prefix}}.{family}.{who}.{verb}"
        channels[name] = {
            "address": address,
            "parameters": _parameters(address),
            "messages": {"request": {"$ref": f"#/components/messages/{name}"}},
        }
        messages[name] = _message(f"intents.schema.json#/$defs/{name}", f"A {name} request")
        operations[name] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{name}"},
            "messages": [{"$ref": f"#/channels/{name}/messages/request"}],
            "reply": {
                "address": {"location": "$message.header#/replyTo"},
                "channel": {"$ref": "#/channels/reply"},
                "messages": [{"$ref": "#/channels/reply/messages/reply"}],
            },
        }
    for name, address, file, what in (
        ("events", "{prefix}.events.{domain}.{type}", "stream.schema.json", "An event"),
        ("state", "$KV.TRELLIS_STATE.{domain}.{kind}.{id}", "kv.schema.json", "A state value"),
    ):
        channels[name] = {
            "address": address,
            "parameters": _parameters(address),
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
        }
        messages[name] = _message(file, what)
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


def _message(ref: str, title: str) -> dict[str, Any]:
    return {"title": title, "payload": {"schemaFormat": SCHEMA_FORMAT, "schema": {"$ref": ref}}}


def _parameters(address: str) -> dict[str, Any]:
    return {name: spec for name, spec in PARAMETERS.items() if f"{{{name}}}" in address}
