"""Request ids: a resend returns the first answer, a reused id with another body is a conflict.

ARCHITECTURE §3/§6: the reply is stored with the events in one transaction, keyed by
(domain, actor, request_id), and a resend is answered from that row without writing anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest_asyncio
from fabrics import event_types, expect_error, expect_ok, fabric, fetch, gpu, row_counts
from harness import Harness, serving

DOMAIN = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


async def imported(h: Harness) -> dict[str, Any]:
    reply = await h.client.admin(DOMAIN, "import-topology", {"request_id": "import-1", **fabric()})
    expect_ok(reply)
    return reply


async def test_resending_a_request_id_with_the_same_body_returns_the_stored_reply_replayed(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    # Given: a drain answered first, then another intent that moved the domain's head on.
    first_import = await imported(h)
    body = {"request_id": "drain-sw", "id": "sw-1", "reason": "maintenance"}
    first = await h.client.admin(DOMAIN, "drain", body)
    assert first["replayed"] is False
    expect_ok(await h.client.admin(DOMAIN, "drain", {"id": "gpu-01"}))
    counts = await row_counts(database_url, pg_schema)

    # When: both are resent, one of them with another key order and spacing.
    again = await h.client.admin(DOMAIN, "drain", body)
    spaced = b'{ "reason" : "maintenance", "id" : "sw-1", "request_id" : "drain-sw" }'
    respaced = await h.client.raw(f"admin.{DOMAIN}.drain", spaced)
    import_again = await h.client.admin(
        DOMAIN, "import-topology", {"request_id": "import-1", **fabric()}
    )

    # Then: the first answers, word for word, marked replayed; nothing new in the log.
    assert again == {**first, "replayed": True}
    assert respaced == again
    assert import_again == {**first_import, "replayed": True}
    assert again["position"] == first["position"] < (await h.store.head(DOMAIN)).position
    assert await row_counts(database_url, pg_schema) == counts


async def test_rejects_a_request_id_reused_with_a_different_body_as_conflict(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    await imported(h)
    expect_ok(await h.client.admin(DOMAIN, "drain", {"request_id": "r-1", "id": "sw-1"}))
    counts = await row_counts(database_url, pg_schema)

    other_body = await h.client.admin(DOMAIN, "drain", {"request_id": "r-1", "id": "gpu-01"})
    other_verb = await h.client.admin(DOMAIN, "undrain", {"request_id": "r-1", "id": "sw-1"})

    for reply in (other_body, other_verb):
        assert expect_error(reply, "conflict")["details"] == {"request_id": "r-1"}
    assert await row_counts(database_url, pg_schema) == counts
    topo = expect_ok(await h.client.query(DOMAIN, "topology"))
    drained = {n["id"] for n in topo["nodes"] if n["drained"]}
    assert drained == {"sw-1"}


async def test_two_requests_with_the_same_request_id_in_flight_together_make_one_event(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    await imported(h)

    for round_ in range(8):
        rid = f"twin-{round_}"
        body = {"request_id": rid, "node": gpu(f"gpu-t{round_}")}

        a, b = await asyncio.gather(
            h.client.admin(DOMAIN, "add-node", body), h.client.admin(DOMAIN, "add-node", body)
        )

        assert expect_ok(a) == expect_ok(b)
        assert a["position"] == b["position"]
        assert sorted([a["replayed"], b["replayed"]]) == [False, True]
        rows = await fetch(
            database_url,
            pg_schema,
            "SELECT count(*) AS n FROM trellis_events WHERE causation_id = $1",
            rid,
        )
        assert rows[0]["n"] == 1
    assert await event_types(database_url, pg_schema, DOMAIN) == [
        "TopologyImported",
        *["NodeAdded"] * 8,
    ]
    assert await row_counts(database_url, pg_schema) == (9, 9)


async def test_racing_bodies_under_one_request_id_leave_one_winner_and_conflicts(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    await imported(h)
    same = {"request_id": "race", "node": gpu("gpu-a")}
    other = {"request_id": "race", "node": gpu("gpu-b")}

    replies = await asyncio.gather(
        *(h.client.admin(DOMAIN, "add-node", b) for b in (same, other, same, other))
    )

    firsts = [r for r in replies if r["ok"] and not r["replayed"]]
    assert len(firsts) == 1
    winner = firsts[0]["result"]["component"]
    for body, reply in zip((same, other, same, other), replies, strict=True):
        if body["node"]["id"] == winner:
            assert reply == {**firsts[0], "replayed": reply["replayed"]}
        else:
            expect_error(reply, "conflict")
    assert await event_types(database_url, pg_schema, DOMAIN) == ["TopologyImported", "NodeAdded"]


async def test_request_ids_are_keyed_by_domain_and_actor(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    # Given: the same request_id used for imports into two domains.
    await imported(h)
    other = await h.client.admin(
        "hall-2", "import-topology", {"request_id": "import-1", **fabric()}
    )
    assert other["replayed"] is False

    # Then: the table's key is (domain, actor, request_id) and admin requests act as operator.
    key = await fetch(
        database_url,
        pg_schema,
        """SELECT a.attname FROM pg_index i
             JOIN unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) ON true
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
            WHERE i.indrelid = 'trellis_requests'::regclass AND i.indisprimary
            ORDER BY k.n""",
    )
    assert [r["attname"] for r in key] == ["domain", "actor", "request_id"]
    rows = await fetch(
        database_url,
        pg_schema,
        "SELECT domain, actor, verb FROM trellis_requests WHERE request_id = 'import-1' "
        "ORDER BY domain",
    )
    assert [tuple(r) for r in rows] == [
        ("hall-1", "operator", "import-topology"),
        ("hall-2", "operator", "import-topology"),
    ]

    # When: a tenant's row with the same id sits beside the operator's (as a compose would write).
    tenant_reply = msgspec.json.encode({"ok": True, "result": {"tenant": 1}, "position": 1})
    await fetch(
        database_url,
        pg_schema,
        "INSERT INTO trellis_requests"
        " (domain, actor, request_id, verb, body_hash, reply, position, fence)"
        " VALUES ('hall-1', 'tenant-a', 'import-1', 'compose', 'x', $1, 1, $2)",
        tenant_reply.decode(),
        h.engine.fence("hall-1"),  # as the domain's writer stores an answer
    )

    # Then: the operator's resend still gets the operator's own answer.
    again = await h.client.admin(DOMAIN, "import-topology", {"request_id": "import-1", **fabric()})
    assert again["replayed"] is True
    assert expect_ok(again)["domain"] == DOMAIN
