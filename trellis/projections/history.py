"""The connection history projection: who held which device when (issue 10 item 5).

proj_history_intervals keeps one row per interval a device was bound to a composition, with
what a bill needs: kind, model, host, tenant, start and end, why it ended, the bandwidth and
memory slice reserved and the hourly price. Rows stay after they end: this is history.

When an interval starts and ends (times are the `recorded_at` of the events, positions theirs):
- start: the device is reserved for the composition (`DevicesReserved`), or reserved as the
  stand-in of a replaced one (`DeviceReplaced`). From then on no one else can have it, so
  that is when GPU-hours are charged, whether or not the fabric has finished programming it.
- end, with `end_reason`:
  `released`       the composition was released (CompositionReleased);
  `lease_expired`  its lease ran out (LeaseExpired; the interval ends at the release it
                   causes, the next event of the same commit, as the composition does);
  `failed`         the fabric could not establish it (CompositionFailed);
  `replaced`       repair or drain moved the composition to another device (DeviceReplaced;
                   the stand-in's interval starts at the same event).
  A reroute (PathRerouted) keeps the device, and its interval. Impairment does not end one:
  the tenant still holds the device. A device in use cannot be removed from the topology
  (engine/core/topology.py refuses), so removal ends nothing.

proj_history_compositions is each composition's life (requested, activated, ended, how);
proj_history_devices the attributes of every device as the topology says now, for bindings
of schema version 1 that did not record them (engine/core/upcast.py).

`Window` and `interval_query` say which intervals a `history` query asks for, in memory and
in SQL, for the live and past readers of projections/read_models.py and projections/past.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec

from trellis.engine.core.events import (
    ComponentRemoved,
    CompositionActivated,
    CompositionFailed,
    CompositionImpaired,
    CompositionReleased,
    CompositionRequested,
    DeviceBinding,
    DeviceReplaced,
    DevicesReserved,
    Event,
    LeaseExpired,
    NodeAdded,
    TopologyImported,
)
from trellis.engine.core.model import NodeSpec
from trellis.engine.core.records import RecordedEvent
from trellis.projections.base import Fact, composition_keys, of_types
from trellis.projections.table import Column, Row, Rows, RowSource, Table

INTERVALS = Table(
    "proj_history_intervals",
    (
        Column("domain", "text"),
        Column("composition_id", "text"),
        Column("device", "text"),
        Column("start_position", "bigint"),
        Column("kind", "text"),
        Column("model", "text"),
        Column("host", "text"),
        Column("tenant", "text"),
        Column("started_at", "timestamptz"),
        Column("ended_at", "timestamptz"),
        Column("end_position", "bigint"),
        Column("end_reason", "text"),
        Column("bandwidth_gbps", "float8"),
        Column("capacity_gib", "float8"),
        Column("cost_per_hour", "float8"),
    ),
    key=("domain", "composition_id", "device", "start_position"),
    group=("domain", "composition_id"),
    # An interval that ended is history: no later event changes it.
    final="ended_at IS NOT NULL",
    final_position="end_position",
)

LIVES = Table(
    "proj_history_compositions",
    (
        Column("domain", "text"),
        Column("composition_id", "text"),
        Column("tenant", "text"),
        Column("host", "text"),
        Column("state", "text"),
        Column("requested_at", "timestamptz"),
        Column("requested_position", "bigint"),
        Column("activated_at", "timestamptz"),
        Column("activated_position", "bigint"),
        Column("ended_at", "timestamptz"),
        Column("end_position", "bigint"),
        Column("end_reason", "text"),
        Column("failure_reason", "text"),
    ),
    key=("domain", "composition_id"),
    final="state IN ('released', 'failed')",
    final_position="end_position",
)

DEVICES = Table(
    "proj_history_devices",
    (
        Column("domain", "text"),
        Column("device", "text"),
        Column("kind", "text"),
        Column("model", "text"),
        Column("cost_per_hour", "float8"),
    ),
    key=("domain", "device"),
)


class Window(msgspec.Struct, frozen=True, kw_only=True):
    """Which intervals a `history` query asks for: of `id` (a device, host or composition)
    and `tenant`, overlapping [since, until] with the ends included; None: any."""

    id: str | None = None
    tenant: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def holds(self, row: Row) -> bool:
        """`interval_query`'s test, for rows in memory (a past moment's fold)."""
        return (
            (self.id is None or self.id in (row["device"], row["host"], row["composition_id"]))
            and (self.tenant is None or row["tenant"] == self.tenant)
            and (self.since is None or row["ended_at"] is None or row["ended_at"] >= self.since)
            and (self.until is None or row["started_at"] <= self.until)
        )


def interval_query(domain: str, window: Window, *, ended_by: int | None = None) -> tuple[Any, ...]:
    """The SQL (and its arguments) for the intervals of `domain` in `window`, in the order
    `history` lists them: by start position, then device (as Python sorts text); with
    `ended_by`, only those that ended at or before that position."""
    conditions = ["domain = $1"]
    values: list[Any] = [domain]

    def given(condition: str, value: Any) -> None:
        values.append(value)
        conditions.append(condition.replace("$?", f"${len(values)}"))

    if window.id is not None:
        given("(device = $? OR host = $? OR composition_id = $?)", window.id)
    if window.tenant is not None:
        given("tenant = $?", window.tenant)
    if window.since is not None:
        given("(ended_at IS NULL OR ended_at >= $?)", window.since)
    if window.until is not None:
        given("started_at <= $?", window.until)
    if ended_by is not None:
        given("end_position <= $?", ended_by)
    sql = (
        f"SELECT {', '.join(INTERVALS.names)} FROM {INTERVALS.name}"
        f' WHERE {" AND ".join(conditions)} ORDER BY start_position, device COLLATE "C"'
    )
    return (sql, *values)


def last_ended_query(domain: str, device: str, *, ended_by: int | None = None) -> tuple[Any, ...]:
    """The SQL (and its arguments) for the interval of `device` that ended last (with
    `ended_by`, at or before that position): why a device that holds nothing is free."""
    bound = "" if ended_by is None else " AND end_position <= $3"
    sql = (
        f"SELECT {', '.join(INTERVALS.names)} FROM {INTERVALS.name}"
        f" WHERE domain = $1 AND device = $2 AND end_position IS NOT NULL{bound}"
        " ORDER BY end_position DESC LIMIT 1"
    )
    return (sql, domain, device) if ended_by is None else (sql, domain, device, ended_by)


# The event types the fold below changes rows for (its `match` arms); it never sees the rest.
FOLDED: frozenset[type[Event]] = frozenset(
    {
        TopologyImported,
        NodeAdded,
        ComponentRemoved,
        CompositionRequested,
        DevicesReserved,
        DeviceReplaced,
        CompositionActivated,
        CompositionImpaired,
        LeaseExpired,
        CompositionReleased,
        CompositionFailed,
    }
)


class HistoryProjection:
    """Folds reservations, replacements and endings into proj_history_intervals."""

    name: str = "history"
    tables: tuple[Table, ...] = (INTERVALS, LIVES, DEVICES)

    async def apply(self, source: RowSource, facts: Sequence[Fact]) -> None:
        facts = of_types(facts, FOLDED)
        if not facts:
            return
        batch = _Batch(source)
        await batch.prefetch(facts)
        for record, event in facts:
            await batch.fold(record, event)
        await batch.flush()


class _Batch:
    def __init__(self, source: RowSource):
        self.intervals = Rows(INTERVALS, source)
        self.lives = Rows(LIVES, source)
        self.devices = Rows(DEVICES, source)

    async def prefetch(self, facts: Sequence[Fact]) -> None:
        keys = composition_keys(facts)
        await self.lives.prefetch(keys)
        await self.intervals.prefetch_groups(keys)
        await self.devices.prefetch(
            (f.record.domain, b.device) for f in facts for b in _bindings(f.event)
        )

    async def fold(self, record: RecordedEvent, event: Event) -> None:
        domain = record.domain
        match event:
            case TopologyImported(nodes=nodes, removed=removed):
                for gone in removed:
                    self.devices.delete((domain, gone))
                for node in nodes:
                    self._specified(domain, node)
            case NodeAdded(node=node):
                self._specified(domain, node)
            case ComponentRemoved(component=gone):
                self.devices.delete((domain, gone))
            case CompositionRequested(composition_id=cid, tenant=tenant, host=host):
                self.lives.put(_life(record, cid, tenant, host))
            case DevicesReserved(composition_id=cid, devices=bindings):
                for binding in bindings:
                    await self._open(record, cid, binding)
            case DeviceReplaced(composition_id=cid, old_device=old, binding=binding):
                await self._close(record, cid, "replaced", device=old)
                await self._open(record, cid, binding)
            case CompositionActivated(composition_id=cid):
                await self._update_life(cid, domain, state="active", first_active=record)
            case CompositionImpaired(composition_id=cid):
                await self._update_life(cid, domain, state="impaired")
            case LeaseExpired(composition_id=cid):
                # The release it causes follows in the same commit, and ends the intervals
                # there (where `connections` and the composition end them too), saying why.
                await self._update_life(cid, domain, end_reason="lease_expired")
            case CompositionReleased(composition_id=cid):
                life = await self.lives.get((domain, cid))
                await self._close(record, cid, (life or {}).get("end_reason") or "released")
                await self._end_life(record, cid, "released")
            case CompositionFailed(composition_id=cid, reason=reason):
                await self._close(record, cid, "failed")
                await self._end_life(record, cid, "failed", failure_reason=reason)
            case _:
                pass

    async def flush(self) -> None:
        await self.devices.flush()
        await self.lives.flush()
        await self.intervals.flush()

    def _specified(self, domain: str, node: NodeSpec) -> None:
        # Node and link ids share one namespace: a node re-specified as no device is none.
        if node.kind != "device" or node.device_kind is None:
            self.devices.delete((domain, node.id))
            return
        self.devices.put(
            {
                "domain": domain,
                "device": node.id,
                "kind": node.device_kind,
                "model": node.model,
                "cost_per_hour": node.cost_per_hour,
            }
        )

    async def _open(self, record: RecordedEvent, cid: str, binding: DeviceBinding) -> None:
        life = await self.lives.get((record.domain, cid))
        device = await self.devices.get((record.domain, binding.device)) or {}
        # A v2 binding says model and price itself; a v1 one (upcast with nulls) did not, and
        # the topology folded up to this position is what was in force when it was made.
        model = binding.model if binding.model is not None else device.get("model")
        cost = binding.cost_per_hour
        if cost is None:
            cost = device.get("cost_per_hour")
        self.intervals.put(
            {
                "domain": record.domain,
                "composition_id": cid,
                "device": binding.device,
                "start_position": record.position,
                "kind": binding.kind,
                "model": model,
                # Only a log that reserves for a composition it never requested lacks a life;
                # say what the envelope and the path know rather than drop the interval.
                "host": life["host"] if life else binding.path[0],
                "tenant": life["tenant"] if life else record.actor,
                "started_at": record.recorded_at,
                "ended_at": None,
                "end_position": None,
                "end_reason": None,
                "bandwidth_gbps": binding.bandwidth_gbps,
                "capacity_gib": binding.capacity_gib,
                "cost_per_hour": cost,
            }
        )

    async def _close(
        self, record: RecordedEvent, cid: str, reason: str, *, device: str | None = None
    ) -> None:
        """End the open intervals of `cid` (of `device` only, when given)."""
        for row in await self.intervals.group((record.domain, cid)):
            if row["ended_at"] is None and device in (None, row["device"]):
                row["ended_at"] = record.recorded_at
                row["end_position"] = record.position
                row["end_reason"] = reason
                self.intervals.put(row)

    async def _update_life(
        self,
        cid: str,
        domain: str,
        *,
        state: str | None = None,
        end_reason: str | None = None,
        first_active: RecordedEvent | None = None,
    ) -> None:
        life = await self.lives.get((domain, cid))
        if life is None:
            return
        if state is not None:
            life["state"] = state
        if end_reason is not None:
            life["end_reason"] = end_reason
        if first_active is not None and life["activated_at"] is None:
            life["activated_at"] = first_active.recorded_at
            life["activated_position"] = first_active.position
        self.lives.put(life)

    async def _end_life(
        self, record: RecordedEvent, cid: str, state: str, *, failure_reason: str | None = None
    ) -> None:
        life = await self.lives.get((record.domain, cid))
        if life is None:
            return
        life["state"] = state
        life["ended_at"] = record.recorded_at
        life["end_position"] = record.position
        # A release caused by LeaseExpired keeps the reason that event gave it.
        life["end_reason"] = life["end_reason"] or state
        life["failure_reason"] = failure_reason
        self.lives.put(life)


def _life(record: RecordedEvent, cid: str, tenant: str, host: str) -> Row:
    return {
        "domain": record.domain,
        "composition_id": cid,
        "tenant": tenant,
        "host": host,
        "state": "pending",
        "requested_at": record.recorded_at,
        "requested_position": record.position,
        "activated_at": None,
        "activated_position": None,
        "ended_at": None,
        "end_position": None,
        "end_reason": None,
        "failure_reason": None,
    }


def _bindings(event: Event) -> list[DeviceBinding]:
    match event:
        case DevicesReserved(devices=bindings):
            return list(bindings)
        case DeviceReplaced(binding=binding):
            return [binding]
        case _:
            return []
