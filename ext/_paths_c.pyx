# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled path core; must agree exactly with ``ext._paths_py`` (the spec), errors included."""

import operator
from array import array

from cpython.array cimport array as carray, clone
from libc.stdlib cimport free, malloc

cdef carray _INT32_TEMPLATE = array("i")


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
