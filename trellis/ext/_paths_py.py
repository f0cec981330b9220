"""Pure-Python reference for the path core: the spec the compiled module must match exactly."""

from __future__ import annotations

import heapq
import itertools
import operator
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import networkx as nx


def _validate(indptr: array[int], indices: array[int], source: int, max_hops: int) -> int:
    """Check the arguments and return the node count.

    The checks run in a fixed order with fixed messages; ``_paths_c`` repeats them word for word
    so both implementations fail the same way on the same input.
    """
    if max_hops < 0:
        raise ValueError(f"max_hops must be >= 0, got {max_hops}")
    n = len(indptr) - 1
    if n < 0:
        raise ValueError("malformed CSR: indptr is empty, expected n + 1 offsets")
    if indptr[0] != 0:
        raise ValueError(f"malformed CSR: indptr[0] is {indptr[0]}, expected 0")
    m = len(indices)
    if indptr[n] != m:
        raise ValueError(f"malformed CSR: indptr[{n}] is {indptr[n]}, expected len(indices) = {m}")
    for i in range(n):
        if indptr[i + 1] < indptr[i]:
            raise ValueError(f"malformed CSR: indptr decreases at position {i + 1}")
    for k in range(m):
        if not 0 <= indices[k] < n:
            raise ValueError(
                f"malformed CSR: indices[{k}] is {indices[k]}, not a node id in [0, {n})"
            )
    if not 0 <= source < n:
        raise ValueError(f"source {source} is out of range for {n} nodes")
    return n


def hop_distances(
    indptr: Sequence[int], indices: Sequence[int], source: int, max_hops: int
) -> list[int]:
    """Breadth-first hop counts from ``source`` over a directed CSR adjacency.

    Args:
        indptr: ``n + 1`` non-decreasing offsets into ``indices``; node ``u``'s successors are
            ``indices[indptr[u]:indptr[u + 1]]``. Values must fit in int32.
        indices: successor node ids, each in ``[0, n)``. Values must fit in int32.
        source: the start node.
        max_hops: nodes farther than this many hops count as unreachable.

    Returns:
        A list of ``n`` hop counts; ``-1`` marks a node that is unreachable within ``max_hops``.

    Raises:
        ValueError: malformed CSR, ``source`` out of range or negative ``max_hops``.
        OverflowError: a value does not fit in int32 (as in the compiled module).
        TypeError: ``source`` or ``max_hops`` is not an integer.
    """
    source = operator.index(source)
    max_hops = operator.index(max_hops)
    # Normalising to int32 arrays gives the compiled module's conversion errors (OverflowError).
    ip = indptr if isinstance(indptr, array) and indptr.typecode == "i" else array("i", indptr)
    ix = indices if isinstance(indices, array) and indices.typecode == "i" else array("i", indices)
    n = _validate(ip, ix, source, max_hops)

    dist = [-1] * n
    dist[source] = 0
    queue = deque([source])
    while queue:
        u = queue.popleft()
        d = dist[u]
        if d >= max_hops:
            # BFS pops in non-decreasing distance order, so nothing later can be expanded either.
            break
        for k in range(ip[u], ip[u + 1]):
            v = ix[k]
            if dist[v] < 0:
                dist[v] = d + 1
                queue.append(v)
    return dist


# ---- best paths under the section-5 rules (ARCHITECTURE.md section 5) ----


class NodeInfo(NamedTuple):
    """A fabric node as the path core sees it: its kind and pass-through latency."""

    kind: str  # "host" | "switch" | "ocs" | "device"
    latency_ns: int = 0


class LinkInfo(NamedTuple):
    """A cable; an end on an OCS names its port."""

    id: str
    a: str
    b: str
    capacity_gbps: float
    latency_ns: int = 0
    a_port: int | None = None
    b_port: int | None = None


class DeviceInfo(NamedTuple):
    """A device's attributes as a `Selector` tests them (static: part of the topology)."""

    kind: str  # "gpu" | "memory" | ... ("" for a device of no kind: no selector takes it)
    model: str = ""
    generation: int = 0
    memory_gib: float = 0.0
    capacity_gib: float = 0.0  # memory pools: what can be sliced out
    rank: int = 0  # the placement policy's rank: lower goes first among equal paths
    labels: Mapping[str, str] = {}


