"""engine/core/lag.py: when a log follower counts as stalled or too far behind (pure: time is
given)."""

from __future__ import annotations

from trellis.engine.core.lag import LagTracker

RELAY = ("d", "relay")


def observe(t: LagTracker, now: float, head: int, version: int) -> tuple[bool, float, str]:
    (part,) = t.observe(now, {"d": (head, head * 10)}, {RELAY: (version, version * 10)})
    return part.ok, part.stalled_s, part.reason


def test_a_follower_idle_with_the_log_is_fine_and_one_new_event_is_not_a_stall() -> None:
    t = LagTracker(stall_s=60, max_behind=100)
    assert observe(t, 0, 5, 5)[0]
    assert observe(t, 600, 5, 5)[0]  # ten quiet minutes
    assert observe(t, 601, 6, 5) == (True, 0.0, "")  # behind since just now


def test_a_follower_that_does_not_move_while_the_log_does_is_stalled_after_the_bound() -> None:
    t = LagTracker(stall_s=60, max_behind=100)
    observe(t, 0, 5, 5)
    observe(t, 10, 6, 5)
    assert observe(t, 69, 9, 5)[0]
    ok, stalled_s, reason = observe(t, 70, 9, 5)
    assert not ok and stalled_s == 60 and "relay of domain d" in reason and "4 events" in reason


def test_a_follower_behind_but_moving_is_catching_up_until_it_trails_too_far() -> None:
    t = LagTracker(stall_s=60, max_behind=100)
    for step in range(1, 20):
        ok, stalled_s, _ = observe(t, step * 30, 50 + step * 2, step)
        assert ok and stalled_s == 0
    ok, _, reason = observe(t, 700, 500, 21)
    assert not ok and "479 events behind" in reason


def test_catching_up_clears_a_stall_and_parts_no_longer_seen_are_forgotten() -> None:
    t = LagTracker(stall_s=1, max_behind=100)
    observe(t, 0, 5, 4)
    assert not observe(t, 2, 5, 4)[0]
    assert observe(t, 3, 5, 5)[0]
    assert t.observe(4, {}, {}) == []
    assert observe(t, 5, 6, 5)[0]  # seen anew: behind since now
