"""The compiled path core and its pure-Python reference agree with networkx and with each other."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import networkx as nx
import pytest
from path_cores import compiled as _compiled

from trellis.ext import _paths_py

HopDistances = Callable[..., list[int]]
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hop_distances(core: SimpleNamespace) -> HopDistances:
    fn: HopDistances = core.hop_distances
    return fn


def to_csr(graph: nx.DiGraph) -> tuple[array[int], array[int]]:
    """CSR of a graph whose nodes are 0..n-1, successors in insertion order."""
    indptr, indices = array("i", [0]), array("i")
    for u in range(graph.number_of_nodes()):
        indices.extend(graph.successors(u))
        indptr.append(len(indices))
    return indptr, indices


def random_graph(seed: int, n: int, p: float, directed: bool) -> nx.DiGraph:
    rng = random.Random(seed)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    for u in range(n):
        for v in range(n):
            if u != v and rng.random() < p:
                graph.add_edge(u, v)
                if not directed:
                    graph.add_edge(v, u)
    return graph


def expected(graph: nx.DiGraph, source: int, max_hops: int) -> list[int]:
    lengths = nx.single_source_shortest_path_length(graph, source, cutoff=max_hops)
    return [lengths.get(v, -1) for v in range(graph.number_of_nodes())]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("directed", [True, False])
def test_matches_networkx_on_random_graphs(
    hop_distances: HopDistances, seed: int, directed: bool
) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    graph = random_graph(seed, n, p=rng.choice([0.02, 0.05, 0.15]), directed=directed)
    indptr, indices = to_csr(graph)
    for source in {0, n - 1, rng.randrange(n)}:
        for max_hops in (0, 1, 2, 3, n):
            assert hop_distances(indptr, indices, source, max_hops) == expected(
                graph, source, max_hops
            )


def test_matches_networkx_on_a_large_sparse_graph(hop_distances: HopDistances) -> None:
    graph = random_graph(seed=99, n=400, p=0.01, directed=True)
    indptr, indices = to_csr(graph)
    assert hop_distances(indptr, indices, 7, 400) == expected(graph, 7, 400)


def test_follows_self_loops_and_parallel_edges_once(hop_distances: HopDistances) -> None:
    # 0 -> 0, 0 -> 1 twice, 1 -> 2; node 3 has no edges in.
    indptr, indices = array("i", [0, 3, 4, 4, 4]), array("i", [0, 1, 1, 2])
    assert hop_distances(indptr, indices, 0, 10) == [0, 1, 2, -1]


def test_marks_nodes_beyond_max_hops_unreachable(hop_distances: HopDistances) -> None:
    chain = array("i", [0, 1, 2, 3, 3]), array("i", [1, 2, 3])
    assert hop_distances(*chain, 0, 0) == [0, -1, -1, -1]
    assert hop_distances(*chain, 0, 2) == [0, 1, 2, -1]
    assert hop_distances(*chain, 0, 2**70) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "convert",
    [list, tuple, lambda a: memoryview(a).toreadonly(), lambda a: array("l", a)],
    ids=["list", "tuple", "readonly-int32-view", "int64-array"],
)
def test_accepts_any_integer_sequence(hop_distances: HopDistances, convert: Callable) -> None:
    indptr, indices = array("i", [0, 1, 2, 2]), array("i", [1, 2])
    assert hop_distances(convert(indptr), convert(indices), 0, 5) == [0, 1, 2]


MALFORMED = {
    "negative max_hops": (([0, 1], [0], 0, -1), "max_hops must be >= 0, got -1"),
    "empty indptr": (([], [], 0, 1), "malformed CSR: indptr is empty, expected n + 1 offsets"),
    "indptr not starting at 0": (([1, 1], [0], 0, 1), "malformed CSR: indptr[0] is 1, expected 0"),
    "indptr end not len(indices)": (
        ([0, 2], [0], 0, 1),
        "malformed CSR: indptr[1] is 2, expected len(indices) = 1",
    ),
    "decreasing indptr": (
        ([0, 2, 1, 2], [0, 1], 0, 1),
        "malformed CSR: indptr decreases at position 2",
    ),
    "index past the last node": (
        ([0, 1, 2], [1, 2], 0, 1),
        r"malformed CSR: indices[1] is 2, not a node id in [0, 2)",
    ),
    "negative index": (
        ([0, 1, 2], [-1, 0], 0, 1),
        r"malformed CSR: indices[0] is -1, not a node id in [0, 2)",
    ),
    "source past the last node": (([0, 0, 0], [], 2, 1), "source 2 is out of range for 2 nodes"),
    "negative source": (([0, 0], [], -1, 1), "source -1 is out of range for 1 nodes"),
    "no nodes": (([0], [], 0, 1), "source 0 is out of range for 0 nodes"),
    "huge source": (([0, 0], [], 2**70, 1), f"source {2**70} is out of range for 1 nodes"),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_rejects_malformed_input_with_the_same_message_in_both(
    case: tuple[tuple[object, ...], str],
) -> None:
    args, message = case
    for module in (_paths_py, _compiled()):
        with pytest.raises(ValueError) as info:
            module.hop_distances(*args)
        assert str(info.value) == message, module.__name__


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (([0, 1], [2**40], 0, 1), OverflowError),
        (([0, 1], [0.5], 0, 1), TypeError),
        (([0, 1], [0], 0.0, 1), TypeError),
        (([0, 1], [0], 0, "1"), TypeError),
    ],
    ids=["index beyond int32", "float index", "float source", "str max_hops"],
)
def test_raises_the_same_conversion_errors(
    hop_distances: HopDistances, args: tuple[object, ...], error: type[Exception]
) -> None:
    with pytest.raises(error):
        hop_distances(*args)


def _implementation_in_subprocess(**env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", "import trellis.ext as ext; print(ext.IMPLEMENTATION)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, **env},
    )
    return result.stdout.strip()


def test_selector_honours_trellis_pure_python() -> None:
    assert _implementation_in_subprocess(TRELLIS_PURE_PYTHON="1") == "python"


def test_selector_prefers_the_compiled_module() -> None:
    _compiled()
    assert _implementation_in_subprocess(TRELLIS_PURE_PYTHON="") == "cython"


def test_selector_falls_back_to_the_reference_with_a_warning_naming_the_reason() -> None:
    # A None entry in sys.modules makes importing ext._paths_c raise ImportError, as a missing
    # build would.
    code = (
        "import sys, warnings\n"
        "sys.modules['trellis.ext._paths_c'] = None\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import trellis.ext as ext\n"
        "print(ext.IMPLEMENTATION)\n"
        "print(caught[0].category.__name__, caught[0].message)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "TRELLIS_PURE_PYTHON": ""},
    )
    implementation, warning = result.stdout.strip().splitlines()
    assert implementation == "python"
    assert warning.startswith("RuntimeWarning trellis: compiled path core unavailable (")
    assert "trellis.ext._paths_c" in warning
