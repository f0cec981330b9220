"""A tenant's intent rate: a token bucket per tenant (pure, like decide.py: time comes in).

Every intent a tenant sends takes a token; tokens come back at `per_second` up to `burst`. An
intent that finds no token is answered `throttled` with the milliseconds until one is back
(`details.retry_after_ms`), before it is decided or queued for the domain's writer: nothing is
written, and the writer's queue holds only what the rates let through, so one tenant's flood
cannot fill the log with its refusals nor delay other tenants' intents behind its own
(ARCHITECTURE §3 and §10, Tenants).
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


def take(bucket: Bucket | None, now: float, limit: RateLimit) -> tuple[Bucket, int]:
    """Take one token from `bucket` (None: a tenant not seen yet, its bucket full) at `now`:
    the bucket after, and 0 when a token was there, else the milliseconds until one is."""
    if bucket is None:
        bucket = Bucket(tokens=float(limit.burst), at=now)
    elapsed = max(0.0, now - bucket.at)  # a clock set back refills nothing
    tokens = min(float(limit.burst), bucket.tokens + elapsed * limit.per_second)
    if tokens >= 1.0:
        return Bucket(tokens=tokens - 1.0, at=now), 0
    wait_ms = max(1, math.ceil((1.0 - tokens) / limit.per_second * 1000))
    return Bucket(tokens=tokens, at=now), wait_ms
