"""Pure-Python reference for the path core: the spec the compiled module must match exactly."""

from __future__ import annotations

import operator
from array import array
from collections import deque
from collections.abc import Sequence


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
