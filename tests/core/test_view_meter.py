"""engine/service/view_meter.py: a tenant's views, let in by the time they take and how many
run at once (the clock is the test's)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from trellis.engine.core.throttle import ViewBudget
from trellis.engine.service.view_meter import ViewMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def code(reply: bytes | None) -> str | None:
    return None if reply is None else msgspec.json.decode(reply)["error"]["code"]


async def test_a_view_holds_its_place_until_released_and_pays_for_its_time() -> None:
    clock = Clock()
    meter = ViewMeter(ViewBudget(share=0.5, burst_s=1.0, in_flight=2), clock, cost=clock)
    assert code(meter.refusal("acme")) is None
    assert code(meter.refusal("acme")) is None
    assert code(meter.refusal("acme")) == "throttled"  # two in flight already
    assert code(meter.refusal("globex")) is None  # another tenant's places are its own
    meter.release("acme")  # one refused later for another reason: its place comes back

    async def slow() -> bytes:
        clock.now += 1.5  # the view took a second and a half of the engine
        return b"answer"

    assert await meter.metered("acme", slow) == b"answer"
    meter.release("acme")
    reply = meter.refusal("acme")  # half a second owed, earned back at half a second a second
    assert code(reply) == "throttled"
    assert msgspec.json.decode(reply)["error"]["details"]["retry_after_ms"] == 1000
    clock.now += 1.01
    assert code(meter.refusal("acme")) is None


def test_no_budget_lets_every_view_in() -> None:
    meter = ViewMeter(ViewBudget(share=0))
    assert all(meter.refusal("acme") is None for _ in range(100))
    meter.release("acme")  # nothing held: nothing to give back


async def test_a_view_pays_for_its_own_steps_not_for_other_requests_run_while_it_waits() -> None:
    """A probe's tenant making a cheap view once a second was refused while sixteen other
    tenants flooded views: it was charged the engine's CPU across its awaits, theirs too."""
    clock = Clock()
    meter = ViewMeter(ViewBudget(share=0.5, burst_s=1.0, in_flight=4), clock, cost=clock)
    waiting = asyncio.Event()

    async def others() -> None:
        await waiting.wait()
        clock.now += 5.0  # another tenant's views, on the same thread

    async def cheap() -> bytes:
        clock.now += 0.01
        waiting.set()
        await asyncio.sleep(0)  # its wait, while the others run
        await asyncio.sleep(0)
        clock.now += 0.01
        return b"answer"

    busy = asyncio.create_task(others())
    assert meter.refusal("clean") is None
    assert await meter.metered("clean", cheap) == b"answer"
    await busy
    meter.release("clean")
    assert code(meter.refusal("clean")) is None  # charged 0.02 s of its 1 s, not 5.02


async def test_a_cancelled_view_is_cancelled_and_still_pays_for_what_it_did() -> None:
    clock = Clock()
    meter = ViewMeter(ViewBudget(share=0.5, burst_s=1.0, in_flight=4), clock, cost=clock)
    stuck = asyncio.Event()

    async def slow() -> bytes:
        clock.now += 2.0
        await stuck.wait()
        return b"never"

    assert meter.refusal("acme") is None
    task = asyncio.create_task(meter.metered("acme", slow))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    meter.release("acme")
    assert code(meter.refusal("acme")) == "throttled"  # the 2 s it spent, owed
