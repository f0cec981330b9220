"""engine/core/throttle.py: each tenant's token bucket (pure)."""

from __future__ import annotations

from trellis.engine.core.throttle import Bucket, RateLimit, take

LIMIT = RateLimit(per_second=10.0, burst=5)


def test_a_new_tenant_has_its_whole_burst_then_waits_for_the_next_token() -> None:
    bucket, waits = None, []
    for _ in range(7):
        bucket, wait = take(bucket, 100.0, LIMIT)
        waits.append(wait)
    assert waits == [0, 0, 0, 0, 0, 100, 100]  # 10 a second: one every 100 ms


def test_tokens_come_back_at_the_rate_up_to_the_burst() -> None:
    empty = Bucket(tokens=0.0, at=0.0)
    assert take(empty, 0.05, LIMIT)[1] == 50  # half a token back: 50 ms to go
    assert take(empty, 0.1, LIMIT)[1] == 0
    bucket, _ = take(empty, 3600.0, LIMIT)  # an hour later: full, never more than the burst
    assert bucket.tokens == LIMIT.burst - 1


def test_a_clock_set_back_refills_nothing() -> None:
    bucket, wait = take(Bucket(tokens=0.0, at=50.0), 10.0, LIMIT)
    assert wait == 100 and bucket.tokens == 0.0
