"""Connection history over real NATS and Postgres: who held which device when, and why it
ended (projections/history.py, the `history` query and its tenant view), and a log that
still holds events of schema version 1 (engine/core/upcast.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest_asyncio
from fabrics import expect_error, expect_ok
from harness import Harness, ManualClock, serving
from history_day import DOMAIN, FABRIC, T0, at, brief, compose, day_served, history, play

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.context import Context
from trellis.engine.core.decide import decide
from trellis.engine.core.events import DevicesReserved, Event, encode
from trellis.engine.core.intents import Compose, ImportTopology
from trellis.engine.core.records import Head, PendingEvent
from trellis.engine.core.state import DomainState, evolve

PAYLOADS = Path(__file__).parents[1] / "core" / "payloads"


@pytest_asyncio.fixture
async def clock() -> ManualClock:
    return ManualClock(T0)


@pytest_asyncio.fixture
async def sim() -> SimulatedFabric:
    return SimulatedFabric(seed=3)


@pytest_asyncio.fixture
async def h(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    clock: ManualClock,
    sim: SimulatedFabric,
) -> AsyncIterator[Harness]:
    async with day_served(nats_url, database_url, pg_schema, subject_prefix, clock, sim) as harness:
        yield harness


async def test_history_tells_who_held_each_device_when_and_how_it_ended(
    h: Harness, clock: ManualClock, sim: SimulatedFabric
) -> None:
    day = await play(h, clock, sim)
    rows = await history(h, {})
    assert [brief(r) for r in rows] == [
        ("gpu-1", "acme", at(0), at(1800), "replaced"),
        ("gpu-2", "globex", at(600), at(2400), "released"),
        ("mem-1", "globex", at(600), at(2400), "released"),
        ("gpu-3", "acme", at(1800), at(3600), "lease_expired"),
        ("gpu-2", "initech", at(3000), at(3000), "failed"),
    ]
    first, h100, memory, stand_in, failed = rows
    assert first == {
        "device": "gpu-1",
        "kind": "gpu",
        "model": "A100",
        "host": "host-1",
        "composition_id": day.acme,
        "tenant": "acme",
        "start": at(0),
        "end": at(1800),
        "end_reason": "replaced",
        "bandwidth_gbps": 0.0,
        "capacity_gib": None,
        "cost_per_hour": 1.1,
        "start_position": first["start_position"],
        "end_position": stand_in["start_position"],
    }
    assert (stand_in["model"], stand_in["cost_per_hour"]) == ("A100", 1.2)
    assert (memory["kind"], memory["capacity_gib"], memory["bandwidth_gbps"]) == ("memory", 256, 50)
    assert (h100["composition_id"], failed["composition_id"]) == (day.globex, day.failed)
    assert first["start_position"] < h100["start_position"] < first["end_position"]


async def test_history_filters_by_device_host_composition_tenant_and_time(
    h: Harness, clock: ManualClock, sim: SimulatedFabric
) -> None:
    day = await play(h, clock, sim)

    async def devices(body: dict[str, Any]) -> list[tuple[str, str]]:
        return [(r["device"], r["tenant"]) for r in await history(h, body)]

    assert await devices({"id": "gpu-2"}) == [("gpu-2", "globex"), ("gpu-2", "initech")]
    assert await devices({"id": "host-1"}) == [("gpu-1", "acme"), ("gpu-3", "acme")]
    assert await devices({"id": day.globex}) == [("gpu-2", "globex"), ("mem-1", "globex")]
    assert await devices({"tenant": "acme", "id": "gpu-2"}) == []
    # "Who was on a device during the outage": the window overlaps, ends included.
    assert await devices({"id": "gpu-2", "since": at(2000), "until": at(2100)}) == [
        ("gpu-2", "globex")
    ]
    assert await devices({"since": at(2400), "until": at(2999)}) == [
        ("gpu-2", "globex"),
        ("mem-1", "globex"),
        ("gpu-3", "acme"),
    ]
    assert await devices({"until": at(599)}) == [("gpu-1", "acme")]
    assert await devices({"since": at(3601)}) == []
    assert await devices({"id": "gpu-9"}) == []


async def test_an_interval_still_held_is_open_and_reaches_into_every_later_window(
    h: Harness, clock: ManualClock
) -> None:
    expect_ok(await compose(h, "acme", {"host": "host-1", "devices": [{"kind": "gpu"}]}))
    (row,) = await history(h, {"since": at(86400 * 365)})
    assert (row["end"], row["end_reason"], row["end_position"]) == (None, None, None)


async def test_a_tenant_view_shows_only_its_own_intervals(
    h: Harness, clock: ManualClock, sim: SimulatedFabric
) -> None:
    day = await play(h, clock, sim)
    own = await history(h, {}, view="globex")
    assert {r["tenant"] for r in own} == {"globex"} and len(own) == 2
    assert await history(h, {"tenant": "acme"}, view="globex") == []
    assert await history(h, {"id": day.acme}, view="globex") == []
    assert len(await history(h, {"id": day.acme}, view="acme")) == 2


async def test_bad_history_bodies_are_invalid(h: Harness) -> None:
    for body in (
        {"since": "2026-11-30T12:00:00"},  # no offset: no moment
        {"since": at(10), "until": at(0)},
        {"id": "gpu 1"},
        {"device": "gpu-1"},
    ):
        expect_error(await h.client.query(DOMAIN, "history", body), "invalid")


# ---- a log written by the code before schema version 2 ----


async def test_a_log_holding_v1_bindings_folds_and_projects_with_the_topology_prices(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, clock: ManualClock
) -> None:
    """Given: a topology, a compose and its DevicesReserved as the old code wrote them
    (schema version 1: the bindings carry no model or price)."""
    state = DomainState(domain=DOMAIN)
    pending: list[PendingEvent] = []

    def record(events: list[Event], actor: str, request_id: str, when: datetime) -> None:
        nonlocal state
        for event in events:
            state = evolve(state, event)
            row = PendingEvent.of(
                event, actor=actor, causation_id=request_id, correlation_id=request_id, at=when
            )
            if isinstance(event, DevicesReserved):
                row = _as_v1(row)
            pending.append(row)

    def ctx(actor: str, verb: str, when: datetime) -> Context:
        return Context(domain=DOMAIN, actor=actor, verb=verb, now=when)

    topology = msgspec.convert({"request_id": "topo-1", **FABRIC}, ImportTopology)
    record(
        decide(state, topology, ctx("operator", "import-topology", T0)).events,
        "operator",
        "topo-1",
        T0,
    )
    ask = msgspec.convert(
        {"request_id": "r-old", "host": "host-1", "devices": [{"kind": "gpu", "models": ["H100"]}]},
        Compose,
    )
    old = decide(state, ask, ctx("acme", "compose", T0 + timedelta(seconds=60)))
    record(old.events, "acme", "r-old", T0 + timedelta(seconds=60))
    cid = old.result.composition_id
    store = await PostgresEventStore.open(database_url, schema=pg_schema)
    try:
        await store.append(DOMAIN, Head(), pending, [])
        stored = [r async for r in store.read(DOMAIN)]
    finally:
        await store.close()
    v1 = [r for r in stored if r.type == "DevicesReserved"]
    assert [r.schema_version for r in v1] == [1] and b"cost_per_hour" not in v1[0].data

    # When: an engine of today serves that log and the tenant releases.
    clock.advance(3600 + 60)
    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as h:
        expect_ok(await h.client.query(DOMAIN, "topology", {}))  # loads the domain
        await h.fabric_idle(DOMAIN)  # the saga settles the pending composition
        held = expect_ok(await h.client.query(DOMAIN, "composition", {"id": cid}))
        assert held["state"] == "active" and held["devices"][0]["id"] == "gpu-2"
        release = {"composition_id": cid}
        expect_ok(await h.client.intent(DOMAIN, "acme", "release", release))
        free = expect_ok(await h.client.query(DOMAIN, "free", {"kind": "gpu"}))
        assert "gpu-2" in [d["id"] for d in free["devices"]]
        (row,) = await history(h, {"id": cid})

    # Then: the interval takes model and price from the topology in force when it began.
    assert (row["device"], row["model"], row["cost_per_hour"]) == ("gpu-2", "H100", 2.5)
    assert (row["start"], row["end"], row["end_reason"]) == (at(60), at(3660), "released")


def _as_v1(row: PendingEvent) -> PendingEvent:
    """The event as the code before schema version 2 encoded it: the same keys in the same
    order, without the binding's model and cost_per_hour (compare payloads/v1)."""
    data = json.loads(row.data)
    for binding in data["devices"]:
        del binding["model"], binding["cost_per_hour"]
    old = (PAYLOADS / "v1" / "DevicesReserved.json").read_bytes()
    assert list(json.loads(old)["devices"][0]) == list(data["devices"][0])
    return msgspec.structs.replace(row, schema_version=1, data=encode(data))