class Conditions(NamedTuple):
    """What changes between requests: health, reservations, circuits, tenancy of switches,
    and which devices are taken or sliced."""

    unusable: AbstractSet[str] = frozenset()  # node and link ids that carry no path
    reserved_gbps: Mapping[str, float] = {}  # link id -> bandwidth already reserved
    circuits: Mapping[str, tuple[int, str]] = {}  # "<ocs>:<port>" -> (other port, owner host)
    switch_tenants: Mapping[str, Mapping[str, int]] = {}  # switch -> tenants with live paths
    exclusive_tenants: Mapping[str, Mapping[str, int]] = {}  # switch -> tenants holding it
    taken: AbstractSet[str] = frozenset()  # devices no selector may choose (held whole)
    sliced_gib: Mapping[str, float] = {}  # memory device -> GiB already sliced out


class Selector(NamedTuple):
    """Which devices a device choice may pick, tested against `DeviceInfo` and conditions:
    of `kind`, one of `models` (any when empty), at least `min_generation` and
    `min_memory_gib`, with `slice_gib` still free when given, every label in `labels`, not
    taken and, as any path end, usable."""

    kind: str
    models: tuple[str, ...] = ()
    min_generation: int | None = None
    min_memory_gib: float | None = None
    slice_gib: float | None = None
    labels: Mapping[str, str] = {}


def selected(
    devices: Mapping[str, DeviceInfo],
    taken: AbstractSet[str],
    sliced_gib: Mapping[str, float],
    selector: Selector,
) -> dict[str, int]:
    """The devices `selector` admits (usability aside), each with its rank: the candidate map
    a device choice by selector searches over."""
    return {
        d: info.rank
        for d, info in devices.items()
        if _matches(info, selector)
        and _free(d, info, taken, sliced_gib, selector)
        and _labelled(info, selector)
    }


def census(fabric: Fabric, conditions: Conditions, selector: Selector) -> tuple[int, int, int, int]:
    """The why-not funnel's first counts for `selector`: its devices of the kind and
    attributes asked for, of those the usable, of those the free, of those the labelled."""
    matched = [(d, i) for d, i in fabric.devices.items() if _matches(i, selector)]
    healthy = [(d, i) for d, i in matched if d not in conditions.unusable]
    taken, sliced = conditions.taken, conditions.sliced_gib
    free = [(d, i) for d, i in healthy if _free(d, i, taken, sliced, selector)]
    labelled = [d for d, i in free if _labelled(i, selector)]
    return len(matched), len(healthy), len(free), len(labelled)


def _matches(info: DeviceInfo, selector: Selector) -> bool:
    return (
        info.kind == selector.kind
        and (not selector.models or info.model in selector.models)
        and (selector.min_generation is None or info.generation >= selector.min_generation)
        and (selector.min_memory_gib is None or info.memory_gib >= selector.min_memory_gib)
    )


def _free(
    device: str,
    info: DeviceInfo,
    taken: AbstractSet[str],
    sliced_gib: Mapping[str, float],
    selector: Selector,
) -> bool:
    if device in taken:
        return False
    need = selector.slice_gib
    return need is None or not info.capacity_gib - sliced_gib.get(device, 0.0) + 1e-9 < need


def _labelled(info: DeviceInfo, selector: Selector) -> bool:
    return all(info.labels.get(k) == v for k, v in selector.labels.items())


class PathRequest(NamedTuple):
    host: str
    tenant: str
    exclusive: bool = False
    max_hops: int | None = None
    max_latency_ns: int | None = None
    bandwidth_gbps: float = 0.0
    isolation: bool = True  # False ignores other tenants' switches (the why-not funnel asks)


class Circuit(NamedTuple):
    ocs: str
    a_port: int  # the lower port
    b_port: int
    new: bool  # False: an existing circuit of the same host is reused


class Path(NamedTuple):
    device: str
    nodes: tuple[str, ...]  # host first, device last
    links: tuple[str, ...]
    circuits: tuple[Circuit, ...]
    hops: int  # links plus circuits
    latency_ns: int


class PathError(ValueError):
    """The request names something the fabric cannot search from."""


# Bandwidth is compared with a little slack so reservations that add up exactly still fit.
_EPSILON = 1e-9


