# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Compiled twins of ``ext._live_py``: conditions changed in place, and the device choice.

``LiveConditions`` is the search's condition arrays (``_paths_c._ConditionArrays``: usable
flags, free bandwidth per link, circuit per slot, tenants per switch, taken and sliced devices)
changed in place, O(1) entries per change, with a journal (``checkpoint``/``rollback``) so a
decision can try picks and undo them, and the paths it tracks by key (``through``: a
component's blast radius). ``best_devices`` is the device choice, answered by the search in
``_paths_c`` that stops once the best ``n`` are certain. Must agree exactly with
``ext._live_py``, errors included.
"""

import operator

from libc.stdint cimport int32_t, uint8_t

from ._paths_c cimport (
    DEVICE,
    UNUSABLE,
    Fabric,
    Query,
    WS,
    _ConditionArrays,
    _Workspace,
    _live,
    _path,
    _prepare,
    _run,
    _select_targets,
)

from ._paths_py import Conditions, Selector


cdef class LiveConditions(_ConditionArrays):
    """Conditions held as arrays on one fabric and changed in place, O(1) entries per change.

    Built from a ``Conditions`` snapshot; the same methods on the reference twin
    (``ext._live_py.LiveConditions``) change its mappings the same way.
    """

    cdef dict _tracked  # key -> the components its paths pass (node i, link n_nodes + k)
    cdef dict _through  # component -> {key: how many of its paths pass it}
    cdef int _depth

    def __init__(self, Fabric fabric not None, conditions=Conditions()):
        self._tracked = {}
        self._through = {}
        self._depth = 0
        _ConditionArrays.__init__(self, fabric, conditions)
        self.regions_on = True  # it lives on through many counts: keep the region index

    @property
    def regions(self):
        """How many regions the region index holds, or None while it is stale or off (see
        _paths_c._ConditionArrays._reach_build); tests read it."""
        return self.n_regions if self.regions_ready else None

    # ---- the journal ----

    def checkpoint(self):
        """Start recording changes; ``rollback(mark)`` undoes every change since. Nestable."""
        if self._journal is None:
            self._journal = []
        self._depth += 1
        return len(self._journal)

    def rollback(self, mark):
        """Undo every change since ``checkpoint()`` returned ``mark``, and end that checkpoint."""
        if self._journal is None or self._depth == 0:
            raise ValueError("rollback without a checkpoint")
        journal = self._journal
        self._journal = None  # the undo steps themselves are not recorded
        try:
            while len(journal) > mark:
                entry = journal.pop()
                what = entry[0]
                if what == 0 or what == 1 or what == 2 or what == 7:
                    self._restore(entry)
                elif what == 8:
                    self.c.sliced[<int32_t>entry[1]] = entry[2]
                elif what == 6:
                    self._untrack(entry[1])
                    if entry[2] is not None:
                        self._track(entry[1], entry[2])
                elif what == 3:
                    s = entry[1]
                    self._slot_tally(s, -1)
                    self._count_owner(s, -1)
                    self.c.circ_other[<int32_t>s] = entry[2]
                    self.c.circ_owner[<int32_t>s] = entry[3]
                    self._count_owner(s, 1)
                    self._slot_tally(s, 1)
                    if entry[4] is None:
                        self._dangling.pop(s, None)
                    else:
                        self._dangling[s] = entry[4]
                else:
                    table = self._users if what == 4 else self._holders
                    self._set_tenants(table, entry[1], entry[2], what == 5)
        finally:
            self._depth -= 1
            self._journal = journal if self._depth > 0 else None

    cdef _restore(self, tuple entry):
        """Undo a journal entry of a node's or link's flags, a link's bandwidth or a device's
        taken mark; what it concerns goes out of the tallies and back in."""
        cdef int what = entry[0]
        cdef int32_t i = entry[1]
        cdef bint is_link = what == 1 or what == 2
        if is_link:
            self._link_tally(i, -1)
        else:
            self._tally(i, -1)
        if what == 0:
            self.c.node_flags[i] = entry[2]
        elif what == 1:
            self.c.link_flags[i] = entry[2]
        elif what == 2:
            self.c.reserved[i] = entry[2]
            self.c.free[i] = entry[3]
        else:
            self.c.taken[i] = entry[2]
        if is_link:
            self._link_tally(i, 1)
        else:
            self._tally(i, 1)
            if what == 0:
                self._node_changed(i)

    # ---- changes ----

    cdef int32_t _component(self, component, bint *is_link) except -2:
        i = self.fabric._node_index.get(component)
        if i is not None:
            is_link[0] = False
            return i
        k = self.fabric._link_index.get(component)
        if k is not None:
            is_link[0] = True
            return k
        raise KeyError(component)

    def set_usable(self, component, bint usable):
        """Mark a node or link usable (healthy, undrained) or not.

        Raises:
            KeyError: no node or link of the fabric has that id.
        """
        cdef bint is_link = False
        cdef int32_t i = self._component(component, &is_link)
        cdef uint8_t* flags = self.c.link_flags if is_link else self.c.node_flags
        cdef uint8_t flag = (flags[i] & ~UNUSABLE) | (0 if usable else UNUSABLE)
        if flag == flags[i]:
            return
        if self._journal is not None:
            self._journal.append((1 if is_link else 0, i, flags[i]))
        if is_link:
            self._link_tally(i, -1)
            flags[i] = flag
            self._link_tally(i, 1)
        else:
            self._tally(i, -1)
            flags[i] = flag
            self._tally(i, 1)
            self._node_changed(i)

    cdef int32_t _node(self, node) except -1:
        i = self.fabric._node_index.get(node)
        if i is None:
            raise KeyError(node)
        return i

    def set_taken(self, device, bint taken):
        """Mark a device taken (held whole; no selector chooses it) or not.

        Raises:
            KeyError: no node of the fabric has that id.
        """
        cdef int32_t i = self._node(device)
        cdef uint8_t flag = 1 if taken else 0
        if flag != self.c.taken[i]:
            if self._journal is not None:
                self._journal.append((7, i, self.c.taken[i]))
            self._tally(i, -1)
            self.c.taken[i] = flag
            self._tally(i, 1)

    def set_sliced(self, device, gib):
        """Set the GiB sliced out of a memory device (0: none).

        Raises:
            KeyError: no node of the fabric has that id.
        """
        cdef int32_t i = self._node(device)
        if self._journal is not None:
            self._journal.append((8, i, self.c.sliced[i]))
        self.c.sliced[i] = gib

    cdef int32_t _link(self, link) except -1:
        k = self.fabric._link_index.get(link)
        if k is None:
            raise KeyError(link)
        return k

    def set_reserved(self, link, gbps):
        """Set the bandwidth reserved on a link (the reference's ``reserved_gbps[link]``)."""
        cdef int32_t k = self._link(link)
        if self._journal is not None:
            self._journal.append((2, k, self.c.reserved[k], self.c.free[k]))
        self._link_tally(k, -1)
        self.c.reserved[k] = gbps
        self.c.free[k] = self.fabric.d.link_cap[k] - self.c.reserved[k]
        self._link_tally(k, 1)

    def reserve(self, link, gbps):
        """Add to the bandwidth reserved on a link."""
        cdef int32_t k = self._link(link)
        self.set_reserved(link, self.c.reserved[k] + <double>gbps)

    def reserved(self, link):
        """The bandwidth reserved on a link."""
        cdef int32_t k = self._link(link)
        return self.c.reserved[k]

    def set_circuit(self, ocs, port, other, owner):
        """Record that ``<ocs>:<port>`` is in a circuit to ``other``, owned by host ``owner``
        (the reference's ``circuits["<ocs>:<port>"] = (other, owner)``). A port without a
        cable carries no path, so it is not recorded."""
        s = self.fabric._slot_of_key.get(f"{ocs}:{port}")
        if s is not None:
            self._set_slot(s, other, owner)

    def clear_circuit(self, ocs, port):
        """``<ocs>:<port>`` is in no circuit any more."""
        s = self.fabric._slot_of_key.get(f"{ocs}:{port}")
        if s is not None:
            self._set_slot(s, None, None)

    def add_circuit(self, ocs, a_port, b_port, owner):
        """A circuit a_port <-> b_port owned by ``owner``: both ports' entries."""
        self.set_circuit(ocs, a_port, b_port, owner)
        self.set_circuit(ocs, b_port, a_port, owner)

    def set_switch_tenants(self, switch, tenants):
        """Tenants with live paths through ``switch`` (the reference's ``switch_tenants``)."""
        i = self.fabric._node_index.get(switch)
        if i is not None:
            self._set_tenants(self._users, i, tenants, False)

    def set_exclusive_tenants(self, switch, tenants):
        """Tenants holding ``switch`` exclusively (the reference's ``exclusive_tenants``)."""
        i = self.fabric._node_index.get(switch)
        if i is not None:
            self._set_tenants(self._holders, i, tenants, True)

    def hold_switch(self, switch, tenant, bint exclusive):
        """One more path of ``tenant`` through ``switch``; held exclusively if ``exclusive``."""
        i = self.fabric._node_index.get(switch)
        if i is None:
            return
        for table, applies in ((self._users, True), (self._holders, exclusive)):
            if applies:
                counts = dict(table.get(i, {}))
                counts[tenant] = counts.get(tenant, 0) + 1
                self._set_tenants(table, i, counts, table is self._holders)

    # ---- blast radius: which tracked paths pass a component ----

    cdef int32_t _component_index(self, component) except -1:
        cdef bint is_link = False
        cdef int32_t i = self._component(component, &is_link)
        return self.fabric.d.n_nodes + i if is_link else i

    cdef _track(self, key, list components):
        self._tracked[key] = components
        for i in components:
            keys = self._through.setdefault(i, {})
            keys[key] = keys.get(key, 0) + 1

    cdef _untrack(self, key):
        components = self._tracked.pop(key, None)
        if components is None:
            return
        for i in components:
            keys = self._through[i]
            if keys[key] == 1:
                del keys[key]
                if not keys:
                    del self._through[i]
            else:
                keys[key] -= 1

    def track(self, key, nodes, links):
        """Record that ``key`` (a composition, say) has a path over ``nodes`` and ``links``;
        tracking a key again adds to what it passes.

        Raises:
            KeyError: a node or link the fabric lacks.
        """
        added = [self._component_index(n) for n in nodes]
        added += [self._component_index(k) for k in links]
        old = self._tracked.get(key)
        if self._journal is not None:
            self._journal.append((6, key, None if old is None else list(old)))
        self._untrack(key)
        self._track(key, ([] if old is None else old) + added)

    def untrack(self, key):
        """``key`` has no paths any more."""
        old = self._tracked.get(key)
        if old is not None:
            if self._journal is not None:
                self._journal.append((6, key, list(old)))
            self._untrack(key)

    def through(self, component):
        """The tracked keys whose paths pass ``component`` (its blast radius), sorted.

        Raises:
            KeyError: no node or link of the fabric has that id.
        """
        return sorted(self._through.get(self._component_index(component), ()))


cdef list _best_selected(Fabric fabric, _ConditionArrays live, Query* q, selector, n):
    cdef _Workspace owner
    cdef int32_t j, count, n_marked
    count = <int32_t>min(max(operator.index(n), 0), len(fabric.devices))
    if count == 0:
        return []
    owner = fabric._take()
    try:
        owner.next_stamp()
        n_marked = _select_targets(fabric, live, owner, q, selector)
        if n_marked < 0:
            return []
        if n_marked > 0 and count > n_marked:
            count = n_marked
        owner.ensure_best(count)
        q.best_n = count
        _run(fabric, live, &owner.w, q, n_marked)
        return [_path(fabric, &owner.w, owner.w.best[j]) for j in range(q.n_best)]
    finally:
        fabric._give(owner)

def best_devices(Fabric fabric not None, conditions, request, ranked, n=1):
    """The best ``n`` target devices by (hops, latency, rank, id) of their best paths.

    ``ranked`` maps each candidate device to its policy rank. The answer equals sorting
    ``best_paths(...)`` over the candidates by that key and keeping ``n``, from one search
    that stops as soon as no device still unseen can enter the first ``n``.

    ``ranked`` may instead be a ``Selector``: the candidates are the fabric's devices it
    admits under these conditions, ranked by their ``DeviceInfo.rank``. They are tested as
    the search reaches them, so the cost does not grow with the devices of the kind; only
    when at most 64 could qualify are they listed first, for the lower bounds.

    Raises:
        PathError: the host is unknown, not a host, or unusable.
    """
    cdef _ConditionArrays live = _live(fabric, conditions)
    cdef Query q
    cdef _Workspace owner
    cdef WS* ws
    cdef int32_t i, count, n_marked = 0
    cdef dict node_index
    _prepare(fabric, live, request, &q)
    if isinstance(ranked, Selector):
        return _best_selected(fabric, live, &q, ranked, n)
    count = <int32_t>min(max(operator.index(n), 0), len(ranked))
    if count == 0:
        return []
    owner = fabric._take()
    ws = &owner.w
    try:
        owner.next_stamp()
        owner.ensure_best(count)
        node_index = <dict>fabric._node_index
        for target, rank in ranked.items():
            i = node_index.get(target, -1)
            if i >= 0 and fabric.d.kind[i] == DEVICE:
                if ws.target_stamp[i] != ws.stamp:
                    ws.target_stamp[i] = ws.stamp
                    ws.found[n_marked] = i
                    n_marked += 1
                ws.rank[i] = rank
        q.n_targets = len(ranked)
        q.best_n = count
        _run(fabric, live, ws, &q, n_marked)
        # When the search ran out first, every device found is among the best n.
        return [_path(fabric, ws, ws.best[i]) for i in range(q.n_best)]
    finally:
        fabric._give(owner)
