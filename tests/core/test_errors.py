"""What the engine's own errors say where they are logged."""

from __future__ import annotations

from trellis.engine.core.errors import ConcurrencyConflict


def test_a_lost_race_is_told_without_a_none_or_the_domain_twice() -> None:
    # Logged as "domain D: <message>; catching up" (upgrade probe: "domain default: domain
    # 'default': expected version 43, found None").
    assert str(ConcurrencyConflict("default", 42)) == (
        "the log is no longer at version 42 as this writer held it"
    )
    assert str(ConcurrencyConflict("default", 42, 44)).endswith("(its head is at version 44)")
