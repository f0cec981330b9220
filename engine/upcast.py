"""Read old event payloads as today's Structs.

An upcaster takes the JSON object of version N (as a dict) and returns version N+1. They chain,
so a payload written years ago is lifted one step at a time. None exist yet: every event type is
still at schema version 1, and a test decodes checked-in v1 payloads to keep it honest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from engine.events import EVENT_TYPES, SCHEMA_VERSIONS, Event

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

# (type, from_version) -> function producing the payload of from_version + 1
UPCASTERS: dict[tuple[str, int], Upcaster] = {}

_DECODERS = {name: msgspec.json.Decoder(cls) for name, cls in EVENT_TYPES.items()}


class UnknownEventType(ValueError):
    """The log holds an event type this code does not know (written by a newer engine)."""


def upcast(type_name: str, schema_version: int, data: bytes) -> Event:
    """Decode `data` written at `schema_version` into the current Struct for `type_name`."""
    decoder = _DECODERS.get(type_name)
    if decoder is None:
        raise UnknownEventType(f"unknown event type {type_name!r}")
    current = SCHEMA_VERSIONS[type_name]
    if schema_version == current:
        return decoder.decode(data)
    payload: dict[str, Any] = msgspec.json.decode(data)
    for version in range(schema_version, current):
        payload = UPCASTERS[(type_name, version)](payload)
    return msgspec.convert(payload, EVENT_TYPES[type_name])
