"""Request ids in PostgreSQL: the stored answers are keyed by (domain, actor, request_id).

The writer's resend and conflict rules run on the in-memory log (tests/adapters/
test_resends.py); this is the table's own key, and an operator's and a tenant's rows under one
id side by side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest_asyncio
from fabrics import expect_ok, fabric, fetch
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
