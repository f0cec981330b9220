"""Section-5 path rules, one test each, on both path cores (the `core` fixture)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from trellis.ext import Circuit, Conditions, LinkInfo, NodeInfo, Path, PathError, PathRequest

NO_CONDITIONS = Conditions()


class Net:
    """A small fabric spelt in one line per node or link."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        self.links: list[LinkInfo] = []

    def node(self, kind: str, *ids: str, latency_ns: int = 0) -> Net:
        for node_id in ids:
            self.nodes[node_id] = NodeInfo(kind, latency_ns)
        return self

    def link(
        self,
        link_id: str,
        a: str,
        b: str,
        gbps: float = 100.0,
        ns: int = 0,
        a_port: int | None = None,
        b_port: int | None = None,
    ) -> Net:
        self.links.append(LinkInfo(link_id, a, b, gbps, ns, a_port, b_port))
        return self

    def chain(self, *ids: str, gbps: float = 100.0, ns: int = 0) -> Net:
        for a, b in itertools.pairwise(ids):
            self.link(f"{a}-{b}", a, b, gbps, ns)
        return self

    def fabric(self, core: SimpleNamespace) -> Any:
        return core.Fabric(self.nodes, self.links)


def search(
    core: SimpleNamespace,
    net: Net,
    targets: set[str] | None = None,
    cond: Conditions = NO_CONDITIONS,
    **request: Any,
) -> dict[str, Path]:
    request.setdefault("host", "h")
    request.setdefault("tenant", "t")
    devices = {n for n, info in net.nodes.items() if info.kind == "device"}
    found: dict[str, Path] = core.best_paths(
        net.fabric(core), cond, PathRequest(**request), devices if targets is None else targets
    )
    return found


def test_takes_the_path_with_the_fewest_hops(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "a", "b", "c").node("device", "d")
    net.chain("h", "a", "b", "c", "d").chain("h", "c")
    assert search(core, net)["d"].nodes == ("h", "c", "d")


def test_equal_hops_go_to_the_lowest_latency_counting_switch_latency(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "a").node("switch", "b", latency_ns=5)
    net.node("device", "d").chain("h", "a", "d", ns=10).chain("h", "b", "d", ns=1)
    path = search(core, net)["d"]
    assert (path.nodes, path.latency_ns) == (("h", "b", "d"), 7)


def test_equal_hops_and_latency_go_to_the_smallest_node_ids(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "s2", "s10").node("device", "d")
    net.chain("h", "s2", "d").chain("h", "s10", "d")
    assert search(core, net)["d"].nodes == ("h", "s10", "d")  # "s10" < "s2" as strings


def test_parallel_cables_are_taken_lowest_id_first(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "s").node("device", "d")
    net.link("l9", "h", "s").link("l10", "h", "s").link("l2", "s", "d")
    assert search(core, net)["d"].links == ("l10", "l2")


def ocs_net(ports: int = 4) -> Net:
    """h -p0- o, and o's ports 1.. cabled to switch s1 (p1), device d (p2), switch s2 (p3)."""
    net = Net().node("host", "h").node("ocs", "o", latency_ns=3).node("switch", "s1", "s2")
    net.node("device", "d", "e")
    net.link("l0", "h", "o", b_port=0).link("l1", "o", "s1", a_port=1)
    net.link("l2", "o", "d", a_port=2).link("l3", "o", "s2", a_port=3)
    net.chain("s1", "e")
    return net


def test_a_path_through_an_ocs_creates_a_circuit_on_free_ports(core: SimpleNamespace) -> None:
    path = search(core, ocs_net())["d"]
    assert path.nodes == ("h", "o", "d")
    assert path.circuits == (Circuit("o", 0, 2, True),)
    assert (path.hops, path.latency_ns) == (3, 3)  # link, circuit, link


