"""Reservations through the engine's subjects (issue 23 item 3), on the in-memory stores: reserve,
preview, apply, cancel-reservation and the expiry tick, with request ids, views and a saga that
settles the applied composition. Over real NATS and PostgreSQL: tests/integration/
test_reservations.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest_asyncio
from integration.fabrics import expect_error, expect_ok, fabric
from integration.harness import ManualClock
from memory_rig import Rig, in_memory

DOMAIN = "hall-1"
GPU_BY_ID = {"host": "host-01", "device_ids": ["gpu-01"]}


@pytest_asyncio.fixture
async def clock() -> ManualClock:
    return ManualClock()


@pytest_asyncio.fixture
async def rig(clock: ManualClock) -> AsyncIterator[Rig]:
    async with in_memory(clock=clock) as r:
        expect_ok(
            await r.client.admin(DOMAIN, "import-topology", {"request_id": "i-1", **fabric()})
        )
        yield r


async def reserve(rig: Rig, tenant: str, manifest: dict[str, Any], **body: Any) -> dict[str, Any]:
    return await rig.client.intent(DOMAIN, tenant, "reserve", {"manifest": manifest, **body})


async def view(rig: Rig, tenant: str, what: str, body: dict[str, Any]) -> dict[str, Any]:
    return await rig.client.raw(f"view.{DOMAIN}.{tenant}.{what}", msgspec.json.encode(body))


async def free_ids(rig: Rig) -> list[str]:
    return [d["id"] for d in expect_ok(await rig.client.query(DOMAIN, "free"))["devices"]]


async def test_reserve_holds_apply_composes_and_the_log_says_so(rig: Rig) -> None:
    made = expect_ok(await reserve(rig, "acme", GPU_BY_ID, duration_seconds=120))
    rid = made["reservation_id"]

    listed = expect_ok(await rig.client.query(DOMAIN, "reservations", {"id": rid}))
    taken = await rig.client.intent(DOMAIN, "globex", "compose", GPU_BY_ID)
    assert "gpu-01" not in await free_ids(rig)
    applied = expect_ok(await rig.client.intent(DOMAIN, "acme", "apply", {"reservation_id": rid}))

    assert made["state"] == "held" and [d["id"] for d in made["devices"]] == ["gpu-01"]
    assert made["expires_at"] == "2026-11-30T12:02:00Z"
    assert listed["reservations"] == [made]
    error = expect_error(taken, "no_capacity")
    assert error["details"]["held"] == "reserved" and "gpu-01 is reserved" in error["message"]
    # The apply is answered once the saga settled it, as a compose is.
    assert applied["state"] == "active" and [d["id"] for d in applied["devices"]] == ["gpu-01"]
    assert expect_ok(await rig.client.query(DOMAIN, "reservations"))["reservations"] == []
    assert rig.log.event_types(DOMAIN)[1:] == [
        "ReservationMade",
        "CompositionRejected",  # globex's compose of the reserved GPU
        "ReservationApplied",
        "CompositionRequested",
        "CircuitCreated",
        "DevicesReserved",
        "PathEstablished",
        "CompositionActivated",
    ]


async def test_a_resent_reserve_replays_and_another_body_under_its_id_is_conflict(
    rig: Rig,
) -> None:
    first = await reserve(rig, "acme", GPU_BY_ID, request_id="rsv-1")
    counts = rig.log.counts()

    again = await reserve(rig, "acme", GPU_BY_ID, request_id="rsv-1")
    other = await reserve(rig, "acme", {**GPU_BY_ID, "device_ids": ["gpu-02"]}, request_id="rsv-1")

    assert again == {**first, "replayed": True}
    expect_error(other, "conflict")
    assert rig.log.counts() == counts


async def test_bad_requests_write_nothing(rig: Rig) -> None:
    counts = rig.log.counts()

    twice = await reserve(rig, "acme", {"host": "host-01", "device_ids": ["gpu-01", "gpu-01"]})
    unknown = await reserve(rig, "acme", {"host": "host-01", "device_ids": ["gpu-99"]})
    neither = await rig.client.intent(DOMAIN, "acme", "apply", {})
    no_such = await rig.client.intent(DOMAIN, "acme", "apply", {"reservation_id": "rsv-x"})
    cancel_none = await rig.client.intent(
        DOMAIN, "acme", "cancel-reservation", {"reservation_id": "rsv-x"}
    )
    preview = await rig.client.query(
        DOMAIN, "preview", {"manifest": {"host": "host-01", "device_ids": ["gpu-99"]}}
    )

    expect_error(twice, "invalid")
    expect_error(unknown, "not_found")
    expect_error(neither, "invalid")
    expect_error(no_such, "not_found")
    expect_error(cancel_none, "not_found")
    expect_error(preview, "not_found")
    assert rig.log.counts() == counts


async def test_the_expiry_tick_records_it_and_an_apply_after_is_conflict(
    rig: Rig, clock: ManualClock
) -> None:
    rid = expect_ok(await reserve(rig, "acme", GPU_BY_ID, duration_seconds=30))["reservation_id"]
    clock.advance(29)
    assert await rig.engine.expire_due_leases() == []
    clock.advance(1)

    before_tick = await rig.client.intent(DOMAIN, "acme", "apply", {"reservation_id": rid})
    await rig.engine.expire_due_leases()
    after_tick = await rig.client.intent(DOMAIN, "acme", "apply", {"reservation_id": rid})

    for reply in (before_tick, after_tick):
        error = expect_error(reply, "conflict")
        assert error["details"]["state"] == "expired"
    assert rig.log.event_types(DOMAIN)[-1] == "ReservationExpired"
    assert "gpu-01" in await free_ids(rig)


async def test_cancel_gives_back_and_a_second_cancel_is_conflict(rig: Rig) -> None:
    rid = expect_ok(await reserve(rig, "acme", GPU_BY_ID))["reservation_id"]

    cancelled = expect_ok(
        await rig.client.intent(DOMAIN, "acme", "cancel-reservation", {"reservation_id": rid})
    )
    again = await rig.client.intent(DOMAIN, "acme", "cancel-reservation", {"reservation_id": rid})

    assert cancelled == {"reservation_id": rid, "state": "cancelled", "devices": ["gpu-01"]}
    assert expect_error(again, "conflict")["details"]["state"] == "cancelled"
    assert "gpu-01" in await free_ids(rig)


async def test_views_show_a_tenant_only_its_own_reservations_and_preview_as_it(rig: Rig) -> None:
    mine = expect_ok(await reserve(rig, "acme", GPU_BY_ID))["reservation_id"]
    expect_ok(await reserve(rig, "globex", {"host": "host-01", "devices": [{"kind": "nic"}]}))
    counts = rig.log.counts()

    acme = expect_ok(await view(rig, "acme", "reservations", {}))
    sneaky = expect_ok(await view(rig, "acme", "reservations", {"tenant": "globex"}))
    preview = expect_ok(
        await view(
            rig, "acme", "preview", {"manifest": {"host": "host-01", "devices": [{"kind": "gpu"}]}}
        )
    )
    blocked = await view(rig, "globex", "preview", {"manifest": GPU_BY_ID})
    other_apply = await rig.client.intent(DOMAIN, "globex", "apply", {"reservation_id": mine})

    assert [r["reservation_id"] for r in acme["reservations"]] == [mine]
    assert sneaky["reservations"] == []
    assert [d["id"] for d in preview["devices"]] == ["gpu-02"]  # gpu-01 is reserved
    assert expect_error(blocked, "no_capacity")["details"]["held"] == "reserved"
    expect_error(other_apply, "not_found")
    assert rig.log.counts() == counts  # previews and views write nothing


async def test_reservations_are_answered_at_a_past_moment_too(rig: Rig) -> None:
    made = await reserve(rig, "acme", GPU_BY_ID)
    rid = expect_ok(made)["reservation_id"]
    expect_ok(
        await rig.client.intent(DOMAIN, "acme", "cancel-reservation", {"reservation_id": rid})
    )

    then = expect_ok(await rig.client.query(DOMAIN, "reservations", {"at": made["position"]}))
    now = expect_ok(await rig.client.query(DOMAIN, "reservations", {}))
    free_then = expect_ok(await rig.client.query(DOMAIN, "free", {"at": made["position"]}))

    assert [r["reservation_id"] for r in then["reservations"]] == [rid]
    assert now["reservations"] == []
    assert "gpu-01" not in [d["id"] for d in free_then["devices"]]
