"""The devices projection: every pooled device with its attributes, health and holder, and
every node and link of the fabric with the topology events that made it what it is.

proj_devices answers "what is free" and "who holds this"; proj_components lets `why` tell an
idle host or link from an unknown id and say what happened to a free device; proj_device_holds
remembers what each composition took, so a release gives back exactly that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from trellis.engine.core.events import (
    ComponentDrained,
    ComponentFaulted,
    ComponentRecovered,
    ComponentRemoved,
    ComponentUndrained,
    CompositionFailed,
    CompositionReleased,
    DeviceBinding,
    DeviceReplaced,
    DevicesReserved,
    Event,
    LinkAdded,
    NodeAdded,
    TopologyImported,
)
from trellis.engine.core.model import LinkSpec, NodeSpec
from trellis.engine.core.records import RecordedEvent
from trellis.projections.base import Fact, chain_entry, composition_keys, of_types
from trellis.projections.table import Column, Row, Rows, RowSource, Table

DEVICES = Table(
    "proj_devices",
    (
        Column("domain", "text"),
        Column("device", "text"),
        Column("device_kind", "text"),
        Column("vendor", "text"),
        Column("model", "text"),
        Column("generation", "bigint"),
        Column("memory_gib", "float8"),
        Column("capacity_gib", "float8"),
        Column("cost_per_hour", "float8"),
        Column("labels", "jsonb"),
        Column("health", "text"),
        Column("drained", "boolean"),
        Column("owner", "text"),
        Column("memory_used_gib", "float8"),
    ),
    key=("domain", "device"),
)

COMPONENTS = Table(
    "proj_components",
    (
        Column("domain", "text"),
        Column("id", "text"),
        Column("kind", "text"),
        Column("health", "text"),
        Column("drained", "boolean"),
        Column("detail", "text"),
        Column("chain", "jsonb"),
    ),
    key=("domain", "id"),
)

HOLDS = Table(
    "proj_device_holds",
    (
        Column("domain", "text"),
        Column("composition_id", "text"),
        Column("device", "text"),
        Column("capacity_gib", "float8"),
    ),
    key=("domain", "composition_id", "device"),
    group=("domain", "composition_id"),
)

# A component's chain keeps its latest topology events only: telemetry may report a flapping
# link thousands of times, and `why` needs what made it so, not its whole life story.
CHAIN_LIMIT = 50

# Slices are floats; a pool given back in pieces may leave rounding dust (the engine's own
# fold drops it at the same threshold).
_DUST_GIB = 1e-9


# The event types the fold below changes rows for (its `match` arms); it never sees the rest.
FOLDED: frozenset[type[Event]] = frozenset(
    {
        TopologyImported,
        NodeAdded,
        LinkAdded,
        ComponentRemoved,
        ComponentDrained,
        ComponentUndrained,
        ComponentFaulted,
        ComponentRecovered,
        DevicesReserved,
        DeviceReplaced,
        CompositionReleased,
        CompositionFailed,
    }
)


class DevicesProjection:
    """Folds topology events and reservations into proj_devices and proj_components."""

    name: str = "devices"
    tables: tuple[Table, ...] = (DEVICES, COMPONENTS, HOLDS)

    async def apply(self, source: RowSource, facts: Sequence[Fact]) -> None:
        facts = of_types(facts, FOLDED)
        if not facts:
            return
        batch = _Batch(source)
        await batch.prefetch(facts)
        for fact in facts:
            await batch.fold(fact.record, fact.event)
        await batch.flush()


class _Batch:
    def __init__(self, source: RowSource):
        self.devices = Rows(DEVICES, source)
        self.components = Rows(COMPONENTS, source)
        self.holds = Rows(HOLDS, source)

    async def prefetch(self, facts: Sequence[Fact]) -> None:
        """Fetch what the batch will touch in a few statements: holds of the compositions it
        names first, then every component and device named by an event or by those holds."""
        await self.holds.prefetch_groups(composition_keys(facts))
        named = {(f.record.domain, c) for f in facts for c in _components_named(f.event)}
        await self.components.prefetch(named)
        held = {(h["domain"], h["device"]) for h in self.holds.cached()}
        await self.devices.prefetch(named | held)

    async def fold(self, record: RecordedEvent, event: Event) -> None:
        domain = record.domain
        match event:
            case TopologyImported(nodes=nodes, links=links, added=added, updated=updated):
                for gone in event.removed:
                    self.components.delete((domain, gone))
                    self.devices.delete((domain, gone))
                changed = set(added) | set(updated)
                for node in nodes:
                    await self._specified(record, node, node.id in changed)
                for link in links:
                    await self._specified(record, link, link.id in changed)
            case NodeAdded(node=node) | LinkAdded(link=node):
                await self._specified(record, node, True)
            case ComponentRemoved(component=cid, links=attached):
                for gone in [cid, *attached]:
                    self.components.delete((domain, gone))
                    self.devices.delete((domain, gone))
            case ComponentDrained(component=cid):
                await self._mark(record, cid, drained=True)
            case ComponentUndrained(component=cid):
                await self._mark(record, cid, drained=False)
            case ComponentFaulted(component=cid, state=health, detail=detail):
                await self._mark(record, cid, health=health, detail=detail)
            case ComponentRecovered(component=cid, detail=detail):
                await self._mark(record, cid, health="healthy", detail=detail)
            case DevicesReserved(composition_id=cid, devices=bindings):
                for binding in bindings:
                    await self._hold(domain, cid, binding)
            case DeviceReplaced(composition_id=cid, old_device=old, binding=binding):
                hold = await self.holds.get((domain, cid, old))
                if hold is not None:
                    await self._give_back(hold)
                await self._hold(domain, cid, binding)
            case CompositionReleased(composition_id=cid) | CompositionFailed(composition_id=cid):
                for hold in await self.holds.group((domain, cid)):
                    await self._give_back(hold)
            case _:
                pass

    async def flush(self) -> None:
        await self.holds.flush()
        await self.components.flush()
        await self.devices.flush()

    async def _specified(
        self, record: RecordedEvent, spec: NodeSpec | LinkSpec, changed: bool
    ) -> None:
        """A node or link as the topology now describes it; health and drain marks stay, as
        they do in the engine's fold. Untouched components of a re-import are not rewritten."""
        key = (record.domain, spec.id)
        component = await self.components.get(key)
        if component is not None and not changed:
            return
        if component is None:
            component = {
                "domain": record.domain,
                "id": spec.id,
                "health": "healthy",
                "drained": False,
                "detail": "",
                "chain": [],
            }
        component["kind"] = spec.kind if isinstance(spec, NodeSpec) else "link"
        _remember(component, record)
        self.components.put(component)
        if isinstance(spec, NodeSpec) and spec.kind == "device":
            self.devices.put(_device_row(record.domain, spec, await self.devices.get(key)))
        else:
            self.devices.delete(key)

    async def _mark(self, record: RecordedEvent, cid: str, **marks: Any) -> None:
        key = (record.domain, cid)
        component = await self.components.get(key)
        if component is None:
            return
        component.update(marks)
        _remember(component, record)
        self.components.put(component)
        device = await self.devices.get(key)
        if device is not None:
            device.update({k: v for k, v in marks.items() if k in ("health", "drained")})
            self.devices.put(device)

    async def _hold(self, domain: str, cid: str, binding: DeviceBinding) -> None:
        self.holds.put(
            {
                "domain": domain,
                "composition_id": cid,
                "device": binding.device,
                "capacity_gib": binding.capacity_gib,
            }
        )
        device = await self.devices.get((domain, binding.device))
        if device is None:
            return
        if binding.capacity_gib is None:
            device["owner"] = cid
        else:
            device["memory_used_gib"] = _add(device["memory_used_gib"], binding.capacity_gib)
        self.devices.put(device)

    async def _give_back(self, hold: Row) -> None:
        self.holds.delete(HOLDS.key_of(hold))
        device = await self.devices.get((hold["domain"], hold["device"]))
        if device is None:
            return
        if hold["capacity_gib"] is None:
            if device["owner"] == hold["composition_id"]:
                device["owner"] = None
        else:
            device["memory_used_gib"] = _add(device["memory_used_gib"], -hold["capacity_gib"])
        self.devices.put(device)