def test_the_hosts_own_circuit_is_reused_and_only_to_its_other_port(core: SimpleNamespace) -> None:
    cond = Conditions(circuits={"o:0": (1, "h"), "o:1": (0, "h")})
    found = search(core, ocs_net(), cond=cond)
    assert found["e"].circuits == (Circuit("o", 0, 1, False),)
    assert "d" not in found  # port 0 is bound to port 1


def test_another_hosts_circuit_blocks_both_its_ports(core: SimpleNamespace) -> None:
    cond = Conditions(circuits={"o:2": (3, "h2"), "o:3": (2, "h2")})
    found = search(core, ocs_net(), cond=cond)
    assert "d" not in found
    assert found["e"].circuits == (Circuit("o", 0, 1, True),)
    cond = Conditions(circuits={"o:0": (1, "h2"), "o:1": (0, "h2")})
    assert search(core, ocs_net(), cond=cond) == {}


def test_equal_node_sequences_prefer_reusing_a_circuit(core: SimpleNamespace) -> None:
    # h reaches s1 over o twice: ports 0 -> 1 (free: a new circuit, links l0 l1) and
    # 4 -> 5 (h's own circuit, links l4 l5). Same nodes; reuse wins before link ids count.
    net = ocs_net(ports=6).link("l4", "h", "o", b_port=4).link("l5", "o", "s1", a_port=5)
    cond = Conditions(circuits={"o:4": (5, "h"), "o:5": (4, "h")})
    path = search(core, net, cond=cond)["e"]
    assert path.circuits == (Circuit("o", 4, 5, False),)
    assert path.links == ("l4", "l5", "s1-e")
    # Without h's circuit both are new, and the smaller link ids win.
    assert search(core, net)["e"].links == ("l0", "l1", "s1-e")


def test_unusable_nodes_and_links_carry_no_path(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "a", "b").node("device", "d")
    net.chain("h", "a", "d").chain("h", "b", "d")
    assert search(core, net, cond=Conditions(unusable={"a"}))["d"].nodes == ("h", "b", "d")
    assert search(core, net, cond=Conditions(unusable={"a", "b-d"})) == {}
    assert search(core, net, cond=Conditions(unusable={"d"})) == {}


def test_bandwidth_must_fit_and_exact_sums_fit(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "a", "b").node("device", "d")
    net.chain("h", "a", "d").chain("h", "b", "d", gbps=200.0)
    cond = Conditions(reserved_gbps={"h-a": 0.1 + 0.2, "h-b": 150.0})
    assert search(core, net, cond=cond, bandwidth_gbps=99.7)["d"].nodes == ("h", "a", "d")
    assert search(core, net, cond=cond, bandwidth_gbps=99.71) == {}
    assert search(core, net, cond=cond, bandwidth_gbps=50.0)["d"].nodes == ("h", "a", "d")


def test_max_hops_and_max_latency_bound_the_path(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "a", "b", "c").node("device", "d")
    net.chain("h", "a", "d", ns=50).chain("h", "b", "c", "d", ns=1)
    assert search(core, net, max_hops=2)["d"].nodes == ("h", "a", "d")
    assert search(core, net, max_hops=1) == {}
    # A longer but faster path is kept when the short one is too slow.
    assert search(core, net, max_latency_ns=10)["d"].nodes == ("h", "b", "c", "d")
    assert search(core, net, max_hops=2, max_latency_ns=10) == {}


def test_hosts_are_never_passed_through_and_devices_only_end_paths(core: SimpleNamespace) -> None:
    net = Net().node("host", "h", "h2").node("switch", "s").node("device", "d", "x")
    net.chain("h", "h2", "d").chain("h", "x", "s", "d")
    assert search(core, net, targets={"d"}) == {}
    assert search(core, net, targets={"x"})["x"].nodes == ("h", "x")


def test_only_targets_are_entered(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "s").node("device", "d", "e").chain("h", "s", "d")
    net.chain("s", "e")
    assert set(search(core, net, targets={"e", "nonexistent", "s"})) == {"e"}
    assert search(core, net, targets=set()) == {}


