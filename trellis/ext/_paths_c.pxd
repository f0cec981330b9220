# cython: language_level=3
# What the compiled path core's modules share: _paths_c.pyx (the topology and the search)
# defines it, and _live_c.pyx (conditions changed in place, and the device choice) cimports it,
# as _live_py imports _paths_py.
#
# The C layout of the topology (FabricData), of the conditions (CondData), of a search's query
# and workspace (Query, WS); the extension types that hold them; and the search's entry points.

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef enum:
    HOST = 0
    SWITCH = 1
    OCS = 2
    DEVICE = 3
    NO_CIRCUIT = -1
    DANGLING = -2  # a circuit whose other port has no cable: the reference raises KeyError
    NOBODY = -2  # an owner or tenant that is no node or known tenant: equal to no request's
    UNUSABLE = 1


ctypedef struct FabricData:
    int32_t n_nodes
    int32_t n_links
    int32_t n_slots
    int32_t n_ocs
    int8_t* kind  # per node
    int64_t* node_lat
    int32_t* ocs_rank  # per node: its rank among OCS, or -1
    int32_t* adj_ptr  # CSR over nodes: n_nodes + 1 offsets
    int32_t* adj_link
    int32_t* adj_far
    int32_t* adj_slot  # the far end's slot when the far node is an OCS, else -1
    int32_t* adj_near_slot  # this end's slot when this node is an OCS, else -1
    int32_t* inner_ptr  # n_nodes + 1 offsets into inner_arc
    int32_t* inner_arc  # per node, its adjacency positions whose far node is no device, by
    #   far node and then the cable's latency (parallel cables side by side, fastest first)
    int32_t* inner_next  # per inner_arc position: the first one past its far node's cables
    int64_t* link_lat
    double* link_cap
    int32_t* slot_ocs  # per slot: its OCS node
    int64_t* slot_port
    int32_t* slot_link  # the cable on the port
    int32_t* slot_far  # the node at the cable's other end
    int32_t* slot_far_slot  # that end's slot when it is an OCS, else -1
    int32_t* ocs_slots  # per OCS rank: n_ocs + 1 offsets into the slots
    int32_t* ocs_inner_ptr  # per OCS rank: n_ocs + 1 offsets into ocs_inner
    int32_t* ocs_inner  # per OCS, in port order, its slots whose cable ends at no device
    # per node, what a Selector tests (DeviceInfo); dev_kind -1: no device, or no such info
    int32_t n_models
    int32_t* dev_kind
    int32_t* dev_model
    int64_t* dev_gen
    double* dev_mem
    double* dev_cap
    int64_t* dev_rank
    # A "leaf" device: one cable, to a switch or host, on no OCS port (most of a hall's), and a
    # DeviceInfo. A BFS reaches it when it goes on from that node and the cable carries it, so
    # _reach counts those per node and bucket (CondData.leaf_open) instead of visiting them.
    int32_t n_buckets
    int32_t* dev_bucket  # per node: its (kind, model) bucket's number, or -1
    int32_t* leaf_link  # per node: a leaf device's cable, or -1
    int32_t* link_leaf  # per link: the leaf device it is the cable of, or -1
    int32_t* home  # per node: its number among the nodes leaf devices hang from, or -1
    int32_t n_homes
    int32_t* outer_ptr  # n_nodes + 1 offsets into outer_arc
    int32_t* outer_arc  # per node, its adjacency positions whose far node is no leaf device
    # A "port" device: one cable, on an OCS port, and a DeviceInfo (a hall's pooled memory and
    # NVMe). The region index (_ConditionArrays._reach_build) tallies those per OCS.
    int32_t* port_slot  # per node: a port device's slot, or -1
    int32_t* link_slots  # per link: the slots of its OCS ends (2 entries each, -1: none)
    uint8_t* switch_link  # per link: 1 when it joins two switches
    int has_other_devices  # a device with a DeviceInfo that is neither a leaf nor a port one