class Fabric:
    """The static topology as a networkx MultiGraph; rebuilt only when the topology changes.

    `devices` gives the attributes a `Selector` tests; entries that name no device node of
    the fabric are ignored."""

    def __init__(
        self,
        nodes: Mapping[str, NodeInfo],
        links: Sequence[LinkInfo],
        devices: Mapping[str, DeviceInfo] | None = None,
    ):
        self.devices = {
            d: info
            for d, info in (devices or {}).items()
            if d in nodes and nodes[d].kind == "device"
        }
        graph = nx.MultiGraph()
        for node_id, info in nodes.items():
            graph.add_node(node_id, kind=info.kind, latency_ns=info.latency_ns)
        self.ports: dict[str, dict[int, LinkInfo]] = {}  # ocs -> port -> the cable on it
        for link in links:
            graph.add_edge(link.a, link.b, key=link.id, link=link)
            for end, port in ((link.a, link.a_port), (link.b, link.b_port)):
                if port is not None:
                    self.ports.setdefault(end, {})[port] = link
        self.graph = graph

    def kind(self, node: str) -> str:
        return str(self.graph.nodes[node]["kind"])


def best_paths(
    fabric: Fabric, conditions: Conditions, request: PathRequest, targets: AbstractSet[str]
) -> dict[str, Path]:
    """The best feasible path from the host to each reachable target device, in one search.

    Best means: fewest hops, then lowest latency, then the smallest sequence of node ids, then
    the fewest new circuits, then the smallest sequence of link ids. The search is a
    label-setting Dijkstra over (hops, latency, nodes, new circuits, links); a vertex is a node,
    or for an OCS the port a path enters on. Labels never revisit a node.

    Labels are popped best first, so a label is dominated at its vertex by an earlier one
    that (with a latency bound) was at least as fast and that passed no OCS this one avoids.
    The OCS condition keeps the search exact: if the rest of the best path needs an OCS the
    earlier label used up, cutting the walk short at the first shared node gives a better
    path unless that node is an OCS, whose circuit cannot be re-paired (a switch can be
    cut there; an OCS cannot). The latency condition keeps the (hops, latency) Pareto front,
    so a longer but faster path is not lost to a shorter slow one.

    Raises:
        PathError: the host is unknown, not a host, or unusable.
    """
    graph = fabric.graph
    host = request.host
    if host not in graph or fabric.kind(host) != "host":
        raise PathError(f"{host!r} is not a host of this fabric")
    if host in conditions.unusable:
        raise PathError(f"host {host!r} is not usable")

    found: dict[str, Path] = {}
    settled: dict[object, list[tuple[int, frozenset[str]]]] = {}  # vertex -> (latency, OCS used)
    bounded = request.max_latency_ns is not None
    tie = itertools.count()
    start = (0, 0, (host,), 0, (), next(tie), host, ())
    heap = [start]
    while heap and len(found) < len(targets):
        hops, latency, nodes, new, links, _, vertex, circuits = heapq.heappop(heap)
        used = frozenset(map(_ocs_of, circuits))
        if isinstance(vertex, tuple):
            used |= {vertex[0]}
        labels = settled.setdefault(vertex, [])
        if any((not bounded or lat <= latency) and ocs <= used for lat, ocs in labels):
            continue  # dominated (see above)
        labels.append((latency, used))
        node = nodes[-1]
        if node != host and fabric.kind(node) == "device":
            found.setdefault(node, Path(node, nodes, links, circuits, hops, latency))
            continue
        for step in _steps(fabric, conditions, request, vertex, nodes, targets):
            s_hops, s_latency, s_nodes, s_new, s_links, s_vertex, s_circuit = step
            total_hops, total_latency = hops + s_hops, latency + s_latency
            if request.max_hops is not None and total_hops > request.max_hops:
                continue
            if request.max_latency_ns is not None and total_latency > request.max_latency_ns:
                continue
            heapq.heappush(
                heap,
                (
                    total_hops,
                    total_latency,
                    nodes + s_nodes,
                    new + s_new,
                    links + s_links,
                    next(tie),
                    s_vertex,
                    circuits + s_circuit,
                ),
            )
    return found


