"""Synthetic fabrics and requests for the path-core benchmark (bench/pathcheck.py).

A pod is what the 4,096-device case is: 8 racks, each with 8 hosts, 2 spine PCIe switches and
15 leaf PCIe switches of 32 devices (24 GPUs of mixed generations, 4 NICs, 4 NVMe); hosts
cable to both spines, spines to every leaf, and each spine has 8 uplinks to each of the pod's
2 OCS (256 ports). The OCS ports left over hold pooled devices (memory pools and NVMe), so
they are reached through a circuit. The 65,536-device case is 16 pods whose OCS also have
16 trunks each to 4 core OCS (256 ports, the rest pooled devices), so a path may cross three
OCS. About 1% of links are failed; some links carry reservations, some OCS ports already
hold circuits (of random hosts), some leaves carry tenants' paths or exclusive holds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trellis.ext import Conditions, DeviceInfo, LinkInfo, NodeInfo, PathRequest, Selector

RACKS_PER_POD = 8
HOSTS_PER_RACK = 8
LEAVES_PER_RACK = 15
DEVICES_PER_LEAF = 32
OCS_PORTS = 256
UPLINKS = 8  # per spine and pod OCS
TRUNKS = 16  # per pod OCS, to the core
CORE_OCS = 4
TENANTS = [f"tenant-{i}" for i in range(8)]
GPUS = [("A100", 8), ("H100", 9), ("H200", 9), ("B200", 10)]


@dataclass
class Device:
    id: str
    kind: str
    generation: int = 0
    model: str = ""


@dataclass
class World:
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    links: list[LinkInfo] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    devices: dict[str, Device] = field(default_factory=dict)
    conditions: Conditions = field(default_factory=Conditions)

    @property
    def device_count(self) -> int:
        return len(self.devices)

    def device_infos(self) -> dict[str, DeviceInfo]:
        """What a Selector tests, ranked by generation as the default policy does."""
        return {
            d.id: DeviceInfo(d.kind, d.model, d.generation, rank=d.generation)
            for d in self.devices.values()
        }


def build(pods: int, seed: int = 1) -> World:
    """A fabric of `pods` pods (1: 4,096 devices; 16: 65,536), with conditions."""
    rng = random.Random(seed)
    w = World()
    ports: dict[str, int] = {}  # ocs -> next free port
    counter = [0]

    def node(node_id: str, kind: str, latency_ns: int = 0) -> str:
        w.nodes[node_id] = NodeInfo(kind, latency_ns)
        if kind == "ocs":
            ports[node_id] = 0
        return node_id

    def link(a: str, b: str, gbps: float, ns: int) -> None:
        counter[0] += 1
        a_port = b_port = None
        if w.nodes[a].kind == "ocs":
            a_port, ports[a] = ports[a], ports[a] + 1
        if w.nodes[b].kind == "ocs":
            b_port, ports[b] = ports[b], ports[b] + 1
        w.links.append(LinkInfo(f"l{counter[0]:07d}", a, b, gbps, ns, a_port, b_port))

    def device(device_id: str, kind: str, generation: int = 0, model: str = "") -> str:
        node(device_id, "device")
        w.devices[device_id] = Device(device_id, kind, generation, model)
        return device_id

    def pooled(ocs: str, prefix: str, count: int) -> None:
        for i in range(count):
            if i % 4 == 3:
                link(device(f"{prefix}-nvme{i:03d}", "nvme"), ocs, 100.0, 12)
            else:
                link(device(f"{prefix}-mem{i:03d}", "memory"), ocs, 200.0, 12)

    core = [node(f"core-ocs{c}", "ocs", 40) for c in range(CORE_OCS)] if pods > 1 else []
    for p in range(pods):
        pod = f"p{p:02d}"
        ocses = [node(f"{pod}-ocs{o}", "ocs", 30) for o in range(2)]
        for r in range(RACKS_PER_POD):
            rack = f"{pod}-r{r}"
            spines = [node(f"{rack}-spine{s}", "switch", 150) for s in range(2)]
            for h in range(HOSTS_PER_RACK):
                host = node(f"{rack}-host{h}", "host")
                w.hosts.append(host)
                for spine in spines:
                    link(host, spine, 256.0, 5)
            for spine in spines:
                for ocs in ocses:
                    for _ in range(UPLINKS):
                        link(spine, ocs, 200.0, rng.choice([18, 20, 22, 25]))
            for leaf_no in range(LEAVES_PER_RACK):
                leaf = node(f"{rack}-leaf{leaf_no:02d}", "switch", 100)
                for spine in spines:
                    link(spine, leaf, 256.0, 5)
                for d in range(DEVICES_PER_LEAF):
                    base = f"{leaf}-"
                    if d < 24:
                        model, generation = GPUS[(leaf_no + d // 6) % len(GPUS)]
                        dev = device(f"{base}gpu{d:02d}", "gpu", generation, model)
                        link(leaf, dev, 128.0, rng.choice([3, 4]))
                    elif d < 28:
                        link(leaf, device(f"{base}nic{d:02d}", "nic"), 200.0, 3)
                    else:
                        link(leaf, device(f"{base}nvme{d:02d}", "nvme"), 64.0, 3)
        for o, ocs in enumerate(ocses):
            if core:
                for t in range(TRUNKS):
                    link(ocs, core[(o * TRUNKS + t) % CORE_OCS], 400.0, 60)
            pooled(ocs, f"{ocs}", OCS_PORTS - ports[ocs])
    for c in core:
        pooled(c, c, OCS_PORTS - ports[c])

    # Conditions: ~1% failed links, reservations, circuits, tenancy.
    failed = set(rng.sample([lk.id for lk in w.links], len(w.links) // 100))
    reserved = {
        lk.id: float(rng.choice([16, 32, 64])) for lk in rng.sample(w.links, len(w.links) // 5)
    }
    circuits: dict[str, tuple[int, str]] = {}
    for ocs in [n for n, info in w.nodes.items() if info.kind == "ocs"]:
        cabled = list(range(ports[ocs]))
        rng.shuffle(cabled)
        for a, b in zip(cabled[0:40:2], cabled[1:40:2], strict=True):
            owner = rng.choice(w.hosts)
            circuits[f"{ocs}:{a}"] = (b, owner)
            circuits[f"{ocs}:{b}"] = (a, owner)
    leaves = [n for n in w.nodes if "-leaf" in n]
    switch_tenants = {s: {rng.choice(TENANTS): 1} for s in rng.sample(leaves, len(leaves) // 3)}
    exclusive = {s: {rng.choice(TENANTS): 1} for s in rng.sample(leaves, len(leaves) // 20)}
    for s, holders in exclusive.items():
        switch_tenants[s] = dict(holders)
    w.conditions = Conditions(
        unusable=failed,
        reserved_gbps=reserved,
        circuits=circuits,
        switch_tenants=switch_tenants,
        exclusive_tenants=exclusive,
    )
    return w


def document(w: World, memory_capacity_gib: float = 1024.0) -> dict[str, Any]:
    """The fabric as an `import-topology` body (ARCHITECTURE section 4), for benches that run
    the engine on it: hosts labelled with their rack, GPUs with model, generation and 80 GiB,
    the pooled memory devices divisible (`memory_capacity_gib` each). Conditions are not part
    of a topology; `w.conditions.unusable` can be reported as faults after the import. Kept
    compact (no default fields): the 4,096-device fabric's body must stay under the 1 MiB an
    intent may carry."""
    nodes: list[dict[str, Any]] = []
    for node_id, info in w.nodes.items():
        n: dict[str, Any] = {"id": node_id, "kind": info.kind}
        if info.latency_ns:
            n["latency_ns"] = info.latency_ns
        if info.kind == "ocs":
            n["ports"] = OCS_PORTS
        elif info.kind == "host":
            n["labels"] = {"rack": node_id.rsplit("-", 1)[0]}
        elif info.kind == "device":
            d = w.devices[node_id]
            n["device_kind"] = d.kind
            if d.kind == "gpu":
                n.update(model=d.model, generation=d.generation, memory_gib=80)
            elif d.kind == "memory":
                n["capacity_gib"] = memory_capacity_gib
        nodes.append(n)
    links: list[dict[str, Any]] = []
    for lk in w.links:
        row: dict[str, Any] = {"id": lk.id, "a": lk.a, "b": lk.b, "capacity_gbps": lk.capacity_gbps}
        if lk.latency_ns:
            row["latency_ns"] = lk.latency_ns
        if lk.a_port is not None:
            row["a_port"] = lk.a_port
        if lk.b_port is not None:
            row["b_port"] = lk.b_port
        links.append(row)
    return {"nodes": nodes, "links": links}


@dataclass
class Request:
    path: PathRequest
    ranked: dict[str, int]  # candidates of the kind asked for -> policy rank (generation)
    selector: Selector  # the same candidates as the engine names them to the compiled core
    device: str  # one candidate, for the single path check


def requests(w: World, count: int, seed: int = 2) -> list[Request]:
    """Random compose-like requests: host, tenant, kind, bounds, bandwidth, isolation."""
    rng = random.Random(seed)
    by_kind: dict[str, list[Device]] = {}
    for d in w.devices.values():
        if d.id not in w.conditions.unusable:
            by_kind.setdefault(d.kind, []).append(d)
    usable_hosts = [h for h in w.hosts if h not in w.conditions.unusable]
    out = []
    for _ in range(count):
        kind = rng.choices(["gpu", "memory", "nic", "nvme"], [6, 2, 1, 1])[0]
        pool = by_kind[kind]
        min_generation = rng.choice([None, None, None, 9, 10]) if kind == "gpu" else None
        candidates = [d for d in pool if min_generation is None or d.generation >= min_generation]
        kwargs: dict[str, Any] = {
            "exclusive": rng.random() < 0.1,
            "max_hops": rng.choice([None, None, None, 6, 8]),
            "max_latency_ns": rng.choice([None, None, None, 600, 900]),
            "bandwidth_gbps": float(rng.choice([0, 16, 32, 64])),
        }
        request = PathRequest(rng.choice(usable_hosts), rng.choice(TENANTS), **kwargs)
        ranked = {d.id: d.generation for d in candidates}
        selector = Selector(kind, min_generation=min_generation)
        out.append(Request(request, ranked, selector, rng.choice(candidates).id))
    return out