ctypedef struct CondData:
    uint8_t* node_flags
    uint8_t* link_flags
    double* free  # capacity - reserved, computed as the reference computes it
    double* reserved  # as given (not read by the search; kept so free stays exact)
    int32_t* circ_other  # per slot: the other slot, NO_CIRCUIT or DANGLING
    int32_t* circ_owner  # per slot: the owner host's node index, or NOBODY
    int32_t* users_n  # per node (switches): tenants with live paths through it
    int32_t* users_sole  # the tenant when users_n == 1
    int32_t* holders_n  # tenants holding it exclusively
    int32_t* holders_sole
    uint8_t* taken  # per node: a device held whole
    double* sliced  # per node: GiB sliced out of a memory device
    # per home and bucket (home * n_buckets + bucket): its leaf devices that are usable, not
    # taken, and whose cable is usable with no less than nothing free (see _leaf_open)
    int32_t* leaf_open
    int32_t* bucket_healthy  # per bucket: its usable devices
    int32_t* bucket_free  # per bucket: its usable devices not taken


ctypedef struct Label:
    int64_t latency
    int64_t seq  # offset into the arena: depth nodes, then depth - 1 links
    uint64_t mask  # OCS on the path, one bit per OCS rank modulo 64
    uint64_t free_mask  # of those, OCS it left on a new circuit where the host holds none
    int32_t hops
    int32_t new_circuits
    int32_t vertex  # a node, or n_nodes + slot
    int32_t node  # the last node
    int32_t depth  # nodes on the path
    int32_t parent
    int32_t circ_in  # the slots of the circuit the last step crossed, or -1
    int32_t circ_out
    int32_t circ_new


ctypedef struct Settled:
    int64_t latency
    uint64_t mask
    uint64_t free_mask
    int32_t label
    int32_t next


ctypedef struct Query:
    int32_t host
    int32_t tenant
    int exclusive
    int isolation
    int bounded
    int64_t max_hops
    int64_t max_latency
    double bandwidth
    int64_t n_targets  # the search stops once this many targets are found (as len(targets))
    int32_t best_n  # > 0: stop once the best n by (hops, latency, rank, id) are certain
    int use_lb  # prune labels that cannot reach a target (within max_hops): ws.lb is set
    int use_lat_lb  # with a latency bound: prune on ws.lat_lb too
    int select  # candidates are the devices _selected admits, not marked targets
    int32_t sel_kind
    int has_models  # the admitted model ids carry ws.model_stamp
    int has_min_gen
    int64_t min_gen
    int has_min_mem
    double min_mem
    int has_slice
    double slice_gib
    int32_t n_labels  # > 0: admitted devices carry target_stamp and label_hits == n_labels
    int64_t limit_hops  # the request's own max_hops; max_hops may be lower while deepening
    int64_t next_bound  # deepening: the least hops + lb of a label cut by max_hops < limit
    int32_t rounds  # searches run (deepening rounds), for Fabric.last_rounds
    # results
    int32_t n_found
    int32_t n_best
    int32_t error_slot  # a dangling circuit of the host was met there
    int out_of_memory


ctypedef struct DEntry:
    int64_t key
    int32_t node


