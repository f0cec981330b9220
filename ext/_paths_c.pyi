from collections.abc import Sequence

def hop_distances(
    indptr: Sequence[int], indices: Sequence[int], source: int, max_hops: int
) -> list[int]: ...
