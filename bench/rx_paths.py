"""The section-5 path search on a rustworkx graph, for comparison in bench/pathcheck.py.

rustworkx has no search that can express section 5 (a circuit pairs two OCS ports, may be
reused only by its owner, labels must not revisit nodes, ties go to node-id sequences, and
an OCS used up by a prefix must not prune a later label). Its Dijkstra on a graph filtered
per request would give different answers. So this is the same label-setting search as the
compiled core (best first over (hops, latency, nodes, new circuits, links); exact dominance;
push-time pruning; new-circuit fan-out deferred until the search reaches its hop count;
best-n early stop), written in Python over a rustworkx PyGraph: nodes and links are numbered
in sorted id order like the compiled core, adjacency comes from ``graph.out_edges``, and
conditions are read from index-addressed lists built once. Answers are checked equal to the
reference's in the bench.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import rustworkx as rx

from trellis.ext import Circuit, Conditions, LinkInfo, NodeInfo, Path, PathError, PathRequest

_EPSILON = 1e-9
HOST, SWITCH, OCS, DEVICE = range(4)
_KINDS = {"host": HOST, "switch": SWITCH, "ocs": OCS, "device": DEVICE}


class RxFabric:
    def __init__(self, nodes: Mapping[str, NodeInfo], links: list[LinkInfo]) -> None:
        self.node_ids = sorted(nodes)
        self.index = {n: i for i, n in enumerate(self.node_ids)}
        self.kind = [_KINDS[nodes[n].kind] for n in self.node_ids]
        self.node_lat = [nodes[n].latency_ns for n in self.node_ids]
        ordered = sorted(links, key=lambda lk: lk.id)
        self.link_ids = [lk.id for lk in ordered]
        self.link_index = {lk: k for k, lk in enumerate(self.link_ids)}
        self.cap = [lk.capacity_gbps for lk in ordered]
        self.link_lat = [lk.latency_ns for lk in ordered]
        self.ends = [(self.index[lk.a], self.index[lk.b], lk.a_port, lk.b_port) for lk in ordered]
        self.graph = rx.PyGraph(multigraph=True)
        self.graph.add_nodes_from(range(len(self.node_ids)))
        # payload: (link, port at end a, port at end b)
        self.graph.add_edges_from(
            [
                (self.index[lk.a], self.index[lk.b], (k, lk.a_port, lk.b_port))
                for k, lk in enumerate(ordered)
            ]
        )
        # ocs -> sorted [(port, link, far node)]
        self.ocs_ports: dict[int, list[tuple[int, int, int]]] = {}
        for k, lk in enumerate(ordered):
            for end, port, far in ((lk.a, lk.a_port, lk.b), (lk.b, lk.b_port, lk.a)):
                if self.kind[self.index[end]] == OCS:
                    assert port is not None  # a link to an OCS names the OCS's port
                    self.ocs_ports.setdefault(self.index[end], []).append(
                        (port, k, self.index[far])
                    )
        for ports in self.ocs_ports.values():
            ports.sort()
        self.port_of = {
            (ocs, port): (link, far)
            for ocs, ports in self.ocs_ports.items()
            for port, link, far in ports
        }


class RxConditions:
    """Conditions as index-addressed lists, built once (as LiveConditions are)."""

    def __init__(self, f: RxFabric, cond: Conditions) -> None:
        self.node_ok = [n not in cond.unusable for n in f.node_ids]
        self.link_ok = [lk not in cond.unusable for lk in f.link_ids]
        self.free = [
            cap - cond.reserved_gbps.get(lk, 0.0) for cap, lk in zip(f.cap, f.link_ids, strict=True)
        ]
        self.circuits: dict[tuple[int, int], tuple[int, int]] = {}
        for key, (other, owner) in cond.circuits.items():
            ocs, _, port = key.rpartition(":")
            self.circuits[(f.index[ocs], int(port))] = (other, f.index.get(owner, -1))
        self.users = {f.index[s]: set(t) for s, t in cond.switch_tenants.items()}
        self.holders = {f.index[s]: set(t) for s, t in cond.exclusive_tenants.items()}


def rx_search(
    f: RxFabric,
    c: RxConditions,
    request: PathRequest,
    targets: AbstractSet[str] | Mapping[str, int],
    best_n: int = 0,
) -> list[Path] | dict[str, Path]:
    """best_paths (best_n == 0) or best_devices (the best n of `targets`, a rank mapping)."""
    host = f.index.get(request.host)
    if host is None or f.kind[host] != HOST:
        raise PathError(f"{request.host!r} is not a host of this fabric")
    if not c.node_ok[host]:
        raise PathError(f"host {request.host!r} is not usable")
    ranks = targets if isinstance(targets, Mapping) else {}
    wanted = {f.index[t] for t in targets if t in f.index and f.kind[f.index[t]] == DEVICE}
    rank_of = {f.index[t]: r for t, r in ranks.items() if t in f.index}
    max_hops = request.max_hops if request.max_hops is not None else 1 << 62
    bounded = request.max_latency_ns is not None
    max_lat = request.max_latency_ns if bounded else 0
    bw, tenant = request.bandwidth_gbps, request.tenant
    kind, node_lat, link_lat, free = f.kind, f.node_lat, f.link_lat, c.free
    node_ok, link_ok = c.node_ok, c.link_ok
    graph, ends = f.graph, f.ends

    def switch_open(s: int) -> bool:
        if any(t != tenant for t in c.holders.get(s, ())):
            return False
        return not (request.exclusive and any(t != tenant for t in c.users.get(s, ())))

    # label: (hops, latency, nodes, new, links, vertex, circuits, mask)
    heap: list[Any] = []
    pushed: dict[Any, tuple[Any, ...]] = {}
    settled: dict[Any, list[tuple[int, frozenset[int]]]] = {}
    deferred: list[Any] = []
    found: dict[int, tuple[Any, ...]] = {}
    best: list[tuple[int, int, int, int]] = []

    def push(
        parent: tuple[Any, ...], hops: int, link: int, far: int, far_port: Any, circ: Any
    ) -> None:
        p_hops, p_lat, nodes, new, links, _, circuits, used = parent
        if far in nodes or not link_ok[link] or not node_ok[far]:
            return
        if free[link] + _EPSILON < bw:
            return
        k = kind[far]
        lat = link_lat[link]
        if k == DEVICE:
            if far not in wanted:
                return
            vertex: Any = far
        elif k == HOST:
            return
        else:
            lat += node_lat[far]
            if k == SWITCH:
                if request.isolation and not switch_open(far):
                    return
                vertex = far
            else:
                vertex = (far, far_port)
                used = used | {far}
        hops, lat = p_hops + hops, p_lat + lat
        if hops > max_hops or (bounded and lat > max_lat):
            return
        label = (
            hops,
            lat,
            (*nodes, far),
            new + (1 if circ is not None and circ[3] else 0),
            (*links, link),
            vertex,
            circuits if circ is None else (*circuits, circ),
            used,
        )
        rival = pushed.get(vertex)
        if rival is not None:
            if rival[:5] < label[:5]:
                if (not bounded or rival[1] <= lat) and rival[7] <= used:
                    return
            else:
                pushed[vertex] = label
        else:
            pushed[vertex] = label
        heapq.heappush(heap, label)

    def fan_out(label: tuple[Any, ...]) -> None:
        ocs, port = label[5]
        for p, link, far in f.ocs_ports[ocs]:
            if p != port and (ocs, p) not in c.circuits:
                far_port = _port(f, link, far)
                push(label, 2, link, far, far_port, (ocs, min(port, p), max(port, p), True))

    heapq.heappush(heap, (0, 0, (host,), 0, (), host, (), frozenset()))
    while len(found) < len(targets):
        while deferred and (not heap or heap[0][0] >= deferred[0][0] + 2):
            fan_out(deferred.pop(0))
        if not heap:
            break
        label = heapq.heappop(heap)
        hops, lat, nodes, _, _, vertex, _, used = label
        if best_n and len(best) == best_n and (hops, lat) > best[-1][:2]:
            break
        marks = settled.setdefault(vertex, [])
        if any((not bounded or m_lat <= lat) and m_used <= used for m_lat, m_used in marks):
            continue
        marks.append((lat, used))
        node = nodes[-1]
        if node != host and kind[node] == DEVICE:
            if node not in found:
                found[node] = label
                if best_n:
                    best.append((hops, lat, rank_of.get(node, 0), node))
                    best.sort()
                    del best[best_n:]
            continue
        if isinstance(vertex, tuple):
            ocs, port = vertex
            existing = c.circuits.get(vertex)
            if existing is None:
                deferred.append(label)
                continue
            other, owner = existing
            if owner != host:
                continue
            link, far = f.port_of[(ocs, other)]
            push(
                label,
                2,
                link,
                far,
                _port(f, link, far),
                (ocs, min(port, other), max(port, other), False),
            )
            continue
        for _, far, (link, a_port, b_port) in graph.out_edges(vertex):
            push(label, 1, link, far, a_port if ends[link][0] == far else b_port, None)

    def path(node: int) -> Path:
        hops, lat, nodes, _, links, _, circuits, _ = found[node]
        return Path(
            f.node_ids[node],
            tuple(f.node_ids[n] for n in nodes),
            tuple(f.link_ids[k] for k in links),
            tuple(Circuit(f.node_ids[o], a, b, new) for o, a, b, new in circuits),
            hops,
            lat,
        )

    if best_n:
        return [path(node) for *_, node in best]
    return {f.node_ids[node]: path(node) for node in found}


def _port(f: RxFabric, link: int, node: int) -> Any:
    a, _, a_port, b_port = f.ends[link]
    return a_port if a == node else b_port
