"""The compiled path core gives the reference's answers on random fabrics (hypothesis).

Random fabrics have hosts, switches, OCS with few ports (so circuits collide), devices, parallel
cables, faults and drains, reservations, circuits of the searching host and of others (some
one-sided, some to ports without a cable), and switch tenancy, shared and exclusive. Random
requests vary host (sometimes no host, or an unusable one), tenant, bounds, bandwidth,
exclusivity and isolation. Both cores must return the same paths, devices, tie-breaks and
errors, from a snapshot, from live conditions fed change by change, and after a rollback; and
the engine must decide the same events (funnels included) on either core.
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from core.fabric_builder import NOW, FabricBuilder, apply, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from path_cores import implementation

import trellis.engine.core.placement as placement
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import Compose, Release, ReportFault
from trellis.ext import Conditions, DeviceInfo, LinkInfo, NodeInfo, PathRequest, Selector
from trellis.ext._paths_py import selected

PY = implementation("python")
C = implementation("cython")

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TENANTS = ("t", "u", "v")


class World(msgspec.Struct):
    nodes: dict[str, NodeInfo]
    links: list[LinkInfo]
    hosts: list[str]
    switches: list[str]
    ocses: list[str]
    devices: list[str]
    ports: dict[str, list[int]]  # ocs -> ports with a cable


def ids(draw: st.DrawFn, prefix: str, count: int, taken: set[str]) -> list[str]:
    """Ids whose string order differs from their number order (s10 < s2)."""
    out = []
    while len(out) < count:
        candidate = f"{prefix}{draw(st.integers(0, 30))}"
        if candidate not in taken:
            taken.add(candidate)
            out.append(candidate)
    return out


@st.composite
def worlds(draw: st.DrawFn) -> World:
    taken: set[str] = set()
    hosts = ids(draw, "h", draw(st.integers(1, 3)), taken)
    switches = ids(draw, "s", draw(st.integers(0, 6)), taken)
    ocses = ids(draw, "o", draw(st.sampled_from([0, 1, 1, 2, 2, 3])), taken)
    devices = ids(draw, "d", draw(st.integers(1, 8)), taken)
    nodes: dict[str, NodeInfo] = {}
    for h in hosts:
        nodes[h] = NodeInfo("host")
    for s in switches:
        nodes[s] = NodeInfo("switch", draw(st.sampled_from([0, 0, 5, 10])))
    for o in ocses:
        nodes[o] = NodeInfo("ocs", draw(st.sampled_from([0, 3])))
    for d in devices:
        nodes[d] = NodeInfo("device")
    # Dense mode: OCS with more ports and two cables from each host and switch, so equal node
    # sequences through an OCS differ in circuits (new or reused) and in links.
    dense = bool(ocses) and draw(st.integers(0, 2)) == 0
    free = {o: list(range(draw(st.integers(6, 10) if dense else st.integers(2, 6)))) for o in ocses}
    inner = hosts + switches + ocses
    everything = list(nodes)
    links: list[LinkInfo] = []
    link_ids: set[str] = set(nodes)  # nodes and links share one namespace

    def cable(a: str, b: str) -> None:
        if a == b or any(not free[x] for x in (a, b) if x in free):
            return
        ports = []
        for end in (a, b):
            if end in free:
                ports.append(free[end].pop(draw(st.integers(0, len(free[end]) - 1))))
            else:
                ports.append(None)
        (link_id,) = ids(draw, "l", 1, link_ids)
        links.append(
            LinkInfo(
                link_id,
                a,
                b,
                draw(st.sampled_from([50.0, 100.0, 100.0, 200.0])),
                draw(st.sampled_from([0, 0, 1, 5, 20])),
                ports[0],
                ports[1],
            )
        )

    # A backbone that usually connects, devices on switches or OCS, then random extra cables
    # (parallel ones, device-device, host-host, OCS-OCS included).
    core = switches + ocses
    for i, node in enumerate(core[1:], start=1):  # a tree over switches and OCS
        cable(node, draw(st.sampled_from(core[:i])))
    for h in hosts:
        if core:
            cable(h, draw(st.sampled_from(core)))
    for o in ocses:  # several cables per OCS, often from the same node
        for _ in range(draw(st.integers(1, 4))):
            cable(draw(st.sampled_from(hosts + switches * 2)), o)
        if dense:
            for node in hosts[:1] + switches[:2]:
                cable(node, o)
                cable(node, o)
    for d in devices:
        cable(d, draw(st.sampled_from(core or hosts)))
    for _ in range(draw(st.integers(0, 12))):
        cable(draw(st.sampled_from(inner)), draw(st.sampled_from(everything)))
    # Parallel cables, so equal node sequences differ in links and circuits.
    for _ in range(draw(st.integers(0, 4))):
        if links:
            twin = draw(st.sampled_from(links))
            cable(twin.a, twin.b)
    ports = {
        o: sorted(
            p for lk in links for end, p in ((lk.a, lk.a_port), (lk.b, lk.b_port)) if end == o
        )
        for o in ocses
    }
    return World(nodes, links, hosts, switches, ocses, devices, ports)


@st.composite
def conditions(draw: st.DrawFn, world: World, host: str) -> Conditions:
    components = [*world.nodes, *(lk.id for lk in world.links)]
    unusable = set(draw(st.lists(st.sampled_from(components), max_size=2)))
    reserved = {
        lk.id: draw(st.sampled_from([0.0, 25.0, 50.0, 0.1 + 0.2, 49.7]))
        for lk in world.links
        if draw(st.integers(0, 2)) == 0
    }
    circuits: dict[str, tuple[int, str]] = {}
    owners = [host, host, *world.hosts, "elsewhere"]  # mostly the searching host's
    for o in world.ocses:
        cabled = world.ports[o]
        order = draw(st.permutations(cabled))
        pairs = draw(st.integers(0, len(cabled) // 2))
        for a, b in zip(order[0 : 2 * pairs : 2], order[1 : 2 * pairs : 2], strict=True):
            owner = draw(st.sampled_from(owners))
            circuits[f"{o}:{a}"] = (b, owner)
            if draw(st.integers(0, 9)):  # now and then only one side is recorded
                circuits[f"{o}:{b}"] = (a, owner)
        if cabled and draw(st.integers(0, 19)) == 0:  # a circuit to a port without a cable
            circuits[f"{o}:{draw(st.sampled_from(cabled))}"] = (99, draw(st.sampled_from(owners)))
    nodes = world.switches + world.ocses
    tenancy = (
        st.dictionaries(
            st.sampled_from(nodes),
            st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 2), max_size=2),
            max_size=3,
        )
        if nodes
        else st.just({})
    )
    return Conditions(
        unusable=unusable,
        reserved_gbps=reserved,
        circuits=circuits,
        switch_tenants=draw(tenancy),
        exclusive_tenants=draw(tenancy),
    )


@st.composite
def requests(draw: st.DrawFn, world: World) -> PathRequest:
    host = (
        draw(st.sampled_from(world.hosts))
        if draw(st.integers(0, 19))
        else draw(st.sampled_from([*world.nodes, "nowhere"]))
    )
    return PathRequest(
        host,
        draw(st.sampled_from(TENANTS)),
        exclusive=draw(st.integers(0, 3)) == 0,
        max_hops=draw(st.sampled_from([None] * 12 + [0, 2, 3, 4, 5, 6])),
        max_latency_ns=draw(st.sampled_from([None] * 12 + [0, 5, 12, 30, 60])),
        bandwidth_gbps=draw(st.sampled_from([0.0] * 8 + [25.0, 50.0, 50.3, 100.0])),
        isolation=draw(st.sampled_from([True, True, False])),
    )


@st.composite
def problems(draw: st.DrawFn) -> tuple[World, Conditions, PathRequest, set[str]]:
    world = draw(worlds())
    everything = [*world.nodes, "nowhere"]
    targets = (
        set(world.devices)
        if draw(st.integers(0, 3))
        else set(draw(st.lists(st.sampled_from(everything), max_size=6)))
    )
    request = draw(requests(world))
    return world, draw(conditions(world, request.host)), request, targets


def outcome(fn: Any, *args: Any) -> Any:
    """What a call returns, or the type and arguments of what it raises."""
    try:
        return fn(*args)
    except (ValueError, KeyError) as exc:
        return (type(exc), exc.args)


def apply_changes(live: Any, cond: Conditions) -> None:
    """Feed a snapshot into live conditions one change at a time."""
    for component in sorted(cond.unusable):
        # A snapshot may name what the fabric lacks; the search ignores it.
        with contextlib.suppress(KeyError):
            live.set_usable(component, False)
    for link, gbps in cond.reserved_gbps.items():
        live.reserve(link, gbps / 2)
        live.reserve(link, gbps - gbps / 2)
        live.set_reserved(link, gbps)  # the sum of halves may differ in the last bit
    for key, (other, owner) in cond.circuits.items():
        ocs, _, port = key.rpartition(":")
        live.set_circuit(ocs, int(port), other, owner)
    for switch, tenants in cond.switch_tenants.items():
        live.set_switch_tenants(switch, tenants)
    for switch, tenants in cond.exclusive_tenants.items():
        live.set_exclusive_tenants(switch, tenants)


@SETTINGS
@given(problems())
def test_both_cores_find_the_same_best_paths(
    problem: tuple[World, Conditions, PathRequest, set[str]],
) -> None:
    world, cond, request, targets = problem
    fabrics = [impl.Fabric(world.nodes, world.links) for impl in (PY, C)]
    expected = outcome(PY.best_paths, fabrics[0], cond, request, targets)
    assert outcome(C.best_paths, fabrics[1], cond, request, targets) == expected
    # best_costs is best_paths' (hops, latency) per device, on both cores.
    costs = (
        {d: (p.hops, p.latency_ns) for d, p in expected.items()}
        if isinstance(expected, dict)
        else expected
    )
    for impl, fabric in zip((PY, C), fabrics, strict=True):
        assert outcome(impl.best_costs, fabric, cond, request, targets) == costs, impl.name
    # The same from live conditions built empty and fed change by change.
    for impl, fabric in zip((PY, C), fabrics, strict=True):
        live = impl.LiveConditions(fabric)
        apply_changes(live, cond)
        assert outcome(impl.best_paths, fabric, live, request, targets) == expected, impl.name
        assert_same_reach(fabrics[0], cond, impl, fabric, live, request, targets)


def assert_same_reach(
    py_fabric: Any,
    cond: Conditions,
    impl: Any,
    fabric: Any,
    live: Any,
    request: PathRequest,
    targets: Any,
) -> None:
    """`reachable` counts what the reference's best_costs finds, for the request as it is and
    without bounds (where the compiled core answers by a BFS), with and without isolation."""
    unbounded = request._replace(max_hops=None, max_latency_ns=None)
    for asked in (request, unbounded, unbounded._replace(isolation=False)):
        costs = outcome(PY.best_costs, py_fabric, cond, asked, targets)
        count = len(costs) if isinstance(costs, dict) else costs
        assert outcome(impl.reachable, fabric, live, asked, targets) == count, (impl.name, asked)


@SETTINGS
@given(problems(), st.data())
def test_both_cores_choose_the_same_devices(
    problem: tuple[World, Conditions, PathRequest, set[str]], data: st.DataObject
) -> None:
    world, cond, request, _ = problem
    ranked = {
        d: data.draw(st.integers(0, 2))
        for d in data.draw(st.lists(st.sampled_from(world.devices), unique=True))
    }
    n = data.draw(st.integers(0, 4))
    fabrics = [impl.Fabric(world.nodes, world.links) for impl in (PY, C)]
    expected = outcome(PY.best_devices, fabrics[0], cond, request, ranked, n)
    live = C.LiveConditions(fabrics[1], cond) if data.draw(st.booleans()) else cond
    got = outcome(C.best_devices, fabrics[1], live, request, ranked, n)
    if isinstance(expected, tuple) and expected[0] is KeyError:
        # A dangling circuit (never built by the engine) raises when the search reaches it;
        # the compiled choice may stop before it does.
        assert got == expected or isinstance(got, list)
    else:
        assert got == expected


@SETTINGS
@given(problems(), st.data())
def test_a_rollback_restores_every_answer(
    problem: tuple[World, Conditions, PathRequest, set[str]], data: st.DataObject
) -> None:
    world, cond, request, targets = problem
    links = [lk.id for lk in world.links]
    components = [*world.nodes, *links]
    for impl in (PY, C):
        fabric = impl.Fabric(world.nodes, world.links)
        live = impl.LiveConditions(fabric, cond)
        before = outcome(impl.best_paths, fabric, live, request, targets)
        outer = live.checkpoint()
        for step in data.draw(st.lists(st.integers(0, 5), max_size=8)):
            if step == 0:
                live.set_usable(data.draw(st.sampled_from(components)), data.draw(st.booleans()))
            elif step == 1 and links:
                live.reserve(data.draw(st.sampled_from(links)), 30.0)
            elif step == 2 and world.ocses:
                o = data.draw(st.sampled_from(world.ocses))
                live.add_circuit(o, 0, 1, data.draw(st.sampled_from(world.hosts)))
            elif step == 3 and world.ocses:
                live.clear_circuit(data.draw(st.sampled_from(world.ocses)), 0)
            elif step == 4 and world.switches:
                live.hold_switch(
                    data.draw(st.sampled_from(world.switches)), "u", data.draw(st.booleans())
                )
            elif step == 5:
                inner = live.checkpoint()
                live.set_usable(
                    request.host if request.host in world.nodes else components[0], False
                )
                live.rollback(inner)
        live.rollback(outer)
        assert outcome(impl.best_paths, fabric, live, request, targets) == before, impl.name
    with pytest.raises(ValueError, match="rollback without a checkpoint"):
        live.rollback(0)


KINDS = ("gpu", "memory", "nic")
MODELS = ("A", "B", "C")


def device_infos(
    draw: Any, devices: list[str], kinds: tuple[str, ...] = KINDS
) -> dict[str, DeviceInfo]:
    """Attributes for most devices (some get none: no selector takes them). `draw` picks one
    of a sequence (hypothesis' sampled_from or random.choice)."""
    infos = {}
    for d in devices:
        if draw((True, True, True, False)):
            infos[d] = DeviceInfo(
                draw(kinds),
                draw(MODELS),
                draw((0, 1, 2, 3)),
                draw((0.0, 40.0, 80.0)),
                draw((0.0, 64.0, 100.0)),
                draw((0, 1, 2)),
                draw(({}, {}, {"rack": "r1"}, {"rack": "r2", "row": "x"}, {"row": "x"})),
            )
    return infos


def selectors(draw: Any) -> Selector:
    return Selector(
        draw((*KINDS, "nvme")),
        draw(((), (), ("A",), ("B", "C"), ("Z",))),
        draw((None, None, 1, 3, 9)),
        draw((None, None, 40.0, 80.5)),
        draw((None, None, 30.0, 64.0, 100.0)),
        draw(({}, {}, {"rack": "r1"}, {"row": "x"}, {"rack": "r2", "row": "x"}, {"no": "x"})),
    )


def device_conditions(draw: Any, cond: Conditions, devices: list[str]) -> Conditions:
    taken = {d for d in devices if draw((False, False, True))}
    sliced = {d: draw((10.0, 36.0, 64.0)) for d in devices if draw((False, False, True))}
    return cond._replace(taken=taken, sliced_gib=sliced)


@SETTINGS
@given(problems(), st.data())
def test_both_cores_choose_the_same_devices_by_selector(
    problem: tuple[World, Conditions, PathRequest, set[str]], data: st.DataObject
) -> None:
    world, cond, request, _ = problem

    def pick(options: Any) -> Any:
        return data.draw(st.sampled_from(options))

    infos = device_infos(pick, world.devices)
    cond = device_conditions(pick, cond, world.devices)
    selector = selectors(pick)
    n = data.draw(st.integers(0, 4))
    py_fabric = PY.Fabric(world.nodes, world.links, infos)
    c_fabric = C.Fabric(world.nodes, world.links, infos)
    expected = outcome(PY.best_devices, py_fabric, cond, request, selector, n)
    # The selector means its candidate map, ranks included.
    ranked = selected(infos, cond.taken, cond.sliced_gib, selector)
    assert outcome(PY.best_devices, py_fabric, cond, request, ranked, n) == expected
    got = outcome(C.best_devices, c_fabric, cond, request, selector, n)
    # The funnel's reads of a selector: its counts, and its devices' best (hops, latency).
    assert C.census(c_fabric, cond, selector) == PY.census(py_fabric, cond, selector)
    costs = outcome(PY.best_costs, py_fabric, cond, request, selector)
    assert costs == outcome(PY.best_costs, py_fabric, cond, request, set(ranked))
    if isinstance(expected, tuple) and expected[0] is KeyError:
        assert got == expected or isinstance(got, list)  # as in the ranked choice above
        return
    assert got == expected
    assert outcome(C.best_costs, c_fabric, cond, request, selector) == costs
    # And from live conditions fed change by change, on both cores.
    for impl, fabric in ((PY, py_fabric), (C, c_fabric)):
        live = impl.LiveConditions(fabric)
        apply_changes(live, cond)
        for d in world.devices:
            live.set_taken(d, True)
            live.set_sliced(d, 5.0)
            live.set_taken(d, d in cond.taken)
            live.set_sliced(d, cond.sliced_gib.get(d, 0.0))
        assert outcome(impl.best_devices, fabric, live, request, selector, n) == expected
        assert_same_reach(py_fabric, cond, impl, fabric, live, request, selector)


def test_a_rollback_restores_taken_and_sliced_devices(core: SimpleNamespace) -> None:
    nodes = {"h": NodeInfo("host"), "s": NodeInfo("switch"), "m": NodeInfo("device")}
    nodes |= {"g": NodeInfo("device")}
    links = [LinkInfo("l1", "h", "s", 100.0), LinkInfo("l2", "s", "m", 100.0)]
    links += [LinkInfo("l3", "s", "g", 100.0)]
    infos = {"m": DeviceInfo("memory", capacity_gib=100.0), "g": DeviceInfo("gpu")}
    fabric = core.Fabric(nodes, links, infos)
    live = core.LiveConditions(fabric)
    request = PathRequest("h", "t")
    memory, gpu = Selector("memory", slice_gib=64.0), Selector("gpu")
    assert [p.device for p in core.best_devices(fabric, live, request, memory)] == ["m"]
    mark = live.checkpoint()
    live.set_sliced("m", 40.0)
    live.set_taken("g", True)
    assert core.best_devices(fabric, live, request, memory) == []
    assert core.best_devices(fabric, live, request, gpu) == []
    live.rollback(mark)
    assert [p.device for p in core.best_devices(fabric, live, request, memory)] == ["m"]
    assert [p.device for p in core.best_devices(fabric, live, request, gpu)] == ["g"]
    with pytest.raises(KeyError):
        live.set_taken("ghost", True)
    with pytest.raises(KeyError):
        live.set_sliced("ghost", 1.0)


def medium_problem(
    seed: int, devices: tuple[int, int] = (8, 25)
) -> tuple[World, Conditions, list[PathRequest]]:
    """A denser fabric than hypothesis draws: more OCS ports, cables, circuits and ties."""
    rng = random.Random(seed)
    hosts = [f"h{i}" for i in rng.sample(range(40), rng.randint(2, 4))]
    switches = [f"s{i}" for i in rng.sample(range(40), rng.randint(3, 9))]
    ocses = [f"o{i}" for i in rng.sample(range(9), rng.randint(1, 3))]
    pool = rng.randint(*devices)
    device_ids = [f"d{i}" for i in rng.sample(range(max(90, 2 * pool)), pool)]
    nodes = {h: NodeInfo("host") for h in hosts}
    nodes |= {s: NodeInfo("switch", rng.choice([0, 0, 5])) for s in switches}
    nodes |= {o: NodeInfo("ocs", rng.choice([0, 3])) for o in ocses}
    nodes |= {d: NodeInfo("device") for d in device_ids}
    free = {o: list(range(rng.randint(6, 16))) for o in ocses}
    links: list[LinkInfo] = []
    link_ids: set[str] = set()
    latencies = [0] if seed % 2 else [0, 0, 1, 5]  # uniform latency: ties everywhere

    def cable(a: str, b: str) -> None:
        if a == b or any(not free[x] for x in (a, b) if x in free):
            return
        ports = [free[x].pop(rng.randrange(len(free[x]))) if x in free else None for x in (a, b)]
        link_id = f"l{rng.randrange(10**6):06d}"
        while link_id in link_ids:  # many cables: draw again rather than collide
            link_id = f"l{rng.randrange(10**6):06d}"
        link_ids.add(link_id)
        links.append(
            LinkInfo(
                link_id,
                a,
                b,
                rng.choice([50.0, 100.0]),
                rng.choice(latencies),
                ports[0],
                ports[1],
            )
        )

    inner = switches + ocses
    for i, node in enumerate(inner[1:], start=1):
        cable(node, rng.choice(inner[:i]))
    for node in hosts + switches:
        for o in ocses:
            for _ in range(rng.choice([0, 1, 2])):
                cable(node, o)
        cable(node, rng.choice(switches))
    for d in device_ids:
        cable(d, rng.choice(inner))
    for _ in range(rng.randint(0, 10)):
        cable(rng.choice(inner), rng.choice(list(nodes)))
    circuits: dict[str, tuple[int, str]] = {}
    for o in ocses:
        cabled = sorted(
            p for lk in links for x, p in ((lk.a, lk.a_port), (lk.b, lk.b_port)) if x == o
        )
        rng.shuffle(cabled)
        for a, b in zip(cabled[0:8:2], cabled[1:8:2], strict=False):
            # Mostly hosts[0]'s, the host most requests search from: reuse is forced there.
            owner = hosts[0] if rng.random() < 0.6 else rng.choice([*hosts, "elsewhere"])
            circuits[f"{o}:{a}"] = (b, owner)
            circuits[f"{o}:{b}"] = (a, owner)
    components = [*nodes, *(lk.id for lk in links)]
    cond = Conditions(
        unusable=set(rng.sample(components, rng.randint(0, 3))),
        reserved_gbps={
            lk.id: rng.choice([25.0, 50.0]) for lk in rng.sample(links, len(links) // 5)
        },
        circuits=circuits,
        switch_tenants={s: {rng.choice(TENANTS): 1} for s in rng.sample(switches, 2)},
        exclusive_tenants={s: {rng.choice(TENANTS): 1} for s in rng.sample(switches, 1)},
    )
    requests = [
        PathRequest(
            hosts[0] if rng.random() < 0.7 else rng.choice(hosts),
            rng.choice(TENANTS),
            exclusive=rng.random() < 0.2,
            max_hops=rng.choice([None, None, None, 4, 6]),
            max_latency_ns=rng.choice([None, None, None, 8, 15, 40]),
            bandwidth_gbps=rng.choice([0.0, 0.0, 40.0]),
            isolation=rng.random() < 0.9,
        )
        for _ in range(12)
    ]
    ports = {o: [] for o in ocses}
    return World(nodes, links, hosts, switches, ocses, device_ids, ports), cond, requests


@pytest.mark.parametrize("seed", range(12))
def test_reachable_by_selector_follows_each_change_and_rollback(seed: int) -> None:
    """With more than 64 devices a selector may take, the compiled core's BFS counts its
    leaf devices (one cable, on no OCS port) per node they hang from, and census its devices
    per (kind, model), from tallies kept as devices, cables and bandwidth change and as a
    rollback undoes changes: reachable and census agree with the reference after every
    step."""
    world, cond, requests = medium_problem(seed, devices=(100, 160))
    rng = random.Random(seed)
    infos = {
        d: DeviceInfo(
            rng.choice(("gpu", "gpu", "gpu", "nic")),
            rng.choice(("A", "B")),
            rng.choice((1, 2, 3)),
            labels=rng.choice(({}, {}, {"rack": "r1"})),
        )
        for d in world.devices
        if rng.random() < 0.95
    }
    selectors = [
        Selector("gpu"),  # each (kind, model) taken whole: the tallies answer
        Selector("gpu", ("B",)),
        Selector("gpu", min_generation=1),
        Selector("gpu", min_generation=2),  # some of a model: each device is tested
        Selector("gpu", labels={"rack": "r1"}),
    ]
    cond = cond._replace(taken={d for d in world.devices if rng.random() < 0.2})
    fabrics = (
        PY.Fabric(world.nodes, world.links, infos),
        C.Fabric(world.nodes, world.links, infos),
    )
    lives = [
        impl.LiveConditions(fabric, cond) for impl, fabric in zip((PY, C), fabrics, strict=True)
    ]
    links = [lk.id for lk in world.links]
    components = [*world.nodes, *links]

    def same_reach() -> None:
        for selector in selectors:
            census = PY.census(fabrics[0], lives[0], selector)
            assert C.census(fabrics[1], lives[1], selector) == census, selector
        for request in requests[:3]:
            unbounded = request._replace(max_hops=None, max_latency_ns=None, bandwidth_gbps=0.0)
            for asked in (unbounded, unbounded._replace(isolation=False)):
                for selector in selectors:
                    costs = outcome(PY.best_costs, fabrics[0], lives[0], asked, selector)
                    count = len(costs) if isinstance(costs, dict) else costs
                    got = outcome(C.reachable, fabrics[1], lives[1], asked, selector)
                    assert got == count, (asked, selector)

    same_reach()
    marks: list[list[int]] = []
    for _ in range(30):
        step = rng.randrange(6)
        if step == 4:
            marks.append([live.checkpoint() for live in lives])
            continue
        if step == 5:
            if marks:
                for live, mark in zip(lives, marks.pop(), strict=True):
                    live.rollback(mark)
                same_reach()
            continue
        change: tuple[Any, ...]
        if step == 0:
            change = ("set_usable", rng.choice(components), rng.random() < 0.5)
        elif step == 1:
            change = ("reserve", rng.choice(links), rng.choice((30.0, 500.0)))  # 500: overdrawn
        elif step == 2:
            change = ("set_reserved", rng.choice(links), 0.0)
        else:
            change = ("set_taken", rng.choice(world.devices), rng.random() < 0.5)
        for live in lives:
            getattr(live, change[0])(*change[1:])
        same_reach()
    while marks:
        for live, mark in zip(lives, marks.pop(), strict=True):
            live.rollback(mark)
    same_reach()


def hall_problem(seed: int) -> tuple[World, dict[str, DeviceInfo], dict[str, int]]:
    """A small hall as bench/fabrics.py builds a large one: pods of spines and leaves, hosts
    on the spines, spines cabled twice to two of three OCS, trunks between the OCS, leaf
    devices under the leaves and port devices on the OCS, and one host on an OCS. Every
    device hangs as a leaf or from one OCS port, so the compiled core keeps its region index.
    Returns the world, the devices' infos, and each OCS's next free port."""
    rng = random.Random(seed)
    nodes: dict[str, NodeInfo] = {}
    links: list[LinkInfo] = []
    ocses = ["o0", "o1", "o2"]
    next_port = dict.fromkeys(ocses, 0)
    hosts: list[str] = []
    switches: list[str] = []
    devices: list[str] = []

    def add(node: str, kind: str, into: list[str]) -> str:
        nodes[node] = NodeInfo(kind)
        into.append(node)
        return node

    def cable(a: str, b: str) -> None:
        ports = [next_port.get(a), next_port.get(b)]
        for end in (a, b):
            if end in next_port:
                next_port[end] += 1
        lat = rng.choice([1, 2, 5])
        links.append(LinkInfo(f"l{len(links):04d}", a, b, 100.0, lat, ports[0], ports[1]))

    for o in ocses:
        add(o, "ocs", [])
    for p in range(3):
        spines = [add(f"p{p}s{i}", "switch", switches) for i in range(2)]
        leaves = [add(f"p{p}l{i}", "switch", switches) for i in range(4)]
        for spine in spines:
            for leaf in leaves:
                cable(spine, leaf)
            for o in rng.sample(ocses, 2):
                cable(spine, o)
                cable(spine, o)
        for h in range(2):
            host = add(f"p{p}h{h}", "host", hosts)
            for spine in spines:
                cable(host, spine)
        for leaf in leaves:
            for d in range(20):  # over 64 of a kind: the core counts by selector, not by list
                cable(add(f"{leaf}d{d}", "device", devices), leaf)
    cable("o0", "o1")
    cable("o1", "o2")
    for o in ocses:
        for d in range(6):
            cable(add(f"{o}d{d}", "device", devices), o)
    cable(add("oh", "host", hosts), "o2")
    infos = {
        d: DeviceInfo(
            rng.choice(("gpu", "gpu", "memory")),
            rng.choice(("A", "B")),
            rng.choice((1, 2)),
            capacity_gib=256.0,
            labels=rng.choice(({}, {"rack": "r1"})),
        )
        for d in devices
    }
    world = World(nodes, links, hosts, switches, ocses, devices, {})
    return world, infos, next_port


@pytest.mark.parametrize("seed", range(8))
def test_reachable_ignoring_isolation_follows_circuits_faults_and_rollback(seed: int) -> None:
    """The compiled core counts what a host that holds no circuit reaches ignoring isolation
    (the why-not funnel's isolation stage) from its region index: switches joined into
    regions, open cables between regions and OCS, and open devices per region and OCS, kept
    as circuits, faults, reservations and taken and sliced devices change and as rollbacks
    undo them; a selector that takes each (kind, model) whole is counted from the tallies,
    any other device by device. Its counts agree with the reference's search after every
    step, from three hosts (every host at the start and the end), and the index answers
    them."""
    world, infos, ports = hall_problem(seed)
    rng = random.Random(seed)
    fabrics = (
        PY.Fabric(world.nodes, world.links, infos),
        C.Fabric(world.nodes, world.links, infos),
    )
    lives = [impl.LiveConditions(f) for impl, f in zip((PY, C), fabrics, strict=True)]
    selectors = [
        Selector("gpu"),  # whole buckets: the tallies
        Selector("gpu", ("B",)),
        Selector("memory"),
        Selector("gpu", min_generation=2),  # each device tested
        Selector("gpu", labels={"rack": "r1"}),
        Selector("memory", slice_gib=64.0),
    ]
    links = [lk.id for lk in world.links]
    components = [*world.nodes, *links]
    circuits: dict[tuple[str, int], tuple[int, str]] = {}  # (ocs, port) -> (other, owner)
    answered_by_index = 0

    def same_reach(hosts: int = 3) -> None:
        nonlocal answered_by_index
        for host in rng.sample(world.hosts, hosts):
            asked = PathRequest(host, "t", isolation=False)
            for selector in selectors:
                costs = outcome(PY.best_costs, fabrics[0], lives[0], asked, selector)
                count = len(costs) if isinstance(costs, dict) else costs
                got = outcome(C.reachable, fabrics[1], lives[1], asked, selector)
                assert got == count, (host, selector)
        answered_by_index += lives[1].regions is not None

    def change(method: str, *args: Any) -> None:
        for live in lives:
            getattr(live, method)(*args)

    same_reach(len(world.hosts))
    marks: list[tuple[list[int], dict[tuple[str, int], tuple[int, str]]]] = []
    steps = 50
    for _ in range(steps):
        step = rng.randrange(10)
        if step == 0:
            marks.append(([live.checkpoint() for live in lives], dict(circuits)))
            continue
        if step == 1 and marks:
            points, circuits = marks.pop()
            for live, mark in zip(lives, points, strict=True):
                live.rollback(mark)
        elif step in (2, 3):  # a circuit between two free ports, of a host or of nobody here
            ocs = rng.choice(world.ocses)
            free = [p for p in range(ports[ocs]) if (ocs, p) not in circuits]
            if len(free) >= 2:
                a, b = sorted(rng.sample(free, 2))
                owner = rng.choice([*world.hosts, "elsewhere"])
                change("add_circuit", ocs, a, b, owner)
                circuits[(ocs, a)], circuits[(ocs, b)] = (b, owner), (a, owner)
        elif step == 4 and circuits:
            ocs, port = rng.choice(sorted(circuits))
            other, _ = circuits.pop((ocs, port))
            circuits.pop((ocs, other))
            change("clear_circuit", ocs, port)
            change("clear_circuit", ocs, other)
        elif step == 5:  # an OCS or switch half the time: the regions' own changes
            picks = components if rng.random() < 0.5 else [*world.ocses, *world.switches]
            change("set_usable", rng.choice(picks), rng.random() < 0.6)
        elif step == 6:
            change("reserve", rng.choice(links), rng.choice((30.0, 500.0)))  # 500: overdrawn
        elif step == 7:
            change("set_reserved", rng.choice(links), 0.0)
        elif step == 8:
            change("set_taken", rng.choice(world.devices), rng.random() < 0.5)
        else:
            change("set_sliced", rng.choice(world.devices), rng.choice((0.0, 128.0, 224.0)))
        same_reach()
    while marks:
        points, circuits = marks.pop()
        for live, mark in zip(lives, points, strict=True):
            live.rollback(mark)
    same_reach(len(world.hosts))
    assert answered_by_index > steps // 2


@pytest.mark.parametrize("seed", range(60))
def test_both_cores_agree_on_denser_seeded_fabrics(seed: int) -> None:
    world, cond, requests = medium_problem(seed)
    py_fabric = PY.Fabric(world.nodes, world.links)
    c_fabric = C.Fabric(world.nodes, world.links)
    live = C.LiveConditions(c_fabric, cond)
    targets = set(world.devices)
    ranked = {d: i % 3 for i, d in enumerate(sorted(world.devices))}
    for request in requests:
        expected = outcome(PY.best_paths, py_fabric, cond, request, targets)
        assert outcome(C.best_paths, c_fabric, live, request, targets) == expected, request
        expected = outcome(PY.best_devices, py_fabric, cond, request, ranked, 3)
        assert outcome(C.best_devices, c_fabric, live, request, ranked, 3) == expected, request
        assert_same_reach(py_fabric, cond, C, c_fabric, live, request, targets)


@pytest.mark.parametrize("seed", range(30))
def test_both_cores_choose_the_same_devices_by_selector_from_large_pools(seed: int) -> None:
    """Over 64 devices of a kind: the compiled core tests candidates as the search reaches
    them instead of listing them first."""
    world, cond, requests = medium_problem(seed, devices=(160, 220))
    rng = random.Random(seed)
    infos = device_infos(rng.choice, world.devices, kinds=("gpu",) * 8 + ("memory", "nic"))
    cond = device_conditions(rng.choice, cond, world.devices)
    py_fabric = PY.Fabric(world.nodes, world.links, infos)
    c_fabric = C.Fabric(world.nodes, world.links, infos)
    live = C.LiveConditions(c_fabric, cond)
    large = 0
    for request in requests:
        selector = selectors(rng.choice)._replace(kind=rng.choice(("gpu", "gpu", "memory")))
        of_kind = [i for i in infos.values() if i.kind == selector.kind]
        large += sum(not selector.models or i.model in selector.models for i in of_kind) > 64
        for n in (1, 3):
            expected = outcome(PY.best_devices, py_fabric, cond, request, selector, n)
            got = outcome(C.best_devices, c_fabric, live, request, selector, n)
            assert got == expected, (request, selector)
        assert C.census(c_fabric, live, selector) == PY.census(py_fabric, cond, selector)
        costs = outcome(PY.best_costs, py_fabric, cond, request, selector)
        assert outcome(C.best_costs, c_fabric, live, request, selector) == costs
        assert_same_reach(py_fabric, cond, C, c_fabric, live, request, selector)
    assert large, "no selector had over 64 possible devices"


def test_live_conditions_refuse_unknown_components(core: SimpleNamespace) -> None:
    nodes = {"h": NodeInfo("host"), "d": NodeInfo("device")}
    live = core.LiveConditions(core.Fabric(nodes, [LinkInfo("l", "h", "d", 10.0)]))
    for call in (
        lambda: live.set_usable("ghost", False),
        lambda: live.reserve("h", 1.0),
        lambda: live.set_reserved("ghost", 1.0),
        lambda: live.reserved("ghost"),
    ):
        with pytest.raises(KeyError):
            call()
    live.reserve("l", 0.1)
    live.reserve("l", 0.2)
    assert live.reserved("l") == 0.1 + 0.2


# ---- the engine decides the same on either core ----


def swap_core(impl: SimpleNamespace, cores: dict[str, Any]) -> None:
    placement.Fabric = impl.Fabric  # type: ignore[misc]
    placement.LiveConditions = impl.LiveConditions  # type: ignore[misc]
    placement.best_costs = impl.best_costs
    placement.reachable = impl.reachable
    placement.census = impl.census
    placement.best_devices = impl.best_devices
    placement._CORES = cores


def described(result: Any) -> Any:
    if isinstance(result, IntentRejected):
        return (result.code, str(result), msgspec.json.encode(result.details))
    return msgspec.json.encode(result)


@st.composite
def engine_fabrics(draw: st.DrawFn) -> tuple[FabricBuilder, list[str], list[str]]:
    b = FabricBuilder()
    hosts = [f"h{i}" for i in range(draw(st.integers(1, 3)))]
    for h in hosts:
        b.host(h, rack=draw(st.sampled_from(["r1", "r2"])))
    switches = [f"s{i}" for i in range(draw(st.integers(1, 4)))]
    for s in switches:
        b.switch(s, latency_ns=draw(st.sampled_from([0, 50])))
    ocses = [f"o{i}" for i in range(draw(st.sampled_from([0, 1, 2])))]
    for o in ocses:
        b.ocs(o, ports=draw(st.integers(2, 5)), latency_ns=draw(st.sampled_from([0, 30])))
    devices = [f"d{i}" for i in range(draw(st.integers(2, 9)))]
    for d in devices:
        kind = draw(st.sampled_from(["gpu", "gpu", "memory", "nic"]))
        if kind == "gpu":
            b.gpu(d, generation=draw(st.sampled_from([None, 8, 9])), zone="eu")
        elif kind == "memory":
            b.memory(d, draw(st.sampled_from([32.0, 64.0])), zone="us")
        else:
            b.nic(d, zone="eu")
    inner = hosts + switches + ocses

    def cable(a: str, c: str) -> None:
        if a != c and all(b.free_port(x) is not None for x in (a, c) if x in ocses):
            b.link(
                a, c, gbps=draw(st.sampled_from([50.0, 100.0])), ns=draw(st.sampled_from([0, 10]))
            )

    for h in hosts:
        cable(h, draw(st.sampled_from(switches + ocses)))
    for d in devices:
        cable(d, draw(st.sampled_from(switches + ocses * 2)))
    for _ in range(draw(st.integers(0, 8))):
        cable(draw(st.sampled_from(inner)), draw(st.sampled_from(inner + devices)))
    components = [*b.nodes, *(lk.id for lk in b.links)]
    return b, hosts, components


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(engine_fabrics(), st.data())
def test_the_engine_decides_the_same_on_both_cores(
    fabric: tuple[FabricBuilder, list[str], list[str]], data: st.DataObject
) -> None:
    builder, hosts, components = fabric
    state = builder.state()
    original = (
        placement.Fabric,
        placement.LiveConditions,
        placement.best_costs,
        placement.reachable,
        placement.census,
        placement.best_devices,
        placement._CORES,
    )
    cores: dict[str, dict[str, Any]] = {"python": {}, "cython": {}}
    try:
        for step in range(data.draw(st.integers(3, 15))):
            live = list(state.compositions)
            verb = data.draw(st.sampled_from(["compose"] * 4 + ["release", "fault"]))
            tenant = data.draw(st.sampled_from(TENANTS))
            actor = tenant
            intent: msgspec.Struct
            if verb == "release" and live:
                cid = data.draw(st.sampled_from(live))
                actor = state.compositions[cid].tenant
                intent = Release(request_id=f"r{step}", composition_id=cid)
            elif verb == "fault":
                intent = ReportFault(
                    request_id=f"r{step}",
                    component=data.draw(st.sampled_from(components)),
                    state=data.draw(st.sampled_from(["failed", "healthy", "healthy"])),
                )
                actor = "operator"
            else:
                entries = [
                    {
                        "kind": kind,
                        "count": data.draw(st.sampled_from([1, 1, 2])),
                        "bandwidth_gbps": data.draw(st.sampled_from([0.0, 30.0, 60.0])),
                        **({"capacity_gib": 16.0} if kind == "memory" else {}),
                    }
                    for kind in data.draw(
                        st.lists(st.sampled_from(["gpu", "memory", "nic"]), min_size=1, max_size=2)
                    )
                ]
                constraints: dict[str, Any] = {
                    "isolation": data.draw(st.sampled_from(["shared", "shared", "exclusive"]))
                }
                if data.draw(st.booleans()):
                    constraints["max_hops"] = data.draw(st.sampled_from([2, 3, 5]))
                if data.draw(st.booleans()):
                    constraints["max_latency_ns"] = data.draw(st.sampled_from([20, 100]))
                where: dict[str, Any] = (
                    {"host": data.draw(st.sampled_from(hosts))}
                    if data.draw(st.integers(0, 3))
                    else {"host_selector": {"labels": {"rack": "r1"}}}
                )
                body = {
                    "request_id": f"r{step}",
                    "devices": entries,
                    "constraints": constraints,
                    **where,
                }
                intent = msgspec.convert(body, Compose)
            answers = []
            for impl in (PY, C):
                swap_core(impl, cores[impl.name])
                events, result = run(state, intent, actor, NOW)
                answers.append((msgspec.json.encode(events), described(result)))
            assert answers[0] == answers[1], intent
            state = apply(state, events)
    finally:
        (
            placement.Fabric,
            placement.LiveConditions,
            placement.best_costs,
            placement.reachable,
            placement.census,
            placement.best_devices,
            placement._CORES,
        ) = original  # type: ignore[misc]
