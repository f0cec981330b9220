"""The state of one fabric domain and `evolve`, the pure fold that builds it from events.

State is immutable: `evolve` returns a new DomainState and copies only the maps an event
touches, so a batch can be decided on a scratch state and thrown away if its commit fails.
"""

from __future__ import annotations

import msgspec

from engine.events import (
    ComponentDrained,
    ComponentFaulted,
    ComponentRecovered,
    ComponentRemoved,
    ComponentUndrained,
    Event,
    LinkAdded,
    NodeAdded,
    TopologyImported,
)
from engine.model import Health, LinkSpec, NodeSpec


class NodeState(msgspec.Struct, frozen=True, kw_only=True):
    spec: NodeSpec
    health: Health = "healthy"
    drained: bool = False
    detail: str = ""


class LinkState(msgspec.Struct, frozen=True, kw_only=True):
    spec: LinkSpec
    health: Health = "healthy"
    drained: bool = False
    detail: str = ""


Component = NodeState | LinkState


class DomainState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `decide` needs about one domain. Maps are never mutated after construction."""

    domain: str
    nodes: dict[str, NodeState] = {}
    links: dict[str, LinkState] = {}

    @property
    def exists(self) -> bool:
        """A domain exists from its first topology event on."""
        return bool(self.nodes or self.links)

    def component(self, component_id: str) -> Component | None:
        return self.nodes.get(component_id) or self.links.get(component_id)


def usable(component: Component) -> bool:
    """Section 5: only healthy, undrained components carry paths."""
    return component.health == "healthy" and not component.drained


def evolve(state: DomainState, event: Event) -> DomainState:
    """Apply one event. Unknown-to-this-fold events (compositions, later) leave state as is."""
    replace = msgspec.structs.replace
    match event:
        case TopologyImported(nodes=nodes, links=links):
            # Components that stay keep their health and drain marks; the specs are replaced.
            return replace(
                state,
                nodes={n.id: _respec(state.nodes.get(n.id), n, NodeState) for n in nodes},
                links={lk.id: _respec(state.links.get(lk.id), lk, LinkState) for lk in links},
            )
        case NodeAdded(node=node):
            return replace(state, nodes={**state.nodes, node.id: NodeState(spec=node)})
        case LinkAdded(link=link):
            return replace(state, links={**state.links, link.id: LinkState(spec=link)})
        case ComponentRemoved(component=cid, kind="node", links=attached):
            nodes = {k: v for k, v in state.nodes.items() if k != cid}
            gone = set(attached)
            links = {k: v for k, v in state.links.items() if k not in gone}
            return replace(state, nodes=nodes, links=links)
        case ComponentRemoved(component=cid, kind="link"):
            return replace(state, links={k: v for k, v in state.links.items() if k != cid})
        case ComponentDrained(component=cid):
            return _mark(state, cid, drained=True)
        case ComponentUndrained(component=cid):
            return _mark(state, cid, drained=False)
        case ComponentFaulted(component=cid, state=health, detail=detail):
            return _mark(state, cid, health=health, detail=detail)
        case ComponentRecovered(component=cid, detail=detail):
            return _mark(state, cid, health="healthy", detail=detail)
        case _:
            return state


def _respec(old, spec, cls):  # type: ignore[no-untyped-def]
    return cls(spec=spec) if old is None else msgspec.structs.replace(old, spec=spec)


def _mark(state: DomainState, cid: str, **changes: object) -> DomainState:
    replace = msgspec.structs.replace
    if cid in state.nodes:
        nodes = {**state.nodes, cid: replace(state.nodes[cid], **changes)}
        return replace(state, nodes=nodes)
    if cid in state.links:
        links = {**state.links, cid: replace(state.links[cid], **changes)}
        return replace(state, links=links)
    return state
