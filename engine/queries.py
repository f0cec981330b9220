"""Read-only answers computed from a domain's state (trellis.query.<domain>.<what>)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.errors import IntentRejected
from engine.intents import TopologyQuery
from engine.state import DomainState, LinkState, NodeState, usable


def answer(state: DomainState, query: msgspec.Struct, what: str) -> dict[str, Any]:
    """Answer `query` from `state`.

    Raises:
        IntentRejected: `not_found` for an unknown domain, `invalid` for a query not served yet.
    """
    if not state.exists:
        raise IntentRejected("not_found", f"domain {state.domain!r} does not exist")
    match query:
        case TopologyQuery():
            return topology(state)
    raise IntentRejected("invalid", f"query {what!r} is not served by this engine version")


def topology(state: DomainState) -> dict[str, Any]:
    """Nodes and links with health and free capacity; circuits (none until compositions)."""
    return {
        "nodes": [_describe(n) for _, n in sorted(state.nodes.items())],
        "links": [
            {**_describe(lk), "free_gbps": lk.spec.capacity_gbps if usable(lk) else 0.0}
            for _, lk in sorted(state.links.items())
        ],
        "circuits": [],
    }


def _describe(component: NodeState | LinkState) -> dict[str, Any]:
    row: dict[str, Any] = msgspec.to_builtins(component.spec)
    row["health"] = component.health
    row["drained"] = component.drained
    if component.detail:
        row["detail"] = component.detail
    return row
