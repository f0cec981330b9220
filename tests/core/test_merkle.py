"""engine/core/merkle.py against RFC 6962/9162 test vectors and an independent reference.

The vectors are the Certificate Transparency reference data (the eight leaves and their tree
heads, inclusion paths and consistency proofs that CT implementations share). The reference
below is written straight from the RFC's recursive definitions (MTH, PATH, SUBPROOF) over
lists, sharing no code with the module, and checks proofs by recomputing the roots they imply.
"""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.engine.core.merkle import MerkleTree, leaf_hash, verify_consistency, verify_inclusion

# ---- the CT reference data (data only) ----

ENTRIES = [
    bytes.fromhex(h)
    for h in [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
INCLUSION = {
    (0, 8): [
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    (5, 8): [
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
}
CONSISTENCY = {
    (2, 8): [
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    (6, 8): [
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
    (2, 5): [
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
    ],
}


# ---- an independent reference, from the RFC's definitions ----


def ref_leaf(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def ref_node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def ref_k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(leaves: list[bytes]) -> bytes:
    """MTH over leaf hashes (RFC 9162 §2.1.1)."""
    if len(leaves) == 1:
        return leaves[0]
    k = ref_k(len(leaves))
    return ref_node(ref_mth(leaves[:k]), ref_mth(leaves[k:]))


def ref_path(m: int, leaves: list[bytes]) -> list[bytes]:
    """PATH(m, D[n]) (§2.1.3.1)."""
    n = len(leaves)
    if n == 1:
        return []
    k = ref_k(n)
    if m < k:
        return [*ref_path(m, leaves[:k]), ref_mth(leaves[k:])]
    return [*ref_path(m - k, leaves[k:]), ref_mth(leaves[:k])]


def ref_subproof(m: int, leaves: list[bytes], whole: bool) -> list[bytes]:
    """SUBPROOF(m, D[n], b) (§2.1.4.1)."""
    n = len(leaves)
    if m == n:
        return [] if whole else [ref_mth(leaves)]
    k = ref_k(n)
    if m <= k:
        return [*ref_subproof(m, leaves[:k], whole), ref_mth(leaves[k:])]
    return [*ref_subproof(m - k, leaves[k:], False), ref_mth(leaves[:k])]


def ref_root_from_path(m: int, n: int, leaf: bytes, path: list[bytes]) -> bytes | None:
    """The root an inclusion path implies, by walking PATH's recursion in reverse."""
    if n == 1:
        return leaf if not path else None
    if not path:
        return None
    k = ref_k(n)
    *inner, sibling = path
    if m < k:
        below = ref_root_from_path(m, k, leaf, inner)
        return None if below is None else ref_node(below, sibling)
    below = ref_root_from_path(m - k, n - k, leaf, inner)
    return None if below is None else ref_node(sibling, below)


def leaves_of(count: int, salt: int = 0) -> list[bytes]:
    return [ref_leaf(f"{salt}:{i}".encode()) for i in range(count)]


# ---- the vectors ----


def test_tree_heads_match_the_ct_reference_for_every_size() -> None:
    tree = MerkleTree(leaf_hash(e) for e in ENTRIES)
    assert [tree.root(n).hex() for n in range(1, 9)] == ROOTS
    assert tree.root(0).hex() == hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize(("index", "size"), sorted(INCLUSION))
def test_inclusion_paths_match_the_ct_reference(index: int, size: int) -> None:
    tree = MerkleTree(leaf_hash(e) for e in ENTRIES)
    path = tree.inclusion_path(index, size)
    assert [p.hex() for p in path] == INCLUSION[(index, size)]
    root = bytes.fromhex(ROOTS[size - 1])
    assert verify_inclusion(leaf_hash(ENTRIES[index]), index, size, path, root)


@pytest.mark.parametrize(("old", "new"), sorted(CONSISTENCY))
def test_consistency_proofs_match_the_ct_reference(old: int, new: int) -> None:
    tree = MerkleTree(leaf_hash(e) for e in ENTRIES)
    proof = tree.consistency_proof(old, new)
    assert [p.hex() for p in proof] == CONSISTENCY[(old, new)]
    old_root, new_root = bytes.fromhex(ROOTS[old - 1]), bytes.fromhex(ROOTS[new - 1])
    assert verify_consistency(old, new, old_root, new_root, proof)


# ---- against the reference ----


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.data())
def test_roots_and_paths_agree_with_the_rfc_definitions(n: int, data: st.DataObject) -> None:
    leaves = leaves_of(n)
    tree = MerkleTree(leaves)
    size = data.draw(st.integers(1, n))
    index = data.draw(st.integers(0, size - 1))
    assert tree.root(size) == ref_mth(leaves[:size])
    path = tree.inclusion_path(index, size)
    assert path == ref_path(index, leaves[:size])
    assert ref_root_from_path(index, size, leaves[index], path) == ref_mth(leaves[:size])
    assert verify_inclusion(leaves[index], index, size, path, tree.root(size))
    assert len(path) <= math.ceil(math.log2(size)) if size > 1 else not path


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.data())
def test_consistency_proofs_agree_with_the_rfc_definitions(n: int, data: st.DataObject) -> None:
    leaves = leaves_of(n)
    tree = MerkleTree(leaves)
    new = data.draw(st.integers(1, n))
    old = data.draw(st.integers(1, new))
    proof = tree.consistency_proof(old, new)
    assert proof == ref_subproof(old, leaves[:new], True)
    assert verify_consistency(old, new, ref_mth(leaves[:old]), ref_mth(leaves[:new]), proof)
    # RFC 9162 bounds a consistency proof by ceil(log2(new)) + 1 hashes.
    assert len(proof) <= math.ceil(math.log2(new)) + 1


def test_every_small_tree_proves_every_leaf_and_every_prefix() -> None:
    leaves = leaves_of(40, salt=7)
    tree = MerkleTree()
    for n, leaf in enumerate(leaves, 1):
        tree.append(leaf)  # grown one leaf at a time: the same answers as built at once
        root = ref_mth(leaves[:n])
        assert tree.root() == root
        for i in range(n):
            assert verify_inclusion(leaves[i], i, n, tree.inclusion_path(i), root)
        for old in range(1, n + 1):
            old_root = ref_mth(leaves[:old])
            assert verify_consistency(old, n, old_root, root, tree.consistency_proof(old))


# ---- what must fail ----


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 200), st.data())
def test_an_inclusion_proof_fails_for_a_wrong_leaf_index_size_or_root(
    n: int, data: st.DataObject
) -> None:
    leaves = leaves_of(n, salt=1)
    tree = MerkleTree(leaves)
    index = data.draw(st.integers(0, n - 1))
    path, root = tree.inclusion_path(index), tree.root()
    other = data.draw(st.integers(0, n - 1).filter(lambda i: i != index))
    assert not verify_inclusion(leaves[other], index, n, path, root)  # wrong leaf
    assert not verify_inclusion(ref_leaf(b"forged"), index, n, path, root)
    assert not verify_inclusion(leaves[index], other, n, path, root)  # wrong index
    # A wrong size, with the root a tree of that size has (a checkpoint binds the two: a
    # path only proves anything against the root signed for its size).
    longer = MerkleTree(leaves_of(2 * n, salt=1))
    wrong_size = data.draw(st.integers(index + 1, 2 * n).filter(lambda s: s != n))
    assert not verify_inclusion(leaves[index], index, wrong_size, path, longer.root(wrong_size))
    assert not verify_inclusion(leaves[index], index, n, path[:-1], root)
    assert not verify_inclusion(leaves[index], index, n, [*path, root], root)
    if path:
        flipped = [bytes([path[0][0] ^ 1]) + path[0][1:], *path[1:]]
        assert not verify_inclusion(leaves[index], index, n, flipped, root)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 200), st.data())
def test_a_consistency_proof_fails_for_a_forked_log_or_wrong_sizes(
    n: int, data: st.DataObject
) -> None:
    leaves = leaves_of(n, salt=2)
    new = data.draw(st.integers(2, n))
    old = data.draw(st.integers(1, new - 1))
    tree = MerkleTree(leaves[:new])
    proof = tree.consistency_proof(old, new)
    old_root, new_root = tree.root(old), tree.root(new)
    # A fork: the same size, but one entry before `old` rewritten.
    changed = data.draw(st.integers(0, old - 1))
    forked = [*leaves[:new]]
    forked[changed] = ref_leaf(b"rewritten")
    fork = MerkleTree(forked)
    assert not verify_consistency(old, new, old_root, fork.root(new), proof)
    assert not verify_consistency(old, new, old_root, fork.root(new), fork.consistency_proof(old))
    assert not verify_consistency(old, new, fork.root(old), new_root, proof)
    # Wrong sizes with the right roots.
    assert not verify_consistency(old + 1, new, old_root, new_root, proof)
    assert not verify_consistency(new, old, new_root, old_root, proof)
    assert not verify_consistency(old, new, old_root, new_root, proof[:-1])
    assert not verify_consistency(old, new, old_root, new_root, [*proof, new_root])


def test_equal_sizes_are_consistent_only_with_equal_roots_and_no_proof() -> None:
    tree = MerkleTree(leaves_of(5))
    assert tree.consistency_proof(5, 5) == []
    assert verify_consistency(5, 5, tree.root(), tree.root(), [])
    assert not verify_consistency(5, 5, tree.root(), tree.root(4), [])
    assert not verify_consistency(5, 5, tree.root(), tree.root(), [tree.root()])


def test_sizes_outside_the_tree_are_refused() -> None:
    tree = MerkleTree(leaves_of(4))
    with pytest.raises(ValueError):
        tree.inclusion_path(4, 4)
    with pytest.raises(ValueError):
        tree.inclusion_path(0, 5)
    with pytest.raises(ValueError):
        tree.inclusion_path(0, 0)
    with pytest.raises(ValueError):
        tree.consistency_proof(3, 2)
    with pytest.raises(ValueError):
        tree.consistency_proof(0, 4)
    with pytest.raises(ValueError):
        tree.append(b"short")
    assert not verify_consistency(0, 4, tree.root(0), tree.root(), [])


def test_proof_length_grows_as_log2_of_the_tree() -> None:
    tree = MerkleTree(leaves_of(1 << 14))
    for size in (2, 3, 100, 1000, 4097, 1 << 14):
        bound = math.ceil(math.log2(size))
        assert max(len(tree.inclusion_path(i, size)) for i in (0, size // 2, size - 1)) <= bound
        assert len(tree.consistency_proof(1, size)) <= bound + 1
