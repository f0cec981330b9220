"""Reservations over real NATS and PostgreSQL (issue 23 item 3): reserve, apply, cancel and
expire as a client and a scheduler see them — replies, the `connections` read model, the KV
bucket — with concurrent reserves of one device, and a reservation that outlives its engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric
from harness import Harness, ManualClock, bucket_values, serving

DOMAIN = "hall-1"
NIC = {"host": "host-01", "device_ids": ["nic-01"]}
MEMORY = {"host": "host-01", "devices": [{"kind": "memory", "capacity_gib": 512}]}


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


async def reserve(h: Harness, tenant: str, manifest: dict[str, Any], **body: Any) -> dict[str, Any]:
    return await h.client.intent(DOMAIN, tenant, "reserve", {"manifest": manifest, **body})


async def types_of(h: Harness) -> list[str]:
    return [e.type async for e in h.store.read(DOMAIN)]


async def kv(h: Harness, subject_prefix: str) -> dict[str, Any]:
    await h.relayed(DOMAIN)
    values = await bucket_values(h.client.nc.jetstream(), subject_prefix)
    return {k: json.loads(v) for k, v in values.items() if k.startswith(f"{DOMAIN}.")}


async def test_reserve_then_apply_is_connected_and_the_bucket_follows(
    h: Harness, subject_prefix: str
) -> None:
    made = expect_ok(await reserve(h, "acme", MEMORY, duration_seconds=600))
    rid = made["reservation_id"]
    held = await kv(h, subject_prefix)
    refused = await h.client.intent(
        DOMAIN, "globex", "compose", {"host": "host-01", "device_ids": ["mem-01"]}
    )

    applied = expect_ok(await h.client.intent(DOMAIN, "acme", "apply", {"reservation_id": rid}))
    await h.projected(DOMAIN)
    connections = expect_ok(await h.client.query(DOMAIN, "connections", {"tenant": "acme"}))
    after = await kv(h, subject_prefix)

    assert held[f"{DOMAIN}.reservation.{rid}"]["state"] == "held"
    assert held[f"{DOMAIN}.device.mem-01"]["free_gib"] == 2048 - 512
    assert expect_error(refused, "no_capacity")["details"]["held"] == "reserved"
    assert applied["state"] == "active"
    [row] = connections["connections"]
    assert (row["device"], row["composition_id"], row["capacity_gib"]) == (
        "mem-01",
        applied["composition_id"],
        512,
    )
    assert f"{DOMAIN}.reservation.{rid}" not in after  # its final value, then deleted
    assert after[f"{DOMAIN}.composition.{applied['composition_id']}"]["state"] == "active"
    assert after[f"{DOMAIN}.device.mem-01"]["free_gib"] == 2048 - 512  # held by it now
    composition = expect_ok(
        await h.client.query(DOMAIN, "composition", {"id": applied["composition_id"]})
    )
    assert composition["tenant"] == "acme" and composition["state"] == "active"


async def test_concurrent_reserves_of_one_device_exactly_one_wins(h: Harness) -> None:
    tenants = [f"tenant-{i}" for i in range(8)]

    replies = await asyncio.gather(*(reserve(h, t, NIC) for t in tenants))

    won = [r for r in replies if r["ok"]]
    lost = [r for r in replies if not r["ok"]]
    assert len(won) == 1, replies
    assert all(r["error"]["code"] == "no_capacity" for r in lost)
    assert all(r["error"]["details"]["held"] == "reserved" for r in lost)
    assert (await types_of(h)).count("ReservationMade") == 1


async def test_expiry_is_recorded_the_bucket_drops_it_and_apply_is_conflict(
    h: Harness, clock: ManualClock, subject_prefix: str
) -> None:
    rid = expect_ok(await reserve(h, "acme", NIC, duration_seconds=30))["reservation_id"]
    clock.advance(30)

    ticked = await h.engine.expire_due_leases()
    late = await h.client.intent(DOMAIN, "acme", "apply", {"reservation_id": rid})
    values = await kv(h, subject_prefix)

    assert len(ticked) == 1 and rid.encode() in ticked[0]
    assert (await types_of(h))[-1] == "ReservationExpired"
    error = expect_error(late, "conflict")
    assert error["details"]["state"] == "expired" and "expired" in error["message"]
    assert f"{DOMAIN}.reservation.{rid}" not in values
    assert values[f"{DOMAIN}.device.nic-01"]["free"] is True
    free = expect_ok(await h.client.query(DOMAIN, "free", {"kind": "nic"}))
    assert [d["id"] for d in free["devices"]] == ["nic-01"]


async def test_a_reservation_outlives_its_engine_and_expires_after_the_restart(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, clock: ManualClock
) -> None:
    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as h:
        expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
        made = expect_ok(await reserve(h, "acme", NIC, duration_seconds=60))
    clock.advance(30)
    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as h:
        listed = expect_ok(await h.client.query(DOMAIN, "reservations", {}))
        taken = await reserve(h, "globex", NIC)
        clock.advance(30)
        await h.engine.expire_due_leases()
        gone = expect_ok(await h.client.query(DOMAIN, "reservations", {}))

    assert listed["reservations"] == [made]
    expect_error(taken, "no_capacity")
    assert gone["reservations"] == []


async def test_cancel_over_the_wire_and_views_keep_tenants_apart(h: Harness) -> None:
    rid = expect_ok(await reserve(h, "acme", NIC))["reservation_id"]

    theirs = await h.client.intent(DOMAIN, "globex", "cancel-reservation", {"reservation_id": rid})
    globex_view = await h.client.raw(f"view.{DOMAIN}.globex.reservations", b"{}")
    acme_view = await h.client.raw(f"view.{DOMAIN}.acme.reservations", b"{}")
    cancelled = expect_ok(
        await h.client.intent(DOMAIN, "acme", "cancel-reservation", {"reservation_id": rid})
    )

    expect_error(theirs, "not_found")
    assert expect_ok(globex_view)["reservations"] == []
    assert [r["reservation_id"] for r in expect_ok(acme_view)["reservations"]] == [rid]
    assert cancelled["state"] == "cancelled"
    assert (await types_of(h))[-1] == "ReservationCancelled"
