"""Write examples/hall.json: the hall the economics demo (`trellis demo economics`) runs on.

Eight racks. Each rack holds two hosts, sixteen GPUs (eight "in" each host's box: labelled
`box=<host>`, on a GPU tray of their own, whose PCIe switch `tray-<host>` is cabled to the
rack's switch), two NICs, two NVMe drives and, on current racks, a CXL memory pool. Racks r1-r3
hold NVIDIA H100 (generation 9), r4 NVIDIA B200 (generation 10), r5-r6 AMD MI300X (generation
9); r7-r8 are prior-generation racks of NVIDIA A100 (generation 8) without CXL. A memory rack
holds two large CXL pools. Every rack switch has one uplink to each of two optical circuit
switches, so any host reaches any rack's devices, and a host whose tray fails still reaches
the rack's other tray.

Prices are illustrative hourly list prices, not quotes. Run it again after editing:

    python examples/make_hall.py > examples/hall.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

# rack -> (vendor, model, generation, HBM GiB per GPU, $ per GPU hour, CXL pool GiB or 0)
RACKS = {
    "r1": ("nvidia", "H100", 9, 80, 2.5, 512),
    "r2": ("nvidia", "H100", 9, 80, 2.5, 512),
    "r3": ("nvidia", "H100", 9, 80, 2.5, 512),
    "r4": ("nvidia", "B200", 10, 192, 5.0, 512),
    "r5": ("amd", "MI300X", 9, 192, 3.0, 512),
    "r6": ("amd", "MI300X", 9, 192, 3.0, 512),
    "r7": ("nvidia", "A100", 8, 80, 1.1, 0),
    "r8": ("nvidia", "A100", 8, 80, 1.1, 0),
}
HOSTS_PER_RACK = 2
GPUS_PER_BOX = 8
MEMORY_RACK_POOLS = (2048, 2048)
OCS = ("ocs-1", "ocs-2")
OCS_PORTS = 32


def hall() -> dict[str, Any]:
    nodes: list[dict[str, Any]] = [
        {"id": ocs, "kind": "ocs", "ports": OCS_PORTS, "latency_ns": 30} for ocs in OCS
    ]
    links: list[dict[str, Any]] = []
    port = 0

    def cable(a: str, b: str, gbps: float, ns: int, **ends: int) -> None:
        links.append(
            {"id": f"l-{len(links) + 1:03d}", "a": a, "b": b, "capacity_gbps": gbps,
             "latency_ns": ns, **ends}
        )  # fmt: skip

    def uplinks(switch: str) -> None:
        nonlocal port
        for ocs in OCS:
            cable(switch, ocs, 800, 100, b_port=port)
        port += 1

    for rack, (vendor, model, generation, hbm, price, pool) in RACKS.items():
        labels = {"rack": rack, "generation": "prior" if generation < 9 else "current"}
        switch = f"sw-{rack}"
        nodes.append({"id": switch, "kind": "switch", "latency_ns": 150, "labels": labels})
        uplinks(switch)
        for h in range(1, HOSTS_PER_RACK + 1):
            host = f"host-{rack}-{h}"
            nodes.append({"id": host, "kind": "host", "labels": labels})
            cable(host, switch, 512, 50)
            tray = f"tray-{host}"
            nodes.append({"id": tray, "kind": "switch", "latency_ns": 150, "labels": labels})
            cable(switch, tray, 1024, 40)
            for g in range(1, GPUS_PER_BOX + 1):
                gpu = f"gpu-{rack}-{h}-{g}"
                nodes.append(
                    {"id": gpu, "kind": "device", "device_kind": "gpu", "vendor": vendor,
                     "model": model, "generation": generation, "memory_gib": hbm,
                     "cost_per_hour": price, "labels": {**labels, "box": host}}
                )  # fmt: skip
                cable(tray, gpu, 128, 40)
            for kind, part, maker, gen, cost in (
                ("nic", "CX7", "nvidia", 7, 0.2),
                ("nvme", "PM1743", "samsung", 5, 0.1),
            ):
                device = f"{kind}-{rack}-{h}"
                nodes.append(
                    {"id": device, "kind": "device", "device_kind": kind, "vendor": maker,
                     "model": part, "generation": gen, "cost_per_hour": cost,
                     "labels": {**labels, "box": host}}
                )  # fmt: skip
                cable(switch, device, 64, 40)
        if pool:
            memory = f"mem-{rack}"
            nodes.append(
                {"id": memory, "kind": "device", "device_kind": "memory", "vendor": "cxl",
                 "model": "CXL-2.0-pool", "generation": 2, "capacity_gib": pool,
                 "cost_per_hour": 0.4, "labels": labels}
            )  # fmt: skip
            cable(switch, memory, 256, 60)
    labels = {"rack": "mem", "generation": "current"}
    nodes.append({"id": "sw-mem", "kind": "switch", "latency_ns": 150, "labels": labels})
    uplinks("sw-mem")
    for i, gib in enumerate(MEMORY_RACK_POOLS, 1):
        memory = f"mem-pool-{i}"
        nodes.append(
            {"id": memory, "kind": "device", "device_kind": "memory", "vendor": "cxl",
             "model": "CXL-3.0-pool", "generation": 3, "capacity_gib": gib,
             "cost_per_hour": 1.2, "labels": labels}
        )  # fmt: skip
        cable("sw-mem", memory, 512, 60)
    return {"nodes": nodes, "links": links}


if __name__ == "__main__":
    json.dump(hall(), sys.stdout, indent=1)
    sys.stdout.write("\n")
