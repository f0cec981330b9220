"""Merkle proof benchmark: what a proof costs as a domain's log grows (engine/core/merkle.py).

For trees of 1K to 1M leaves (random 32-byte leaf hashes; the tree never reads their
content) it times building the tree leaf by leaf, and the median of random inclusion paths,
consistency proofs and their verification, and prints each as a ratio: the cost of one build
step, one proof or one check in units of a single SHA-256 of a node (65 bytes) measured in the
same run, and the proof's cost at each size over its cost at 1K leaves. Proof lengths are
printed beside ceil(log2 n), their bound. Pure Python, no servers. The last line printed is
one JSON object with every figure.

    python bench/merkle.py              # 1K, 16K, 256K, 1M leaves
    python bench/merkle.py --max 65536
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trellis.engine.core.merkle import MerkleTree, verify_consistency, verify_inclusion

SAMPLES = 2000


def median_seconds(work: Callable[[], object], samples: int = SAMPLES) -> float:
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def one_hash() -> float:
    """The median time of one node hash, the unit every figure is given in."""
    left, right = os.urandom(32), os.urandom(32)
    return median_seconds(lambda: hashlib.sha256(b"\x01" + left + right).digest(), 20_000)


def measure(n: int, rng: random.Random) -> dict[str, float]:
    leaves = [rng.randbytes(32) for _ in range(n)]
    started = time.perf_counter()
    tree = MerkleTree(leaves)
    build = (time.perf_counter() - started) / n
    root = tree.root()
    picks = [(rng.randrange(n), rng.randrange(1, n + 1)) for _ in range(SAMPLES)]
    it = iter(picks * 2)

    def inclusion() -> object:
        index, _ = next(it)
        return tree.inclusion_path(index)

    def consistency() -> object:
        _, old = next(it)
        return tree.consistency_proof(old)

    index, old = picks[0]
    path, proof, old_root = tree.inclusion_path(index), tree.consistency_proof(old), tree.root(old)
    return {
        "leaves": n,
        "build_per_leaf_s": build,
        "inclusion_s": median_seconds(inclusion),
        "consistency_s": median_seconds(consistency),
        "verify_inclusion_s": median_seconds(
            lambda: verify_inclusion(leaves[index], index, n, path, root)
        ),
        "verify_consistency_s": median_seconds(
            lambda: verify_consistency(old, n, old_root, root, proof)
        ),
        "max_path": max(len(tree.inclusion_path(i)) for i, _ in picks[:200]),
        "bound": math.ceil(math.log2(n)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=1 << 20, help="the largest tree (leaves)")
    args = parser.parse_args()
    rng = random.Random(7)
    unit = one_hash()
    sizes = [n for n in (1 << 10, 1 << 14, 1 << 18, 1 << 20) if n <= args.max]
    rows = [measure(n, rng) for n in sizes]
    base = rows[0]
    print(f"unit: one SHA-256 node hash, {unit * 1e9:.0f} ns in this run")
    print(
        f"{'leaves':>9} {'build/leaf':>10} {'inclusion':>10} {'consist.':>10} "
        f"{'verify in.':>10} {'verify co.':>10} {'incl. vs 1K':>11} {'path':>5} {'bound':>5}"
    )
    for row in rows:
        print(
            f"{row['leaves']:>9,} {row['build_per_leaf_s'] / unit:>9.1f}h "
            f"{row['inclusion_s'] / unit:>9.1f}h {row['consistency_s'] / unit:>9.1f}h "
            f"{row['verify_inclusion_s'] / unit:>9.1f}h "
            f"{row['verify_consistency_s'] / unit:>9.1f}h "
            f"{row['inclusion_s'] / base['inclusion_s']:>10.2f}x "
            f"{row['max_path']:>5} {row['bound']:>5}"
        )
    print(json.dumps({"unit_s": unit, "rows": rows}))


if __name__ == "__main__":
    main()