def test_a_switch_held_exclusively_by_another_tenant_is_closed(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "a", "b").node("device", "d")
    net.chain("h", "a", "d").chain("h", "b", "d")
    cond = Conditions(exclusive_tenants={"a": {"u": 1}})
    assert search(core, net, cond=cond)["d"].nodes == ("h", "b", "d")
    assert search(core, net, cond=cond, tenant="u")["d"].nodes == ("h", "a", "d")
    assert search(core, net, cond=cond, isolation=False)["d"].nodes == ("h", "a", "d")


def test_an_exclusive_request_avoids_switches_other_tenants_use(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "a", "b").node("device", "d")
    net.chain("h", "a", "d").chain("h", "b", "d")
    cond = Conditions(switch_tenants={"a": {"u": 1, "t": 2}, "b": {"t": 1}})
    assert search(core, net, cond=cond)["d"].nodes == ("h", "a", "d")
    assert search(core, net, cond=cond, exclusive=True)["d"].nodes == ("h", "b", "d")
    cond = Conditions(switch_tenants={"a": {"u": 1}, "b": {"v": 1}})
    assert search(core, net, cond=cond, exclusive=True) == {}


def test_an_ocs_does_not_count_for_isolation(core: SimpleNamespace) -> None:
    cond = Conditions(switch_tenants={"o": {"u": 1}}, exclusive_tenants={"o": {"u": 1}})
    assert search(core, ocs_net(), cond=cond, exclusive=True)["d"].nodes == ("h", "o", "d")


def test_a_later_label_survives_when_the_best_prefix_used_up_an_ocs(core: SimpleNamespace) -> None:
    # h -p0- o -p1- s1 -p2- o -p3- d, and h - s2 - s3 - s1; h owns circuits p0-p1 and p2-p3.
    net = Net().node("host", "h").node("ocs", "o").node("switch", "s1", "s2", "s3")
    net.node("device", "d")
    net.link("l0", "h", "o", b_port=0).link("l1", "o", "s1", a_port=1)
    net.link("l2", "s1", "o", b_port=2).link("l3", "o", "d", a_port=3)
    net.link("l4", "h", "s2").link("l5", "s2", "s3").link("l6", "s3", "s1")
    cond = Conditions(circuits={"o:0": (1, "h"), "o:1": (0, "h"), "o:2": (3, "h"), "o:3": (2, "h")})
    assert search(core, net, cond=cond)["d"].nodes == ("h", "s2", "s3", "s1", "o", "d")


@pytest.mark.parametrize(
    ("host", "cond", "message"),
    [
        ("nobody", Conditions(), "'nobody' is not a host of this fabric"),
        ("s", Conditions(), "'s' is not a host of this fabric"),
        ("h", Conditions(unusable={"h"}), "host 'h' is not usable"),
    ],
)
def test_an_unknown_or_unusable_host_is_a_path_error(
    core: SimpleNamespace, host: str, cond: Conditions, message: str
) -> None:
    net = Net().node("host", "h").node("switch", "s").node("device", "d").chain("h", "s", "d")
    with pytest.raises(PathError) as info:
        search(core, net, cond=cond, host=host)
    assert str(info.value) == message
    with pytest.raises(PathError) as info:
        core.best_devices(net.fabric(core), cond, PathRequest(host, "t"), {"d": 0}, 0)
    assert str(info.value) == message


def test_a_circuit_of_the_host_to_a_port_without_a_cable_is_a_key_error(
    core: SimpleNamespace,
) -> None:
    # Conditions the engine never builds (circuits join cabled ports): both cores fail alike.
    cond = Conditions(circuits={"o:0": (7, "h"), "o:7": (0, "h")})
    with pytest.raises(KeyError) as info:
        search(core, ocs_net(), cond=cond)
    assert info.value.args == (7,)
    cond = Conditions(circuits={"o:0": (7, "h2")})
    assert search(core, ocs_net(), cond=cond) == {}