def best_costs(
    fabric: Fabric,
    conditions: Conditions,
    request: PathRequest,
    targets: AbstractSet[str] | Selector,
) -> dict[str, tuple[int, int]]:
    """``{device: (hops, latency_ns)}`` of ``best_paths``: what the why-not funnel reads.
    ``targets`` may be a ``Selector``: the devices it admits."""
    if isinstance(targets, Selector):
        targets = set(selected(fabric.devices, conditions.taken, conditions.sliced_gib, targets))
    paths = best_paths(fabric, conditions, request, targets)
    return {d: (p.hops, p.latency_ns) for d, p in paths.items()}


def reachable(
    fabric: Fabric,
    conditions: Conditions,
    request: PathRequest,
    targets: AbstractSet[str] | Selector,
) -> int:
    """How many of `targets` (ids or a ``Selector``) some path from the host reaches: the
    why-not funnel asks it of the search that ignores isolation."""
    return len(best_costs(fabric, conditions, request, targets))


def _ocs_of(circuit: Circuit) -> str:
    return circuit.ocs


def _steps(  # type: ignore[no-untyped-def]
    fabric: Fabric,
    conditions: Conditions,
    request: PathRequest,
    vertex,
    nodes: tuple[str, ...],
    targets: AbstractSet[str],
):
    """Moves from a vertex: over one cable, or for an OCS entry port through a circuit and out
    over the cable on the exit port. Yields (hops, latency, nodes, new circuits, links, vertex,
    circuits) increments."""
    if isinstance(vertex, tuple):  # (ocs, entry port)
        ocs, port = vertex
        existing = conditions.circuits.get(f"{ocs}:{port}")
        if existing is not None:
            other, owner = existing
            exits = [(other, 0)] if owner == request.host else []
        else:
            exits = [
                (p, 1)
                for p in sorted(fabric.ports.get(ocs, {}))
                if p != port and f"{ocs}:{p}" not in conditions.circuits
            ]
        for exit_port, new in exits:
            link = fabric.ports[ocs][exit_port]
            far = link.b if link.a == ocs else link.a
            arrival = _arrive(fabric, conditions, request, link, far, nodes, targets)
            if arrival is not None:
                latency, s_vertex = arrival
                circuit = Circuit(ocs, min(port, exit_port), max(port, exit_port), bool(new))
                yield 2, latency, (far,), new, (link.id,), s_vertex, (circuit,)
        return
    for _, far, data in fabric.graph.edges(vertex, data=True):
        cable: LinkInfo = data["link"]
        arrival = _arrive(fabric, conditions, request, cable, far, nodes, targets)
        if arrival is not None:
            latency, s_vertex = arrival
            yield 1, latency, (far,), 0, (cable.id,), s_vertex, ()


def _arrive(  # type: ignore[no-untyped-def]
    fabric: Fabric,
    conditions: Conditions,
    request: PathRequest,
    link: LinkInfo,
    far: str,
    nodes: tuple[str, ...],
    targets: AbstractSet[str],
):
    """Cross `link` to `far` if the rules allow; return (latency added, vertex reached)."""
    if far in nodes or link.id in conditions.unusable or far in conditions.unusable:
        return None
    free = link.capacity_gbps - conditions.reserved_gbps.get(link.id, 0.0)
    if free + _EPSILON < request.bandwidth_gbps:
        return None
    kind = fabric.kind(far)
    latency = link.latency_ns
    if kind == "device":
        return (latency, far) if far in targets else None
    if kind == "host":
        return None  # hosts are endpoints, never passed through
    latency += fabric.graph.nodes[far]["latency_ns"]
    if kind == "switch":
        if request.isolation and not _may_use_switch(conditions, request, far):
            return None
        return latency, far
    port = link.a_port if link.a == far else link.b_port
    return latency, (far, port)


def _may_use_switch(conditions: Conditions, request: PathRequest, switch: str) -> bool:
    """Exclusive isolation: nobody else's path through a switch another tenant holds, and an
    exclusive request only through switches no other tenant uses."""
    holders = conditions.exclusive_tenants.get(switch, {})
    if any(t != request.tenant for t in holders):
        return False
    if request.exclusive:
        users = conditions.switch_tenants.get(switch, {})
        return all(t == request.tenant for t in users)
    return True
