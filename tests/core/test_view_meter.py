"""engine/service/view_meter.py: a tenant's views, let in by the time they take and how many
run at once (the clock is the test's)."""

from __future__ import annotations

import msgspec

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
