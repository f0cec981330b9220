"""Hand-made fabrics and one-line intents for tests of the pure core.

A FabricBuilder collects hosts, switches, OCS, devices and links and yields the
TopologyImported event (or the DomainState it folds into). Links get zero-padded ids in the
order they are added (`l-01`, `l-02`, ...), so link-id order equals insertion order, and a link
onto an OCS takes the lowest port without a cable unless one is named.

The intent helpers run `decide` and return `(events, result_or_error)`; nothing is applied
until the test calls `apply`, so given/when/then reads as it does in test_decide_topology.py:

    state = FabricBuilder().host("h").switch("s").gpu("g").chain("h", "s", "g").state()
    events, result = compose(state, "acme", host="h", devices=[{"kind": "gpu"}])
    state = apply(state, events)
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from functools import reduce
from typing import Any

import msgspec

from trellis.engine.core.context import Context
from trellis.engine.core.decide import decide
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import Event, TopologyImported
from trellis.engine.core.intents import (
    Compose,
    Drain,
    EstablishComposition,
    Extend,
    Release,
    ReportFault,
    settle_request_id,
)
from trellis.engine.core.model import LinkSpec, NodeSpec
from trellis.engine.core.state import DomainState, evolve

DOMAIN = "d1"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
OPERATOR = "operator"

_request_ids = itertools.count(1)


class FabricBuilder:
    """Collects node and link specs; every method returns the builder for chaining."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeSpec] = {}
        self.links: list[LinkSpec] = []
        self._cabled: dict[str, set[int]] = {}  # ocs -> ports with a cable

    # ---- nodes ----

    def host(self, node_id: str, **labels: str) -> FabricBuilder:
        return self._add(NodeSpec(id=node_id, kind="host", labels=labels))

    def switch(self, node_id: str, latency_ns: int = 0, **labels: str) -> FabricBuilder:
        return self._add(NodeSpec(id=node_id, kind="switch", latency_ns=latency_ns, labels=labels))

    def ocs(self, node_id: str, ports: int = 8, latency_ns: int = 0) -> FabricBuilder:
        return self._add(NodeSpec(id=node_id, kind="ocs", ports=ports, latency_ns=latency_ns))

    def device(
        self, node_id: str, device_kind: str, labels: dict[str, str] | None = None, **fields: Any
    ) -> FabricBuilder:
        spec = msgspec.convert(
            {
                "id": node_id,
                "kind": "device",
                "device_kind": device_kind,
                "labels": labels or {},
                **fields,
            },
            NodeSpec,
        )
        return self._add(spec)

    def gpu(
        self,
        node_id: str,
        generation: int | None = 9,
        model: str = "H100",
        memory_gib: float = 80,
        **labels: str,
    ) -> FabricBuilder:
        return self.device(
            node_id, "gpu", labels, model=model, generation=generation, memory_gib=memory_gib
        )

    def memory(self, node_id: str, capacity_gib: float, **labels: str) -> FabricBuilder:
        return self.device(node_id, "memory", labels, capacity_gib=capacity_gib)

    def nic(self, node_id: str, **labels: str) -> FabricBuilder:
        return self.device(node_id, "nic", labels)

    # ---- links ----

    def link(
        self,
        a: str,
        b: str,
        *,
        id: str | None = None,
        gbps: float = 256,
        ns: int = 0,
        a_port: int | None = None,
        b_port: int | None = None,
    ) -> FabricBuilder:
        """Cable `a` to `b`; an end on an OCS takes `a_port`/`b_port` or its lowest free port."""
        a_port = self._port(a, a_port)
        b_port = self._port(b, b_port)
        link_id = id or f"l-{len(self.links) + 1:02d}"
        self.links.append(
            LinkSpec(
                id=link_id,
                a=a,
                b=b,
                capacity_gbps=gbps,
                latency_ns=ns,
                a_port=a_port,
                b_port=b_port,
            )
        )
        return self

    def chain(self, *nodes: str, gbps: float = 256, ns: int = 0) -> FabricBuilder:
        """Cable each node to the next one with auto-numbered links."""
        for a, b in itertools.pairwise(nodes):
            self.link(a, b, gbps=gbps, ns=ns)
        return self

    def free_port(self, node: str) -> int | None:
        """The lowest port of OCS `node` without a cable, or None when all have one."""
        spec = self.nodes[node]
        cabled = self._cabled.get(node, set())
        return next((p for p in range(spec.ports or 0) if p not in cabled), None)

    # ---- results ----

    def imported(self) -> TopologyImported:
        ids = sorted([*self.nodes, *(lk.id for lk in self.links)])
        return TopologyImported(nodes=list(self.nodes.values()), links=self.links, added=ids)

    def state(self, *events: Event) -> DomainState:
        """The domain after the import, then `events`."""
        return given(self.imported(), *events)

    def _add(self, spec: NodeSpec) -> FabricBuilder:
        assert spec.id not in self.nodes, f"duplicate node {spec.id}"
        self.nodes[spec.id] = spec
        return self

    def _port(self, node: str, port: int | None) -> int | None:
        spec = self.nodes[node]
        if spec.kind != "ocs":
            assert port is None, f"{node} is no ocs and has no ports"
            return port
        cabled = self._cabled.setdefault(node, set())
        if port is None:
            port = self.free_port(node)
            assert port is not None, f"every port of {node} has a cable"
        assert port not in cabled, f"{node}:{port} already has a cable"
        cabled.add(port)
        return port


