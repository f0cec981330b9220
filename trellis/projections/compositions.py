"""The compositions projection: one row per composition with its devices, state and history.

Released and failed compositions keep their row (only `state` changes), so the `composition`
and `why` queries answer for them after the fact. `chain` lists every event that names the
composition, in log order: the audit trail of how it came to be what it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from trellis.engine.core.compose import devices_of
from trellis.engine.core.events import (
    CompositionActivated,
    CompositionFailed,
    CompositionImpaired,
    CompositionReleased,
    CompositionRequested,
    DeviceBinding,
    DeviceReplaced,
    DevicesReserved,
    Event,
    LeaseExtended,
    PathRerouted,
)
from trellis.projections.base import Fact, chain_entry, composition_of
from trellis.projections.table import Column, Row, Rows, RowSource, Table

COMPOSITIONS = Table(
    "proj_compositions",
    (
        Column("domain", "text"),
        Column("composition_id", "text"),
        Column("tenant", "text"),
        Column("host", "text"),
        Column("state", "text"),
        Column("labels", "jsonb"),
        Column("reason", "text"),
        Column("request_id", "text"),
        Column("created_at", "timestamptz"),
        Column("expires_at", "timestamptz"),
        Column("devices", "jsonb"),
        Column("impaired_by", "jsonb"),
        Column("chain", "jsonb"),
        # {device: [link ids of its path]}: with `devices`' paths, what lies on them, so a
        # repair that mends some paths stops naming what it moved off (as evolve() does).
        Column("links", "jsonb"),
        Column("updated_position", "bigint"),
    ),
    key=("domain", "composition_id"),
    # An ended composition is never named again: its row stays as it ended.
    final="state IN ('released', 'failed')",
    final_position="updated_position",
)


def device_entry(binding: DeviceBinding) -> dict[str, Any]:
    """A bound device in the compose result's shape (the engine's own function, so the two
    cannot drift apart)."""
    entry: dict[str, Any] = msgspec.to_builtins(devices_of([binding])[0])
    return entry


class CompositionsProjection:
    """Folds composition events into proj_compositions."""

    name: str = "compositions"
    tables: tuple[Table, ...] = (COMPOSITIONS,)

    async def apply(self, source: RowSource, facts: Sequence[Fact]) -> None:
        rows = Rows(COMPOSITIONS, source)
        # Every event but a topology one names a composition: its key, worked out once.
        named = [
            (fact, (fact.record.domain, cid))
            for fact in facts
            if (cid := composition_of(fact.event))
        ]
        await rows.prefetch({key for _, key in named})
        for fact, key in named:
            record, event = fact
            if isinstance(event, CompositionRequested):
                rows.put(_requested(fact, event))
                continue
            row = await rows.get(key)
            if row is None:
                # decide() never names a composition before requesting it; a log that does is
                # not ours to repair, and stalling every read model on it would help nobody.
                continue
            _fold(row, event)
            row["chain"].append(chain_entry(record))
            row["updated_position"] = record.position
            rows.put(row)
        await rows.flush()


def _requested(fact: Fact, event: CompositionRequested) -> Row:
    return {
        "domain": fact.record.domain,
        "composition_id": event.composition_id,
        "tenant": event.tenant,
        "host": event.host,
        "state": "pending",
        "labels": dict(event.request.labels),
        "reason": event.request.reason,
        "request_id": fact.record.causation_id,
        "created_at": event.requested_at,
        "expires_at": event.expires_at,
        "devices": [],
        "impaired_by": [],
        "chain": [chain_entry(fact.record)],
        "links": {},
        "updated_position": fact.record.position,
    }


def _fold(row: Row, event: Event) -> None:
    """The same transitions as engine.core.state.evolve, told in rows."""
    match event:
        case DevicesReserved(devices=bindings):
            row["devices"].extend(device_entry(b) for b in bindings)
            row["links"].update({b.device: list(b.links) for b in bindings})
        case CompositionActivated():
            # Also the end of a repair: what impaired it is history (the chain keeps it).
            row["state"] = "active"
            row["impaired_by"] = []
        case CompositionImpaired(component=component, reason=reason):
            row["state"] = "impaired"
            # Named once, with the reason it was first named for, as evolve() keeps it.
            if all(i["component"] != component for i in row["impaired_by"]):
                row["impaired_by"].append({"component": component, "reason": reason})
        case PathRerouted(device=device, binding=binding):
            _replace_device(row, device, binding)
        case DeviceReplaced(old_device=old, binding=binding):
            _replace_device(row, old, binding)
        case LeaseExtended(expires_at=expires_at):
            row["expires_at"] = expires_at
        case CompositionReleased():
            row["state"] = "released"
        case CompositionFailed():
            row["state"] = "failed"
        case _:
            pass  # PathEstablished, CircuitCreated, LeaseExpired: recorded in the chain only


def _replace_device(row: Row, device: str, binding: DeviceBinding) -> None:
    row["devices"] = [device_entry(binding) if d["id"] == device else d for d in row["devices"]]
    links = {k: v for k, v in row["links"].items() if k != device}
    row["links"] = {**links, binding.device: list(binding.links)}
    # What the move left behind impairs it no more (engine.core.state's _swap_binding).
    used = {n for d in row["devices"] for n in d["path"]}
    used.update(link for path in row["links"].values() for link in path)
    row["impaired_by"] = [i for i in row["impaired_by"] if i["component"] in used]
