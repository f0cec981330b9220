"""Read old event payloads as today's Structs.

An upcaster takes the JSON object of version N (as a dict) and returns version N+1. They chain,
so a payload written years ago is lifted one step at a time. Checked-in payloads of every old
version (tests/core/payloads/v<N>/) are decoded by a test to keep it honest.

v1 -> v2 of DevicesReserved, PathRerouted and DeviceReplaced: each DeviceBinding gained the
required `model` and `cost_per_hour` (engine.core.events.DeviceBinding). A v1 payload did not say
them, and a payload alone cannot know them, so the upcaster fills null ("not recorded"); a
reader that needs them takes them from the topology in force at that position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from trellis.engine.core.events import EVENT_TYPES, SCHEMA_VERSIONS, Event

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


def _binding_v1_v2(binding: dict[str, Any]) -> dict[str, Any]:
    # A v1 payload never has them; one that somehow does keeps its own.
    return {"model": None, "cost_per_hour": None, **binding}


def _devices_reserved_v1_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "devices": [_binding_v1_v2(b) for b in payload["devices"]]}


def _one_binding_v1_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "binding": _binding_v1_v2(payload["binding"])}


# (type, from_version) -> function producing the payload of from_version + 1
UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("DevicesReserved", 1): _devices_reserved_v1_v2,
    ("PathRerouted", 1): _one_binding_v1_v2,
    ("DeviceReplaced", 1): _one_binding_v1_v2,
}

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
