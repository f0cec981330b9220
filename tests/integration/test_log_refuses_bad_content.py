"""Defence in depth: the log refuses, at append, what validation should have refused (issue 9).

schema/007 checks every appended event: its domain and actor are ids, the node and link ids in
its data are ids (whole strings, no trailing newline), its numbers fit int64, and its text can be
stored. These tests append straight through PostgresEventStore.append, bypassing the engine and
its validation, as a bug in validation would; then through a DomainWriter, to show the client of
such a request hears `invalid` and the rest of its batch is committed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio
from fabrics import fetch, row_counts

from trellis.adapters.clock import SystemClock
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.errors import EventRefused
from trellis.engine.core.events import EVENT_TYPES
from trellis.engine.core.intents import AddNode, ImportTopology
from trellis.engine.core.model import NodeSpec
from trellis.engine.core.records import Head, PendingEvent
from trellis.engine.service.writer import DomainWriter

DOMAIN = "hall-1"
AT = datetime(2026, 12, 1, tzinfo=UTC)


@pytest_asyncio.fixture
async def store(database_url: str, pg_schema: str) -> AsyncIterator[PostgresEventStore]:
    opened = await PostgresEventStore.open(database_url, schema=pg_schema)
    yield opened
    await opened.close()


def pending(type_: str, data: dict[str, Any] | str, actor: str = "operator") -> PendingEvent:
    text = data if isinstance(data, str) else json.dumps({"type": type_, **data})
    return PendingEvent(
        id=str(uuid.uuid4()),
        type=type_,
        schema_version=1,
        actor=actor,
        causation_id="r-1",
        correlation_id="r-1",
        recorded_at=AT,
        data=text.encode(),
    )


HOST = {"id": "host-01", "kind": "host"}
SWITCH = {"id": "sw-1", "kind": "switch", "latency_ns": 150}
LINK = {"id": "l-1", "a": "host-01", "b": "sw-1", "capacity_gbps": 64.0}
BINDING = {
    "device": "gpu-01",
    "kind": "gpu",
    "path": ["host-01", "sw-1", "gpu-01"],
    "links": ["l-1", "l-2"],
    "circuits": [{"ocs": "ocs-1", "a_port": 0, "b_port": 1}],
    "hops": 2,
    "latency_ns": 250,
}
COMPOSE = {"request_id": "r-1", "host": "host-01", "device_ids": ["gpu-01"]}


def topology(**changes: Any) -> dict[str, Any]:
    return {"nodes": [HOST, SWITCH], "links": [LINK], "added": ["host-01", "l-1", "sw-1"]} | changes


GOOD = [
    pending("TopologyImported", topology()),
    pending("NodeAdded", {"node": {"id": "x" * 64, "kind": "host"}}),
    pending("LinkAdded", {"link": {**LINK, "id": "A_z-9"}}),
    pending("ComponentDrained", {"component": "sw-1", "reason": "a\nb \u202e\u200b"}),
    pending(
        "CompositionRequested",
        {
            "composition_id": "c-1",
            "tenant": "acme",
            "host": "host-01",
            "request": {**COMPOSE, "host": None},
            "requested_at": "2026-12-01T00:00:00Z",
        },
        actor="acme",
    ),
    pending("DevicesReserved", {"composition_id": "c-1", "devices": [BINDING]}, actor="acme"),
    pending(
        "CircuitRemoved",
        {"ocs": "ocs-1", "a_port": 0, "b_port": 1, "host": "host-01", "composition_id": ""},
    ),
    pending(
        "CompositionRejected",
        {
            "tenant": "acme",
            "code": "no_path",
            "message": "m",
            "details": {"n": 2**63 - 1, "m": -(2**63), "x": 1.5},
        },
    ),
    pending(
        "ReservationMade",
        {
            "reservation_id": "rsv-1",
            "tenant": "acme",
            "host": "host-01",
            "request": {**COMPOSE, "host": None},
            "devices": [BINDING],
            "made_at": "2026-12-01T00:00:00Z",
            "expires_at": "2026-12-01T00:05:00Z",
        },
        actor="acme",
    ),
    pending("ReservationApplied", {"reservation_id": "rsv-1", "composition_id": "c-2"}),
    pending("EventFromTheFuture", "{}"),  # a newer engine's type: only the checks for all
    # \u escapes other than \u0000, and an escaped backslash before "u0000", are text the log
    # can store.
    pending(
        "ComponentDrained",
        '{"type":"ComponentDrained","component":"sw-1","reason":"\\\\u0000 \\u00e9 \\n"}',
    ),
    # What makes schema/018's quick look hand an event to the whole check, and is fine: an id
    # of 19 digits, a number written with an exponent.
    pending("NodeAdded", {"node": {"id": "1234567890123456789", "kind": "host"}}),
    pending(
        "CompositionRejected",
        '{"type":"CompositionRejected","tenant":"acme","code":"no_path","message":"m",'
        '"details":{"tiny":1e-07,"big":9.2E18}}',
    ),
]

# Appended before each bad event: valid, and plain (no escape in its text), so the trigger's
# quick look (schema/018) is what must catch a bad domain or actor, not the whole check.
PLAIN = pending("ComponentDrained", {"component": "sw-1", "reason": "maintenance"})


async def test_the_log_accepts_every_valid_id_and_number_at_the_limits(
    store: PostgresEventStore,
) -> None:
    appended = await store.append(DOMAIN, Head(), GOOD, [])
    assert appended.head.version == len(GOOD)


BAD: list[tuple[str, str, str, PendingEvent]] = [
    # (case, domain, what the message names, the event)
    (
        "reservation-id",
        DOMAIN,
        "$.reservation_id",
        pending("ReservationExpired", {"reservation_id": "rsv.1"}),
    ),
    (
        "reserved-device",
        DOMAIN,
        "$.devices[*].device",
        pending(
            "ReservationMade",
            {
                "reservation_id": "rsv-2",
                "tenant": "acme",
                "host": "host-01",
                "request": COMPOSE,
                "devices": [{**BINDING, "device": "gpu 01"}],
                "made_at": "2026-12-01T00:00:00Z",
                "expires_at": "2026-12-01T00:05:00Z",
            },
        ),
    ),
    ("domain-newline", "hall-1\n", "domain", pending("NodeAdded", {"node": HOST})),
    ("domain-65", "d" * 65, "domain", pending("NodeAdded", {"node": HOST})),
    ("actor-65", DOMAIN, "actor", pending("NodeAdded", {"node": HOST}, actor="a" * 65)),
    ("node-65", DOMAIN, "$.node.id", pending("NodeAdded", {"node": {**HOST, "id": "x" * 65}})),
    (
        "import-added-65",
        DOMAIN,
        "$.added[*]",
        pending("TopologyImported", topology(added=["host-01", "l" * 65, "sw-1"])),
    ),
    ("domain-dot", "hall.1", "domain", pending("NodeAdded", {"node": HOST})),
    ("domain-empty", "", "domain", pending("NodeAdded", {"node": HOST})),
    ("actor-newline", DOMAIN, "actor", pending("NodeAdded", {"node": HOST}, actor="acme\n")),
    ("actor-star", DOMAIN, "actor", pending("NodeAdded", {"node": HOST}, actor="*")),
    (
        "node-newline",
        DOMAIN,
        "$.node.id",
        pending("NodeAdded", {"node": {**HOST, "id": "h01\n"}}),
    ),
    ("node-number", DOMAIN, "$.node.id", pending("NodeAdded", {"node": {**HOST, "id": 7}})),
    ("link-end", DOMAIN, "$.link.a", pending("LinkAdded", {"link": {**LINK, "a": "sw 1"}})),
    (
        "import-node",
        DOMAIN,
        "$.nodes[*].id",
        pending("TopologyImported", topology(nodes=[HOST, {**SWITCH, "id": "sw>"}])),
    ),
    (
        "import-link-end",
        DOMAIN,
        "$.links[*].b",
        pending("TopologyImported", topology(links=[{**LINK, "b": "sw-1\n"}])),
    ),
    (
        "import-added",
        DOMAIN,
        "$.added[*]",
        pending("TopologyImported", topology(added=["host-01", "l-1\n"])),
    ),
    ("drained", DOMAIN, "$.component", pending("ComponentDrained", {"component": "ocs-1:3"})),
    (
        "path",
        DOMAIN,
        "$.devices[*].path[*]",
        pending(
            "DevicesReserved",
            {"composition_id": "c-1", "devices": [{**BINDING, "path": ["host-01", "s.w"]}]},
        ),
    ),
    (
        "circuit-ocs",
        DOMAIN,
        "$.ocs",
        pending("CircuitCreated", {"ocs": "ocs\n", "a_port": 0, "b_port": 1, "host": "host-01"}),
    ),
    (
        "requested-device",
        DOMAIN,
        "$.request.device_ids[*]",
        pending(
            "CompositionRequested",
            {
                "composition_id": "c-1",
                "tenant": "acme",
                "host": "host-01",
                "request": {**COMPOSE, "device_ids": ["gpu 01"]},
                "requested_at": "2026-12-01T00:00:00Z",
            },
        ),
    ),
    (
        "latency-int64",
        DOMAIN,
        "int64",
        pending("TopologyImported", topology(nodes=[HOST, {**SWITCH, "latency_ns": 2**63}])),
    ),
    (
        "nested-int64",
        DOMAIN,
        "int64",
        pending(
            "CompositionRejected",
            {
                "tenant": "acme",
                "code": "no_path",
                "message": "m",
                "details": {"funnel": [{"n": -(2**63) - 1}]},
            },
        ),
    ),
    (
        "binding-int64",
        DOMAIN,
        "int64",
        pending(
            "DevicesReserved",
            {"composition_id": "c-1", "devices": [{**BINDING, "latency_ns": 10**20}]},
        ),
    ),
    (
        "exponent-int64",
        DOMAIN,
        "int64",
        pending(
            "CompositionRejected",
            '{"type":"CompositionRejected","tenant":"acme","code":"no_path","message":"m",'
            '"details":{"n":1e19}}',
        ),
    ),
    (
        "nul",
        DOMAIN,
        "cannot store",
        pending(
            "ComponentDrained", '{"type":"ComponentDrained","component":"sw-1","reason":"\\u0000"}'
        ),
    ),
    (
        "lone-surrogate",
        DOMAIN,
        "type json",
        pending(
            "ComponentDrained", '{"type":"ComponentDrained","component":"sw-1","reason":"\\ud800"}'
        ),
    ),
]


@pytest.mark.parametrize(("domain", "names", "bad"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
async def test_the_log_refuses_an_event_with_a_bad_id_or_integer_and_writes_nothing(
    store: PostgresEventStore,
    database_url: str,
    pg_schema: str,
    domain: str,
    names: str,
    bad: PendingEvent,
) -> None:
    # Given: a domain with some history, and a valid event in the same append as the bad one.
    head = (await store.append(DOMAIN, Head(), GOOD[:2], [])).head
    start = head if domain == DOMAIN else Head()
    before = await row_counts(database_url, pg_schema)

    with pytest.raises(EventRefused) as refused:
        await store.append(domain, start, [PLAIN, bad], [])

    assert names in str(refused.value)
    assert await row_counts(database_url, pg_schema) == before
    assert await store.head(DOMAIN) == head
    assert (await store.append(DOMAIN, head, [GOOD[3]], [])).head.version == head.version + 1


async def test_the_quick_look_collects_ids_from_the_places_the_whole_check_names(
    database_url: str, pg_schema: str
) -> None:
    """schema/018 makes both functions from one list; a later migration that restates one of
    them alone would leave the quick look collecting ids from other places than the refusals
    name. Unknown types have no places in either."""
    rows = await fetch(
        database_url,
        pg_schema,
        "SELECT t AS type, trellis_event_id_jsonpaths(t)::text[] AS quick,"
        " trellis_event_id_paths(t)::jsonpath[]::text[] AS whole"
        " FROM unnest($1::text[]) AS t",
        [*sorted(EVENT_TYPES), "EventFromTheFuture"],
    )
    assert [r["type"] for r in rows if r["quick"] != r["whole"]] == []
    assert sum(len(r["whole"]) for r in rows) > len(EVENT_TYPES)  # the list is not empty


# ---- through the writer: the client of such a request hears `invalid` ----


async def test_a_request_whose_events_the_log_refuses_is_invalid_and_its_batch_commits(
    store: PostgresEventStore, database_url: str, pg_schema: str
) -> None:
    writer = DomainWriter(DOMAIN, store, SystemClock(), max_batch=16)
    try:
        await writer.request(
            "operator",
            "import-topology",
            ImportTopology(request_id="t", nodes=[NodeSpec(id="host-01", kind="host")]),
            "admin",
        )
        before = await row_counts(database_url, pg_schema)
        # Built in Python, so msgspec's validation never ran: as a bug in validation would.
        bad = AddNode(request_id="bad", node=NodeSpec(id="h01\n", kind="host"))
        goods = [
            AddNode(request_id=f"g{i}", node=NodeSpec(id=f"h{i}", kind="host")) for i in range(3)
        ]

        answers = await asyncio.gather(
            writer.request("operator", "add-node", goods[0], "admin"),
            writer.request("operator", "add-node", bad, "admin"),
            *(writer.request("operator", "add-node", g, "admin") for g in goods[1:]),
        )

        refused = json.loads(answers[1])
        assert refused["ok"] is False and refused["error"]["code"] == "invalid", refused
        assert "refused" in refused["error"]["message"]
        assert [json.loads(a)["ok"] for i, a in enumerate(answers) if i != 1] == [True] * 3
        events, requests = await row_counts(database_url, pg_schema)
        assert (events, requests) == (before[0] + 3, before[1] + 3)
        assert "h01\n" not in writer.state.nodes and {"h0", "h1", "h2"} <= set(writer.state.nodes)
    finally:
        await writer.close()
