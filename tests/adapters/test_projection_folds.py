"""What each projection's fold is handed: only the event types its `match` arms name.

A projection declares those types (FOLDED) and picks them out of a batch once, so the events it
ignores cost it nothing per event (projections.base.of_types). The declaration is a second
statement of what the fold already says; these tests hold the two together, so a new arm
cannot be skipped silently, and check that a batch of nothing a projection folds costs it no
statement at all."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Sequence
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import pytest

from trellis.engine.core import events
from trellis.engine.core.events import (
    CircuitCreated,
    CompositionActivated,
    Event,
    PathEstablished,
    QuotaSet,
)
from trellis.engine.core.records import RecordedEvent
from trellis.projections import connections, devices, history
from trellis.projections.base import Fact, composition_keys, composition_of, of_types
from trellis.projections.table import Key, Row, Table

PROJECTIONS = {
    connections: connections.ConnectionsProjection,
    devices: devices.DevicesProjection,
    history: history.HistoryProjection,
}
FOLDS = list(PROJECTIONS)


def matched_types(module: ModuleType) -> set[type[Event]]:
    """Every event class a `case` pattern of `module` names."""
    names = {
        node.cls.id
        for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.MatchClass) and isinstance(node.cls, ast.Name)
    }
    return {getattr(events, n) for n in names if isinstance(getattr(events, n, None), type)}


@pytest.mark.parametrize("module", FOLDS, ids=lambda m: m.__name__)
def test_a_projection_declares_exactly_the_types_its_match_arms_name(module: ModuleType) -> None:
    assert matched_types(module) == module.FOLDED


class Counting:
    """A RowSource that holds nothing and counts the statements it would have run."""

    def __init__(self) -> None:
        self.statements = 0

    async def fetch(self, table: Table, by: tuple[str, ...], keys: Sequence[Key]) -> list[Row]:
        self.statements += 1
        return []

    async def write(self, table: Table, gone: Sequence[Key], kept: Sequence[Row]) -> None:
        self.statements += 1


def fact(version: int, event: Event) -> Fact:
    record = RecordedEvent(
        id=f"e{version}",
        domain="d",
        version=version,
        position=version,
        type=type(event).__name__,
        schema_version=1,
        recorded_at=datetime(2026, 3, 1, tzinfo=UTC),
        actor="tenant",
        causation_id=f"r{version}",
        correlation_id=f"r{version}",
        data=b"{}",
        prev_hash="",
        hash="",
    )
    return Fact(record, event)


@pytest.mark.parametrize("module", FOLDS, ids=lambda m: m.__name__)
async def test_a_batch_of_events_a_projection_ignores_costs_it_no_statement(
    module: ModuleType,
) -> None:
    ignored: list[Any] = [
        PathEstablished(composition_id="c1", device="gpu-1", path=["h1", "gpu-1"]),
        CompositionActivated(composition_id="c1"),
    ]
    facts = [fact(v, e) for v, e in enumerate(ignored, 1) if type(e) not in module.FOLDED]
    assert facts
    projection = PROJECTIONS[module]()
    source = Counting()
    await projection.apply(source, facts)
    assert source.statements == 0


def mixed_batch() -> list[Fact]:
    """Events with a composition, with an empty one (a circuit no composition asked for) and
    with none, some of one type twice."""
    batch: list[Any] = [
        PathEstablished(composition_id="c1", device="gpu-1", path=["h1", "gpu-1"]),
        CircuitCreated(ocs="o1", a_port=1, b_port=2, host="h1"),
        QuotaSet(tenant="t", kind="gpu", count=2),
        CompositionActivated(composition_id="c2"),
        CircuitCreated(ocs="o1", a_port=3, b_port=4, host="h1", composition_id="c3"),
        PathEstablished(composition_id="c1", device="gpu-2", path=["h1", "gpu-2"]),
    ]
    return [fact(v, e) for v, e in enumerate(batch, 1)]


def test_composition_keys_are_the_compositions_composition_of_names() -> None:
    facts = mixed_batch()
    expected = {(f.record.domain, c) for f in facts if (c := composition_of(f.event))}
    assert composition_keys(facts) == expected == {("d", "c1"), ("d", "c2"), ("d", "c3")}


def test_of_types_keeps_the_facts_of_those_types_in_log_order() -> None:
    facts = mixed_batch()
    types = frozenset({PathEstablished, CircuitCreated})
    assert of_types(facts, types) == [f for f in facts if type(f.event) in types]
    assert [f.record.version for f in of_types(facts, types)] == [1, 2, 5, 6]
    assert of_types(facts, frozenset()) == []
