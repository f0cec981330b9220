"""Placement policy: how equally good devices are ranked (ARCHITECTURE section 5)."""

from __future__ import annotations

from trellis.engine.core.model import NodeSpec


def rank(device: NodeSpec) -> int:
    """Default policy: the oldest generation that satisfies the request goes first, keeping the
    newest for requests that need them. No generation counts as 0."""
    return device.generation or 0