# ---- given / when ----


def given(*events: Event) -> DomainState:
    return reduce(evolve, events, DomainState(domain=DOMAIN))


def apply(state: DomainState, events: list[Event]) -> DomainState:
    return reduce(evolve, events, state)


def ctx(actor: str = OPERATOR, verb: str = "test", now: datetime = NOW) -> Context:
    return Context(domain=DOMAIN, actor=actor, verb=verb, now=now)


def run(
    state: DomainState, intent: msgspec.Struct, actor: str = OPERATOR, now: datetime = NOW
) -> tuple[list[Event], Any]:
    """decide() as (events, result), or (events, error): a raised IntentRejected gives no
    events; a recorded rejection gives its CompositionRejected event and the error."""
    try:
        decision = decide(state, intent, ctx(actor, type(intent).__name__.lower(), now))
    except IntentRejected as err:
        return [], err
    return decision.events, decision.error if decision.error is not None else decision.result


def request_id() -> str:
    return f"r-{next(_request_ids)}"


def compose_pending(
    state: DomainState, tenant: str, *, now: datetime = NOW, **body: Any
) -> tuple[list[Event], Any]:
    """Compose with a body as on the wire (dicts for `devices` and `constraints`), stopping
    where the fabric saga takes over: the composition is pending."""
    body.setdefault("request_id", request_id())
    return run(state, msgspec.convert(body, Compose), tenant, now)


def compose(
    state: DomainState, tenant: str, *, now: datetime = NOW, **body: Any
) -> tuple[list[Event], Any]:
    """Compose, then settle as the saga does when the fabric programs it: established."""
    events, result = compose_pending(state, tenant, now=now, **body)
    if isinstance(result, IntentRejected) or result.state != "pending":
        return events, result
    settle = EstablishComposition(
        request_id=settle_request_id(result.composition_id), composition_id=result.composition_id
    )
    more, settled = run(apply(state, events), settle, "engine", now)
    return [*events, *more], settled


def release(
    state: DomainState, tenant: str, composition_id: str, *, now: datetime = NOW
) -> tuple[list[Event], Any]:
    intent = Release(request_id=request_id(), composition_id=composition_id)
    return run(state, intent, tenant, now)


def extend(
    state: DomainState,
    tenant: str,
    composition_id: str,
    lease_seconds: int,
    *,
    now: datetime = NOW,
) -> tuple[list[Event], Any]:
    intent = Extend(
        request_id=request_id(), composition_id=composition_id, lease_seconds=lease_seconds
    )
    return run(state, intent, tenant, now)


def report_fault(
    state: DomainState, component: str, health: str = "failed", detail: str = ""
) -> tuple[list[Event], Any]:
    intent = msgspec.convert(
        {"request_id": request_id(), "component": component, "state": health, "detail": detail},
        ReportFault,
    )
    return run(state, intent)


def drain(state: DomainState, component: str) -> tuple[list[Event], Any]:
    return run(state, Drain(request_id=request_id(), id=component))


def composed(state: DomainState, tenant: str, **body: Any) -> tuple[DomainState, Any]:
    """Compose that must succeed: the state after it and the ComposeResult."""
    events, result = compose(state, tenant, **body)
    assert not isinstance(result, IntentRejected), f"{result.code}: {result.message}"
    return apply(state, events), result
