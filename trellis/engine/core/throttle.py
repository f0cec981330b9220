"""A tenant's intent rate and view time: token buckets per tenant (pure, like decide.py: time
comes in).

Every intent a tenant sends takes a token; tokens come back at `per_second` up to `burst`. An
intent that finds no token is answered `throttled` with the milliseconds until one is back
(`details.retry_after_ms`), before it is decided or queued for the domain's writer: nothing is
written, and the writer's queue holds only what the rates let through, so one tenant's flood
cannot fill the log with its refusals nor delay other tenants' intents behind its own
(ARCHITECTURE §3 and §10, Tenants).

A tenant's views write nothing, but some cost an engine far more than an intent (a `preview`
places, a view `at` a past position folds the log), and they run on the engine that writes
the domain. Their bucket holds seconds of that engine's time: a view may start while the
tenant's bucket is not empty, and what it took is taken out when it ends. So a tenant's views
keep to their share of the engine's time on average, and to their burst at once.
"""

from __future__ import annotations

import math

import msgspec

#: The default: a steady 50 intents a second per tenant, in bursts of up to 100.
DEFAULT_PER_SECOND = 50.0
DEFAULT_BURST = 100


class RateLimit(msgspec.Struct, frozen=True):
    """What each tenant may send: `per_second` intents, bursts of `burst`. `per_second` 0: no
    limit."""

    per_second: float = DEFAULT_PER_SECOND
    burst: int = DEFAULT_BURST


class Bucket(msgspec.Struct, frozen=True):
    tokens: float
    at: float  # seconds (any monotonic origin) when `tokens` was counted


#: Views: a tenth of an engine's time per tenant on average, a tenth of a second of it at
#: once, and four views in flight. A flood of previews from one tenant then raised another
#: tenant's p99 4.6-5.1x, against 25-44x with no budget (bench/flood.py --views).
DEFAULT_VIEW_SHARE = 0.1
DEFAULT_VIEW_BURST_S = 0.1
DEFAULT_VIEWS_IN_FLIGHT = 4


class ViewBudget(msgspec.Struct, frozen=True):
    """What each tenant's views may cost the engine that answers them: `share` of its time
    (seconds a second), `burst_s` seconds at once, `in_flight` views at a time. `share` 0: no
    limit."""

    share: float = DEFAULT_VIEW_SHARE
    burst_s: float = DEFAULT_VIEW_BURST_S
    in_flight: int = DEFAULT_VIEWS_IN_FLIGHT


#: Tenants' buckets kept before the refilled ones are forgotten, so made-up tenant names cannot
#: grow them without bound.
MAX_BUCKETS = 10_000


def kept(
    buckets: dict[str, Bucket], now: float, per_second: float, full: float
) -> dict[str, Bucket]:
    """`buckets`, less those full again by `now`, once there are more than MAX_BUCKETS: a
    forgotten tenant's next bucket starts full, as its old one would be."""
    if len(buckets) <= MAX_BUCKETS:
        return buckets
    return {t: b for t, b in buckets.items() if b.tokens + (now - b.at) * per_second < full}


def refilled(bucket: Bucket | None, now: float, per_second: float, full: float) -> Bucket:
    """`bucket` at `now` (None: a tenant not seen yet, its bucket full)."""
    if bucket is None:
        return Bucket(tokens=full, at=now)
    elapsed = max(0.0, now - bucket.at)  # a clock set back refills nothing
    return Bucket(tokens=min(full, bucket.tokens + elapsed * per_second), at=now)


def take(bucket: Bucket | None, now: float, limit: RateLimit) -> tuple[Bucket, int]:
    """Take one token from `bucket` (None: a tenant not seen yet, its bucket full) at `now`:
    the bucket after, and 0 when a token was there, else the milliseconds until one is."""
    bucket = refilled(bucket, now, limit.per_second, float(limit.burst))
    tokens = bucket.tokens
    if tokens >= 1.0:
        return Bucket(tokens=tokens - 1.0, at=now), 0
    wait_ms = max(1, math.ceil((1.0 - tokens) / limit.per_second * 1000))
    return Bucket(tokens=tokens, at=now), wait_ms


def may_view(bucket: Bucket | None, now: float, budget: ViewBudget) -> tuple[Bucket, int]:
    """Whether a view may start at `now`: the bucket, and 0 while it holds time, else the
    milliseconds until it does again."""
    bucket = refilled(bucket, now, budget.share, budget.burst_s)
    if bucket.tokens > 0:
        return bucket, 0
    return bucket, max(1, math.ceil(-bucket.tokens / budget.share * 1000))


def charge(bucket: Bucket | None, now: float, budget: ViewBudget, seconds: float) -> Bucket:
    """The bucket once a view that took `seconds` has ended at `now`: it may go below empty
    (one costly view), and the tenant then waits until that time is earned back."""
    bucket = refilled(bucket, now, budget.share, budget.burst_s)
    return Bucket(tokens=bucket.tokens - max(0.0, seconds), at=now)
