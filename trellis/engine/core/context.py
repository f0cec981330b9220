"""What every decision gets and gives: the Context of an intent and the Decision about it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import Event


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """Who asks, where, and when (time comes from the Clock port, never from here)."""

    domain: str
    actor: str
    verb: str
    now: datetime


class Decision(msgspec.Struct, frozen=True):
    """Events to append and the answer. A recorded rejection (quota, no_capacity, no_path) has
    events and an `error`; everything else that is refused raises IntentRejected instead."""

    events: list[Event]
    result: Any = None
    error: IntentRejected | None = None
    # Events from this index on are the engine's own follow-up, recorded as actor `engine`:
    # a composition mended with what a tenant's intent freed may be another tenant's, which
    # must not read that tenant's name in its history.
    engine_from: int | None = None