def _components_named(event: Event) -> Iterable[str]:
    match event:
        case TopologyImported(nodes=nodes, links=links):
            return [n.id for n in nodes] + [lk.id for lk in links]
        case NodeAdded(node=node):
            return [node.id]
        case LinkAdded(link=link):
            return [link.id]
        case (
            ComponentDrained(component=cid)
            | ComponentUndrained(component=cid)
            | ComponentFaulted(component=cid)
            | ComponentRecovered(component=cid)
        ):
            return [cid]
        case DevicesReserved(devices=bindings):
            return [b.device for b in bindings]
        case DeviceReplaced(old_device=old, binding=binding):
            return [old, binding.device]
        case _:
            return []


def _device_row(domain: str, spec: NodeSpec, old: Row | None) -> Row:
    # Slices are counted for memory pools only; other kinds are held whole (`owner`).
    used = (old["memory_used_gib"] if old else None) or 0.0
    return {
        "domain": domain,
        "device": spec.id,
        "device_kind": spec.device_kind,
        "vendor": spec.vendor,
        "model": spec.model,
        "generation": spec.generation,
        "memory_gib": spec.memory_gib,
        "capacity_gib": spec.capacity_gib,
        "cost_per_hour": spec.cost_per_hour,
        "labels": dict(spec.labels),
        # Marks and holdings survive a re-specification, as in the engine's fold.
        "health": old["health"] if old else "healthy",
        "drained": old["drained"] if old else False,
        "owner": old["owner"] if old else None,
        "memory_used_gib": used if spec.device_kind == "memory" else None,
    }


def _remember(component: Row, record: RecordedEvent) -> None:
    component["chain"] = [*component["chain"], chain_entry(record)][-CHAIN_LIMIT:]


def _add(total: float | None, delta: float) -> float:
    value = (total or 0.0) + delta
    return value if value > _DUST_GIB else 0.0
