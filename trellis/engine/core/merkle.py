"""RFC 9162 (Certificate Transparency v2) Merkle trees over a domain's event hashes.

Definitions (RFC 9162 §2.1.1): the leaf hash of entry d is `SHA-256(0x00 || d)`, an interior
node `SHA-256(0x01 || left || right)`, and the tree of n > 1 entries splits at k, the largest
power of two smaller than n: `MTH(D[n]) = node(MTH(D[0:k]), MTH(D[k:n]))`. Entry i of a
domain's tree is the 32 raw bytes of the hash of its version-(i+1) event (ARCHITECTURE §6).

`MerkleTree` keeps the hash of every complete, aligned subtree, level by level (level h holds
the subtrees of 2^h leaves, each level one bytearray of 32-byte hashes), and grows by
appending. Every subtree a root, an inclusion path (PATH, §2.1.3.1) or a consistency proof
(PROOF, §2.1.4.1) needs is either one of those or splits into O(log n) of them, so a proof
over a million leaves costs a few dozen hashes, and appending costs one hash per level a leaf
completes (two per leaf on average). The verifiers follow §2.1.3.2 and §2.1.4.2 step by step
and need nothing but the proof, the sizes and the roots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

HASH_SIZE = 32
_LEAF = b"\x00"
_NODE = b"\x01"


def leaf_hash(entry: bytes) -> bytes:
    """RFC 9162's hash of one entry: `SHA-256(0x00 || entry)`."""
    return hashlib.sha256(_LEAF + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162's interior node: `SHA-256(0x01 || left || right)`."""
    return hashlib.sha256(_NODE + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


class MerkleTree:
    """An append-only RFC 9162 tree that answers for any size up to its own.

    Args:
        leaves: the entries' leaf hashes (already `leaf_hash`ed), in order.
    """

    def __init__(self, leaves: Iterable[bytes] = ()):
        self._levels: list[bytearray] = [bytearray()]
        self.extend(leaves)

    @property
    def size(self) -> int:
        return len(self._levels[0]) // HASH_SIZE

    def append(self, leaf: bytes) -> None:
        """Add one leaf hash; complete every subtree it completes."""
        if len(leaf) != HASH_SIZE:
            raise ValueError(f"a leaf hash has {HASH_SIZE} bytes, not {len(leaf)}")
        levels = self._levels
        levels[0] += leaf
        height, count, hashed = 0, self.size, leaf
        while count % 2 == 0:  # this leaf closed a pair at `height`: hash it one level up
            row = levels[height]
            hashed = node_hash(bytes(row[-2 * HASH_SIZE : -HASH_SIZE]), hashed)
            height += 1
            if height == len(levels):
                levels.append(bytearray())
            levels[height] += hashed
            count //= 2

    def extend(self, leaves: Iterable[bytes]) -> None:
        for leaf in leaves:
            self.append(leaf)

    def leaf(self, index: int) -> bytes:
        return self._aligned(0, index)

    def root(self, size: int | None = None) -> bytes:
        """MTH of the first `size` leaves (all by default); the empty tree's is SHA-256("")."""
        size = self.size if size is None else size
        self._check_size(size, allow_empty=True)
        if size == 0:
            return hashlib.sha256(b"").digest()
        return self._hash(0, size)

    def inclusion_path(self, index: int, size: int | None = None) -> list[bytes]:
        """PATH(index, D[size]): the siblings from the leaf up to the root, leaf side first.

        Raises:
            ValueError: `size` is 0 or beyond the tree, or `index` is not below it.
        """
        size = self.size if size is None else size
        self._check_size(size)
        if not 0 <= index < size:
            raise ValueError(f"leaf {index} is not in a tree of {size} leaves")
        path: list[bytes] = []
        start, n, m = 0, size, index
        while n > 1:  # descend towards the leaf; the siblings come out root side first
            k = _split(n)
            if m < k:
                path.append(self._hash(start + k, n - k))
                n = k
            else:
                path.append(self._hash(start, k))
                start, n, m = start + k, n - k, m - k
        path.reverse()
        return path

    def consistency_proof(self, old: int, new: int | None = None) -> list[bytes]:
        """PROOF(old, D[new]): what shows the tree of `old` leaves is a prefix of `new`'s.

        Raises:
            ValueError: a size is 0 or beyond the tree, or `old` > `new`.
        """
        new = self.size if new is None else new
        self._check_size(new)
        self._check_size(old)
        if old > new:
            raise ValueError(f"the old size {old} is beyond the new size {new}")
        proof: list[bytes] = []
        start, n, m, whole = 0, new, old, True
        # SUBPROOF(m, D[start:start+n], whole), unrolled: each step adds one sibling.
        while m != n:
            k = _split(n)
            if m <= k:
                proof.append(self._hash(start + k, n - k))
                n = k
            else:
                proof.append(self._hash(start, k))
                start, n, m, whole = start + k, n - k, m - k, False
        if not whole:
            proof.append(self._hash(start, n))
        proof.reverse()
        return proof

    # ---- internals ----

    def _check_size(self, size: int, *, allow_empty: bool = False) -> None:
        if not (0 if allow_empty else 1) <= size <= self.size:
            raise ValueError(f"no tree of {size} leaves: this one has {self.size}")

    def _aligned(self, height: int, index: int) -> bytes:
        offset = index * HASH_SIZE
        return bytes(self._levels[height][offset : offset + HASH_SIZE])

    def _hash(self, start: int, n: int) -> bytes:
        """MTH(D[start:start+n]) for a `start` aligned to n's largest power-of-two part (every
        subtree RFC 9162's split produces is): complete subtrees are looked up, the rest are
        split as the RFC splits them."""
        if n & (n - 1) == 0:
            height = n.bit_length() - 1
            return self._aligned(height, start >> height)
        k = _split(n)
        return node_hash(
            self._aligned(k.bit_length() - 1, start // k), self._hash(start + k, n - k)
        )


def verify_inclusion(
    leaf: bytes, index: int, size: int, path: Sequence[bytes], root: bytes
) -> bool:
    """RFC 9162 §2.1.3.2: True when `path` proves leaf hash `leaf` is entry `index` of the
    tree of `size` leaves whose root is `root`."""
    if not 0 <= index < size or any(len(p) != HASH_SIZE for p in path):
        return False
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while not fn & 1 and fn != 0:
                    fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def verify_consistency(
    old: int, new: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """RFC 9162 §2.1.4.2: True when `proof` shows the tree of `old` leaves with root
    `old_root` is a prefix of the tree of `new` leaves with root `new_root`. Sizes start at 1:
    no checkpoint is ever of the empty tree."""
    if not 1 <= old <= new or any(len(p) != HASH_SIZE for p in proof):
        return False
    if old == new:
        return not proof and old_root == new_root
    path = list(proof)
    if old & (old - 1) == 0:  # a power of two: the old tree is a node of the new one
        path.insert(0, old_root)
    if not path:
        return False
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            if not fn & 1:
                while not fn & 1 and fn != 0:
                    fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == old_root and sr == new_root
