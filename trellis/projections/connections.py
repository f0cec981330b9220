"""The connections projection: what is connected to what, and why.

One row per device bound to a live composition, carrying the path it is reached over and the
request that asked for it (`why`). Rows leave when their composition is released or fails, so
the table is always the fabric's current wiring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from trellis.engine.core.events import (
    CompositionFailed,
    CompositionReleased,
    CompositionRequested,
    DeviceBinding,
    DeviceReplaced,
    DevicesReserved,
    Event,
    PathRerouted,
)
from trellis.engine.core.records import RecordedEvent
from trellis.projections.base import Fact, composition_keys, of_types
from trellis.projections.table import Column, Row, Rows, RowSource, Table

CONNECTIONS = Table(
    "proj_connections",
    (
        Column("domain", "text"),
        Column("composition_id", "text"),
        Column("device", "text"),
        Column("host", "text"),
        Column("tenant", "text"),
        Column("path", "jsonb"),
        Column("links", "jsonb"),
        Column("bandwidth_gbps", "float8"),
        Column("capacity_gib", "float8"),
        Column("since", "timestamptz"),
        Column("why", "jsonb"),
    ),
    key=("domain", "composition_id", "device"),
    group=("domain", "composition_id"),
)

# The request behind each live composition: DevicesReserved does not repeat it.
REQUESTS = Table(
    "proj_connection_requests",
    (
        Column("domain", "text"),
        Column("composition_id", "text"),
        Column("host", "text"),
        Column("tenant", "text"),
        Column("why", "jsonb"),
    ),
    key=("domain", "composition_id"),
)


# The event types the fold below changes rows for (its `match` arms); it never sees the rest.
FOLDED: frozenset[type[Event]] = frozenset(
    {
        CompositionRequested,
        DevicesReserved,
        PathRerouted,
        DeviceReplaced,
        CompositionReleased,
        CompositionFailed,
    }
)


class ConnectionsProjection:
    """Folds reservations and releases into proj_connections."""

    name: str = "connections"
    tables: tuple[Table, ...] = (CONNECTIONS, REQUESTS)

    async def apply(self, source: RowSource, facts: Sequence[Fact]) -> None:
        facts = of_types(facts, FOLDED)
        if not facts:
            return
        connections = Rows(CONNECTIONS, source)
        requests = Rows(REQUESTS, source)
        keys = composition_keys(facts)
        await requests.prefetch(keys)
        await connections.prefetch_groups(keys)
        for fact in facts:
            record, event = fact
            match event:
                case CompositionRequested():
                    requests.put(_request_row(record, event))
                case DevicesReserved(composition_id=cid, devices=bindings):
                    request = await requests.get((record.domain, cid))
                    for binding in bindings:
                        connections.put(_connection(record, cid, binding, request))
                case PathRerouted(composition_id=cid, device=device, binding=binding):
                    row = await connections.get((record.domain, cid, device))
                    if row is not None:
                        # Same device, new path: it has been connected since it first was.
                        connections.put({**_connection(record, cid, binding, None), **_kept(row)})
                case DeviceReplaced(composition_id=cid, old_device=old, binding=binding):
                    connections.delete((record.domain, cid, old))
                    request = await requests.get((record.domain, cid))
                    connections.put(_connection(record, cid, binding, request))
                case (
                    CompositionReleased(composition_id=cid) | CompositionFailed(composition_id=cid)
                ):
                    for row in await connections.group((record.domain, cid)):
                        connections.delete(CONNECTIONS.key_of(row))
                    requests.delete((record.domain, cid))
                case _:
                    pass
        await requests.flush()
        await connections.flush()


def _request_row(record: RecordedEvent, event: CompositionRequested) -> Row:
    request = event.request
    return {
        "domain": record.domain,
        "composition_id": event.composition_id,
        "host": event.host,
        "tenant": event.tenant,
        "why": {
            "request_id": record.causation_id,
            "actor": record.actor,
            "reason": request.reason,
            "labels": dict(request.labels),
            "constraints": msgspec.to_builtins(request.constraints),
            "position": record.position,
        },
    }


def _connection(
    record: RecordedEvent, cid: str, binding: DeviceBinding, request: Row | None
) -> Row:
    if request is None:
        # Only a log that reserves for a composition it never requested gets here; say what
        # the envelope knows rather than drop the wiring.
        request = {
            "host": binding.path[0],
            "tenant": record.actor,
            "why": {"request_id": record.causation_id, "actor": record.actor},
        }
    return {
        "domain": record.domain,
        "composition_id": cid,
        "device": binding.device,
        "host": request["host"],
        "tenant": request["tenant"],
        "path": list(binding.path),
        "links": list(binding.links),
        "bandwidth_gbps": binding.bandwidth_gbps,
        "capacity_gib": binding.capacity_gib,
        "since": record.recorded_at,
        "why": request["why"],
    }


def _kept(row: Row) -> dict[str, Any]:
    return {k: row[k] for k in ("host", "tenant", "since", "why")}