ctypedef struct WS:
    Label* labels
    int64_t labels_cap
    int64_t n_labels
    int32_t* arena
    int64_t arena_cap
    int64_t arena_used
    int32_t* heap
    int64_t heap_cap
    int64_t heap_n
    Settled* settled
    int64_t settled_cap
    int64_t n_settled
    int32_t* settled_head  # per vertex
    uint32_t* settled_stamp  # per vertex
    int32_t* pushed_label  # per vertex: the smallest label pushed there in this search
    uint32_t* pushed_stamp  # per vertex
    int32_t* deferred  # OCS entry labels whose new-circuit exits are not pushed yet (FIFO)
    int64_t deferred_cap
    int64_t deferred_head
    int64_t deferred_tail
    uint32_t* target_stamp  # per node
    uint32_t* found_stamp  # per node
    int32_t* found_label  # per node
    int32_t* found  # nodes in the order found
    int64_t* rank  # per node (best_devices)
    int32_t* best  # the best n found so far, best first
    int64_t best_cap
    int32_t* lb  # per node: fewest hops to a target over the relaxed fabric (with lb_stamp)
    uint32_t* lb_stamp
    int32_t* queue  # BFS queue, one slot per node
    int64_t lb_head  # the lower bounds' BFS so far (see _extend_bounds): queue head and tail,
    int64_t lb_tail
    int64_t lb_level  # and every node within this many hops of a target has its bound
    int32_t* hop  # per node: fewest hops from the host over the relaxed fabric (hop_stamp),
    uint32_t* hop_stamp  # within the few a refusal needs (_hop_ball_meets)
    int32_t* hop_queue  # that BFS's queue: a node, or once per OCS a token, as ws.queue
    int64_t* lat_lb  # per node: least latency to a target over the relaxed fabric (lat_stamp)
    uint32_t* lat_stamp
    DEntry* dheap  # the latency bound's Dijkstra heap (resumable: see _latency_reachable)
    int64_t dheap_n
    uint32_t lat_seeded  # == stamp: the latency bound's Dijkstra started in this search
    int64_t* fwd_lat  # per node: least latency from the host (fwd_stamp; _latency_reachable)
    uint32_t* fwd_stamp
    DEntry* fheap  # that forward Dijkstra's heap
    int64_t fheap_cap
    int64_t meet  # the least latency of a host-target path the two Dijkstras found so far
    int32_t targets[64]  # the marked targets when at most _LOWER_BOUND_TARGETS (lower bounds)
    int32_t n_targets
    int32_t* fan_exits  # per slot: an OCS's exits that pass this round's tests (_fan_exits),
    uint32_t* fan_round  # per OCS rank: listed at fan_exits + ocs_slots[rank] for this round
    int32_t* fan_hops  # per OCS rank: and for labels of these hops at its entry
    int32_t* fan_n  # per OCS rank: exits listed
    int64_t* fan_cut  # per OCS rank: the least bound of an exit cut (_cut), or _NO_LIMIT
    int32_t* fan_cut_slot  # per OCS rank: that exit
    int64_t* fan_cut_next  # per OCS rank: the least bound of any other exit cut
    int64_t* fan_cut_latency  # per OCS rank: the least latency on from the entry of an exit cut
    uint32_t* own_stamp  # per OCS rank: the host holds a circuit there (set by _run)
    uint32_t* target_ocs_stamp  # per OCS rank: a marked target hangs on it (set by _run)
    uint32_t* model_stamp  # per model id: admitted by this search's Selector
    int32_t* label_hits  # per node: labels of this search's Selector it carries
    int64_t dheap_cap
    uint32_t stamp  # per search: targets, lower bounds
    uint32_t round  # per round of a search (see _deepen): settled, pushed, found
    int32_t n_models
    int32_t n_ocs
    int32_t n_nodes
    int32_t n_vertices


cdef class _Workspace:
    cdef WS w

    cdef void next_stamp(self)
    cdef int ensure_best(self, int64_t n) except -1