def test_best_devices_orders_by_hops_latency_rank_and_id(core: SimpleNamespace) -> None:
    net = Net().node("host", "h").node("switch", "s", "t").node("device", "a", "b", "c", "z", "far")
    net.chain("h", "s", "a").chain("s", "b").chain("s", "c").chain("s", "z")
    net.chain("h", "t", "far")
    net.link("slow", "s", "far", ns=5)
    fabric = net.fabric(core)
    ranked = {"a": 2, "b": 1, "c": 1, "z": 0, "far": 0}
    chosen = core.best_devices(fabric, Conditions(), PathRequest("h", "t"), ranked, 3)
    assert [p.device for p in chosen] == ["far", "z", "b"]
    every = core.best_devices(fabric, Conditions(), PathRequest("h", "t"), ranked, 99)
    assert [p.device for p in every] == ["far", "z", "b", "c", "a"]
    assert every == sorted(
        core.best_paths(fabric, Conditions(), PathRequest("h", "t"), set(ranked)).values(),
        key=lambda p: (p.hops, p.latency_ns, ranked[p.device], p.device),
    )
    assert core.best_devices(fabric, Conditions(), PathRequest("h", "t"), ranked, 0) == []
    assert core.best_devices(fabric, Conditions(), PathRequest("h", "t"), {}, 1) == []


def test_fabric_keeps_the_reference_views(core: SimpleNamespace) -> None:
    net = ocs_net()
    fabric = net.fabric(core)
    assert fabric.kind("o") == "ocs"
    assert sorted(fabric.ports["o"]) == [0, 1, 2, 3]
    assert fabric.ports["o"][2].id == "l2"
    assert sorted(key for _, _, key in fabric.graph.edges(keys=True)) == sorted(
        lk.id for lk in net.links
    )


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([LinkInfo("l", "h", "ghost", 1.0)], "link 'l' ends at 'ghost', which is no node"),
        ([LinkInfo("l", "h", "o", 1.0)], "link 'l' ends on ocs 'o' without a port"),
        (
            [LinkInfo("l", "h", "o", 1.0, 0, None, 1), LinkInfo("m", "s", "o", 1.0, 0, None, 1)],
            "ocs 'o' port 1 has two cables ('l' and 'm')",
        ),
        ([LinkInfo("l", "h", "s", 1.0), LinkInfo("l", "s", "o", 1.0, 0, None, 1)], "twice"),
        ([LinkInfo("l", "s", "s", 1.0)], "link 'l' connects 's' to itself"),
    ],
)
def test_the_compiled_fabric_refuses_topologies_decide_refuses(
    links: list[LinkInfo], message: str
) -> None:
    # The reference accepts these and fails (or not) later in a search; the engine never
    # builds them (topology._check_links), so only the compiled core checks them up front.
    from path_cores import compiled

    nodes = {"h": NodeInfo("host"), "s": NodeInfo("switch"), "o": NodeInfo("ocs")}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compiled().Fabric(nodes, links)


def test_blast_radius_names_the_tracked_paths_through_a_component(core: SimpleNamespace) -> None:
    live = core.LiveConditions(ocs_net().fabric(core))
    live.track("c2", ["h", "o", "d"], ["l0", "l2"])
    live.track("c1", ["h", "o", "s1", "e"], ["l0", "l1", "s1-e"])
    assert live.through("l0") == ["c1", "c2"]
    assert live.through("o") == ["c1", "c2"]
    assert live.through("s1") == ["c1"]
    assert live.through("s2") == []
    mark = live.checkpoint()
    live.untrack("c1")
    live.track("c2", ["s2"], ["l3"])
    assert live.through("l0") == ["c2"]
    assert live.through("s2") == ["c2"]
    live.rollback(mark)
    assert live.through("s1") == ["c1"]
    assert live.through("s2") == []
    live.untrack("c2")
    live.untrack("c2")
    assert live.through("o") == ["c1"]
    with pytest.raises(KeyError):
        live.through("ghost")
    with pytest.raises(KeyError):
        live.track("c3", ["ghost"], [])
