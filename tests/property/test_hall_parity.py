"""The compiled core's few-target checks against the reference on small halls shaped like
bench/fabrics.py's: pods of racks behind two pod OCS, pods joined through core OCS, so a path
crosses up to three OCS. These are the searches the lower bounds, the deepening rounds and
the OCS fan-out's per-round exit lists serve (one to a few targets, with and without hop and
latency bounds, the host's own circuits and others'), and their answers must be the
reference's exactly."""

from __future__ import annotations

import random
from typing import Any

import pytest
from path_cores import compiled

from trellis.ext import Conditions, LinkInfo, NodeInfo, PathError, PathRequest, _paths_py

TENANTS = ["t0", "t1", "t2"]


def hall(seed: int) -> tuple[dict[str, NodeInfo], list[LinkInfo], Conditions, list[str], list[str]]:
    rng = random.Random(seed)
    nodes: dict[str, NodeInfo] = {}
    links: list[LinkInfo] = []
    ports: dict[str, int] = {}
    hosts: list[str] = []
    devices: list[str] = []

    def node(name: str, kind: str, latency: int = 0) -> str:
        nodes[name] = NodeInfo(kind, latency)
        if kind == "ocs":
            ports[name] = 0
        return name

    def port(n: str) -> int | None:
        if nodes[n].kind != "ocs":
            return None
        ports[n] += 1
        return ports[n] - 1

    def link(a: str, b: str, gbps: float = 100.0) -> None:
        links.append(
            LinkInfo(f"l{len(links):04d}", a, b, gbps, rng.choice([2, 5, 9]), port(a), port(b))
        )

    cores = [node(f"core{c}", "ocs", 7) for c in range(2)]
    for p in range(3):
        ocses = [node(f"p{p}-ocs{o}", "ocs", 5) for o in range(2)]
        for r in range(2):
            spines = [node(f"p{p}-r{r}-spine{s}", "switch", 3) for s in range(2)]
            for h in range(2):
                host = node(f"p{p}-r{r}-host{h}", "host")
                hosts.append(host)
                for spine in spines:
                    link(host, spine)
            for spine in spines:
                for ocs in ocses:
                    for _ in range(2):
                        link(spine, ocs)
            for leaf_no in range(2):
                leaf = node(f"p{p}-r{r}-leaf{leaf_no}", "switch", 2)
                for spine in spines:
                    link(spine, leaf)
                for d in range(3):
                    devices.append(node(f"{leaf}-d{d}", "device"))
                    link(leaf, devices[-1], rng.choice([50.0, 100.0]))
        for o, ocs in enumerate(ocses):
            for t in range(2):
                link(ocs, cores[(o + t) % 2])
            devices.append(node(f"{ocs}-mem", "device"))
            link(devices[-1], ocs)
    for core in cores:
        devices.append(node(f"{core}-mem", "device"))
        link(devices[-1], core)

    circuits: dict[str, tuple[int, str]] = {}
    for ocs, used in ports.items():
        free = list(range(used))
        rng.shuffle(free)
        for a, b in zip(free[0:4:2], free[1:4:2], strict=True):
            owner = rng.choice(hosts)
            circuits[f"{ocs}:{a}"] = (b, owner)
            circuits[f"{ocs}:{b}"] = (a, owner)
    switches = [n for n, info in nodes.items() if info.kind == "switch"]
    cond = Conditions(
        unusable=set(rng.sample([lk.id for lk in links], len(links) // 25)),
        reserved_gbps={
            lk.id: rng.choice([40.0, 80.0]) for lk in rng.sample(links, len(links) // 5)
        },
        circuits=circuits,
        switch_tenants={s: {rng.choice(TENANTS): 1} for s in rng.sample(switches, 4)},
        exclusive_tenants={s: {rng.choice(TENANTS): 1} for s in rng.sample(switches, 2)},
    )
    return nodes, links, cond, hosts, devices


def cores(nodes: dict[str, NodeInfo], links: list[LinkInfo], cond: Conditions) -> Any:
    """The compiled core's module, the reference's fabric, the compiled fabric and its
    LiveConditions for one hall."""
    C = compiled()
    c_fabric = C.Fabric(nodes, links)
    live = compiled("_live_c").LiveConditions(c_fabric, cond)
    return C, _paths_py.Fabric(nodes, links), c_fabric, live


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except PathError as exc:
        return ("PathError", str(exc))


@pytest.mark.parametrize("seed", range(12))
def test_few_target_checks_across_pods_match_the_reference(seed: int) -> None:
    nodes, links, cond, hosts, devices = hall(seed)
    C, py_fabric, c_fabric, live = cores(nodes, links, cond)
    rng = random.Random(seed + 1000)
    for _ in range(40):
        request = PathRequest(
            rng.choice(hosts),
            rng.choice(TENANTS),
            exclusive=rng.random() < 0.2,
            max_hops=rng.choice([None, None, 6, 8, 10]),
            max_latency_ns=rng.choice([None, None, 40, 60, 90]),
            bandwidth_gbps=rng.choice([0.0, 0.0, 60.0]),
            isolation=rng.random() < 0.8,
        )
        targets = set(rng.sample(devices, rng.choice([1, 1, 2, 3])))
        expected = outcome(_paths_py.best_paths, py_fabric, cond, request, targets)
        assert outcome(C.best_paths, c_fabric, live, request, targets) == expected, request
        assert outcome(C.best_paths, c_fabric, cond, request, targets) == expected, request


@pytest.mark.parametrize("seed", range(6))
def test_latency_bounds_swept_across_the_best_latency_match_the_reference(seed: int) -> None:
    """Every latency bound from below the shortest relaxed path to above the best one: the
    compiled core first asks whether any target is within the bound (two Dijkstras that meet
    half way) and must refuse exactly where the reference finds nothing."""
    nodes, links, cond, hosts, devices = hall(seed)
    C, py_fabric, c_fabric, live = cores(nodes, links, cond)
    rng = random.Random(seed + 2000)
    swept = 0
    while swept < 3:
        host, tenant = rng.choice(hosts), rng.choice(TENANTS)
        targets = set(rng.sample(devices, rng.choice([1, 2])))
        free = PathRequest(host, tenant)
        best = outcome(_paths_py.best_paths, py_fabric, cond, free, targets)
        if not isinstance(best, dict) or not best:
            continue
        swept += 1
        most = max(path.latency_ns for path in best.values())
        found_at = []
        for bound in range(0, most + 3):
            request = PathRequest(host, tenant, max_latency_ns=bound)
            expected = outcome(_paths_py.best_paths, py_fabric, cond, request, targets)
            assert outcome(C.best_paths, c_fabric, live, request, targets) == expected, request
            found_at.append(bool(expected))
        assert not found_at[0] and found_at[-1]  # the sweep crossed the boundary


def test_a_target_beyond_the_latency_or_hop_bound_is_refused_before_any_search() -> None:
    """Refusals the bounds prove need no label-setting round: a latency bound no path can
    meet (the two Dijkstras meet nowhere within it), and a max_hops below the host's lower
    bound (the BFS stops at max_hops)."""
    nodes, links, *_ = hall(0)
    cond = Conditions()  # no faults, reservations or circuits: only the bounds refuse
    C, py_fabric, c_fabric, live = cores(nodes, links, cond)
    host = "p0-r0-host0"
    far = {"p2-r1-leaf1-d2"}  # another pod: through the pod OCS, a core OCS, the pod OCS
    reachable = PathRequest(host, "t0")
    assert C.best_paths(c_fabric, live, reachable, far) == _paths_py.best_paths(
        py_fabric, cond, reachable, far
    )
    assert c_fabric.last_rounds >= 1
    for request in (
        PathRequest(host, "t0", max_latency_ns=20),
        PathRequest(host, "t0", max_hops=4),
        PathRequest(host, "t0", max_hops=4, max_latency_ns=20),
    ):
        assert _paths_py.best_paths(py_fabric, cond, request, far) == {}
        assert C.best_paths(c_fabric, live, request, far) == {}, request
        assert c_fabric.last_rounds == 0, request


def test_a_target_just_beyond_max_hops_is_refused_from_both_ends() -> None:
    """A target in another pod is 10 hops away. Every max_hops below that is refused without
    a search round: the host's few hops and the target's few meet nowhere within it. (The
    bounds from the target alone proved it only up to 6; 7 to 9 took a round.) At 10 the path
    is found, as the reference finds it."""
    nodes, links, *_ = hall(0)
    cond = Conditions()
    C, py_fabric, c_fabric, live = cores(nodes, links, cond)
    host, far = "p0-r0-host0", {"p2-r1-leaf1-d2"}
    found = PathRequest(host, "t0", max_hops=10)
    assert (
        C.best_paths(c_fabric, live, found, far)
        == _paths_py.best_paths(py_fabric, cond, found, far)
        != {}
    )
    for max_hops in range(3, 10):
        request = PathRequest(host, "t0", max_hops=max_hops)
        assert _paths_py.best_paths(py_fabric, cond, request, far) == {}
        assert C.best_paths(c_fabric, live, request, far) == {}, request
        assert c_fabric.last_rounds == 0, request
