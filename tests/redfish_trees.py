"""Redfish mockup trees made from Trellis topology documents (examples/fabric.json), for DMTF's
Mockup Server to serve as a fabric manager of that fabric.

The tree is a short-form mockup (`redfishMockupServer.py -S -D <dir>`) in the shape Trellis's
discovery reads (adapters/fabric/redfish/discovery.py) and its own Redfish service writes:
one Fabric with a Switch per switch and OCS (`Oem.Trellis.Kind: "ocs"`, every port listed and
numbered), a Port per cable end on a switch (`Links.ConnectedPorts` between two switches,
`Links.AssociatedEndpoints` to a host or device), an Endpoint per host (initiator, its
ComputerSystem) and per device (target: a GPU or accelerator `Processor`, a memory pool's
`CXLDevice` whose `MemoryDomain` allows chunks, a NIC's `NetworkController`, an NVMe `Drive`),
empty Zones and Connections, and an EventService whose Subscriptions the server fills. Vendor
and model are `Manufacturer` and `Model`; generation, cost and labels go under `Oem.Trellis`.
Latency has no Redfish field, so an import of the tree takes the defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Doc = dict[str, Any]
ROOT = "/redfish/v1"
FABRIC = "Trellis"
CHUNK_STEP_MIB = 1024


def write_tree(doc: Doc, where: Path, *, fabric: str = FABRIC, events: bool = True) -> Path:
    """Write the mockup of topology `doc` into the folder `where`; `where`."""
    resources = tree(doc, fabric=fabric, events=events)
    for uri, body in resources.items():
        folder = where / uri.removeprefix(ROOT).strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "index.json").write_text(json.dumps(body, indent=1))
    return where


def tree(doc: Doc, *, fabric: str = FABRIC, events: bool = True) -> dict[str, Doc]:
    """Every resource of the mockup, by URI."""
    nodes = {n["id"]: n for n in doc["nodes"]}
    f = f"{ROOT}/Fabrics/{fabric}"
    out: dict[str, Doc] = {}
    root = {
        "@odata.type": "#ServiceRoot.v1_20_0.ServiceRoot",
        "Id": "RootService",
        "Name": "Trellis example fabric (generated)",
        "RedfishVersion": "1.20.0",
        "Systems": {"@odata.id": f"{ROOT}/Systems"},
        "Chassis": {"@odata.id": f"{ROOT}/Chassis"},
        "Fabrics": {"@odata.id": f"{ROOT}/Fabrics"},
    }
    if events:
        root["EventService"] = {"@odata.id": f"{ROOT}/EventService"}
        out[f"{ROOT}/EventService"] = {
            "@odata.type": "#EventService.v1_10_0.EventService",
            "Id": "EventService",
            "Name": "Event Service",
            "ServiceEnabled": True,
            "Subscriptions": {"@odata.id": f"{ROOT}/EventService/Subscriptions"},
            "Actions": {
                "#EventService.SubmitTestEvent": {
                    "target": f"{ROOT}/EventService/Actions/EventService.SubmitTestEvent"
                }
            },
        }
        out[f"{ROOT}/EventService/Subscriptions"] = _collection(
            f"{ROOT}/EventService/Subscriptions", "EventDestination", []
        )
    out[f"{ROOT}/"] = {**root, "@odata.id": f"{ROOT}/"}
    hosts = [n for n in doc["nodes"] if n["kind"] == "host"]
    switches = [n for n in doc["nodes"] if n["kind"] in ("switch", "ocs")]
    devices = [n for n in doc["nodes"] if n["kind"] == "device"]
    out[f"{ROOT}/Systems"] = _collection(
        f"{ROOT}/Systems", "ComputerSystem", [f"{ROOT}/Systems/{h['id']}" for h in hosts]
    )
    for host in hosts:
        out[f"{ROOT}/Systems/{host['id']}"] = {
            "@odata.id": f"{ROOT}/Systems/{host['id']}",
            "@odata.type": "#ComputerSystem.v1_22_0.ComputerSystem",
            "Id": host["id"],
            "Name": host["id"],
            "SystemType": "Physical",
            **_oem({"Labels": host.get("labels")}),
        }
    out[f"{ROOT}/Chassis"] = _collection(
        f"{ROOT}/Chassis", "Chassis", [f"{ROOT}/Chassis/{d['id']}" for d in devices]
    )
    out[f"{ROOT}/Fabrics"] = _collection(f"{ROOT}/Fabrics", "Fabric", [f])
    out[f] = {
        "@odata.id": f,
        "@odata.type": "#Fabric.v1_3_0.Fabric",
        "Id": fabric,
        "Name": f"{fabric} fabric",
        "FabricType": "PCIe",
        **{c: {"@odata.id": f"{f}/{c}"} for c in ("Switches", "Endpoints", "Zones", "Connections")},
    }
    out[f"{f}/Zones"] = _collection(f"{f}/Zones", "Zone", [])
    out[f"{f}/Connections"] = _collection(f"{f}/Connections", "Connection", [])
    endpoints = {
        n: f"{f}/Endpoints/{'I' if nodes[n]['kind'] == 'host' else 'T'}-{n}" for n in nodes
    }
    endpoints = {n: e for n, e in endpoints.items() if nodes[n]["kind"] in ("host", "device")}
    out[f"{f}/Endpoints"] = _collection(f"{f}/Endpoints", "Endpoint", list(endpoints.values()))
    for host in hosts:
        out[endpoints[host["id"]]] = _endpoint(
            endpoints[host["id"]], "RootComplex", "Initiator", f"{ROOT}/Systems/{host['id']}"
        )
    for device in devices:
        entity_type, entity = _device(device, out)
        out[endpoints[device["id"]]] = _endpoint(
            endpoints[device["id"]], entity_type, "Target", entity
        )

    ports: dict[str, dict[str, Doc]] = {s["id"]: {} for s in switches}
    for s in switches:
        if s["kind"] == "ocs":
            for number in range(s["ports"]):
                ports[s["id"]][str(number)] = {"PortMedium": "Optical"}
    for link in doc["links"]:
        ends = [(link["a"], link.get("a_port")), (link["b"], link.get("b_port"))]
        on_switch = [(n, p) for n, p in ends if nodes[n]["kind"] in ("switch", "ocs")]
        if not on_switch:
            raise ValueError(f"link {link['id']} joins no switch: a Redfish fabric cannot say so")
        names = []
        for node, port in on_switch:
            name = str(port) if port is not None else f"P{len(ports[node]) + 1}"
            ports[node].setdefault(name, {"PortMedium": "Electrical"})
            ports[node][name]["CurrentSpeedGbps"] = link["capacity_gbps"]
            names.append((node, name))
        if len(names) == 2:
            (s1, p1), (s2, p2) = names
            ports[s1][p1]["ConnectedPorts"] = [f"{f}/Switches/{s2}/Ports/{p2}"]
            ports[s2][p2]["ConnectedPorts"] = [f"{f}/Switches/{s1}/Ports/{p1}"]
        else:
            (s1, p1), other = names[0], next(n for n, _ in ends if n != names[0][0])
            ports[s1][p1]["AssociatedEndpoints"] = [endpoints[other]]
    for s in switches:
        uri = f"{f}/Switches/{s['id']}"
        out[uri] = {
            "@odata.id": uri,
            "@odata.type": "#Switch.v1_9_0.Switch",
            "Id": s["id"],
            "Name": s["id"],
            "SwitchType": "PCIe",
            "Ports": {"@odata.id": f"{uri}/Ports"},
            **_oem({"Kind": "ocs" if s["kind"] == "ocs" else None, "Labels": s.get("labels")}),
        }
        out[f"{uri}/Ports"] = _collection(
            f"{uri}/Ports", "Port", [f"{uri}/Ports/{p}" for p in ports[s["id"]]]
        )
        for name, port in ports[s["id"]].items():
            out[f"{uri}/Ports/{name}"] = _port(f"{uri}/Ports/{name}", name, port)
    out[f"{f}/Switches"] = _collection(
        f"{f}/Switches", "Switch", [f"{f}/Switches/{s['id']}" for s in switches]
    )
    return out


def _device(device: Doc, out: dict[str, Doc]) -> tuple[str, str]:
    """Write the device's chassis and entity; the endpoint's EntityType and EntityLink."""
    d = device["id"]
    chassis = f"{ROOT}/Chassis/{d}"
    out[chassis] = {
        "@odata.id": chassis,
        "@odata.type": "#Chassis.v1_25_0.Chassis",
        "Id": d,
        "Name": d,
        "ChassisType": "Module",
    }
    named = {"Manufacturer": device.get("vendor"), "Model": device.get("model")}
    named = {k: v for k, v in named.items() if v is not None}
    oem = _oem(
        {
            "Generation": device.get("generation"),
            "CostPerHour": device.get("cost_per_hour"),
            "Labels": device.get("labels"),
        }
    )
    kind = device["device_kind"]
    if kind in ("gpu", "accelerator"):
        uri = f"{chassis}/Processors/{d}"
        body: Doc = {
            "@odata.type": "#Processor.v1_20_0.Processor",
            "ProcessorType": "GPU" if kind == "gpu" else "Accelerator",
            **named,
            **oem,
        }
        if device.get("memory_gib"):
            body["MemorySummary"] = {"TotalMemorySizeMiB": device["memory_gib"] * 1024}
        out[uri] = {"@odata.id": uri, "Id": d, "Name": d, **body}
        return "Processor", uri
    if kind == "memory":
        pool = f"{chassis}/MemoryDomains/{d}"
        logical = f"{chassis}/PCIeDevices/1/CXLLogicalDevices/1"
        out[pool] = {
            "@odata.id": pool,
            "@odata.type": "#MemoryDomain.v1_5_0.MemoryDomain",
            "Id": d,
            "Name": f"{d} pool",
            "MemorySizeMiB": int(device["capacity_gib"] * 1024),
            "AllowsMemoryChunkCreation": True,
            "MinMemoryChunkSizeMiB": CHUNK_STEP_MIB,
            "MemoryChunkIncrementMiB": CHUNK_STEP_MIB,
            "MemoryChunks": {"@odata.id": f"{pool}/MemoryChunks"},
            **named,
            **oem,
        }
        out[f"{pool}/MemoryChunks"] = _collection(f"{pool}/MemoryChunks", "MemoryChunks", [])
        out[f"{chassis}/MemoryDomains"] = _collection(
            f"{chassis}/MemoryDomains", "MemoryDomain", [pool]
        )
        out[chassis]["MemoryDomains"] = {"@odata.id": f"{chassis}/MemoryDomains"}
        out[logical] = {
            "@odata.id": logical,
            "@odata.type": "#CXLLogicalDevice.v1_1_0.CXLLogicalDevice",
            "Id": "1",
            "Name": f"{d} logical device",
            "Links": {"MemoryDomains": [{"@odata.id": pool}]},
        }
        return "CXLDevice", logical
    if kind == "nic":
        uri = f"{chassis}/NetworkAdapters/{d}"
        out[uri] = {"@odata.id": uri, "Id": d, "Name": d, **named, **oem}
        return "NetworkController", uri
    uri = f"{chassis}/Drives/{d}"
    drive: Doc = {"@odata.id": uri, "Id": d, "Name": d, "Protocol": "NVMe", **named, **oem}
    if device.get("capacity_gib"):
        drive["CapacityBytes"] = int(device["capacity_gib"] * 2**30)
    out[uri] = drive
    return "Drive", uri


def _endpoint(uri: str, entity_type: str, role: str, entity: str) -> Doc:
    return {
        "@odata.id": uri,
        "@odata.type": "#Endpoint.v1_8_0.Endpoint",
        "Id": uri.rsplit("/", 1)[1],
        "Name": uri.rsplit("/", 1)[1],
        "EndpointProtocol": "PCIe",
        "ConnectedEntities": [
            {"EntityType": entity_type, "EntityRole": role, "EntityLink": {"@odata.id": entity}}
        ],
    }


def _port(uri: str, name: str, port: Doc) -> Doc:
    body: Doc = {
        "@odata.id": uri,
        "@odata.type": "#Port.v1_11_0.Port",
        "Id": name,
        "Name": f"Port {name}",
        "PortId": name,
        "PortProtocol": "PCIe",
        "PortMedium": port["PortMedium"],
        "LinkState": "Enabled",
        "LinkStatus": "LinkUp",
        "Status": {"State": "Enabled", "Health": "OK"},
    }
    if "CurrentSpeedGbps" in port:
        body["CurrentSpeedGbps"] = port["CurrentSpeedGbps"]
    refs = {
        k: [{"@odata.id": u} for u in port[k]]
        for k in ("ConnectedPorts", "AssociatedEndpoints")
        if k in port
    }
    if refs:
        body["Links"] = refs
    return body


def _collection(uri: str, of: str, members: list[str]) -> Doc:
    return {
        "@odata.id": uri,
        "@odata.type": f"#{of}Collection.{of}Collection",
        "Name": f"{of} Collection",
        "Members": [{"@odata.id": m} for m in members],
        "Members@odata.count": len(members),
    }


def _oem(values: dict[str, Any]) -> Doc:
    kept = {k: v for k, v in values.items() if v not in (None, {}, [])}
    return {"Oem": {"Trellis": kept}} if kept else {}
