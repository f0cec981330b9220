"""How long TrellisClient waits before asking again after a `throttled` answer."""

from __future__ import annotations

from trellis.adapters.nats.client import _retry_after

THROTTLED = {"ok": False, "error": {"code": "throttled", "details": {"retry_after_ms": 20}}}


def test_a_throttled_answer_is_waited_for_and_up_to_as_long_again_at_random() -> None:
    # A burst refused at once is told one time; resent together, all but one would be
    # refused again, so each waits a share of the same span again at random.
    assert _retry_after(THROTTLED, jitter=lambda: 0.0) == 0.02
    assert _retry_after(THROTTLED, jitter=lambda: 0.999) == 0.02 * 1.999
    waits = {_retry_after(THROTTLED) for _ in range(50)}
    assert len(waits) > 1 and all(0.02 <= w < 0.04 for w in waits if w is not None)


def test_only_a_throttled_answer_with_a_wait_is_waited_for() -> None:
    assert _retry_after({"ok": True, "result": {}}) is None
    assert _retry_after({"ok": False, "error": {"code": "unavailable", "details": {}}}) is None
    no_wait = {"ok": False, "error": {"code": "throttled", "details": {}}}
    assert _retry_after(no_wait) is None
