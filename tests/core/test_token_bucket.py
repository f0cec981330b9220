"""engine/core/throttle.py: each tenant's token bucket (pure)."""

from __future__ import annotations

from trellis.engine.core.throttle import (
    MAX_BUCKETS,
    Bucket,
    RateLimit,
    ViewBudget,
    charge,
    kept,
    may_view,
    take,
)

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


BUDGET = ViewBudget(share=0.25, burst_s=1.0)


def test_views_start_while_the_bucket_holds_time_and_pay_for_theirs_when_they_end() -> None:
    bucket, wait = may_view(None, 10.0, BUDGET)
    assert wait == 0 and bucket.tokens == 1.0
    bucket = charge(bucket, 10.0, BUDGET, 0.6)
    assert may_view(bucket, 10.0, BUDGET)[1] == 0  # 0.4 s left
    bucket = charge(bucket, 10.0, BUDGET, 0.9)  # one costly view: half a second owed
    bucket, wait = may_view(bucket, 10.0, BUDGET)
    assert wait == 2000  # earned back at a quarter of a second a second
    assert may_view(bucket, 11.0, BUDGET)[1] == 1000
    assert may_view(bucket, 12.01, BUDGET)[1] == 0


def test_a_views_bucket_refills_up_to_its_burst_only() -> None:
    bucket = charge(None, 0.0, BUDGET, 0.5)
    bucket, _ = may_view(bucket, 3600.0, BUDGET)
    assert bucket.tokens == BUDGET.burst_s


def test_past_the_cap_only_buckets_full_again_are_forgotten() -> None:
    buckets = {f"t{i}": Bucket(tokens=0.0, at=0.0) for i in range(MAX_BUCKETS)}
    buckets["owing"] = Bucket(tokens=-5.0, at=0.0)  # a view's debt: full only at 6 s
    left = kept(buckets, 1.0, 1.0, 1.0)
    assert list(left) == ["owing"]
    assert kept(left, 1.0, 1.0, 1.0) is left  # under the cap: nothing forgotten
