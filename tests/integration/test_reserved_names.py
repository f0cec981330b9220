"""Internal actors are out of every tenant's reach, in actor names and in request ids.

Request ids are scoped by actor, so the only way to take the engine's `settle-<composition>`
or `lease-expiry-<digest>`, or an operator's admin request id, was to be a tenant of that name:
a tenant `engine` could keep another tenant's composition pending forever, or its lease from
ever expiring, and a tenant `operator` could make the operator's next admin request a conflict.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric, row_counts
from harness import Harness, ManualClock, serving

from trellis.engine.core.compose import composition_id
from trellis.engine.core.intents import lease_expiry_request_id, settle_request_id

DOMAIN = "hall-1"
VICTIM = "beta"
ADMIN_REQUEST_ID = "maintenance-1"


@pytest_asyncio.fixture
async def clock() -> ManualClock:
    return ManualClock()


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, clock: ManualClock
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as harness:
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", fabric()))
        yield harness


@pytest.mark.parametrize(
    "tenant", ["engine", "operator", "auditor", "Engine", "OPERATOR", "_relay"]
)
async def test_a_tenant_token_cannot_name_an_internal_actor(
    h: Harness, database_url: str, pg_schema: str, tenant: str
) -> None:
    before = await row_counts(database_url, pg_schema)
    body = {"host": "host-01", "devices": [{"kind": "nic"}]}

    error = expect_error(await h.client.intent(DOMAIN, tenant, "compose", body), "forbidden")

    assert error["details"] == {"tenant": tenant}
    assert await row_counts(database_url, pg_schema) == before


@pytest.mark.parametrize("attacker", ["engine", "operator", "acme"])
async def test_no_tenant_can_take_the_request_ids_of_internal_actors(
    h: Harness, clock: ManualClock, attacker: str
) -> None:
    victim_cid = composition_id(DOMAIN, VICTIM, "b-1")
    internal_ids = [
        settle_request_id(victim_cid),
        lease_expiry_request_id([victim_cid]),
        ADMIN_REQUEST_ID,
    ]
    for request_id in internal_ids:
        body = {"request_id": request_id, "host": "host-01", "devices": [{"kind": "nvme"}]}
        reply = await h.client.intent(DOMAIN, attacker, "compose", body)
        if reply["ok"]:  # a plain tenant gets its own composition under its own request id
            await h.client.intent(
                DOMAIN, attacker, "release", {"composition_id": reply["result"]["composition_id"]}
            )
        else:
            expect_error(reply, "forbidden")

    # The victim's compose settles, the operator's admin request is its own, and the lease
    # ends when it falls due.
    composed = await h.client.intent(
        DOMAIN,
        VICTIM,
        "compose",
        {"request_id": "b-1", "host": "host-01", "devices": [{"kind": "nic"}], "lease_seconds": 60},
    )
    assert expect_ok(composed)["state"] == "active"
    assert expect_ok(composed)["composition_id"] == victim_cid
    drained = await h.client.admin(
        DOMAIN, "drain", {"request_id": ADMIN_REQUEST_ID, "id": "nvme-01", "reason": "firmware"}
    )
    assert expect_ok(drained)["changed"] is True
    clock.at += timedelta(seconds=61)
    await h.engine.expire_due_leases()
    state = h.engine.state(DOMAIN)
    assert state is not None and victim_cid not in state.compositions
