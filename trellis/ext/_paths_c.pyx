# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Compiled path core; must agree exactly with ``ext._paths_py`` (the spec), errors included.

``_live_c`` is the compiled twin of ``_live_py`` (conditions changed in place, the device
choice); what the two modules share is declared in ``_paths_c.pxd``.

Layout (section 5 of ARCHITECTURE.md, data layout in docs/architecture.md section 11):

- ``Fabric``: the static topology, rebuilt only when the topology changes. Node and link ids
  are numbered in sorted id order, so comparing index sequences compares the id strings the
  way the reference does. CSR adjacency (link, far node, far end's OCS port slot), per-link
  capacity and latency, per-node kind and latency, and the cabled ports of each OCS as *slots*
  (grouped by OCS, in port order). A search vertex is a node, or a slot (an OCS entry port).
- ``_ConditionArrays``: what changes between requests, as flat arrays: usable flags, free
  bandwidth per link, circuit per slot (other slot, owner host), and per switch the number of
  tenants with paths (and exclusive holds) and, when there is one, which. A ``Conditions``
  snapshot is converted for one search; ``_live_c.LiveConditions`` keeps them and changes them
  in place, O(1) entries per update, with a journal (``checkpoint``/``rollback``) that lets a
  decision try picks and undo them. Tallies kept with them (each change bracketed out and
  back in) count, per (kind, model) bucket, its usable and free devices, and per node its
  open *leaf* devices (one cable, on no OCS port) by bucket: census and the unbounded BFS
  of reachable answer from them when a Selector takes each bucket whole.
- The search runs without the GIL over buffers kept in a per-fabric workspace that grows only
  when a search needs more than any search before (no allocation per step).
"""

import operator
from array import array

from cpython.array cimport array as carray, clone
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

from ._paths_py import Circuit, Conditions, Path, PathError, Selector

cdef carray _INT32_TEMPLATE = array("i")


# ---- hop_distances (BFS over a CSR adjacency) ----


cdef const int[:] _as_int32(object seq):
    # Zero-copy for any int32 buffer (array('i'), numpy int32, read-only views); anything else
    # is converted the way the reference converts it, so both raise the same errors.
    try:
        return seq
    except (TypeError, ValueError):
        return array("i", seq)


def hop_distances(indptr, indices, source, max_hops):
    # Range checks run on the Python ints, so huge values get the reference's ValueError
    # rather than an OverflowError from a C conversion.
    source = operator.index(source)
    max_hops = operator.index(max_hops)
    cdef const int[:] ip = _as_int32(indptr)
    cdef const int[:] ix = _as_int32(indices)
    cdef Py_ssize_t n, m, i, k, src, bad = -1
    cdef int limit
    cdef Py_ssize_t head = 0, tail = 0
    cdef int u, v, d
    cdef int* queue
    cdef carray result
    cdef int[::1] dist

    # Same checks, order and messages as _paths_py._validate.
    if max_hops < 0:
        raise ValueError(f"max_hops must be >= 0, got {max_hops}")
    n = ip.shape[0] - 1
    if n < 0:
        raise ValueError("malformed CSR: indptr is empty, expected n + 1 offsets")
    if ip[0] != 0:
        raise ValueError(f"malformed CSR: indptr[0] is {ip[0]}, expected 0")
    m = ix.shape[0]
    if ip[n] != m:
        raise ValueError(f"malformed CSR: indptr[{n}] is {ip[n]}, expected len(indices) = {m}")
    with nogil:
        for i in range(n):
            if ip[i + 1] < ip[i]:
                bad = i + 1
                break
    if bad >= 0:
        raise ValueError(f"malformed CSR: indptr decreases at position {bad}")
    with nogil:
        for k in range(m):
            if ix[k] < 0 or ix[k] >= n:
                bad = k
                break
    if bad >= 0:
        raise ValueError(
            f"malformed CSR: indices[{bad}] is {ix[bad]}, not a node id in [0, {n})"
        )
    if not 0 <= source < n:
        raise ValueError(f"source {source} is out of range for {n} nodes")
    src = source
    # No path is longer than n - 1 hops, so clamping keeps the limit within a C int.
    limit = <int>min(max_hops, n)

    # All memory is taken up front: the loop below allocates nothing and holds no GIL.
    result = clone(_INT32_TEMPLATE, n, False)
    dist = result
    queue = <int*>malloc(n * sizeof(int))
    if queue == NULL:
        raise MemoryError()
    try:
        with nogil:
            for i in range(n):
                dist[i] = -1
            dist[src] = 0
            queue[tail] = <int>src
            tail += 1
            while head < tail:
                u = queue[head]
                head += 1
                d = dist[u]
                if d >= limit:
                    # Pops come in non-decreasing distance, so nothing later expands either.
                    break
                for k in range(ip[u], ip[u + 1]):
                    v = ix[k]
                    if dist[v] < 0:
                        dist[v] = d + 1
                        queue[tail] = v
                        tail += 1
    finally:
        free(queue)
    return result.tolist()


# ---- the section-5 path search ----

# The node kinds and markers (HOST ... UNUSABLE), the C structs (FabricData, CondData, Label,
# Settled, Query, DEntry, WS) and the extension types' attributes are declared in
# _paths_c.pxd, which _live_c.pyx cimports too.

cdef double _EPSILON = 1e-9  # as _paths_py._EPSILON: reservations that add up exactly fit
cdef int64_t _NO_LIMIT = (<int64_t>1) << 62

_KINDS = {"host": HOST, "switch": SWITCH, "ocs": OCS, "device": DEVICE}


cdef void* _alloc(Py_ssize_t count, size_t size) except NULL:
    cdef void* p = malloc(<size_t>(count if count > 0 else 1) * size)
    if p == NULL:
        raise MemoryError()
    return p


cdef class _Workspace:
    """Search buffers for one fabric; reused across searches, grown only when short."""


    def __cinit__(self, int32_t n_nodes, int32_t n_slots, int32_t n_models, int32_t n_ocs):
        memset(&self.w, 0, sizeof(WS))
        self.w.own_stamp = <uint32_t*>_alloc(n_ocs, sizeof(uint32_t))
        memset(self.w.own_stamp, 0, (n_ocs if n_ocs > 0 else 1) * sizeof(uint32_t))
        self.w.target_ocs_stamp = <uint32_t*>_alloc(n_ocs, sizeof(uint32_t))
        memset(self.w.target_ocs_stamp, 0, (n_ocs if n_ocs > 0 else 1) * sizeof(uint32_t))
        self.w.n_ocs = n_ocs
        self.w.fan_exits = <int32_t*>_alloc(n_slots, sizeof(int32_t))
        self.w.fan_round = <uint32_t*>_alloc(n_ocs, sizeof(uint32_t))
        memset(self.w.fan_round, 0, (n_ocs if n_ocs > 0 else 1) * sizeof(uint32_t))
        self.w.fan_hops = <int32_t*>_alloc(n_ocs, sizeof(int32_t))
        self.w.fan_n = <int32_t*>_alloc(n_ocs, sizeof(int32_t))
        self.w.fan_cut = <int64_t*>_alloc(n_ocs, sizeof(int64_t))
        self.w.fan_cut_slot = <int32_t*>_alloc(n_ocs, sizeof(int32_t))
        self.w.fan_cut_next = <int64_t*>_alloc(n_ocs, sizeof(int64_t))
        self.w.fan_cut_latency = <int64_t*>_alloc(n_ocs, sizeof(int64_t))
        self.w.model_stamp = <uint32_t*>_alloc(n_models, sizeof(uint32_t))
        memset(self.w.model_stamp, 0, (n_models if n_models > 0 else 1) * sizeof(uint32_t))
        self.w.n_models = n_models
        self.w.label_hits = <int32_t*>_alloc(n_nodes, sizeof(int32_t))
        self.w.n_nodes = n_nodes
        self.w.n_vertices = n_nodes + n_slots
        self.w.labels_cap = 1024
        self.w.labels = <Label*>_alloc(self.w.labels_cap, sizeof(Label))
        self.w.arena_cap = 16384
        self.w.arena = <int32_t*>_alloc(self.w.arena_cap, sizeof(int32_t))
        self.w.heap_cap = 1024
        self.w.heap = <int32_t*>_alloc(self.w.heap_cap, sizeof(int32_t))
        self.w.settled_cap = 1024
        self.w.settled = <Settled*>_alloc(self.w.settled_cap, sizeof(Settled))
        self.w.settled_head = <int32_t*>_alloc(self.w.n_vertices, sizeof(int32_t))
        self.w.settled_stamp = <uint32_t*>_alloc(self.w.n_vertices, sizeof(uint32_t))
        self.w.pushed_label = <int32_t*>_alloc(self.w.n_vertices, sizeof(int32_t))
        self.w.pushed_stamp = <uint32_t*>_alloc(self.w.n_vertices, sizeof(uint32_t))
        self.w.deferred_cap = 256
        self.w.deferred = <int32_t*>_alloc(self.w.deferred_cap, sizeof(int32_t))
        self.w.target_stamp = <uint32_t*>_alloc(n_nodes, sizeof(uint32_t))
        self.w.found_stamp = <uint32_t*>_alloc(n_nodes, sizeof(uint32_t))
        self.w.found_label = <int32_t*>_alloc(n_nodes, sizeof(int32_t))
        self.w.found = <int32_t*>_alloc(n_nodes, sizeof(int32_t))
        self.w.rank = <int64_t*>_alloc(n_nodes, sizeof(int64_t))
        self.w.best_cap = 16
        self.w.best = <int32_t*>_alloc(self.w.best_cap, sizeof(int32_t))
        self.w.lb = <int32_t*>_alloc(n_nodes, sizeof(int32_t))
        self.w.lb_stamp = <uint32_t*>_alloc(n_nodes, sizeof(uint32_t))
        # A node, or once per OCS a token for its extra hop (see _lower_bounds).
        self.w.queue = <int32_t*>_alloc(2 * n_nodes, sizeof(int32_t))
        memset(self.w.lb_stamp, 0, n_nodes * sizeof(uint32_t))
        self.w.hop = <int32_t*>_alloc(n_nodes, sizeof(int32_t))
        self.w.hop_stamp = <uint32_t*>_alloc(n_nodes, sizeof(uint32_t))
        memset(self.w.hop_stamp, 0, n_nodes * sizeof(uint32_t))
        self.w.hop_queue = <int32_t*>_alloc(2 * n_nodes, sizeof(int32_t))
        self.w.lat_lb = <int64_t*>_alloc(n_nodes, sizeof(int64_t))
        self.w.lat_stamp = <uint32_t*>_alloc(n_nodes, sizeof(uint32_t))
        memset(self.w.lat_stamp, 0, n_nodes * sizeof(uint32_t))
        self.w.dheap_cap = 1024
        self.w.dheap = <DEntry*>_alloc(self.w.dheap_cap, sizeof(DEntry))
        self.w.fwd_lat = <int64_t*>_alloc(n_nodes, sizeof(int64_t))
        self.w.fwd_stamp = <uint32_t*>_alloc(n_nodes, sizeof(uint32_t))
        memset(self.w.fwd_stamp, 0, n_nodes * sizeof(uint32_t))
        self.w.fheap_cap = 1024
        self.w.fheap = <DEntry*>_alloc(self.w.fheap_cap, sizeof(DEntry))
        memset(self.w.settled_stamp, 0, self.w.n_vertices * sizeof(uint32_t))
        memset(self.w.pushed_stamp, 0, self.w.n_vertices * sizeof(uint32_t))
        memset(self.w.target_stamp, 0, n_nodes * sizeof(uint32_t))
        memset(self.w.found_stamp, 0, n_nodes * sizeof(uint32_t))

    def __dealloc__(self):
        free(self.w.labels)
        free(self.w.arena)
        free(self.w.heap)
        free(self.w.settled)
        free(self.w.settled_head)
        free(self.w.settled_stamp)
        free(self.w.pushed_label)
        free(self.w.pushed_stamp)
        free(self.w.deferred)
        free(self.w.target_stamp)
        free(self.w.found_stamp)
        free(self.w.found_label)
        free(self.w.found)
        free(self.w.rank)
        free(self.w.best)
        free(self.w.lb)
        free(self.w.lb_stamp)
        free(self.w.hop)
        free(self.w.hop_stamp)
        free(self.w.hop_queue)
        free(self.w.lat_lb)
        free(self.w.lat_stamp)
        free(self.w.dheap)
        free(self.w.fwd_lat)
        free(self.w.fwd_stamp)
        free(self.w.fheap)
        free(self.w.model_stamp)
        free(self.w.own_stamp)
        free(self.w.target_ocs_stamp)
        free(self.w.fan_exits)
        free(self.w.fan_round)
        free(self.w.fan_hops)
        free(self.w.fan_n)
        free(self.w.fan_cut)
        free(self.w.fan_cut_slot)
        free(self.w.fan_cut_next)
        free(self.w.fan_cut_latency)
        free(self.w.label_hits)
        free(self.w.queue)

    cdef void next_stamp(self):
        # Stamps mark per-search membership without clearing arrays; on wrap-around clear once.
        self.w.stamp += 1
        if self.w.stamp == 0:
            memset(self.w.target_stamp, 0, self.w.n_nodes * sizeof(uint32_t))
            memset(self.w.lb_stamp, 0, self.w.n_nodes * sizeof(uint32_t))
            memset(self.w.hop_stamp, 0, self.w.n_nodes * sizeof(uint32_t))
            memset(self.w.lat_stamp, 0, self.w.n_nodes * sizeof(uint32_t))
            memset(self.w.fwd_stamp, 0, self.w.n_nodes * sizeof(uint32_t))
            self.w.lat_seeded = 0
            memset(self.w.model_stamp, 0,
                   (self.w.n_models if self.w.n_models > 0 else 1) * sizeof(uint32_t))
            memset(self.w.own_stamp, 0,
                   (self.w.n_ocs if self.w.n_ocs > 0 else 1) * sizeof(uint32_t))
            memset(self.w.target_ocs_stamp, 0,
                   (self.w.n_ocs if self.w.n_ocs > 0 else 1) * sizeof(uint32_t))
            self.w.stamp = 1
        _next_round(&self.w)

    cdef int ensure_best(self, int64_t n) except -1:
        if not _grow(<void**>&self.w.best, &self.w.best_cap, n, sizeof(int32_t)):
            raise MemoryError()
        return 0


cdef void _next_round(WS* w) noexcept nogil:
    w.round += 1
    if w.round == 0:
        memset(w.settled_stamp, 0, w.n_vertices * sizeof(uint32_t))
        memset(w.pushed_stamp, 0, w.n_vertices * sizeof(uint32_t))
        memset(w.found_stamp, 0, w.n_nodes * sizeof(uint32_t))
        memset(w.fan_round, 0, (w.n_ocs if w.n_ocs > 0 else 1) * sizeof(uint32_t))
        w.round = 1


cdef class Fabric:
    """The static topology, numbered and laid out for the search; see the module docstring.

    Same constructor as the reference ``Fabric``. ``ports`` is the reference's OCS port map;
    ``graph`` builds the reference's networkx view on first use (tests and tools read it).

    Raises:
        ValueError: a node kind the path core does not know, a link to an unknown node or to
            itself, a duplicate link id, an OCS end without a port, or two cables on one OCS
            port (decide() refuses all of these before they reach a topology).

    Its C attributes are declared in _paths_c.pxd.
    """

    def __cinit__(self):
        memset(&self.d, 0, sizeof(FabricData))

    def __init__(self, nodes, links, devices=None):
        cdef int32_t n, m, i, k, a, b, r, s, nslots, u, v
        cdef Py_ssize_t pos
        self._nodes = nodes
        self._links = list(links)
        node_ids = sorted(nodes)
        n = len(node_ids)
        self.node_ids = tuple(node_ids)
        self._node_index = {node_id: i for i, node_id in enumerate(node_ids)}
        self.d.n_nodes = n
        self.d.kind = <int8_t*>_alloc(n, sizeof(int8_t))
        self.d.node_lat = <int64_t*>_alloc(n, sizeof(int64_t))
        self.d.ocs_rank = <int32_t*>_alloc(n, sizeof(int32_t))
        kinds = []
        r = 0
        for i in range(n):
            info = nodes[node_ids[i]]
            code = _KINDS.get(info.kind)
            if code is None:
                raise ValueError(f"node {node_ids[i]!r} has kind {info.kind!r}, not one of "
                                 "host, switch, ocs, device")
            kinds.append(info.kind)
            self.d.kind[i] = <int8_t>code
            self.d.node_lat[i] = operator.index(info.latency_ns)
            if code == OCS:
                self.d.ocs_rank[i] = r
                r += 1
            else:
                self.d.ocs_rank[i] = -1
        self.d.n_ocs = r
        self._kinds = tuple(kinds)

        by_id = {}
        self.ports = {}
        for link in self._links:
            if link.id in by_id:
                raise ValueError(f"link id {link.id!r} appears twice")
            by_id[link.id] = link
            for end in (link.a, link.b):
                if end not in self._node_index:
                    raise ValueError(f"link {link.id!r} ends at {end!r}, which is no node")
            if link.a == link.b:
                raise ValueError(f"link {link.id!r} connects {link.a!r} to itself")
            # The reference's port map, kept as it builds it (a port on a non-OCS end is
            # recorded and never read).
            for end, port in ((link.a, link.a_port), (link.b, link.b_port)):
                if port is not None:
                    self.ports.setdefault(end, {})[port] = link
        link_ids = sorted(by_id)
        m = len(link_ids)
        self.link_ids = tuple(link_ids)
        self._link_index = {link_id: k for k, link_id in enumerate(link_ids)}
        self.d.n_links = m
        self.d.link_lat = <int64_t*>_alloc(m, sizeof(int64_t))
        self.d.link_cap = <double*>_alloc(m, sizeof(double))

        # OCS slots: every cabled port of every OCS, grouped by OCS (in id order), port order.
        ends = []  # (ocs index, port, link index)
        ends_of = [None] * m  # link index -> [slot key of end a or None, of end b or None]
        for k in range(m):
            link = by_id[link_ids[k]]
            self.d.link_lat[k] = operator.index(link.latency_ns)
            self.d.link_cap[k] = float(link.capacity_gbps)
            for end, port in ((link.a, link.a_port), (link.b, link.b_port)):
                i = self._node_index[end]
                if self.d.kind[i] == OCS:
                    if port is None:
                        raise ValueError(f"link {link.id!r} ends on ocs {end!r} without a port")
                    ends.append((i, port, k))
        ends.sort(key=lambda e: (e[0], e[1]))
        nslots = len(ends)
        self.d.n_slots = nslots
        self.d.slot_ocs = <int32_t*>_alloc(nslots, sizeof(int32_t))
        self.d.slot_port = <int64_t*>_alloc(nslots, sizeof(int64_t))
        self.d.slot_link = <int32_t*>_alloc(nslots, sizeof(int32_t))
        self.d.slot_far = <int32_t*>_alloc(nslots, sizeof(int32_t))
        self.d.slot_far_slot = <int32_t*>_alloc(nslots, sizeof(int32_t))
        self.d.ocs_slots = <int32_t*>_alloc(self.d.n_ocs + 1, sizeof(int32_t))
        self._slot_of_key = {}
        self._slot_of_port = {}
        ports_obj = []
        end_slot = {}  # (link index, ocs index) -> slot
        for s in range(nslots):
            i, port, k = ends[s]
            if (i, port) in self._slot_of_port:
                raise ValueError(
                    f"ocs {node_ids[i]!r} port {port} has two cables "
                    f"({link_ids[self.d.slot_link[self._slot_of_port[(i, port)]]]!r} and "
                    f"{link_ids[k]!r})"
                )
            self._slot_of_port[(i, port)] = s
            self._slot_of_key[f"{node_ids[i]}:{port}"] = s
            ports_obj.append(port)
            self.d.slot_ocs[s] = i
            self.d.slot_port[s] = operator.index(port)
            self.d.slot_link[s] = k
            end_slot[(k, i)] = s
        self._slot_port_obj = tuple(ports_obj)
        for r in range(self.d.n_ocs + 1):
            self.d.ocs_slots[r] = nslots
        for s in range(nslots - 1, -1, -1):
            self.d.ocs_slots[self.d.ocs_rank[self.d.slot_ocs[s]]] = s
        for r in range(self.d.n_ocs - 1, -1, -1):
            # An OCS without cables starts where the next one does.
            if self.d.ocs_slots[r] > self.d.ocs_slots[r + 1]:
                self.d.ocs_slots[r] = self.d.ocs_slots[r + 1]
        for s in range(nslots):
            k = self.d.slot_link[s]
            link = by_id[link_ids[k]]
            i = self.d.slot_ocs[s]
            far = link.b if self._node_index[link.a] == i else link.a
            b = self._node_index[far]
            self.d.slot_far[s] = b
            self.d.slot_far_slot[s] = end_slot.get((k, b), -1)

        # CSR adjacency: each link from both ends.
        self.d.adj_ptr = <int32_t*>_alloc(n + 1, sizeof(int32_t))
        self.d.adj_link = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        self.d.adj_far = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        self.d.adj_slot = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        self.d.adj_near_slot = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        memset(self.d.adj_ptr, 0, (n + 1) * sizeof(int32_t))
        ends_ab = []
        for k in range(m):
            link = by_id[link_ids[k]]
            a = self._node_index[link.a]
            b = self._node_index[link.b]
            ends_ab.append((a, b))
            self.d.adj_ptr[a + 1] += 1
            self.d.adj_ptr[b + 1] += 1
        for i in range(n):
            self.d.adj_ptr[i + 1] += self.d.adj_ptr[i]
        fill = [self.d.adj_ptr[i] for i in range(n)]
        for k in range(m):
            a, b = ends_ab[k]
            for u, v in ((a, b), (b, a)):
                pos = fill[u]
                fill[u] = pos + 1
                self.d.adj_link[pos] = k
                self.d.adj_far[pos] = v
                self.d.adj_slot[pos] = end_slot.get((k, v), -1)
                self.d.adj_near_slot[pos] = end_slot.get((k, u), -1)
        # The lower bounds never step onto a device (only targets, seeded first), and most
        # cables end at one: their BFS and Dijkstra walk this shorter list.
        # Parallel cables (a spine's uplinks to one OCS) side by side, fastest first: once
        # their far node is reached, or one of them carried a step, the rest add nothing.
        self.d.inner_ptr = <int32_t*>_alloc(n + 1, sizeof(int32_t))
        self.d.inner_arc = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        self.d.inner_next = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        pos = 0
        for u in range(n):
            self.d.inner_ptr[u] = <int32_t>pos
            inner = sorted(
                (self.d.adj_far[k], self.d.link_lat[self.d.adj_link[k]], k)
                for k in range(self.d.adj_ptr[u], self.d.adj_ptr[u + 1])
                if self.d.kind[self.d.adj_far[k]] != DEVICE
            )
            for i in range(len(inner)):
                self.d.inner_arc[pos + i] = inner[i][2]
            for i in range(len(inner) - 1, -1, -1):
                if i + 1 < len(inner) and inner[i + 1][0] == inner[i][0]:
                    self.d.inner_next[pos + i] = self.d.inner_next[pos + i + 1]
                else:
                    self.d.inner_next[pos + i] = <int32_t>(pos + i + 1)
            pos += len(inner)
        self.d.inner_ptr[n] = <int32_t>pos
        # An OCS's ports whose cable ends at a switch or another OCS: all that a new circuit
        # can lead on to, unless a target hangs on the OCS (see _fan_exits).
        self.d.ocs_inner_ptr = <int32_t*>_alloc(self.d.n_ocs + 1, sizeof(int32_t))
        self.d.ocs_inner = <int32_t*>_alloc(nslots, sizeof(int32_t))
        pos = 0
        for r in range(self.d.n_ocs):
            self.d.ocs_inner_ptr[r] = <int32_t>pos
            for s in range(self.d.ocs_slots[r], self.d.ocs_slots[r + 1]):
                if self.d.kind[self.d.slot_far[s]] != DEVICE:
                    self.d.ocs_inner[pos] = s
                    pos += 1
        self.d.ocs_inner_ptr[self.d.n_ocs] = <int32_t>pos
        self._graph = None
        self._spare = None
        self._load_devices(devices or {})
        self._index_leaves()

    cdef _load_devices(self, devices):
        cdef int32_t n = self.d.n_nodes, i
        self.d.dev_kind = <int32_t*>_alloc(n, sizeof(int32_t))
        self.d.dev_model = <int32_t*>_alloc(n, sizeof(int32_t))
        self.d.dev_gen = <int64_t*>_alloc(n, sizeof(int64_t))
        self.d.dev_mem = <double*>_alloc(n, sizeof(double))
        self.d.dev_cap = <double*>_alloc(n, sizeof(double))
        self.d.dev_rank = <int64_t*>_alloc(n, sizeof(int64_t))
        for i in range(n):
            self.d.dev_kind[i] = -1
            self.d.dev_model[i] = -1
        self.devices = {}
        self._device_kinds = {}
        self._model_ids = {}
        self._label_index = {}
        self._buckets = {}
        self._kind_models = {}
        for device in sorted(devices):
            found = self._node_index.get(device)
            if found is None or self.d.kind[<int32_t>found] != DEVICE:
                continue  # as the reference: only device nodes of this fabric
            i = found
            info = devices[device]
            self.devices[device] = info
            kind = self._device_kinds.setdefault(info.kind, len(self._device_kinds))
            model = self._model_ids.setdefault(info.model, len(self._model_ids))
            self.d.dev_kind[i] = kind
            self.d.dev_model[i] = model
            self.d.dev_gen[i] = operator.index(info.generation)
            self.d.dev_mem[i] = float(info.memory_gib)
            self.d.dev_cap[i] = float(info.capacity_gib)
            self.d.dev_rank[i] = operator.index(info.rank)
            self._buckets.setdefault((kind, model), []).append(i)
            models = self._kind_models.setdefault(kind, [])
            if model not in models:
                models.append(model)
            for pair in info.labels.items():
                self._label_index.setdefault(pair, []).append(i)
        self.d.n_models = len(self._model_ids)
        self._model_names = sorted(self._model_ids, key=self._model_ids.get)
        # As C ints, so census walks a hall's devices of a kind without a Python object each.
        self._buckets = {key: array("i", ids) for key, ids in self._buckets.items()}
        self._bucket_no = {}
        self._bucket_span = []
        self.d.dev_bucket = <int32_t*>_alloc(n, sizeof(int32_t))
        for i in range(n):
            self.d.dev_bucket[i] = -1
        for key, ids in self._buckets.items():
            self._bucket_no[key] = len(self._bucket_span)
            gens = [self.d.dev_gen[<int32_t>j] for j in ids]
            mems = [self.d.dev_mem[<int32_t>j] for j in ids]
            self._bucket_span.append((min(gens), max(gens), min(mems), max(mems), len(ids)))
            for j in ids:
                self.d.dev_bucket[<int32_t>j] = self._bucket_no[key]
        self.d.n_buckets = len(self._bucket_span)

    cdef _index_leaves(self):
        """Find the leaf devices (FabricData.leaf_link) and the nodes they hang from."""
        cdef int32_t n = self.d.n_nodes, m = self.d.n_links, i, k, u
        cdef Py_ssize_t pos = 0
        self.d.leaf_link = <int32_t*>_alloc(n, sizeof(int32_t))
        self.d.home = <int32_t*>_alloc(n, sizeof(int32_t))
        self.d.link_leaf = <int32_t*>_alloc(m, sizeof(int32_t))
        self.d.outer_ptr = <int32_t*>_alloc(n + 1, sizeof(int32_t))
        self.d.outer_arc = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        for i in range(m):
            self.d.link_leaf[i] = -1
        for i in range(n):
            self.d.leaf_link[i] = -1
            self.d.home[i] = -1
        self.d.n_homes = 0
        for i in range(n):
            if self.d.dev_bucket[i] < 0 or self.d.adj_ptr[i + 1] - self.d.adj_ptr[i] != 1:
                continue
            k = self.d.adj_ptr[i]
            u = self.d.adj_far[k]
            if self.d.kind[u] == DEVICE or self.d.kind[u] == OCS:
                continue
            if self.d.adj_slot[k] >= 0 or self.d.adj_near_slot[k] >= 0:
                continue
            self.d.leaf_link[i] = self.d.adj_link[k]
            self.d.link_leaf[self.d.adj_link[k]] = i
            if self.d.home[u] < 0:
                self.d.home[u] = self.d.n_homes
                self.d.n_homes += 1
        for u in range(n):
            self.d.outer_ptr[u] = <int32_t>pos
            for k in range(self.d.adj_ptr[u], self.d.adj_ptr[u + 1]):
                if self.d.leaf_link[self.d.adj_far[k]] < 0:
                    self.d.outer_arc[pos] = k
                    pos += 1
        self.d.outer_ptr[n] = <int32_t>pos
        self._index_ports()

    cdef _index_ports(self):
        """Find the port devices (FabricData.port_slot), each link's OCS slots, and whether
        any device with a DeviceInfo is neither a leaf nor a port one (the region index then
        stays off: such a device may hang between two places)."""
        cdef int32_t n = self.d.n_nodes, m = self.d.n_links, i, k, s
        self.d.port_slot = <int32_t*>_alloc(n, sizeof(int32_t))
        self.d.link_slots = <int32_t*>_alloc(2 * m, sizeof(int32_t))
        for k in range(2 * m):
            self.d.link_slots[k] = -1
        for s in range(self.d.n_slots):
            k = self.d.slot_link[s]
            self.d.link_slots[2 * k + (0 if self.d.link_slots[2 * k] < 0 else 1)] = s
        self.d.switch_link = <uint8_t*>_alloc(m, sizeof(uint8_t))
        memset(self.d.switch_link, 0, m)
        for i in range(n):
            if self.d.kind[i] == SWITCH:
                for k in range(self.d.adj_ptr[i], self.d.adj_ptr[i + 1]):
                    if self.d.kind[self.d.adj_far[k]] == SWITCH:
                        self.d.switch_link[self.d.adj_link[k]] = 1
        self.d.has_other_devices = 0
        for i in range(n):
            self.d.port_slot[i] = -1
            if self.d.dev_bucket[i] < 0 or self.d.leaf_link[i] >= 0:
                continue
            k = self.d.adj_ptr[i]
            if self.d.adj_ptr[i + 1] - k == 1 and self.d.adj_slot[k] >= 0:
                self.d.port_slot[i] = self.d.adj_slot[k]
            else:
                self.d.has_other_devices = 1

    def __dealloc__(self):
        free(self.d.dev_bucket)
        free(self.d.leaf_link)
        free(self.d.port_slot)
        free(self.d.link_slots)
        free(self.d.switch_link)
        free(self.d.link_leaf)
        free(self.d.home)
        free(self.d.outer_ptr)
        free(self.d.outer_arc)
        free(self.d.dev_kind)
        free(self.d.dev_model)
        free(self.d.dev_gen)
        free(self.d.dev_mem)
        free(self.d.dev_cap)
        free(self.d.dev_rank)
        free(self.d.kind)
        free(self.d.node_lat)
        free(self.d.ocs_rank)
        free(self.d.adj_ptr)
        free(self.d.adj_link)
        free(self.d.adj_far)
        free(self.d.adj_slot)
        free(self.d.adj_near_slot)
        free(self.d.inner_ptr)
        free(self.d.inner_arc)
        free(self.d.inner_next)
        free(self.d.link_lat)
        free(self.d.link_cap)
        free(self.d.slot_ocs)
        free(self.d.slot_port)
        free(self.d.slot_link)
        free(self.d.slot_far)
        free(self.d.slot_far_slot)
        free(self.d.ocs_slots)
        free(self.d.ocs_inner_ptr)
        free(self.d.ocs_inner)

    def kind(self, node):
        return self._kinds[self._node_index[node]]

    @property
    def graph(self):
        """The reference's networkx MultiGraph of this topology, built on first use."""
        if self._graph is None:
            from ._paths_py import Fabric as _ReferenceFabric

            self._graph = _ReferenceFabric(self._nodes, self._links).graph
        return self._graph

    cdef _Workspace _take(self):
        # Under the GIL: hand out the spare workspace, or a fresh one when a search in another
        # thread holds it, so searches released from the GIL never share buffers.
        cdef _Workspace ws = self._spare
        if ws is None:
            return _Workspace(self.d.n_nodes, self.d.n_slots, self.d.n_models, self.d.n_ocs)
        self._spare = None
        return ws

    cdef void _give(self, _Workspace ws):
        if self._spare is None:
            self._spare = ws


cdef inline bint _leaf_open(const FabricData* f, const CondData* c, int32_t device) noexcept nogil:
    """Whether a BFS of _reach for no bandwidth, going on from a leaf device's home, reaches
    it and a Selector that admits its bucket whole takes it: it and its cable are usable, its
    cable has no less than nothing free (as _reach tests), and it is not taken."""
    cdef int32_t link = f.leaf_link[device]
    return not (
        (c.link_flags[link] | c.node_flags[device]) & UNUSABLE
        or c.free[link] + _EPSILON < 0.0
        or c.taken[device]
    )


cdef inline bint _port_open(const FabricData* f, const CondData* c, int32_t device) noexcept nogil:
    """Whether a BFS of _reach for no bandwidth that reaches a port device's OCS reaches it
    and a Selector that admits its bucket whole takes it: as _leaf_open, and its port holds
    no circuit."""
    cdef int32_t slot = f.port_slot[device]
    cdef int32_t link = f.slot_link[slot]
    return not (
        (c.link_flags[link] | c.node_flags[device]) & UNUSABLE
        or c.free[link] + _EPSILON < 0.0
        or c.taken[device]
        or c.circ_other[slot] != NO_CIRCUIT
    )


cdef inline bint _cable_open(const FabricData* f, const CondData* c, int32_t link) noexcept nogil:
    """Whether _reach's BFS, ignoring isolation, for no bandwidth and from a host that holds
    no circuit, crosses a cable with OCS ends: it, its ends and its ports are free."""
    cdef int32_t a = f.link_slots[2 * link], b = f.link_slots[2 * link + 1]
    return not (
        c.link_flags[link] & UNUSABLE
        or c.free[link] + _EPSILON < 0.0
        or (c.node_flags[f.slot_ocs[a]] | c.node_flags[f.slot_far[a]]) & UNUSABLE
        or c.circ_other[a] != NO_CIRCUIT
        or (b >= 0 and c.circ_other[b] != NO_CIRCUIT)
    )


# The region index has at most this many places (regions and OCS): its table of open cables
# is places x places, and a count scans a row per place it reaches.
cdef int32_t _MAX_PLACES = 256


cdef class _ConditionArrays:
    """The conditions of one fabric as arrays, built from a ``Conditions`` snapshot: what the
    search reads. ``_live_c.LiveConditions`` is these arrays changed in place."""

    def __cinit__(self):
        memset(&self.c, 0, sizeof(CondData))
        self.regions_stale = True  # the region index's pointers start NULL, as every C field

    def __init__(self, Fabric fabric not None, conditions=Conditions()):
        cdef int32_t n = fabric.d.n_nodes, m = fabric.d.n_links, s = fabric.d.n_slots, i
        self.fabric = fabric
        self.c.node_flags = <uint8_t*>_alloc(n, sizeof(uint8_t))
        self.c.link_flags = <uint8_t*>_alloc(m, sizeof(uint8_t))
        self.c.free = <double*>_alloc(m, sizeof(double))
        self.c.reserved = <double*>_alloc(m, sizeof(double))
        self.c.circ_other = <int32_t*>_alloc(s, sizeof(int32_t))
        self.c.circ_owner = <int32_t*>_alloc(s, sizeof(int32_t))
        self.c.users_n = <int32_t*>_alloc(n, sizeof(int32_t))
        self.c.users_sole = <int32_t*>_alloc(n, sizeof(int32_t))
        self.c.holders_n = <int32_t*>_alloc(n, sizeof(int32_t))
        self.c.holders_sole = <int32_t*>_alloc(n, sizeof(int32_t))
        self.c.taken = <uint8_t*>_alloc(n, sizeof(uint8_t))
        self.c.sliced = <double*>_alloc(n, sizeof(double))
        self.c.leaf_open = <int32_t*>_alloc(
            max(1, fabric.d.n_homes * fabric.d.n_buckets), sizeof(int32_t)
        )
        self.c.bucket_healthy = <int32_t*>_alloc(max(1, fabric.d.n_buckets), sizeof(int32_t))
        self.c.bucket_free = <int32_t*>_alloc(max(1, fabric.d.n_buckets), sizeof(int32_t))
        memset(self.c.taken, 0, n)
        for i in range(n):
            self.c.sliced[i] = 0.0
        memset(self.c.node_flags, 0, n)
        memset(self.c.link_flags, 0, m)
        for i in range(m):
            self.c.reserved[i] = 0.0
            self.c.free[i] = fabric.d.link_cap[i] - 0.0
        for i in range(s):
            self.c.circ_other[i] = NO_CIRCUIT
            self.c.circ_owner[i] = NOBODY
        memset(self.c.users_n, 0, n * sizeof(int32_t))
        memset(self.c.holders_n, 0, n * sizeof(int32_t))
        for i in range(n):
            self.c.users_sole[i] = NOBODY
            self.c.holders_sole[i] = NOBODY
        self._tenant_ids = {}
        self._users = {}
        self._holders = {}
        self._dangling = {}
        self._owned = {}
        self._journal = None
        self._load(conditions)

    def __dealloc__(self):
        free(self.c.node_flags)
        free(self.c.link_flags)
        free(self.c.free)
        free(self.c.reserved)
        free(self.c.circ_other)
        free(self.c.circ_owner)
        free(self.c.users_n)
        free(self.c.users_sole)
        free(self.c.holders_n)
        free(self.c.holders_sole)
        free(self.c.taken)
        free(self.c.sliced)
        free(self.c.leaf_open)
        free(self.c.bucket_healthy)
        free(self.c.bucket_free)
        self._free_regions()

    cdef void _free_regions(self) noexcept:
        free(self.region)
        free(self.place_links)
        free(self.region_open)
        free(self.ocs_open)
        free(self.place_seen)
        free(self.place_queue)
        self.region = NULL
        self.place_links = NULL
        self.region_open = NULL
        self.ocs_open = NULL
        self.place_seen = NULL
        self.place_queue = NULL

    cdef _load(self, conditions):
        # A snapshot may name things the fabric lacks (the reference ignores them): skip them.
        cdef Fabric f = self.fabric
        cdef int32_t leaf
        node_index = f._node_index
        link_index = f._link_index
        for component in conditions.unusable:
            i = node_index.get(component)
            if i is not None:
                self.c.node_flags[<int32_t>i] |= UNUSABLE
            k = link_index.get(component)
            if k is not None:
                self.c.link_flags[<int32_t>k] |= UNUSABLE
        for link_id, gbps in conditions.reserved_gbps.items():
            k = link_index.get(link_id)
            if k is not None:
                self.c.reserved[<int32_t>k] = gbps
                self.c.free[<int32_t>k] = f.d.link_cap[<int32_t>k] - <double>gbps
        slot_of_key = f._slot_of_key
        for key, value in conditions.circuits.items():
            s = slot_of_key.get(key)
            if s is not None:
                other, owner = value
                self._set_slot(s, other, owner)
        for switch, tenants in conditions.switch_tenants.items():
            i = node_index.get(switch)
            if i is not None:
                self._set_tenants(self._users, i, tenants, False)
        for switch, tenants in conditions.exclusive_tenants.items():
            i = node_index.get(switch)
            if i is not None:
                self._set_tenants(self._holders, i, tenants, True)
        for device in conditions.taken:
            i = node_index.get(device)
            if i is not None:
                self.c.taken[<int32_t>i] = 1
        for device, gib in conditions.sliced_gib.items():
            i = node_index.get(device)
            if i is not None:
                self.c.sliced[<int32_t>i] = gib
        self._regions_stale()
        memset(self.c.leaf_open, 0, max(1, f.d.n_homes * f.d.n_buckets) * sizeof(int32_t))
        memset(self.c.bucket_healthy, 0, max(1, f.d.n_buckets) * sizeof(int32_t))
        memset(self.c.bucket_free, 0, max(1, f.d.n_buckets) * sizeof(int32_t))
        for leaf in range(f.d.n_nodes):
            self._tally(leaf, 1)

    cdef void _tally(self, int32_t device, int delta) noexcept:
        """Count a device with a bucket in (delta 1) or out (-1) of its bucket's healthy
        and free tallies as it is now, and a leaf device of its home's leaf_open (and its
        region's) if it is open now (_leaf_open), a port device of its OCS's (_port_tally); a
        change to a device or its cable is bracketed by -1 before and 1 after. Anything else
        (device -1, or no device of a bucket): no-op."""
        cdef const FabricData* f = &self.fabric.d
        cdef int32_t b, home
        if device < 0 or f.dev_bucket[device] < 0:
            return
        b = f.dev_bucket[device]
        if not self.c.node_flags[device] & UNUSABLE:
            self.c.bucket_healthy[b] += delta
            if not self.c.taken[device]:
                self.c.bucket_free[b] += delta
        if f.leaf_link[device] >= 0:
            if _leaf_open(f, &self.c, device):
                home = f.adj_far[f.adj_ptr[device]]
                self.c.leaf_open[f.home[home] * f.n_buckets + b] += delta
                if self.regions_ready and self.region[home] >= 0:
                    self.region_open[self.region[home] * f.n_buckets + b] += delta
        else:
            self._port_tally(device, delta)

    # ---- the region index ----
    #
    # A count of what a host reaches ignoring isolation, with no hop, latency or bandwidth
    # bound, from a host that holds no circuit (the why-not funnel's isolation stage, for a
    # Selector) walks the hall: at 65,536 devices that is most of a refused compose. Its BFS
    # passes switches and OCS, and counts leaf devices per node and port devices one by one.
    # The region index answers it from smaller parts, kept as conditions change:
    # - a region is a set of usable switches joined by open cables between switches; a change
    #   that could split or join one (a switch or OCS, or a cable between switches, opening or
    #   closing) marks the index stale, and the next count rebuilds it (faults are rare);
    # - place_links counts, for each two places (regions and OCS), the open cables between
    #   them (_cable_open): a circuit, a fault or a reservation on an OCS cable moves one;
    # - region_open and ocs_open tally the open leaf devices per region and the open port
    #   devices per OCS, per bucket.
    # The BFS then walks places, not nodes. Off when a device hangs any other way.

    cdef void _regions_stale(self) noexcept:
        self.regions_stale = True
        self.regions_ready = False

    cdef void _node_changed(self, int32_t node) noexcept:
        """A node's flags changed: a switch or OCS may split or join regions."""
        cdef int8_t kind = self.fabric.d.kind[node]
        if self.regions_ready and (kind == SWITCH or kind == OCS):
            self._regions_stale()

    cdef void _port_tally(self, int32_t device, int delta) noexcept:
        """Count a port device in (1) or out (-1) of its OCS's tally, if it is open now."""
        cdef const FabricData* f = &self.fabric.d
        if not self.regions_ready or device < 0 or f.port_slot[device] < 0:
            return
        if _port_open(f, &self.c, device):
            self.ocs_open[
                f.ocs_rank[f.slot_ocs[f.port_slot[device]]] * f.n_buckets + f.dev_bucket[device]
            ] += delta

    cdef void _cable_tally(self, int32_t link, int delta) noexcept:
        """Count an OCS cable in (1) or out (-1) of place_links, if it is open now; a cable
        between switches that opens or closes between the two marks the regions stale."""
        cdef const FabricData* f = &self.fabric.d
        cdef int32_t j, s, far, here, there, places = self.n_places
        cdef bint is_open
        if not self.regions_ready or link < 0:
            return
        if f.switch_link[link]:
            is_open = not (self.c.link_flags[link] & UNUSABLE or self.c.free[link] + _EPSILON < 0.0)
            if delta < 0:
                self._was_open = is_open
            elif is_open != self._was_open:
                self._regions_stale()
            return
        if f.link_slots[2 * link] < 0 or not _cable_open(f, &self.c, link):
            return
        for j in range(2):
            s = f.link_slots[2 * link + j]
            if s < 0:
                continue
            here = self.n_regions + f.ocs_rank[f.slot_ocs[s]]
            far = f.slot_far[s]
            if f.kind[far] == SWITCH:
                there = self.region[far]
                self.place_links[here * places + there] += delta
                self.place_links[there * places + here] += delta
            elif f.kind[far] == OCS:  # the far end's own slot counts the way back
                self.place_links[here * places + self.n_regions + f.ocs_rank[far]] += delta

    cdef void _slot_port_tally(self, int32_t slot, int delta) noexcept:
        """The port device on `slot`, if any, in or out of its OCS's tally (_port_tally)."""
        cdef const FabricData* f = &self.fabric.d
        cdef int32_t far = f.slot_far[slot]
        if f.kind[far] == DEVICE and f.port_slot[far] == slot:
            self._port_tally(far, delta)

    cdef void _slot_tally(self, int32_t slot, int delta) noexcept:
        """Around a change to a slot's circuit: its cable, and the port device on it."""
        self._cable_tally(self.fabric.d.slot_link[slot], delta)
        self._slot_port_tally(slot, delta)

    cdef void _link_tally(self, int32_t link, int delta) noexcept:
        """Around a change to a link's flags or bandwidth: the leaf or port device it is the
        cable of, and the cable itself."""
        cdef const FabricData* f = &self.fabric.d
        cdef int32_t j
        self._tally(f.link_leaf[link], delta)
        for j in range(2):
            if f.link_slots[2 * link + j] >= 0:
                self._slot_port_tally(f.link_slots[2 * link + j], delta)
        self._cable_tally(link, delta)

    cdef int _reach_build(self) except -1:
        """Build the region index from the arrays as they are; off (regions_ready False
        until the next stale mark) when a device hangs another way or the places are too
        many."""
        cdef const FabricData* f = &self.fabric.d
        cdef int32_t n = f.n_nodes, nb = f.n_buckets, u, v, k, j, b, head, tail, regions = 0
        cdef int32_t places, link
        cdef int32_t* queue
        self.regions_stale = False
        self.regions_ready = False
        self._free_regions()
        if f.has_other_devices:
            return 0
        self.region = <int32_t*>_alloc(n, sizeof(int32_t))
        for u in range(n):
            self.region[u] = -1
        queue = <int32_t*>_alloc(n, sizeof(int32_t))
        try:
            for u in range(n):
                if f.kind[u] != SWITCH or self.region[u] >= 0 or self.c.node_flags[u] & UNUSABLE:
                    continue
                self.region[u] = regions
                queue[0] = u
                head, tail = 0, 1
                while head < tail:
                    v = queue[head]
                    head += 1
                    for j in range(f.adj_ptr[v], f.adj_ptr[v + 1]):
                        k = f.adj_far[j]
                        link = f.adj_link[j]
                        if (
                            f.kind[k] != SWITCH
                            or self.region[k] >= 0
                            or (self.c.node_flags[k] | self.c.link_flags[link]) & UNUSABLE
                            or self.c.free[link] + _EPSILON < 0.0
                        ):
                            continue
                        self.region[k] = regions
                        queue[tail] = k
                        tail += 1
                regions += 1
        finally:
            free(queue)
        places = regions + f.n_ocs
        if places > _MAX_PLACES:
            return 0
        self.n_regions = regions
        self.n_places = places
        self.place_links = <int32_t*>_alloc(places * places, sizeof(int32_t))
        self.region_open = <int32_t*>_alloc(max(1, regions * nb), sizeof(int32_t))
        self.ocs_open = <int32_t*>_alloc(max(1, f.n_ocs * nb), sizeof(int32_t))
        self.place_seen = <uint8_t*>_alloc(places, sizeof(uint8_t))
        self.place_queue = <int32_t*>_alloc(places, sizeof(int32_t))
        memset(self.place_links, 0, max(1, places * places) * sizeof(int32_t))
        memset(self.region_open, 0, max(1, regions * nb) * sizeof(int32_t))
        memset(self.ocs_open, 0, max(1, f.n_ocs * nb) * sizeof(int32_t))
        memset(self.place_seen, 0, max(1, places))
        self.regions_ready = True
        for u in range(n):
            if f.home[u] >= 0 and self.region[u] >= 0:
                for b in range(nb):
                    self.region_open[self.region[u] * nb + b] += self.c.leaf_open[f.home[u] * nb + b]
        for link in range(f.n_links):
            if f.link_slots[2 * link] >= 0:
                self._cable_tally(link, 1)
        for u in range(n):
            self._port_tally(u, 1)
        return 0

    cdef _set_slot(self, s, other, owner):
        cdef int32_t slot = s
        if self._journal is not None:
            self._journal.append(
                (3, s, self.c.circ_other[slot], self.c.circ_owner[slot], self._dangling.get(s))
            )
        self._slot_tally(slot, -1)
        self._set_circuit(slot, other, owner)
        self._slot_tally(slot, 1)

    cdef _set_circuit(self, int32_t slot, other, owner):
        """The arrays' part of _set_slot (which journals it and keeps the tallies)."""
        cdef Fabric f = self.fabric
        cdef int32_t other_slot
        s = slot
        self._count_owner(slot, -1)
        if other is None and owner is None:
            self.c.circ_other[slot] = NO_CIRCUIT
            self.c.circ_owner[slot] = NOBODY
            self._dangling.pop(s, None)
            return
        o = f._slot_of_port.get((f.d.slot_ocs[slot], other))
        if o is None:
            self.c.circ_other[slot] = DANGLING
            self._dangling[s] = other
        else:
            other_slot = o
            self.c.circ_other[slot] = other_slot
            self._dangling.pop(s, None)
        w = f._node_index.get(owner)
        self.c.circ_owner[slot] = NOBODY if w is None else <int32_t>w
        self._count_owner(slot, 1)

    cdef _count_owner(self, int32_t slot, int delta):
        """Count the circuit on `slot` (if any) in or out of its owner's tally per OCS, which
        _run reads so that the search knows at once where the host holds circuits."""
        cdef int32_t owner = self.c.circ_owner[slot]
        if self.c.circ_other[slot] == NO_CIRCUIT or owner < 0:
            return
        rank = self.fabric.d.ocs_rank[self.fabric.d.slot_ocs[slot]]
        tally = self._owned.setdefault(owner, {})
        held = tally.get(rank, 0) + delta
        if held:
            tally[rank] = held
        else:
            del tally[rank]
            if not tally:
                del self._owned[owner]

    cdef _set_tenants(self, dict table, i, tenants, bint exclusive):
        cdef int32_t node = i
        cdef int32_t* count = self.c.holders_n if exclusive else self.c.users_n
        cdef int32_t* sole = self.c.holders_sole if exclusive else self.c.users_sole
        if self._journal is not None:
            self._journal.append((5 if exclusive else 4, i, dict(table.get(i, {}))))
        tenants = dict(tenants)
        if tenants:
            table[i] = tenants
        else:
            table.pop(i, None)
        count[node] = len(tenants)
        if len(tenants) == 1:
            (tenant,) = tenants
            tid = self._tenant_ids.get(tenant)
            if tid is None:
                tid = len(self._tenant_ids)
                self._tenant_ids[tenant] = tid
            sole[node] = tid
        else:
            sole[node] = NOBODY

    cdef int32_t _tenant(self, tenant):
        tid = self._tenant_ids.get(tenant)
        return -1 if tid is None else <int32_t>tid


# ---- the search (no GIL, no allocation per step) ----


cdef inline bint _less(const Label* la, const Label* lb, const int32_t* arena) noexcept nogil:
    """The section-5 order: hops, latency, node ids, new circuits, link ids."""
    cdef const int32_t* na
    cdef const int32_t* nb
    cdef int32_t i, m
    if la.hops != lb.hops:
        return la.hops < lb.hops
    if la.latency != lb.latency:
        return la.latency < lb.latency
    na = arena + la.seq
    nb = arena + lb.seq
    m = la.depth if la.depth < lb.depth else lb.depth
    for i in range(m):
        if na[i] != nb[i]:
            return na[i] < nb[i]
    if la.depth != lb.depth:
        return la.depth < lb.depth
    if la.new_circuits != lb.new_circuits:
        return la.new_circuits < lb.new_circuits
    na += la.depth
    nb += lb.depth
    for i in range(la.depth - 1):
        if na[i] != nb[i]:
            return na[i] < nb[i]
    return False


cdef inline void _heap_push(WS* ws, int32_t x) noexcept nogil:
    cdef int64_t i = ws.heap_n, parent
    cdef int32_t* heap = ws.heap
    cdef Label* labels = ws.labels
    ws.heap_n += 1
    while i > 0:
        parent = (i - 1) >> 1
        if not _less(&labels[x], &labels[heap[parent]], ws.arena):
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = x


cdef inline int32_t _heap_pop(WS* ws) noexcept nogil:
    cdef int32_t* heap = ws.heap
    cdef Label* labels = ws.labels
    cdef int32_t top = heap[0], last
    cdef int64_t n, i = 0, child
    ws.heap_n -= 1
    n = ws.heap_n
    if n == 0:
        return top
    last = heap[n]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _less(&labels[heap[child + 1]], &labels[heap[child]], ws.arena):
            child += 1
        if not _less(&labels[heap[child]], &labels[last], ws.arena):
            break
        heap[i] = heap[child]
        i = child
    heap[i] = last
    return top


cdef bint _grow(void** buffer, int64_t* capacity, int64_t need, size_t size) noexcept nogil:
    cdef int64_t cap = capacity[0]
    cdef void* grown
    if need <= cap:
        return True
    while cap < need:
        cap *= 2
    grown = realloc(buffer[0], <size_t>cap * size)
    if grown == NULL:
        return False
    buffer[0] = grown
    capacity[0] = cap
    return True


cdef inline bint _on_path(const int32_t* nodes, int32_t depth, int32_t node) noexcept nogil:
    cdef int32_t i
    for i in range(depth):
        if nodes[i] == node:
            return True
    return False


cdef inline bint _owns(const FabricData* f, const CondData* c, WS* ws, const Query* q,
                       int32_t ocs) noexcept nogil:
    """Whether the host holds a circuit on any port of ``ocs`` (marked by _run)."""
    return ws.own_stamp[f.ocs_rank[ocs]] == ws.stamp


cdef bint _ocs_covered(
    const FabricData* f, const CondData* c, WS* ws, const Query* q, int32_t a, int32_t b
) noexcept nogil:
    """Exact test that every OCS label a passed and label b avoids, a left on a new circuit
    where the host holds none (the masks alias past 64 OCS). Each OCS a passed has the label
    that crossed its circuit on a's chain; an OCS a stands at, b stands at too."""
    cdef const Label* lb = &ws.labels[b]
    cdef const int32_t* nb = ws.arena + lb.seq
    cdef const Label* y
    cdef int32_t x = a, ocs
    while x >= 0:
        y = &ws.labels[x]
        if y.circ_in >= 0:
            ocs = f.slot_ocs[y.circ_in]
            if not _on_path(nb, lb.depth, ocs) and (not y.circ_new or _owns(f, c, ws, q, ocs)):
                return False
        x = y.parent
    return True


cdef inline bint _dominates(
    const FabricData* f, const CondData* c, WS* ws, const Query* q, int32_t a, int32_t b,
    int64_t b_latency, uint64_t b_mask,
) noexcept nogil:
    """Label a, earlier in the search order at b's vertex, dominates b: every path through b
    has a strictly better one, so b is no prefix of a best path. With a continuation C of b,
    a + C is a path unless C meets a's path; at the last node x where it does, a's path to x
    and C's rest from x is one, with fewer hops. That splice holds at a switch, and at an OCS
    (one b avoids: C avoids b's path) when a left it on a new circuit, so a's entry port is
    free, and the host holds no circuit there, so C left it on a new circuit from a free
    port too: the splice's circuit pairs the two. With a latency bound, a must also be as
    fast as b (the splice is no slower than a). The masks decide it exactly up to 64 OCS.
    """
    cdef const Label* la = &ws.labels[a]
    if q.bounded and la.latency > b_latency:
        return False
    if (la.mask & ~b_mask & ~la.free_mask) != 0:
        return False
    return f.n_ocs <= 64 or _ocs_covered(f, c, ws, q, a, b)


cdef inline bint _switch_open(const CondData* c, const Query* q, int32_t node) noexcept nogil:
    """_paths_py._may_use_switch on the tenant summaries."""
    cdef int32_t n = c.holders_n[node]
    if n >= 2 or (n == 1 and c.holders_sole[node] != q.tenant):
        return False
    if q.exclusive:
        n = c.users_n[node]
        if n >= 2 or (n == 1 and c.users_sole[node] != q.tenant):
            return False
    return True


cdef inline bint _selected(
    const FabricData* f, const CondData* c, const WS* ws, const Query* q, int32_t node
) noexcept nogil:
    """_paths_py.selected for one device (usability is the search's own test)."""
    if f.dev_kind[node] != q.sel_kind or c.taken[node]:
        return False
    if q.has_models and ws.model_stamp[f.dev_model[node]] != ws.stamp:
        return False
    if q.has_min_gen and f.dev_gen[node] < q.min_gen:
        return False
    if q.has_min_mem and f.dev_mem[node] < q.min_mem:
        return False
    if q.has_slice and f.dev_cap[node] - c.sliced[node] + 1e-9 < q.slice_gib:
        return False
    if q.n_labels > 0 and (
        ws.target_stamp[node] != ws.stamp or ws.label_hits[node] != q.n_labels
    ):
        return False
    return True


cdef inline bint _best_before(WS* ws, int32_t u, int32_t v) noexcept nogil:
    """Device order of best_devices: (hops, latency, rank, id) of their best paths."""
    cdef const Label* a = &ws.labels[ws.found_label[u]]
    cdef const Label* b = &ws.labels[ws.found_label[v]]
    if a.hops != b.hops:
        return a.hops < b.hops
    if a.latency != b.latency:
        return a.latency < b.latency
    if ws.rank[u] != ws.rank[v]:
        return ws.rank[u] < ws.rank[v]
    return u < v


cdef int _step(
    const FabricData* f, const CondData* c, WS* ws, Query* q, int32_t x,
    int32_t link, int32_t far, int32_t far_slot, int32_t hops, int32_t circ_in,
    int32_t circ_out, int32_t circ_new,
) noexcept nogil:
    """_paths_py._arrive plus the push: cross ``link`` to ``far`` if the rules allow.
    Returns -1 when out of memory."""
    cdef Label* parent = &ws.labels[x]
    cdef int32_t depth = parent.depth, i, vertex
    cdef int64_t seq = parent.seq, latency, total_latency, total_hops, need
    cdef int8_t kind
    cdef Label* y
    cdef Label* a
    cdef int32_t* dst
    cdef int32_t child, rival
    cdef int compare
    cdef uint64_t mask, free_mask
    if (c.link_flags[link] | c.node_flags[far]) & UNUSABLE:
        return 0
    if c.free[link] + _EPSILON < q.bandwidth:
        return 0
    kind = f.kind[far]
    latency = f.link_lat[link]
    mask = parent.mask
    free_mask = parent.free_mask
    if circ_new and not _owns(f, c, ws, q, f.slot_ocs[circ_in]):
        free_mask |= (<uint64_t>1) << (f.ocs_rank[f.slot_ocs[circ_in]] & 63)
    if kind == DEVICE:
        if q.select:
            if not _selected(f, c, ws, q, far):
                return 0
        elif ws.target_stamp[far] != ws.stamp:
            return 0
        vertex = far
    elif kind == HOST:
        return 0  # hosts are endpoints, never passed through
    else:
        latency += f.node_lat[far]
        if kind == SWITCH:
            if q.isolation and not _switch_open(c, q, far):
                return 0
            vertex = far
        else:
            vertex = f.n_nodes + far_slot
            mask |= (<uint64_t>1) << (f.ocs_rank[far] & 63)
    total_hops = parent.hops + hops
    total_latency = parent.latency + latency
    if q.bounded and total_latency > q.max_latency:
        return 0
    if q.use_lat_lb and kind != DEVICE and (
        ws.lat_stamp[far] != ws.stamp or total_latency + ws.lat_lb[far] > q.max_latency
    ):
        return 0  # no target within the latency bound from there (see _latency_bounds)
    if total_hops > q.max_hops:
        _cut(q, total_hops)
        return 0
    if q.use_lb and kind != DEVICE:
        need = _hops_needed(ws, total_hops, far)
        if need < 0:
            return 0  # no target within reach from there (see _lower_bounds)
        if need > q.max_hops:
            _cut(q, need)
            return 0

    # Pruned at push when the smallest label pushed at this vertex so far comes first and
    # dominates this one: it either settles and drops this one at its pop, or is dropped by
    # a settled label that drops this one too. Exact, and most of an OCS fan-out never
    # reaches the heap. Decided on (hops, latency) alone when they differ, before any copy.
    rival = -1
    compare = 0  # 0: this one is the smallest so far; 1: the rival is smaller; 2: tie
    if ws.pushed_stamp[vertex] == ws.round:
        rival = ws.pushed_label[vertex]
        a = &ws.labels[rival]
        if a.hops < total_hops or (a.hops == total_hops and a.latency < total_latency):
            compare = 1
            if ((not q.bounded or a.latency <= total_latency)
                    and (a.mask & ~mask & ~a.free_mask) == 0 and f.n_ocs <= 64):
                return 0
        elif a.hops == total_hops and a.latency == total_latency:
            compare = 2
    if _on_path(ws.arena + seq, depth, far):
        return 0

    need = ws.arena_used + 2 * depth + 1
    if not _grow(<void**>&ws.arena, &ws.arena_cap, need, sizeof(int32_t)):
        return -1
    if not _grow(<void**>&ws.labels, &ws.labels_cap, ws.n_labels + 1, sizeof(Label)):
        return -1
    if not _grow(<void**>&ws.heap, &ws.heap_cap, ws.heap_n + 1, sizeof(int32_t)):
        return -1
    parent = &ws.labels[x]  # the buffers may have moved
    dst = ws.arena + ws.arena_used
    memcpy(dst, ws.arena + seq, depth * sizeof(int32_t))
    dst[depth] = far
    memcpy(dst + depth + 1, ws.arena + seq + depth, (depth - 1) * sizeof(int32_t))
    dst[2 * depth] = link
    child = <int32_t>ws.n_labels
    y = &ws.labels[child]
    y.latency = total_latency
    y.seq = ws.arena_used
    y.mask = mask
    y.free_mask = free_mask
    y.hops = <int32_t>total_hops
    y.new_circuits = parent.new_circuits + circ_new
    y.vertex = vertex
    y.node = far
    y.depth = depth + 1
    y.parent = x
    y.circ_in = circ_in
    y.circ_out = circ_out
    y.circ_new = circ_new
    if compare == 2:
        compare = 1 if _less(&ws.labels[rival], y, ws.arena) else 0
    if compare == 1 and _dominates(f, c, ws, q, rival, child, total_latency, mask):
        return 0  # not committed: the slot and arena space are reused
    elif compare == 0:
        ws.pushed_stamp[vertex] = ws.round
        ws.pushed_label[vertex] = child
    ws.arena_used = need
    ws.n_labels += 1
    _heap_push(ws, child)
    return 0


cdef inline int64_t _hops_needed(const WS* ws, int64_t hops, int32_t far) noexcept nogil:
    """The fewest hops of a path on to a target from `far`, reached in `hops` (the lower
    bounds; a node the BFS has not reached yet lies beyond ws.lb_level), or -1 for none."""
    if ws.lb_stamp[far] == ws.stamp:
        return hops + ws.lb[far]
    if ws.lb_level == _NO_LIMIT:
        return -1
    return hops + ws.lb_level + 1


cdef inline void _cut(Query* q, int64_t hops) noexcept nogil:
    """A label dropped for the deepening bound, not the request's: a later round may need it."""
    if hops <= q.limit_hops and hops < q.next_bound:
        q.next_bound = hops


cdef void _fan_exits(
    const FabricData* f, const CondData* c, WS* ws, Query* q, int32_t r, int32_t hops
) noexcept nogil:
    """List the exits of OCS rank `r` that a new circuit from an entry label of `hops` may
    take this round, in port order: those _step would not refuse at once whatever the label
    (a free port; usable cable and node; bandwidth; a device it may end at; a switch open to
    the request; with the lower bounds, within max_hops of a target; with the latency
    bounds, some target within max_latency_ns). An exit refused for the hop bound is cut
    (_cut): the least such bound is kept, and the least of any other exit's, for the entry
    port is no exit of itself; and the least latency one of them adds, for _step cuts only
    what is within the latency bound.

    Every entry of the OCS in a round shares these tests (conditions and bounds hold still
    during a search), so a wide OCS's ports are read once per round and hops, not once per
    entry label: a cross-pod path enters each OCS on its way over many ports."""
    cdef int32_t exit_slot, far, link, n = 0, cut_slot = -1, i, first, last
    cdef int32_t* exits = ws.fan_exits + f.ocs_slots[r]
    cdef const int32_t* ports = NULL
    cdef int64_t need, cut = _NO_LIMIT, cut_next = _NO_LIMIT, latency, cut_latency = _NO_LIMIT
    cdef int8_t kind
    if q.use_lb and not q.select and ws.target_ocs_stamp[r] != ws.stamp:
        # No target hangs here, and a device is no exit unless it is one: the ports that
        # lead on to a switch or an OCS are all there is to read (at hall scale, half).
        ports = f.ocs_inner
        first = f.ocs_inner_ptr[r]
        last = f.ocs_inner_ptr[r + 1]
    else:
        first = f.ocs_slots[r]
        last = f.ocs_slots[r + 1]
    for i in range(first, last):
        exit_slot = ports[i] if ports != NULL else i
        if c.circ_other[exit_slot] != NO_CIRCUIT:
            continue
        far = f.slot_far[exit_slot]
        link = f.slot_link[exit_slot]
        if (c.link_flags[link] | c.node_flags[far]) & UNUSABLE:
            continue
        if c.free[link] + _EPSILON < q.bandwidth:
            continue
        kind = f.kind[far]
        if kind == HOST:
            continue
        if kind == DEVICE:
            if q.select:
                if not _selected(f, c, ws, q, far):
                    continue
            elif ws.target_stamp[far] != ws.stamp:
                continue
        else:
            if kind == SWITCH and q.isolation and not _switch_open(c, q, far):
                continue
            latency = f.link_lat[link] + f.node_lat[far]
            if q.use_lat_lb:
                if ws.lat_stamp[far] != ws.stamp:
                    continue  # no target within the latency bound from there
                latency += ws.lat_lb[far]
            if q.use_lb:
                need = -1
                if hops > q.max_hops:
                    need = hops
                else:
                    need = _hops_needed(ws, hops, far)
                    if need < 0:
                        continue  # no target within reach from there
                    if need <= q.max_hops:
                        need = -1
                if need >= 0:
                    if need < cut:
                        cut_next = cut
                        cut = need
                        cut_slot = exit_slot
                    elif need < cut_next:
                        cut_next = need
                    if latency < cut_latency:
                        cut_latency = latency
                    continue
        exits[n] = exit_slot
        n += 1
    ws.fan_round[r] = ws.round
    ws.fan_hops[r] = hops
    ws.fan_n[r] = n
    ws.fan_cut[r] = cut
    ws.fan_cut_slot[r] = cut_slot
    ws.fan_cut_next[r] = cut_next
    ws.fan_cut_latency[r] = cut_latency


cdef int _fan_out(
    const FabricData* f, const CondData* c, WS* ws, Query* q, int32_t x
) noexcept nogil:
    """New circuits from an OCS entry port to every free cabled port (the exits _fan_exits
    lists). Returns -1 when out of memory.

    _fan_exits made every test of _step on a switch or OCS exit that does not depend on the
    label; the one that settles most (many entries of an OCS reach the same exits) is the
    last, the smallest label pushed at the far end (see _step): it is made here first, as
    _step would make it, so that most of a wide fan-out costs no call. Exits cut for the
    hop bound are cut as _step would, with a latency bound only if one of them is within it
    (if the least bound is not among those, the next round is only sooner)."""
    cdef const Label* lx = &ws.labels[x]
    cdef const Label* a
    cdef int32_t s = lx.vertex - f.n_nodes
    cdef int32_t r = f.ocs_rank[f.slot_ocs[s]], i, exit_slot, far, vertex
    cdef int32_t hops = lx.hops + 2
    cdef const int32_t* exits = ws.fan_exits + f.ocs_slots[r]
    cdef bint exact = f.n_ocs <= 64
    cdef int64_t latency
    cdef uint64_t mask
    cdef int8_t kind
    if ws.fan_round[r] != ws.round or ws.fan_hops[r] != hops:
        _fan_exits(f, c, ws, q, r, hops)
    for i in range(ws.fan_n[r]):
        exit_slot = exits[i]
        if exit_slot == s:
            continue
        far = f.slot_far[exit_slot]
        kind = f.kind[far]
        if exact and kind != DEVICE:
            vertex = far if kind == SWITCH else f.n_nodes + f.slot_far_slot[exit_slot]
            if ws.pushed_stamp[vertex] == ws.round:
                a = &ws.labels[ws.pushed_label[vertex]]
                latency = lx.latency + f.link_lat[f.slot_link[exit_slot]] + f.node_lat[far]
                mask = lx.mask
                if kind == OCS:
                    mask |= (<uint64_t>1) << (f.ocs_rank[far] & 63)
                if ((a.hops < hops or (a.hops == hops and a.latency < latency))
                        and (not q.bounded or a.latency <= latency)
                        and (a.mask & ~mask & ~a.free_mask) == 0):
                    continue
        if _step(f, c, ws, q, x, f.slot_link[exit_slot], far,
                 f.slot_far_slot[exit_slot], 2, s, exit_slot, 1) < 0:
            return -1
        lx = &ws.labels[x]  # the labels may have moved
    if not q.bounded or lx.latency + ws.fan_cut_latency[r] <= q.max_latency:
        _cut(q, ws.fan_cut_next[r] if ws.fan_cut_slot[r] == s else ws.fan_cut[r])
    return 0


cdef inline bint _foreign(const CondData* c, const Query* q, int32_t slot) noexcept nogil:
    return c.circ_other[slot] != NO_CIRCUIT and c.circ_owner[slot] != q.host


cdef inline bint _relaxed_step(
    const FabricData* f, const CondData* c, const Query* q, int32_t k, int32_t v
) noexcept nogil:
    """Whether the lower bounds walk adjacency entry `k` back to node `v`: the relaxed
    fabric's per-link and per-node rules, shared by _lower_bounds and _latency_bounds."""
    cdef int32_t link = f.adj_link[k]
    cdef int8_t kind = f.kind[v]
    if (c.link_flags[link] | c.node_flags[v]) & UNUSABLE:
        return False
    if c.free[link] + _EPSILON < q.bandwidth:
        return False
    # A cable on an OCS port that holds another host's circuit carries no path through that
    # OCS: entering there is blocked, and leaving there needs one's own circuit.
    if f.adj_slot[k] >= 0 and _foreign(c, q, f.adj_slot[k]):
        return False
    if f.adj_near_slot[k] >= 0 and _foreign(c, q, f.adj_near_slot[k]):
        return False
    if kind == DEVICE:
        return False  # devices end paths; targets were seeded already
    return not (kind == SWITCH and q.isolation and not _switch_open(c, q, v))


cdef void _lower_bounds(
    const FabricData* f, const CondData* c, WS* ws, const Query* q, int32_t n_targets,
) noexcept nogil:
    """Fewest hops from each node to a target, over the fabric relaxed of everything but
    per-link and per-node rules (usable, bandwidth, switch isolation, no port of another
    host's circuit; an OCS otherwise passes anything, any port to any port).

    A hop is a link or a circuit, so passing an OCS costs one more: the reverse BFS reaches an
    OCS one level late, through a token queued for it (the queue holds each node and each OCS
    token at most once). Every path the search can find runs in that relaxed fabric with at
    least these hops, so a label whose far node reaches no target, or not within max_hops, is
    dropped exactly: its descendants cannot reach one either, and any label it would dominate
    stands at the same vertex with no fewer hops, so it is just as unable.

    This seeds the BFS; _extend_bounds runs it only as far as a round's bound needs, so a
    check costs what lies between the host and its targets, not the whole hall.
    """
    cdef int32_t k, u
    ws.lb_head = 0
    ws.lb_tail = 0
    ws.lb_level = 0
    for k in range(n_targets):
        u = ws.targets[k]
        if c.node_flags[u] & UNUSABLE:
            continue
        ws.lb_stamp[u] = ws.stamp
        ws.lb[u] = 0
        ws.queue[ws.lb_tail] = u
        ws.lb_tail += 1


cdef inline int32_t _next_relaxed(
    const FabricData* f, const CondData* c, const Query* q, const uint32_t* stamps,
    uint32_t stamp, int32_t* j, int32_t end,
) noexcept nogil:
    """The next of a node's inner arcs, from `j[0]` up to `end`, whose far node is not stamped
    yet and that the relaxed fabric carries (_relaxed_step); -1 when none is left. A far node
    stamped already skips its other cables (they add nothing); a cable that cannot carry the
    step leaves a parallel one to try. Shared by the two hop BFS, the bounds' and the host's."""
    cdef int32_t k, v
    while j[0] < end:
        k = f.inner_arc[j[0]]
        v = f.adj_far[k]
        if stamps[v] == stamp:
            j[0] = f.inner_next[j[0]]
            continue
        if not _relaxed_step(f, c, q, k, v):
            j[0] += 1
            continue
        j[0] = f.inner_next[j[0]]
        return k
    return -1


cdef inline void _bounds_step(
    const FabricData* f, const CondData* c, WS* ws, const Query* q
) noexcept nogil:
    """One entry of the lower bounds' BFS queue: a node's neighbours get their bounds."""
    cdef int32_t u = ws.queue[ws.lb_head], v, k, j
    cdef int8_t kind
    ws.lb_head += 1
    if u < 0:  # an OCS token: the OCS itself, now at its level
        ws.queue[ws.lb_tail] = -u - 1
        ws.lb_tail += 1
        return
    j = f.inner_ptr[u]
    while True:
        k = _next_relaxed(f, c, q, ws.lb_stamp, ws.stamp, &j, f.inner_ptr[u + 1])
        if k < 0:
            return
        v = f.adj_far[k]
        kind = f.kind[v]
        ws.lb_stamp[v] = ws.stamp
        if kind == OCS:
            ws.lb[v] = ws.lb[u] + 2  # its circuit, then the cable towards the target
            ws.queue[ws.lb_tail] = -v - 1
            ws.lb_tail += 1
        else:
            ws.lb[v] = ws.lb[u] + 1
            if kind != HOST:  # hosts are endpoints, never passed through
                ws.queue[ws.lb_tail] = v
                ws.lb_tail += 1


cdef void _extend_bounds(
    const FabricData* f, const CondData* c, WS* ws, const Query* q, int64_t level
) noexcept nogil:
    """Run the BFS until every node within `level` hops of a target has its bound (level < 0:
    until the host has one). The queue holds nodes in order of their bounds, so once the next
    has `level` or more, every node within `level` was reached from one before it. A node
    without a bound then lies beyond ws.lb_level; with the queue empty, it reaches no target
    (ws.lb_level is _NO_LIMIT)."""
    cdef int32_t u
    cdef int64_t reached = -1
    while ws.lb_head < ws.lb_tail:
        u = ws.queue[ws.lb_head]
        if u >= 0 and ws.lb[u] > reached:
            reached = ws.lb[u]  # every node within `reached` hops has its bound now
            if reached > ws.lb_level:
                ws.lb_level = reached
            if level < 0 and (_host_bound(f, c, ws, q, reached) or reached >= q.limit_hops):
                return  # the host has its bound, or it lies beyond max_hops
            if 0 <= level <= reached:
                return
        _bounds_step(f, c, ws, q)
    ws.lb_level = _NO_LIMIT


cdef bint _host_bound(
    const FabricData* f, const CondData* c, WS* ws, const Query* q, int64_t reached
) noexcept nogil:
    """Give the host its bound once it is certain, every node within `reached` hops having
    its own: one more than the least of its neighbours', as the BFS would give it when it
    expands them. A neighbour the BFS has not reached yet (so at least reached + 1 away) has
    the least of its own neighbours' bounds, plus its hop (2 for an OCS), from those within
    reached + 1: exact, as any other neighbour is at least reached + 1 away. One with neither
    is at least reached + 2 away. So the two levels before the host need not be expanded: at
    hall scale, the one before the host's spines is every pod's OCS."""
    cdef int32_t k, j, u, w, link
    cdef int64_t best = _NO_LIMIT, hop
    cdef int8_t kind
    if ws.lb_stamp[q.host] == ws.stamp:
        return True
    for k in range(f.adj_ptr[q.host], f.adj_ptr[q.host + 1]):
        u = f.adj_far[k]
        kind = f.kind[u]
        # The BFS's step from u back over this cable (_relaxed_step towards a host).
        if c.link_flags[f.adj_link[k]] & UNUSABLE or c.free[f.adj_link[k]] + _EPSILON < q.bandwidth:
            continue
        if f.adj_slot[k] >= 0 and _foreign(c, q, f.adj_slot[k]):
            continue
        if ws.lb_stamp[u] == ws.stamp:
            if kind != HOST and ws.lb[u] < best:
                best = ws.lb[u]
            continue
        # Not reached yet: u's bound from its neighbours, were the BFS to reach u from them.
        if kind == HOST or kind == DEVICE or c.node_flags[u] & UNUSABLE:
            continue
        if kind == SWITCH and q.isolation and not _switch_open(c, q, u):
            continue
        hop = 2 if kind == OCS else 1
        for j in range(f.adj_ptr[u], f.adj_ptr[u + 1]):
            w = f.adj_far[j]
            if (ws.lb_stamp[w] != ws.stamp or f.kind[w] == HOST or ws.lb[w] > reached + 1
                    or ws.lb[w] + hop >= best):
                continue
            link = f.adj_link[j]  # _relaxed_step from w back to u
            if c.link_flags[link] & UNUSABLE or c.free[link] + _EPSILON < q.bandwidth:
                continue
            if f.adj_slot[j] >= 0 and _foreign(c, q, f.adj_slot[j]):
                continue
            if f.adj_near_slot[j] >= 0 and _foreign(c, q, f.adj_near_slot[j]):
                continue
            best = ws.lb[w] + hop
    if best > reached + 2:
        return False
    ws.lb_stamp[q.host] = ws.stamp
    ws.lb[q.host] = <int32_t>best + 1
    return True


cdef void _search(const FabricData* f, const CondData* c, WS* ws, Query* q) noexcept nogil:
    """_paths_py.best_paths: a label-setting search over (hops, latency, nodes, new, links)."""
    cdef Label* start
    cdef Label* lx
    cdef int32_t x, vertex, node, e, s, r, k, exit_slot, i, j, nth
    cdef int64_t latency
    cdef uint64_t mask
    cdef bint exact = f.n_ocs <= 64, dominated
    cdef Settled* entry
    cdef int32_t n = f.n_nodes

    ws.n_labels = 0
    ws.arena_used = 0
    ws.heap_n = 0
    ws.n_settled = 0
    ws.deferred_head = 0
    ws.deferred_tail = 0
    q.n_found = 0
    q.n_best = 0
    q.error_slot = -1
    q.out_of_memory = 0

    start = &ws.labels[0]
    start.latency = 0
    start.seq = 0
    start.mask = 0
    start.free_mask = 0
    start.hops = 0
    start.new_circuits = 0
    start.vertex = q.host
    start.node = q.host
    start.depth = 1
    start.parent = -1
    start.circ_in = -1
    start.circ_out = -1
    start.circ_new = 0
    ws.arena[0] = q.host
    ws.arena_used = 1
    ws.n_labels = 1
    if q.use_lb and ws.lb_stamp[q.host] != ws.stamp:
        return  # no target is reachable at all
    if q.use_lat_lb and ws.lat_stamp[q.host] != ws.stamp:
        return  # none within the latency bound
    q.rounds += 1
    _heap_push(ws, 0)

    while q.n_found < q.n_targets:
        # An OCS entry's new-circuit exits are 2 hops on: push them only once the search has
        # no label left with fewer hops than they have. Pops keep the exact order, and a
        # search that ends before never builds them.
        while ws.deferred_head < ws.deferred_tail:
            x = ws.deferred[ws.deferred_head]
            if ws.heap_n > 0 and ws.labels[ws.heap[0]].hops < ws.labels[x].hops + 2:
                break
            ws.deferred_head += 1
            if _fan_out(f, c, ws, q, x) < 0:
                q.out_of_memory = 1
                return
        if ws.heap_n == 0:
            break
        x = _heap_pop(ws)
        lx = &ws.labels[x]
        if q.best_n > 0 and q.n_best == q.best_n:
            # Every label left is at least this far; devices reached later rank after the
            # n-th best by (hops, latency) already, so the choice is made.
            nth = ws.found_label[ws.best[q.best_n - 1]]
            if lx.hops > ws.labels[nth].hops or (
                lx.hops == ws.labels[nth].hops and lx.latency > ws.labels[nth].latency
            ):
                break
        vertex = lx.vertex
        latency = lx.latency
        mask = lx.mask
        if ws.settled_stamp[vertex] != ws.round:
            ws.settled_stamp[vertex] = ws.round
            ws.settled_head[vertex] = -1
        # Dominated by an earlier label at this vertex (see _dominates); the settled entries
        # keep what the test reads first, so most are passed over without their label.
        dominated = False
        e = ws.settled_head[vertex]
        while e != -1:
            entry = &ws.settled[e]
            if ((not q.bounded or entry.latency <= latency)
                    and (entry.mask & ~mask & ~entry.free_mask) == 0):
                if exact or _ocs_covered(f, c, ws, q, entry.label, x):
                    dominated = True
                    break
            e = entry.next
        if dominated:
            continue
        if not _grow(<void**>&ws.settled, &ws.settled_cap, ws.n_settled + 1, sizeof(Settled)):
            q.out_of_memory = 1
            return
        entry = &ws.settled[ws.n_settled]
        entry.latency = latency
        entry.mask = mask
        entry.free_mask = lx.free_mask
        entry.label = x
        entry.next = ws.settled_head[vertex]
        ws.settled_head[vertex] = <int32_t>ws.n_settled
        ws.n_settled += 1

        node = lx.node
        if node != q.host and f.kind[node] == DEVICE:
            if ws.found_stamp[node] != ws.round:
                ws.found_stamp[node] = ws.round
                ws.found_label[node] = x
                ws.found[q.n_found] = node
                q.n_found += 1
                if q.select:
                    ws.rank[node] = f.dev_rank[node]
                if q.best_n > 0:
                    # Insert into the best n so far (insertion sort: n is small).
                    if q.n_best < q.best_n:
                        i = q.n_best
                        q.n_best += 1
                    elif _best_before(ws, node, ws.best[q.best_n - 1]):
                        i = q.best_n - 1
                    else:
                        i = -1
                    if i >= 0:
                        while i > 0 and _best_before(ws, node, ws.best[i - 1]):
                            ws.best[i] = ws.best[i - 1]
                            i -= 1
                        ws.best[i] = node
            continue

        if vertex < n:
            for k in range(f.adj_ptr[vertex], f.adj_ptr[vertex + 1]):
                if _step(f, c, ws, q, x, f.adj_link[k], f.adj_far[k], f.adj_slot[k],
                         1, -1, -1, 0) < 0:
                    q.out_of_memory = 1
                    return
            continue

        # An OCS entry port: through a circuit, out over the cable on the exit port.
        s = vertex - n
        if c.circ_other[s] != NO_CIRCUIT:
            if c.circ_owner[s] != q.host:
                continue  # another host's circuit blocks the port
            if c.circ_other[s] == DANGLING:
                q.error_slot = s
                return
            exit_slot = c.circ_other[s]
            if _step(f, c, ws, q, x, f.slot_link[exit_slot], f.slot_far[exit_slot],
                     f.slot_far_slot[exit_slot], 2, s, exit_slot, 0) < 0:
                q.out_of_memory = 1
                return
            continue
        if not _grow(<void**>&ws.deferred, &ws.deferred_cap, ws.deferred_tail + 1,
                     sizeof(int32_t)):
            q.out_of_memory = 1
            return
        ws.deferred[ws.deferred_tail] = x
        ws.deferred_tail += 1


cdef int64_t _limit(value) except? -1:
    """A bound as an int64 the search compares with: None is no bound; huge bounds clamp."""
    if value is None:
        return _NO_LIMIT
    if isinstance(value, float):
        if value != value:  # nan: every comparison with it is false, so nothing exceeds it
            return _NO_LIMIT
        if value >= <double>_NO_LIMIT:
            return _NO_LIMIT
        if value <= -<double>_NO_LIMIT:
            return -_NO_LIMIT
        return <int64_t>(value // 1)
    value = operator.index(value)
    if value >= _NO_LIMIT:
        return _NO_LIMIT
    if value <= -_NO_LIMIT:
        return -_NO_LIMIT
    return value


cdef _ConditionArrays _live(Fabric fabric, conditions):
    # LiveConditions (_live_c) as they are; a snapshot converted for this search.
    cdef _ConditionArrays live
    if isinstance(conditions, _ConditionArrays):
        live = conditions
        if live.fabric is not fabric:
            raise ValueError("these LiveConditions belong to another Fabric")
        return live
    return _ConditionArrays(fabric, conditions)


cdef _prepare(Fabric fabric, _ConditionArrays live, request, Query* q):
    host = request.host
    i = fabric._node_index.get(host)
    if i is None or fabric.d.kind[<int32_t>i] != HOST:
        raise PathError(f"{host!r} is not a host of this fabric")
    if live.c.node_flags[<int32_t>i] & UNUSABLE:
        raise PathError(f"host {host!r} is not usable")
    q.host = i
    q.tenant = live._tenant(request.tenant)
    q.exclusive = bool(request.exclusive)
    q.isolation = bool(request.isolation)
    q.bounded = request.max_latency_ns is not None
    q.max_hops = _limit(request.max_hops)
    q.max_latency = _limit(request.max_latency_ns)
    q.bandwidth = float(request.bandwidth_gbps)
    q.best_n = 0
    q.select = 0
    q.n_labels = 0
    q.rounds = 0


cdef bint _dheap_push(
    DEntry** heap, int64_t* cap, int64_t* n, int64_t key, int32_t node
) noexcept nogil:
    cdef int64_t i, parent
    cdef DEntry* h
    if not _grow(<void**>heap, cap, n[0] + 1, sizeof(DEntry)):
        return False
    h = heap[0]
    i = n[0]
    n[0] += 1
    while i > 0:
        parent = (i - 1) >> 1
        if h[parent].key <= key:
            break
        h[i] = h[parent]
        i = parent
    h[i].key = key
    h[i].node = node
    return True


cdef void _dheap_pop(DEntry* h, int64_t* n) noexcept nogil:
    cdef int64_t i = 0, child, last
    n[0] -= 1
    last = n[0]
    while True:
        child = 2 * i + 1
        if child >= last:
            break
        if child + 1 < last and h[child + 1].key < h[child].key:
            child += 1
        if h[last].key <= h[child].key:
            break
        h[i] = h[child]
        i = child
    h[i] = h[last]


cdef bint _latency_seed(const FabricData* f, const CondData* c, WS* ws) noexcept nogil:
    """Start the latency bounds' Dijkstra at the targets (once a search; see _latency_bounds).
    False when out of memory."""
    cdef int32_t k, u
    ws.lat_seeded = ws.stamp
    ws.dheap_n = 0
    ws.meet = _NO_LIMIT
    for k in range(ws.n_targets):
        u = ws.targets[k]
        if c.node_flags[u] & UNUSABLE:
            continue
        ws.lat_stamp[u] = ws.stamp
        ws.lat_lb[u] = 0
        if not _dheap_push(&ws.dheap, &ws.dheap_cap, &ws.dheap_n, 0, u):
            return False
    return True


cdef bint _latency_step(
    const FabricData* f, const CondData* c, WS* ws, const Query* q
) noexcept nogil:
    """The latency bounds' Dijkstra takes its next node: its neighbours get their bounds. A
    neighbour the host's Dijkstra (_latency_reachable) labelled too joins a path from the host
    to a target: ws.meet keeps the least such latency. False when out of memory."""
    cdef int64_t d = ws.dheap[0].key, cand
    cdef int32_t u = ws.dheap[0].node, v, k, j
    _dheap_pop(ws.dheap, &ws.dheap_n)
    if d > ws.lat_lb[u]:
        return True  # a stale entry: u was reached faster since
    # Passing u costs its own latency, except at a target: a device ends the path.
    if f.kind[u] != DEVICE:
        d += f.node_lat[u]
    j = f.inner_ptr[u]
    while j < f.inner_ptr[u + 1]:
        k = f.inner_arc[j]
        v = f.adj_far[k]
        cand = d + f.link_lat[f.adj_link[k]]
        if cand > q.max_latency or (ws.lat_stamp[v] == ws.stamp and ws.lat_lb[v] <= cand):
            j = f.inner_next[j]  # its parallel cables are no faster
            continue
        if not _relaxed_step(f, c, q, k, v):
            j += 1
            continue
        j = f.inner_next[j]
        ws.lat_stamp[v] = ws.stamp
        ws.lat_lb[v] = cand
        if ws.fwd_stamp[v] == ws.stamp and ws.fwd_lat[v] + cand < ws.meet:
            ws.meet = ws.fwd_lat[v] + cand
        if f.kind[v] != HOST and not _dheap_push(
            &ws.dheap, &ws.dheap_cap, &ws.dheap_n, cand, v
        ):
            return False
    return True


cdef bint _latency_bounds(
    const FabricData* f, const CondData* c, WS* ws, const Query* q
) noexcept nogil:
    """Least latency from each node (its own latency already paid on arrival) to a target,
    over the same relaxed fabric as _lower_bounds, up to the request's latency bound (a
    Dijkstra from the targets that stops there; it goes on from where _latency_reachable left
    it). A label whose latency plus its far node's bound exceeds max_latency_ns, or whose far
    node was not reached, is dropped exactly, as in _lower_bounds. False when out of memory
    (the search then runs without it).
    """
    if ws.lat_seeded != ws.stamp and not _latency_seed(f, c, ws):
        return False
    while ws.dheap_n > 0:
        if not _latency_step(f, c, ws, q):
            return False
    return True


cdef inline int64_t _heap_top(DEntry* h, int64_t* n, const int64_t* label) noexcept nogil:
    """The least key of a lazy Dijkstra heap, its stale entries dropped first; or _NO_LIMIT."""
    while n[0] > 0 and h[0].key > label[h[0].node]:
        _dheap_pop(h, n)
    return h[0].key if n[0] > 0 else _NO_LIMIT


cdef int _latency_reachable(
    const FabricData* f, const CondData* c, WS* ws, const Query* q
) noexcept nogil:
    """Whether a path from the host reaches a target within max_latency_ns over the relaxed
    fabric of the latency bounds: 1 if so, 0 if not, -1 when out of memory. The same answer
    as the host's latency bound (_latency_bounds labels the host or not), found by a second
    Dijkstra from the host that meets the bounds' own half way, so a target far beyond the
    latency bound is refused without a search and without the bounds' Dijkstra over all that
    lies within the bound of the target (at hall scale, every pod's OCS and spines).

    Exact as a bidirectional Dijkstra: with the least keys left tf (from the host) and tb
    (towards the targets), a path not yet met has at least tf + tb. The host's Dijkstra walks
    no device, so the targets are expanded first: a node next to one then has its bound.
    """
    cdef int64_t nf = 0, d, cand, tf, tb
    cdef int32_t u, v, k, j
    if ws.lat_seeded != ws.stamp and not _latency_seed(f, c, ws):
        return -1
    while _heap_top(ws.dheap, &ws.dheap_n, ws.lat_lb) == 0:
        if not _latency_step(f, c, ws, q):
            return -1
    ws.fwd_stamp[q.host] = ws.stamp
    ws.fwd_lat[q.host] = 0
    if ws.lat_stamp[q.host] == ws.stamp and ws.lat_lb[q.host] < ws.meet:
        ws.meet = ws.lat_lb[q.host]
    if not _dheap_push(&ws.fheap, &ws.fheap_cap, &nf, 0, q.host):
        return -1
    while ws.meet > q.max_latency:
        tf = _heap_top(ws.fheap, &nf, ws.fwd_lat)
        tb = _heap_top(ws.dheap, &ws.dheap_n, ws.lat_lb)
        if tf == _NO_LIMIT or tb == _NO_LIMIT or tf + tb > q.max_latency:
            return 0
        if ws.dheap_n < nf:  # the side with the fewer nodes waiting goes on (any order is exact)
            if not _latency_step(f, c, ws, q):
                return -1
            continue
        u = ws.fheap[0].node
        d = tf
        _dheap_pop(ws.fheap, &nf)
        j = f.inner_ptr[u]
        while j < f.inner_ptr[u + 1]:
            k = f.inner_arc[j]
            v = f.adj_far[k]
            cand = d + f.link_lat[f.adj_link[k]] + f.node_lat[v]
            # Hosts are endpoints, never passed through; parallel cables are no faster.
            if f.kind[v] == HOST or cand > q.max_latency or (
                ws.fwd_stamp[v] == ws.stamp and ws.fwd_lat[v] <= cand
            ):
                j = f.inner_next[j]
                continue
            if not _relaxed_step(f, c, q, k, v):
                j += 1
                continue
            j = f.inner_next[j]
            ws.fwd_stamp[v] = ws.stamp
            ws.fwd_lat[v] = cand
            if ws.lat_stamp[v] == ws.stamp and cand + ws.lat_lb[v] < ws.meet:
                ws.meet = cand + ws.lat_lb[v]
            if not _dheap_push(&ws.fheap, &ws.fheap_cap, &nf, cand, v):
                return -1
    return 1


cdef inline void _nothing_found(Query* q) noexcept nogil:
    q.n_found = 0
    q.n_best = 0
    q.error_slot = -1
    q.out_of_memory = 0


cdef void _deepen(const FabricData* f, const CondData* c, WS* ws, Query* q) noexcept nogil:
    """The search in rounds of growing max_hops, from the host's lower bound up (iterative
    deepening). A round at bound B finds every path of at most B hops that the full search
    would, and ranks them the same way, so it answers as the full search does once it found
    every target (or, choosing devices, the best n: one unseen needs more hops, so it ranks
    after), or when nothing was cut for the bound. Across pods most labels of the full search
    lead nowhere near the target in as few hops; a round at the target's distance never
    builds them. Whether any target lies within max_hops is asked first (_beyond_max_hops,
    two BFS that meet half way), then, with a latency bound, whether any lies within it
    (_latency_reachable, two Dijkstras that meet half way): a far target beyond either bound
    is refused before any round, the hop bound first because it is the cheaper to prove. The
    latency bounds themselves are completed only when a first round did not settle the
    answer (they cost a Dijkstra over what the bound reaches from the targets: at hall
    scale, every pod's OCS).
    """
    cdef int64_t bound
    cdef bint latency_pending = q.bounded
    cdef int reach = -1
    if _beyond_max_hops(f, c, ws, q):
        _nothing_found(q)  # no target within max_hops
        return
    if q.bounded:
        reach = _latency_reachable(f, c, ws, q)
        if reach == 0:
            _nothing_found(q)  # no target within the latency bound
            return
    _extend_bounds(f, c, ws, q, -1)
    if ws.lb_stamp[q.host] != ws.stamp:
        _search(f, c, ws, q)  # no target is reachable (within max_hops): answered at once
        return
    bound = ws.lb[q.host]
    while True:
        q.max_hops = bound if bound < q.limit_hops else q.limit_hops
        # Nodes without a bound then count as at least max_hops - 1 away: a label there is
        # cut unless it is one hop from the host (a few; _host_bound read their bounds off
        # their neighbours, so the level before them need not be expanded).
        _extend_bounds(f, c, ws, q, q.max_hops - 2)
        q.next_bound = _NO_LIMIT
        _search(f, c, ws, q)
        if q.out_of_memory or q.error_slot >= 0 or q.max_hops >= q.limit_hops:
            break
        if q.n_found >= q.n_targets or (q.best_n > 0 and q.n_best >= q.best_n):
            break
        if q.next_bound == _NO_LIMIT:
            break  # nothing was cut for the bound: a higher one finds nothing more
        if latency_pending:
            latency_pending = False  # some target is within it (reach > 0), or memory ran out
            q.use_lat_lb = reach > 0 and _latency_bounds(f, c, ws, q)
        bound = q.next_bound
        _next_round(ws)
    q.max_hops = q.limit_hops


# Up to this max_hops a refusal is looked for from both ends (_beyond_max_hops); beyond it the
# two balls are the hall anyway.
cdef int64_t _MEET_HOPS = 32


cdef bint _beyond_max_hops(const FabricData* f, const CondData* c, WS* ws, Query* q) noexcept nogil:
    """Whether no target lies within max_hops of the host over the relaxed fabric of the lower
    bounds, found from both ends: the bounds' BFS from the targets to b hops and a BFS from the
    host to a hops (_hop_level), each grown a level at a time on the side with fewer entries
    waiting, until a + b > max_hops; refused when no node reached by both is within max_hops
    in all. (The bounds' BFS alone runs to max_hops around the targets: at hall scale, for a
    target in another pod, its whole pod and every pod's OCS.) False also when the usual way
    answers at once: the host within b hops, or nothing reachable at all.

    Exact: hops add 1 a step and 2 leaving an OCS (its circuit, then the cable on), on both
    sides, so the hops from the host along a path skip at most one number at a time. A path
    of L <= max_hops hops has L > b (else the host has its bound), so with a + b > L and b >= 2
    some node of it other than the target lies between L - b and a hops along it: both BFS
    reached it, and its hops from the host plus its bound are at most L. The bounds' BFS
    stops where its own levels end, so what the rounds read of it later is unchanged.
    """
    cdef int64_t limit = q.limit_hops, a = 0, b = 0, head = 0, tail = 1, i
    cdef int32_t v
    if limit < 3 or limit > _MEET_HOPS:
        return False
    ws.hop_stamp[q.host] = ws.stamp
    ws.hop[q.host] = 0
    ws.hop_queue[0] = q.host
    while a + b <= limit or b < 2:
        if b < 2 or a >= limit or ws.lb_tail - ws.lb_head <= tail - head:
            b += 1
            _extend_bounds(f, c, ws, q, b)
            if ws.lb_stamp[q.host] == ws.stamp or ws.lb_level == _NO_LIMIT:
                return False
        else:
            a += 1
            if _hop_level(f, c, ws, q, a, &head, &tail):
                return False
            if head == tail:
                a = limit  # nothing more is reachable from the host: its BFS is whole
    for i in range(tail):  # what the host's BFS reached, against the bounds as they stand
        v = ws.hop_queue[i]
        if v >= 0 and ws.lb_stamp[v] == ws.stamp and ws.hop[v] + ws.lb[v] <= limit:
            return False
    return True


cdef bint _hop_level(
    const FabricData* f, const CondData* c, WS* ws, const Query* q, int64_t a,
    int64_t* head, int64_t* tail,
) noexcept nogil:
    """Grow the host's BFS over the relaxed fabric (_relaxed_step, as the bounds' BFS walks it
    back) until every node within `a` hops has its hops: True once one reached has hops plus
    its lower bound within max_hops. Hosts end paths: reached, never passed through. An OCS is
    left two hops on (its circuit, then the cable) through a token, as in the bounds' BFS, so
    the queue holds its entries in order of the hops they lead to."""
    cdef int64_t level
    cdef int32_t u, src, v, k, j
    while head[0] < tail[0]:
        u = ws.hop_queue[head[0]]
        if u < 0:  # an OCS token: the OCS passed, its far ends two hops on
            src = -u - 1
            level = ws.hop[src] + 2
        else:
            src = u
            level = ws.hop[u] + 1
        if level > a:
            return False
        head[0] += 1
        if u >= 0 and f.kind[u] == OCS:
            ws.hop_queue[tail[0]] = -u - 1
            tail[0] += 1
            continue
        j = f.inner_ptr[src]
        while True:
            k = _next_relaxed(f, c, q, ws.hop_stamp, ws.stamp, &j, f.inner_ptr[src + 1])
            if k < 0:
                break
            v = f.adj_far[k]
            ws.hop_stamp[v] = ws.stamp
            ws.hop[v] = <int32_t>level
            if ws.lb_stamp[v] == ws.stamp and level + ws.lb[v] <= q.limit_hops:
                return True
            if f.kind[v] != HOST:
                ws.hop_queue[tail[0]] = v
                tail[0] += 1
    return False


cdef void _mark_target_ocs(const FabricData* f, WS* ws, int32_t n_targets) noexcept nogil:
    """Mark the OCS a target hangs on: only there can a new circuit end at one (_fan_exits)."""
    cdef int32_t i, k, far
    for i in range(n_targets):
        for k in range(f.adj_ptr[ws.targets[i]], f.adj_ptr[ws.targets[i] + 1]):
            far = f.adj_far[k]
            if f.kind[far] == OCS:
                ws.target_ocs_stamp[f.ocs_rank[far]] = ws.stamp


# Few targets: the lower bounds' BFS (at most the whole fabric, O(nodes + links)) costs less
# than the labels it saves; with many, the search reaches targets early anyway.
cdef int32_t _LOWER_BOUND_TARGETS = 64


cdef _run(Fabric fabric, _ConditionArrays live, WS* ws, Query* q, int32_t n_marked):
    # A circuit to a port without a cable (never built by the engine) raises in the reference
    # when the search reaches it; pruning could skip that, so it is off while one exists.
    q.use_lb = 0 < n_marked <= _LOWER_BOUND_TARGETS and not live._dangling
    q.use_lat_lb = 0
    q.limit_hops = q.max_hops
    for r in live._owned.get(q.host, ()):
        ws.own_stamp[<int32_t>r] = ws.stamp
    with nogil:
        if not q.use_lb:
            _search(&fabric.d, &live.c, ws, q)
        else:
            memcpy(ws.targets, ws.found, n_marked * sizeof(int32_t))
            ws.n_targets = n_marked
            _mark_target_ocs(&fabric.d, ws, n_marked)
            _lower_bounds(&fabric.d, &live.c, ws, q, n_marked)
            _deepen(&fabric.d, &live.c, ws, q)
    fabric.last_rounds = q.rounds
    if q.out_of_memory:
        raise MemoryError()
    if q.error_slot >= 0:
        # The reference looks the exit port up among the OCS's cables and finds none.
        raise KeyError(live._dangling[q.error_slot])


cdef object _path(Fabric fabric, WS* ws, int32_t node):
    cdef int32_t x = ws.found_label[node], y, i
    cdef Label* label = &ws.labels[x]
    cdef int32_t depth = label.depth
    cdef const int32_t* seq = ws.arena + label.seq
    cdef tuple node_ids = fabric.node_ids, link_ids = fabric.link_ids
    nodes = tuple([node_ids[seq[i]] for i in range(depth)])
    links = tuple([link_ids[seq[depth + i]] for i in range(depth - 1)])
    circuits = []
    y = x
    while y >= 0:
        label = &ws.labels[y]
        if label.circ_in >= 0:
            a = fabric._slot_port_obj[label.circ_in]
            b = fabric._slot_port_obj[label.circ_out]
            circuits.append(Circuit(node_ids[fabric.d.slot_ocs[label.circ_in]], min(a, b),
                                    max(a, b), bool(label.circ_new)))
        y = label.parent
    circuits.reverse()
    label = &ws.labels[x]
    return Path(node_ids[node], nodes, links, tuple(circuits), label.hops, label.latency)


def best_paths(Fabric fabric not None, conditions, request, targets):
    """The best feasible path from the host to each reachable target device, in one search.

    Exactly ``_paths_py.best_paths``; ``conditions`` is a ``Conditions`` snapshot (converted
    for this search) or, without conversion, ``LiveConditions`` of this fabric.

    Raises:
        PathError: the host is unknown, not a host, or unusable.
    """
    cdef _ConditionArrays live = _live(fabric, conditions)
    cdef Query q
    cdef _Workspace owner
    cdef WS* ws
    cdef int32_t i, n_marked
    _prepare(fabric, live, request, &q)
    owner = fabric._take()
    ws = &owner.w
    try:
        owner.next_stamp()
        n_marked = _mark_targets(fabric, live, owner, &q, targets)
        _run(fabric, live, ws, &q, n_marked)
        return {fabric.node_ids[ws.found[i]]: _path(fabric, ws, ws.found[i])
                for i in range(q.n_found)}
    finally:
        fabric._give(owner)


cdef tuple _selector_buckets(Fabric fabric, selector):
    """The (kind, model) buckets of devices `selector` may take: static, from the topology."""
    kind = fabric._device_kinds.get(selector.kind)
    if kind is None:
        return None, [], []
    models = fabric._kind_models.get(kind, [])
    if selector.models:
        wanted = set(selector.models)
        models = [m for m in models if fabric._model_names[m] in wanted]
    return kind, models, [fabric._buckets[(kind, m)] for m in models]


cdef bint _arm(Fabric fabric, WS* ws, Query* q, selector, int32_t kind, list models) except -1:
    """Set the query's Selector tests and this search's marks for them (after next_stamp);
    False when a label of it is carried by no device."""
    cdef int32_t i
    q.select = 1
    q.sel_kind = kind
    q.has_models = bool(selector.models)
    for m in models:
        ws.model_stamp[<int32_t>m] = ws.stamp
    q.has_min_gen = selector.min_generation is not None
    q.min_gen = operator.index(selector.min_generation) if q.has_min_gen else 0
    q.has_min_mem = selector.min_memory_gib is not None
    q.min_mem = float(selector.min_memory_gib) if q.has_min_mem else 0.0
    q.has_slice = selector.slice_gib is not None
    q.slice_gib = float(selector.slice_gib) if q.has_slice else 0.0
    q.n_labels = 0
    for pair in selector.labels.items():
        carriers = fabric._label_index.get(pair)
        if carriers is None:
            return False
        for i in carriers:
            if q.n_labels == 0:
                ws.target_stamp[i] = ws.stamp
                ws.label_hits[i] = 1
            elif ws.target_stamp[i] == ws.stamp and ws.label_hits[i] == q.n_labels:
                ws.label_hits[i] += 1
        q.n_labels += 1
    return True


cdef int32_t _select_targets(
    Fabric fabric, _ConditionArrays live, _Workspace owner, Query* q, selector
) except -2:
    """Point the search at the devices `selector` admits: tested as it reaches them
    (q.select; returns 0), or, with at most 64 possible, listed as marked targets so the
    lower bounds apply (returns how many). -1: none can qualify."""
    cdef WS* ws = &owner.w
    cdef int32_t i, n_marked = 0
    cdef Py_ssize_t possible = 0
    kind, models, buckets = _selector_buckets(fabric, selector)
    for bucket in buckets:
        possible += len(bucket)
    if possible == 0 or not _arm(fabric, ws, q, selector, kind, models):
        return -1
    if possible > _LOWER_BOUND_TARGETS:
        q.n_targets = possible  # an upper bound: the search ends by exhaustion or best n
        return 0
    # The marks _arm made are spent on the listing; the search gets fresh ones.
    chosen = [i for bucket in buckets for i in bucket if _selected(&fabric.d, &live.c, ws, q, i)]
    owner.next_stamp()
    q.select = 0
    q.n_labels = 0
    for i in chosen:
        ws.target_stamp[i] = ws.stamp
        ws.found[n_marked] = i
        ws.rank[i] = fabric.d.dev_rank[i]
        n_marked += 1
    q.n_targets = n_marked
    return n_marked if n_marked > 0 else -1


def census(Fabric fabric not None, conditions, selector):
    """``_paths_py.census``: the why-not funnel's first four counts for ``selector``, taken
    in the core (no list of ids leaves it)."""
    cdef _ConditionArrays live = _live(fabric, conditions)
    cdef Query q
    cdef _Workspace owner
    cdef WS* ws
    cdef int32_t i
    cdef Py_ssize_t j, matched = 0, healthy = 0, free = 0, labelled = 0
    cdef const int[:] ids
    cdef bint armed
    cdef const FabricData* f = &fabric.d
    cdef const CondData* c = &live.c
    kind, models, buckets = _selector_buckets(fabric, selector)
    if kind is None:
        return (0, 0, 0, 0)
    memset(&q, 0, sizeof(Query))
    owner = fabric._take()
    ws = &owner.w
    try:
        owner.next_stamp()
        armed = _arm(fabric, ws, &q, selector, kind, models)
        whole = _whole_buckets(fabric, &q, selector) if armed else None
        if whole is not None:
            # Each bucket taken whole or not at all, no labels, no slice: the tallies answer.
            for number in whole:
                matched += fabric._bucket_span[number][4]
                healthy += c.bucket_healthy[<int32_t>number]
                free += c.bucket_free[<int32_t>number]
            return (matched, healthy, free, free)
        for bucket in buckets:
            ids = bucket
            for j in range(ids.shape[0]):
                i = ids[j]
                if (q.has_min_gen and f.dev_gen[i] < q.min_gen) or (
                    q.has_min_mem and f.dev_mem[i] < q.min_mem
                ):
                    continue
                matched += 1
                if c.node_flags[i] & UNUSABLE:
                    continue
                healthy += 1
                if c.taken[i] or (q.has_slice and f.dev_cap[i] - c.sliced[i] + 1e-9 < q.slice_gib):
                    continue
                free += 1
                if armed and (q.n_labels == 0 or (
                    ws.target_stamp[i] == ws.stamp and ws.label_hits[i] == q.n_labels
                )):
                    labelled += 1
        return (matched, healthy, free, labelled)
    finally:
        fabric._give(owner)


def best_costs(Fabric fabric not None, conditions, request, targets):
    """``{device: (hops, latency_ns)}`` of ``best_paths(...)``, from the same search, without
    building the paths (the why-not funnel counts and ranks, it does not bind). ``targets``
    may be a ``Selector``, as in ``best_devices``."""
    cdef _ConditionArrays live = _live(fabric, conditions)
    cdef Query q
    cdef _Workspace owner
    cdef WS* ws
    cdef int32_t i, n_marked
    cdef Label* label
    _prepare(fabric, live, request, &q)
    owner = fabric._take()
    ws = &owner.w
    try:
        owner.next_stamp()
        n_marked = _mark_targets(fabric, live, owner, &q, targets)
        if n_marked < 0:
            return {}
        _run(fabric, live, ws, &q, n_marked)
        costs = {}
        for i in range(q.n_found):
            label = &ws.labels[ws.found_label[ws.found[i]]]
            costs[fabric.node_ids[ws.found[i]]] = (label.hops, label.latency)
        return costs
    finally:
        fabric._give(owner)


cdef int32_t _mark_targets(
    Fabric fabric, _ConditionArrays live, _Workspace owner, Query* q, targets
) except -2:
    """Point the search at ``targets``, ids or a Selector (see _select_targets); returns how
    many are marked, or -1 when none can qualify."""
    cdef WS* ws = &owner.w
    cdef int32_t i, n_marked = 0
    cdef dict node_index = <dict>fabric._node_index
    if isinstance(targets, Selector):
        return _select_targets(fabric, live, owner, q, targets)
    for target in targets:
        i = node_index.get(target, -1)
        if i >= 0 and fabric.d.kind[i] == DEVICE and ws.target_stamp[i] != ws.stamp:
            ws.target_stamp[i] = ws.stamp
            ws.found[n_marked] = i
            n_marked += 1
    q.n_targets = len(targets)
    return n_marked


cdef int64_t _reach(
    const FabricData* f, const CondData* c, WS* ws, const Query* q, bint own_free, bint* met_own,
    const int32_t* buckets, int32_t n_buckets
) noexcept nogil:
    """How many targets a BFS from the host reaches, with no hop or latency bound, by the
    search's per-link and per-node rules, where a port holding another host's circuit carries
    nothing, and one holding a circuit of the host's own carries nothing either or (own_free)
    anything. met_own: whether it met one of those on a cable into a node it goes on from or
    a target (a device passes nothing on, so one that is no target is not looked at further:
    for most requests most of the hall's devices are of another kind, or taken).

    With the host's own ports closed, an OCS passes between any two free ports, so a walk
    the BFS follows that meets a node twice shortens to one that meets it once (a switch
    passes anything, and the first entry port pairs with the last exit port): what it reaches
    some path reaches. With them open it reaches at least what any path reaches, since a path
    passes an OCS between free ports or over its own circuit. See reachable.

    n_buckets >= 0 (a Selector that admits each of `buckets` whole or not at all, for no
    bandwidth): leaf devices are counted per node the BFS goes on from (leaf_open), not
    visited; the BFS walks the other cables (outer_arc). A leaf device has no OCS port, so
    met_own is the same.
    """
    cdef int32_t head = 0, tail = 1, u, v, k, j, b, at
    cdef int32_t ends[2]
    cdef int64_t count = 0
    cdef int8_t kind
    cdef bint blocked
    cdef bint tallied = n_buckets >= 0
    ws.found_stamp[q.host] = ws.round
    ws.queue[0] = q.host
    while head < tail:
        u = ws.queue[head]
        head += 1
        if tallied and f.home[u] >= 0:
            at = f.home[u] * f.n_buckets
            for b in range(n_buckets):
                count += c.leaf_open[at + buckets[b]]
        for j in range(
            f.outer_ptr[u] if tallied else f.adj_ptr[u],
            f.outer_ptr[u + 1] if tallied else f.adj_ptr[u + 1],
        ):
            k = f.outer_arc[j] if tallied else j
            v = f.adj_far[k]
            if ws.found_stamp[v] == ws.round:
                continue
            kind = f.kind[v]
            # A device passes nothing on: one that is no target needs no more tests.
            if kind == DEVICE and not (
                _selected(f, c, ws, q, v) if q.select else ws.target_stamp[v] == ws.stamp
            ):
                continue
            if (c.link_flags[f.adj_link[k]] | c.node_flags[v]) & UNUSABLE:
                continue
            if c.free[f.adj_link[k]] + _EPSILON < q.bandwidth:
                continue
            ends[0] = f.adj_near_slot[k]  # the cable's OCS ports, if any
            ends[1] = f.adj_slot[k]
            blocked = False
            for b in range(2):
                if ends[b] >= 0 and c.circ_other[ends[b]] != NO_CIRCUIT:
                    if c.circ_owner[ends[b]] != q.host:
                        blocked = True
                    else:
                        met_own[0] = True
                        blocked = blocked or not own_free
            if blocked:
                continue
            if kind == DEVICE:
                ws.found_stamp[v] = ws.round
                count += 1
            elif kind != HOST and not (kind == SWITCH and q.isolation and not _switch_open(c, q, v)):
                ws.found_stamp[v] = ws.round
                ws.queue[tail] = v
                tail += 1
    return count


_NO_BUCKETS = array("i", [0])


cdef int32_t _reach_places(_ConditionArrays live, const Query* q) noexcept:
    """The places (the region index, see _ConditionArrays._reach_build) that _reach's BFS
    enters with the host's own ports closed, for no bandwidth: those the host's open cables
    enter, and all that open cables join to them. Marks them in place_seen, lists them in
    place_queue and returns how many (_clear_places unmarks them). For a host that holds no
    circuit."""
    cdef const FabricData* f = &live.fabric.d
    cdef const CondData* c = &live.c
    cdef int32_t places = live.n_places, host = q.host
    cdef int32_t j, k, v, link, slot, place, here, head = 0, tail = 0
    cdef const int32_t* row
    for j in range(f.outer_ptr[host], f.outer_ptr[host + 1]):
        k = f.outer_arc[j]
        v = f.adj_far[k]
        link = f.adj_link[k]
        slot = f.adj_slot[k]
        if f.kind[v] == SWITCH:
            place = live.region[v]
        elif f.kind[v] == OCS:
            place = live.n_regions + f.ocs_rank[v]
        else:
            continue  # hosts pass nothing on; no device but a leaf one hangs from a host
        if (
            place < 0
            or live.place_seen[place]
            or (c.link_flags[link] | c.node_flags[v]) & UNUSABLE
            or c.free[link] + _EPSILON < 0.0
            or (slot >= 0 and c.circ_other[slot] != NO_CIRCUIT)
        ):
            continue
        live.place_seen[place] = 1
        live.place_queue[tail] = place
        tail += 1
    while head < tail:
        here = live.place_queue[head]
        head += 1
        row = live.place_links + here * places
        for place in range(places):
            if row[place] > 0 and not live.place_seen[place]:
                live.place_seen[place] = 1
                live.place_queue[tail] = place
                tail += 1
    return tail


cdef void _clear_places(_ConditionArrays live, int32_t n) noexcept:
    cdef int32_t j
    for j in range(n):
        live.place_seen[live.place_queue[j]] = 0


cdef int64_t _count_tallied(
    _ConditionArrays live, const Query* q, int32_t n_places, const int32_t* buckets,
    int32_t n_buckets
) noexcept:
    """_reach's count for a Selector that takes `buckets` whole: the host's leaf devices and
    the open devices of each place reached, from the index's tallies."""
    cdef const FabricData* f = &live.fabric.d
    cdef int32_t nb = f.n_buckets, j, b, here
    cdef const int32_t* tally
    cdef int64_t count = 0
    if f.home[q.host] >= 0:
        for b in range(n_buckets):
            count += live.c.leaf_open[f.home[q.host] * nb + buckets[b]]
    for j in range(n_places):
        here = live.place_queue[j]
        if here < live.n_regions:
            tally = live.region_open + here * nb
        else:
            tally = live.ocs_open + (here - live.n_regions) * nb
        for b in range(n_buckets):
            count += tally[buckets[b]]
    return count


cdef int64_t _count_selected(
    Fabric fabric, _ConditionArrays live, const WS* ws, const Query* q, list buckets
):
    """_reach's count for any other Selector (a slice, labels, part of a model): each device
    of its buckets that it admits, open as the BFS would find it (_leaf_open, _port_open),
    whose place was reached."""
    cdef const FabricData* f = &fabric.d
    cdef const CondData* c = &live.c
    cdef const int[:] ids
    cdef int32_t d, home, region
    cdef Py_ssize_t j
    cdef int64_t count = 0
    for bucket in buckets:
        ids = bucket
        for j in range(ids.shape[0]):
            d = ids[j]
            if not _selected(f, c, ws, q, d):
                continue
            if f.leaf_link[d] >= 0:
                home = f.adj_far[f.adj_ptr[d]]
                region = live.region[home]
                if _leaf_open(f, c, d) and (
                    home == q.host or (region >= 0 and live.place_seen[region])
                ):
                    count += 1
            elif _port_open(f, c, d) and live.place_seen[
                live.n_regions + f.ocs_rank[f.slot_ocs[f.port_slot[d]]]
            ]:
                count += 1
    return count


cdef object _whole_buckets(Fabric fabric, const Query* q, targets):
    """The numbers of the buckets a Selector (armed in q) admits whole, as array("i"), when
    it admits every other bucket not at all and the BFS asks for no bandwidth: then _reach
    counts leaf devices per node (leaf_open). Else None: each device is tested."""
    if not q.select or q.bandwidth != 0.0 or q.n_labels > 0 or q.has_slice:
        return None
    kind, models, _ = _selector_buckets(fabric, targets)
    whole = array("i")
    for m in models:
        number = fabric._bucket_no[(kind, m)]
        least_gen, most_gen, least_mem, most_mem, _ = fabric._bucket_span[number]
        if (q.has_min_gen and most_gen < q.min_gen) or (q.has_min_mem and most_mem < q.min_mem):
            continue  # none of it
        if (q.has_min_gen and least_gen < q.min_gen) or (
            q.has_min_mem and least_mem < q.min_mem
        ):
            return None  # some of it
        whole.append(number)
    return whole


def reachable(Fabric fabric not None, conditions, request, targets):
    """``_paths_py.reachable``: how many of ``targets`` (ids or a Selector) some path
    reaches, as ``len(best_costs(...))``. Without a hop or latency bound a BFS answers
    (_reach), in time linear in the fabric rather than in the labels of a search (in its
    nodes and cables but the leaf devices', when the Selector takes each bucket whole and no
    bandwidth is asked: those are counted from the tallies): with the host's own circuit
    ports closed it counts targets some path reaches, with them open at
    least every one; when it meets none, or both count the same, that is the answer. Else
    the search counts. For a Selector, no bandwidth and a host that holds no circuit, live
    conditions' region index answers instead of the BFS (_reach_places)."""
    cdef _ConditionArrays live = _live(fabric, conditions)
    cdef Query q
    cdef _Workspace owner
    cdef WS* ws
    cdef int32_t n_marked, n_places, n_buckets = -1
    cdef int64_t count, at_most
    cdef bint met_own = False
    cdef int[:] buckets = _NO_BUCKETS
    _prepare(fabric, live, request, &q)
    owner = fabric._take()
    ws = &owner.w
    try:
        owner.next_stamp()
        n_marked = _mark_targets(fabric, live, owner, &q, targets)
        if n_marked < 0:
            return 0
        # A dangling circuit of the host raises in the search: leave those to it.
        if q.max_hops == _NO_LIMIT and not q.bounded and not live._dangling:
            whole = _whole_buckets(fabric, &q, targets)
            if whole is not None:
                buckets = whole if len(whole) else _NO_BUCKETS
                n_buckets = len(whole)
            if (
                q.select
                and live.regions_on
                and not q.isolation
                and q.bandwidth == 0.0
                and q.host not in live._owned
            ):
                if live.regions_stale:
                    live._reach_build()
                if live.regions_ready:
                    n_places = _reach_places(live, &q)
                    try:
                        if n_buckets >= 0:
                            return _count_tallied(
                                live, &q, n_places, <const int32_t*>&buckets[0], n_buckets
                            )
                        return _count_selected(
                            fabric, live, ws, &q, _selector_buckets(fabric, targets)[2]
                        )
                    finally:
                        _clear_places(live, n_places)
            with nogil:
                count = _reach(&fabric.d, &live.c, ws, &q, False, &met_own, <const int32_t*>&buckets[0], n_buckets)
            if not met_own:
                return count
            _next_round(ws)  # each BFS and the search mark visits afresh
            with nogil:
                at_most = _reach(&fabric.d, &live.c, ws, &q, True, &met_own, <const int32_t*>&buckets[0], n_buckets)
            if at_most == count:
                return count
            _next_round(ws)
        _run(fabric, live, ws, &q, n_marked)
        return q.n_found
    finally:
        fabric._give(owner)