cdef class Fabric:
    cdef FabricData d
    cdef readonly tuple node_ids  # sorted: index order is id order
    cdef readonly tuple link_ids
    cdef dict _node_index
    cdef dict _link_index
    cdef dict _slot_of_key  # "<ocs>:<port>" -> slot
    cdef dict _slot_of_port  # (ocs index, port) -> slot
    cdef tuple _kinds  # kind strings by node index
    cdef tuple _slot_port_obj  # the port values as given, by slot
    cdef object _nodes
    cdef object _links
    cdef object _graph
    cdef readonly dict ports
    cdef _Workspace _spare
    cdef readonly dict devices  # device id -> DeviceInfo, as given (device nodes only)
    cdef readonly int last_rounds  # label-setting searches the last query ran (_run)
    cdef dict _device_kinds  # kind string -> id
    cdef dict _model_ids  # model string -> id
    cdef dict _label_index  # (key, value) -> node indices of devices carrying it
    cdef dict _buckets  # (kind id, model id) -> node indices (array("i")), in id order
    cdef dict _kind_models  # kind id -> its model ids
    cdef list _model_names  # model id -> string
    cdef dict _bucket_no  # (kind id, model id) -> the bucket's number (FabricData.dev_bucket)
    cdef list _bucket_span  # by number: (least, most) generation, (least, most) memory, size

    cdef _load_devices(self, devices)
    cdef _index_leaves(self)
    cdef _index_ports(self)
    cdef _Workspace _take(self)
    cdef void _give(self, _Workspace ws)


# The conditions of one fabric as flat arrays (CondData), built from a snapshot: what the
# search reads. _live_c.LiveConditions adds the changes in place and the journal's undo.
cdef class _ConditionArrays:
    cdef readonly Fabric fabric
    cdef CondData c
    cdef dict _tenant_ids
    cdef dict _users  # node index -> {tenant: count}
    cdef dict _holders
    cdef dict _dangling  # slot -> the other port as given, for the reference's KeyError
    cdef dict _owned  # owner node index -> {OCS rank: its circuit ports there}
    cdef list _journal  # None, or the undo entries since the outermost checkpoint
    # The region index (see _reach_build): kept only by LiveConditions (regions_on), built on
    # the first unisolated count after a change it cannot follow (regions_stale).
    cdef bint regions_on
    cdef bint regions_stale
    cdef bint regions_ready
    cdef bint _was_open  # a switch-to-switch cable's state before a change (_cable_tally)
    cdef int32_t n_regions
    cdef int32_t n_places  # regions, then OCS
    cdef int32_t* region  # per node: its region, or -1 (not a usable switch)
    cdef int32_t* place_links  # n_places x n_places: open cables between two places
    cdef int32_t* region_open  # per region and bucket: leaf devices open (as leaf_open)
    cdef int32_t* ocs_open  # per OCS rank and bucket: port devices open (_port_open)
    cdef uint8_t* place_seen  # per place: the count's BFS (cleared after each)
    cdef int32_t* place_queue

    cdef _load(self, conditions)
    cdef void _tally(self, int32_t device, int delta) noexcept
    cdef void _port_tally(self, int32_t device, int delta) noexcept
    cdef void _cable_tally(self, int32_t link, int delta) noexcept
    cdef void _slot_port_tally(self, int32_t slot, int delta) noexcept
    cdef void _slot_tally(self, int32_t slot, int delta) noexcept
    cdef void _link_tally(self, int32_t link, int delta) noexcept
    cdef void _node_changed(self, int32_t node) noexcept
    cdef void _regions_stale(self) noexcept
    cdef int _reach_build(self) except -1
    cdef _set_slot(self, s, other, owner)
    cdef _set_circuit(self, int32_t slot, other, owner)
    cdef void _free_regions(self) noexcept
    cdef _count_owner(self, int32_t slot, int delta)
    cdef _set_tenants(self, dict table, i, tenants, bint exclusive)
    cdef int32_t _tenant(self, tenant)


cdef void* _alloc(Py_ssize_t count, size_t size) except NULL
cdef _ConditionArrays _live(Fabric fabric, conditions)
cdef _prepare(Fabric fabric, _ConditionArrays live, request, Query* q)
cdef _run(Fabric fabric, _ConditionArrays live, WS* ws, Query* q, int32_t n_marked)
cdef object _path(Fabric fabric, WS* ws, int32_t node)
cdef int32_t _select_targets(
    Fabric fabric, _ConditionArrays live, _Workspace owner, Query* q, selector
) except -2
