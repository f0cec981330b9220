"""The read model: Trellis's fabric and compositions as Redfish resources (ARCHITECTURE §11).

Everything here is computed from two of the engine's answers per domain, `topology` (nodes,
links, circuits, health) and `connections` (who holds which device, on which path, and why),
asked over NATS at or after the last position this service wrote (read your writes). Nothing
is stored: the log stays the one source of truth.

Ids: a node is `<domain>.<node id>` wherever Redfish needs one (blocks, switches, endpoints); a
system and its zone are the composition id; a memory connection `<composition id>.<device id>`;
a PCIe switch's ports are its cables' link ids, an OCS's ports their numbers.

What a tenant's account sees (`Viewer.tenant` set): its own systems, zones and connections; a
device another tenant holds reads `CompositionState: Unavailable` with no `Client`, no `Pool`
and no link to the system. A host is shared (`SharingCapable`): to a tenant it reads
`Composed` while one of that tenant's systems lives on it, else `Unused`.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from trellis.adapters.http.redfish.registries import RedfishError, error, from_engine
from trellis.adapters.nats.client import TrellisClient
from trellis.engine.core.ids import is_valid_id

R = "/redfish/v1"
BLOCK_TYPE = {
    "gpu": "Processor",
    "accelerator": "Processor",
    "memory": "Memory",
    "nic": "Network",
    "nvme": "Storage",
}
MEMBER = {  # device kind -> (ResourceBlock property, URI segment, @odata.type, EntityType)
    "gpu": ("Processors", "Processors", "#Processor.v1_22_0.Processor", "Processor"),
    "accelerator": ("Processors", "Processors", "#Processor.v1_22_0.Processor", "Processor"),
    "memory": ("Memory", "Memory", "#Memory.v1_23_0.Memory", "MemoryChunk"),
    "nic": (
        "NetworkInterfaces",
        "NetworkInterfaces",
        "#NetworkInterface.v1_2_3.NetworkInterface",
        "NetworkController",
    ),
    "nvme": ("Drives", "Drives", "#Drive.v1_22_0.Drive", "Drive"),
}
HEALTH = {"healthy": "OK", "degraded": "Warning", "failed": "Critical"}


def ref(path: str) -> dict[str, str]:
    return {"@odata.id": path}


def collection(path: str, odata_type: str, name: str, members: list[str]) -> dict[str, Any]:
    return {
        "@odata.id": path,
        "@odata.type": f"#{odata_type}.{odata_type}",
        "Name": name,
        "Members@odata.count": len(members),
        "Members": [ref(m) for m in members],
    }


def etag(body: dict[str, Any] | bytes) -> str:
    """A weak ETag of a representation: it changes whenever the resource does."""
    import msgspec

    if isinstance(body, dict) and "@Message.ExtendedInfo" in body:  # about a request, not it
        body = {k: v for k, v in body.items() if k != "@Message.ExtendedInfo"}
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body, order="sorted")
    return f'W/"{hashlib.sha256(raw).hexdigest()[:20]}"'


def block_id(domain: str, node: str) -> str:
    return f"{domain}.{node}"


def split_id(rid: str) -> tuple[str, str]:
    """(domain, node) of a `<domain>.<node>` id; ids have no dots of their own."""
    domain, dot, node = rid.partition(".")
    if not dot or not domain or not node:
        raise error(404, "ResourceNotFound", "Resource", rid)
    return domain, node


class Viewer:
    """Who reads: an Administrator (tenant None) or a tenant's account."""

    def __init__(self, tenant: str | None) -> None:
        self.tenant = tenant

    def sees(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant


class Domain:
    """One domain's topology and connections, and what follows from them."""

    def __init__(
        self,
        name: str,
        topology: dict[str, Any],
        connections: list[dict[str, Any]],
        reservations: list[dict[str, Any]] | None = None,
    ):
        self.name = name
        #: The live reservations (every tenant's) and the devices they hold.
        self.reservations = list(reservations or [])
        #: Each reserved device's tenant (a memory pool: one of those reserving a slice).
        self.reserved_by = {
            d["id"]: str(r["tenant"]) for r in self.reservations for d in r.get("devices", [])
        }
        self.reserved = set(self.reserved_by)
        self.nodes: dict[str, dict[str, Any]] = {n["id"]: n for n in topology.get("nodes", [])}
        self.links: list[dict[str, Any]] = topology.get("links", [])
        self.circuits: list[dict[str, Any]] = topology.get("circuits", [])
        self.rows = connections
        self.by_device: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.by_composition: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.by_host: dict[str, set[str]] = defaultdict(set)
        for row in connections:
            self.by_device[row["device"]].append(row)
            self.by_composition[row["composition_id"]].append(row)
            self.by_host[row["host"]].add(row["composition_id"])

    def kind(self, node: str) -> str:
        return str(self.nodes[node]["kind"])

    def of_kind(self, *kinds: str) -> list[str]:
        return [n for n, spec in sorted(self.nodes.items()) if spec["kind"] in kinds]

    def tenant_of(self, composition: str) -> str:
        return str(self.by_composition[composition][0]["tenant"])

    def host_of(self, composition: str) -> str:
        return str(self.by_composition[composition][0]["host"])

    def compositions(self, viewer: Viewer) -> list[str]:
        return sorted(c for c in self.by_composition if viewer.sees(self.tenant_of(c)))

    def links_of(self, node: str) -> list[dict[str, Any]]:
        return [lk for lk in self.links if node in (lk["a"], lk["b"])]


class Reader:
    """Asks the engine for each domain's topology and connections, at or after the positions
    this service's writes reached."""

    def __init__(self, client: TrellisClient, domains: Callable[[], Awaitable[list[str]]]) -> None:
        self.client = client
        self._domains = domains
        self.positions: dict[str, int] = {}  # per domain: the last position a write reached

    def wrote(self, domain: str, position: int | None) -> None:
        if position is not None:
            self.positions[domain] = max(self.positions.get(domain, 0), position)

    async def domains(self) -> list[str]:
        return sorted(await self._domains())

    async def domain(self, name: str) -> Domain:
        if name not in await self.domains():
            raise error(404, "ResourceNotFound", "Fabric", name)
        return await self._load(name)

    async def all(self) -> list[Domain]:
        return list(await asyncio.gather(*(self._load(d) for d in await self.domains())))

    async def _load(self, name: str) -> Domain:
        body: dict[str, Any] = {}
        if name in self.positions:
            body["min_position"] = self.positions[name]
        topology, connections, reservations = await asyncio.gather(
            self.client.all_pages(f"query.{name}.topology", body),
            self.client.all_pages(f"query.{name}.connections", body),
            self.client.query(name, "reservations", body),
        )
        for reply in (topology, connections, reservations):
            if not reply.get("ok"):
                raise from_engine(reply.get("error", {}))
        return Domain(
            name,
            topology["result"],
            connections["result"]["connections"],
            reservations["result"]["reservations"],
        )

    async def find_system(self, composition: str, viewer: Viewer) -> tuple[str, dict[str, Any]]:
        """The domain holding live composition `composition` that `viewer` may see, and the
        engine's `composition` answer for it (one query per domain)."""
        if not is_valid_id(composition):
            raise error(404, "ResourceNotFound", "ComputerSystem", composition)
        domains = await self.domains()
        replies = await asyncio.gather(
            *(
                self.client.query(
                    d,
                    "composition",
                    {"id": composition}
                    | ({"min_position": self.positions[d]} if d in self.positions else {}),
                )
                for d in domains
            )
        )
        for domain, reply in zip(domains, replies, strict=True):
            if not reply.get("ok"):
                if reply.get("error", {}).get("code") == "not_found":
                    continue
                raise from_engine(reply.get("error", {}), "ComputerSystem")
            found: dict[str, Any] = reply["result"]
            if found.get("state") in LIVE and viewer.sees(str(found.get("tenant"))):
                return domain, found
        raise error(404, "ResourceNotFound", "ComputerSystem", composition)


#: The states of a composition that has a ComputerSystem.
LIVE = ("pending", "active", "impaired")


# ---- the service root and the OData documents ----


def service_root(service_uuid: uuid.UUID) -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/",
        "@odata.type": "#ServiceRoot.v1_20_0.ServiceRoot",
        "Id": "RootService",
        "Name": "Trellis Redfish Service",
        "RedfishVersion": "1.22.0",
        "UUID": str(service_uuid),
        "Vendor": "Trellis",
        "Product": "Trellis composable fabric control plane",
        "ProtocolFeaturesSupported": {
            "ExpandQuery": {"ExpandAll": False, "Levels": False, "Links": False, "NoLinks": False},
            "SelectQuery": False,
            "FilterQuery": False,
            "OnlyMemberQuery": False,
            "ExcerptQuery": False,
            "TopSkipQuery": False,
            "DeepOperations": {"DeepPATCH": False, "DeepPOST": False},
            # Many requests at once, each on a connection of its own (no pipelining).
            "MultipleHTTPRequests": True,
        },
        "Systems": ref(f"{R}/Systems"),
        "Fabrics": ref(f"{R}/Fabrics"),
        "CompositionService": ref(f"{R}/CompositionService"),
        "AccountService": ref(f"{R}/AccountService"),
        "SessionService": ref(f"{R}/SessionService"),
        "EventService": ref(f"{R}/EventService"),
        "Links": {"Sessions": ref(f"{R}/SessionService/Sessions")},
    }


#: The OData service document: the service root's top-level resources.
ODATA_TOP = [
    ("Systems", f"{R}/Systems"),
    ("Fabrics", f"{R}/Fabrics"),
    ("CompositionService", f"{R}/CompositionService"),
    ("AccountService", f"{R}/AccountService"),
    ("SessionService", f"{R}/SessionService"),
    ("Sessions", f"{R}/SessionService/Sessions"),
    ("EventService", f"{R}/EventService"),
]


def odata_document() -> dict[str, Any]:
    return {
        "@odata.context": f"{R}/$metadata",
        "value": [
            {"name": "Service", "kind": "Singleton", "url": f"{R}/"},
            *({"name": name, "kind": "Singleton", "url": url} for name, url in ODATA_TOP),
        ],
    }


# ---- CompositionService, blocks, zones ----


def composition_service(reservation_duration: str) -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/CompositionService",
        "@odata.type": "#CompositionService.v1_2_3.CompositionService",
        "Id": "CompositionService",
        "Name": "Composition Service",
        "Status": {"State": "Enabled", "Health": "OK"},
        "ServiceEnabled": True,
        "AllowOverprovisioning": False,
        "AllowZoneAffinity": True,
        "ResourceBlocks": ref(f"{R}/CompositionService/ResourceBlocks"),
        "ResourceZones": ref(f"{R}/CompositionService/ResourceZones"),
        "ActivePool": ref(f"{R}/CompositionService/ActivePool"),
        "FreePool": ref(f"{R}/CompositionService/FreePool"),
        "CompositionReservations": ref(f"{R}/CompositionService/CompositionReservations"),
        "ReservationDuration": reservation_duration,
        "Actions": {
            "#CompositionService.Compose": {
                "target": f"{R}/CompositionService/Actions/CompositionService.Compose",
                "RequestFormat@Redfish.AllowableValues": ["Manifest"],
                "RequestType@Redfish.AllowableValues": ["Preview", "PreviewReserve", "Apply"],
            }
        },
    }


def block_ids(domain: Domain) -> list[str]:
    return [block_id(domain.name, n) for n in domain.of_kind("host", "device")]


class BlockState:
    """A block's composition status as `viewer` may see it."""

    def __init__(self, domain: Domain, node: str, viewer: Viewer) -> None:
        spec = domain.nodes[node]
        self.sharing = spec["kind"] == "host" or spec.get("device_kind") == "memory"
        if spec["kind"] == "host":
            compositions = sorted(domain.by_host.get(node, ()))
        else:
            compositions = sorted({r["composition_id"] for r in domain.by_device.get(node, [])})
        self.visible = [c for c in compositions if viewer.sees(domain.tenant_of(c))]
        tenants = {domain.tenant_of(c) for c in self.visible}
        full = False
        if spec.get("device_kind") == "memory":
            used = sum(r.get("capacity_gib") or 0.0 for r in domain.by_device.get(node, []))
            full = used + 1e-9 >= (spec.get("capacity_gib") or 0.0)
        elif spec["kind"] == "device":
            full = bool(compositions)  # held whole: by a tenant this viewer may not see
        # A reserved block reads Reserved and stays Unused to its reserver (and the
        # Administrator), out of the FreePool; to other tenants a reserved device is taken
        # (Unavailable), and they are not told why (ARCHITECTURE §11).
        reserver = domain.reserved_by.get(node)
        self.reserved = reserver is not None and viewer.sees(reserver)
        whole = spec.get("device_kind") != "memory"
        full = full or (reserver is not None and whole and not self.reserved)
        # One tenant's block names it; a shared host or pool serving several names none.
        self.client = next(iter(tenants)) if self.visible and len(tenants) == 1 else None
        usable = spec.get("health") == "healthy" and not spec.get("drained")
        self.pool: str | None = None
        if self.visible:
            self.state, self.pool = "Composed", "Active"
        elif spec.get("health") == "failed":
            self.state = "Failed"
        elif not usable or full:
            self.state = "Unavailable"
        elif self.reserved and whole:
            self.state, self.pool = "Unused", "Unassigned"
        else:
            self.state, self.pool = "Unused", "Free"
        self.number = len(self.visible)


def resource_block(domain: Domain, node: str, viewer: Viewer) -> dict[str, Any]:
    spec = domain.nodes[node]
    bid = block_id(domain.name, node)
    path = f"{R}/CompositionService/ResourceBlocks/{bid}"
    state = BlockState(domain, node, viewer)
    status: dict[str, Any] = {
        "CompositionState": state.state,
        "Reserved": state.reserved,
        "SharingCapable": state.sharing,
        "NumberOfCompositions": state.number,
    }
    if spec.get("device_kind") == "memory":
        # One composition holds at most one slice of a pool (ARCHITECTURE §5), of 1 GiB or
        # more: the pool's size in GiB bounds how many share it.
        status["MaxCompositions"] = max(1, int(spec.get("capacity_gib") or 1))
    elif spec["kind"] == "device":
        status["MaxCompositions"] = 1
    body: dict[str, Any] = {
        "@odata.id": path,
        "@odata.type": "#ResourceBlock.v1_4_3.ResourceBlock",
        "Id": bid,
        "Name": f"{spec['kind'] if spec['kind'] == 'host' else spec['device_kind']} {node}",
        "ResourceBlockType": [
            "Compute" if spec["kind"] == "host" else BLOCK_TYPE[spec["device_kind"]]
        ],
        "Status": {"State": "Enabled", "Health": HEALTH.get(spec.get("health", ""), "OK")},
        "CompositionStatus": status,
        "Links": {
            "ComputerSystems": [ref(f"{R}/Systems/{c}") for c in state.visible],
            "Zones": [ref(f"{R}/CompositionService/ResourceZones/{domain.name}")],
        },
        "Oem": {"Trellis": _oem_node(domain, spec)},
    }
    if spec.get("drained"):
        body["Status"]["State"] = "StandbyOffline"
    if state.pool is not None:
        body["Pool"] = state.pool
    if state.client is not None:
        body["Client"] = state.client
    if spec["kind"] == "device":
        prop = MEMBER[spec["device_kind"]][0]
        body[prop] = [ref(member_path(domain.name, node, spec["device_kind"]))]
    return body


def member_path(domain: str, node: str, kind: str) -> str:
    """The URI of the device behind a device block (its Processor, Memory, Drive or
    NetworkInterface)."""
    bid = block_id(domain, node)
    return f"{R}/CompositionService/ResourceBlocks/{bid}/{MEMBER[kind][1]}/{bid}"


def _oem_node(domain: Domain, spec: dict[str, Any]) -> dict[str, Any]:
    oem: dict[str, Any] = {"Domain": domain.name, "Kind": spec["kind"]}
    if spec.get("generation") is not None:
        oem["Generation"] = spec["generation"]
    if spec.get("labels"):
        oem["Labels"] = spec["labels"]
    if spec.get("cost_per_hour") is not None:
        oem["CostPerHour"] = spec["cost_per_hour"]
    return oem


def block_member(domain: Domain, node: str, segment: str, member: str) -> dict[str, Any]:
    """The device behind a device block (its Processor, Memory, Drive or NetworkInterface)."""
    spec = domain.nodes.get(node)
    bid = block_id(domain.name, node)
    if spec is None or spec["kind"] != "device" or member != bid:
        raise error(404, "ResourceNotFound", "Resource", member)
    _, want, odata_type, _ = MEMBER[spec["device_kind"]]
    if segment != want:
        raise error(404, "ResourceNotFound", "Resource", member)
    path = member_path(domain.name, node, spec["device_kind"])
    body: dict[str, Any] = {
        "@odata.id": path,
        "@odata.type": odata_type,
        "Id": bid,
        "Name": f"{spec['device_kind']} {node}",
        "Status": {"State": "Enabled", "Health": HEALTH.get(spec.get("health", ""), "OK")},
    }
    kind = spec["device_kind"]
    if kind != "nic":
        if spec.get("vendor"):
            body["Manufacturer"] = spec["vendor"]
        if spec.get("model"):
            body["Model"] = spec["model"]
    if kind in ("gpu", "accelerator"):
        body["ProcessorType"] = "GPU" if kind == "gpu" else "Accelerator"
        if spec.get("memory_gib"):
            body["ProcessorMemory"] = [{"CapacityMiB": int(spec["memory_gib"] * 1024)}]
    elif kind == "memory":
        body["CapacityMiB"] = int((spec.get("capacity_gib") or 0) * 1024)
    elif kind == "nvme":
        if spec.get("capacity_gib"):
            body["CapacityBytes"] = int(spec["capacity_gib"] * 2**30)
        body["Protocol"] = "NVMe"
    elif kind == "nic":
        oem = {k: spec[k] for k in ("vendor", "model") if spec.get(k)}
        if oem:
            body["Oem"] = {"Trellis": {k.title(): v for k, v in oem.items()}}
    return body


def resource_zone(domain: Domain) -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/CompositionService/ResourceZones/{domain.name}",
        "@odata.type": "#Zone.v1_6_3.Zone",
        "Id": domain.name,
        "Name": f"fabric domain {domain.name}",
        "ZoneType": "ZoneOfResourceBlocks",
        "Status": {"State": "Enabled", "Health": "OK"},
        "Links": {
            "ResourceBlocks": [
                ref(f"{R}/CompositionService/ResourceBlocks/{b}") for b in block_ids(domain)
            ]
        },
        "Oem": {"Trellis": {"Domain": domain.name}},
    }


# ---- Systems ----


def systems_collection(domains: list[Domain], viewer: Viewer) -> dict[str, Any]:
    members = [f"{R}/Systems/{c}" for d in domains for c in d.compositions(viewer)]
    body = collection(f"{R}/Systems", "ComputerSystemCollection", "Computer Systems", members)
    zones = [ref(f"{R}/CompositionService/ResourceZones/{d.name}") for d in domains]
    body["@Redfish.CollectionCapabilities"] = {
        "@odata.type": "#CollectionCapabilities.v1_4_1.CollectionCapabilities",
        "Capabilities": [
            {
                "CapabilitiesObject": ref(f"{R}/Systems/{object_id}"),
                "UseCase": use_case,
                "Links": {"TargetCollection": ref(f"{R}/Systems"), "RelatedItem": zones},
            }
            for use_case, object_id in CAPABILITIES.items()
        ],
    }
    return body


CAPABILITIES = {
    "ComputerSystemComposition": "Capabilities",
    "ComputerSystemConstrainedComposition": "ConstrainedCompositionCapabilities",
}


def capabilities(object_id: str) -> dict[str, Any]:
    """What a POST to Systems takes, as DSP0266's capabilities annotations say it."""
    body: dict[str, Any] = {
        "@odata.id": f"{R}/Systems/{object_id}",
        "@odata.type": "#ComputerSystem.v1_27_0.ComputerSystem",
        "Id": object_id,
        "Name": "Capabilities for composing systems",
        "Name@Redfish.OptionalOnCreate": True,
        "Name@Redfish.SetOnlyOnCreate": True,
        "Description@Redfish.OptionalOnCreate": True,
        "Description@Redfish.SetOnlyOnCreate": True,
    }
    if object_id == "Capabilities":
        body["Links@Redfish.RequiredOnCreate"] = True
        body["Links"] = {"ResourceBlocks@Redfish.RequiredOnCreate": True}
        body["@Redfish.ResourceBlockLimits"] = {"MinCompute": 1, "MaxCompute": 1}
    else:
        body["Links@Redfish.OptionalOnCreate"] = True
        body["Links"] = {"ResourceBlocks@Redfish.OptionalOnCreate": True}
        # The member templates (Processors, Memory with @Redfish.RequestedCount) are in
        # docs/redfish.md: inline, without an @odata.id, they fail the Service Validator's
        # navigation property check.
        for members in ("Processors", "Memory", "NetworkInterfaces", "Storage"):
            body[f"{members}@Redfish.OptionalOnCreate"] = True
    return body


def system(domain: Domain | str, composition: dict[str, Any]) -> dict[str, Any]:
    """The ComputerSystem of a composition: the engine's `composition` answer, or a compose
    result with the request's tenant, labels and reason added (`domain`: its name will do)."""
    name = domain if isinstance(domain, str) else domain.name
    cid = composition["composition_id"]
    host = composition["host"]
    blocks = [block_id(name, host)] + [
        block_id(name, d["id"]) for d in composition.get("devices", [])
    ]
    state = composition.get("state", "active")
    oem: dict[str, Any] = {
        "Domain": name,
        "CompositionId": cid,
        "Tenant": composition.get("tenant"),
        "State": state,
        "Paths": {d["id"]: d["path"] for d in composition.get("devices", [])},
    }
    if composition.get("expires_at"):
        oem["LeaseExpiresAt"] = composition["expires_at"]
    if composition.get("labels"):
        oem["Labels"] = composition["labels"]
    if composition.get("reason"):
        oem["Reason"] = composition["reason"]
    body: dict[str, Any] = {
        "@odata.id": f"{R}/Systems/{cid}",
        "@odata.type": "#ComputerSystem.v1_27_0.ComputerSystem",
        "Id": cid,
        # The Name (or Description) a Redfish client composed it with is its reason.
        "Name": composition.get("reason") or f"composition {cid}",
        "SystemType": "Composed",
        "Status": _system_status(state),
        "Links": {
            "ResourceBlocks": [ref(f"{R}/CompositionService/ResourceBlocks/{b}") for b in blocks]
        },
        "Oem": {"Trellis": oem},
    }
    for prop in SYSTEM_MEMBERS:
        body[prop] = ref(f"{R}/Systems/{cid}/{prop}")
    return body


def _system_status(state: str) -> dict[str, str]:
    """A composed system's Status (and its members'), from its composition's state."""
    return {
        "State": "Starting" if state == "pending" else "Enabled",
        "Health": "Warning" if state == "impaired" else "OK",
    }


#: A composed system's collections of what it holds: property (and URI segment) -> the
#: collection's type and name, and the device kinds in it.
SYSTEM_MEMBERS = {
    "Processors": ("ProcessorCollection", "Processors", ("gpu", "accelerator")),
    "Memory": ("MemoryCollection", "Memory", ("memory",)),
    "NetworkInterfaces": ("NetworkInterfaceCollection", "Network Interfaces", ("nic",)),
    "Storage": ("StorageCollection", "Storage", ("nvme",)),
}
#: The one Storage of a composed system that holds drives: all its NVMe drives.
STORAGE_ID = "NVMe"


def system_collection(domain: str, composition: dict[str, Any], prop: str) -> dict[str, Any]:
    """One of a composed system's collections (SYSTEM_MEMBERS). As in DMTF's composability
    mockup, processors and network interfaces are its blocks' own members and its drives are
    in one Storage; a memory slice is a Memory of the system's own, of the slice's capacity
    (the pool's block member has the whole pool's)."""
    path = f"{R}/Systems/{composition['composition_id']}/{prop}"
    odata_type, name, kinds = SYSTEM_MEMBERS[prop]
    devices = [d for d in composition.get("devices", []) if d.get("kind") in kinds]
    if prop == "Memory":
        members = [f"{path}/{block_id(domain, d['id'])}" for d in devices]
    elif prop == "Storage":
        members = [f"{path}/{STORAGE_ID}"] if devices else []
    else:
        members = [member_path(domain, d["id"], d["kind"]) for d in devices]
    return collection(path, odata_type, name, members)


def system_member(
    domain: Domain, composition: dict[str, Any], prop: str, member: str
) -> dict[str, Any]:
    """A composed system's Memory slice (a whole pool when it holds one without a capacity),
    or its Storage of NVMe drives."""
    system_path = f"{R}/Systems/{composition['composition_id']}"
    path = f"{system_path}/{prop}/{member}"
    status = _system_status(composition.get("state", "active"))
    devices = composition.get("devices", [])
    if prop == "Memory":
        for device in devices:
            if device.get("kind") == "memory" and block_id(domain.name, device["id"]) == member:
                whole = domain.nodes.get(device["id"], {}).get("capacity_gib") or 0
                gib = device.get("capacity_gib") or whole  # none: the whole pool
                return {
                    "@odata.id": path,
                    "@odata.type": "#Memory.v1_23_0.Memory",
                    "Id": member,
                    "Name": f"memory slice of {device['id']}",
                    "CapacityMiB": int(gib * 1024),
                    "Status": status,
                    "Oem": {"Trellis": {"Domain": domain.name, "Pool": member}},
                }
    drives = [member_path(domain.name, d["id"], "nvme") for d in devices if d.get("kind") == "nvme"]
    if prop == "Storage" and member == STORAGE_ID and drives:
        return {
            "@odata.id": path,
            "@odata.type": "#Storage.v1_21_0.Storage",
            "Id": STORAGE_ID,
            "Name": "NVMe drives",
            "Status": status,
            "Drives@odata.count": len(drives),
            "Drives": [ref(d) for d in drives],
        }
    raise error(404, "ResourceNotFound", "Resource", member)


# ---- Fabrics ----


def fabric(domain: Domain) -> dict[str, Any]:
    path = f"{R}/Fabrics/{domain.name}"
    return {
        "@odata.id": path,
        "@odata.type": "#Fabric.v1_4_0.Fabric",
        "Id": domain.name,
        "Name": f"fabric domain {domain.name}",
        "FabricType": "PCIe",
        "Status": {"State": "Enabled", "Health": "OK"},
        "Switches": ref(f"{path}/Switches"),
        "Endpoints": ref(f"{path}/Endpoints"),
        "Zones": ref(f"{path}/Zones"),
        "Connections": ref(f"{path}/Connections"),
    }


def switch(domain: Domain, node: str) -> dict[str, Any]:
    spec = domain.nodes[node]
    sid = block_id(domain.name, node)
    path = f"{R}/Fabrics/{domain.name}/Switches/{sid}"
    oem = _oem_node(domain, spec)
    oem["LatencyNs"] = spec.get("latency_ns", 0)
    body: dict[str, Any] = {
        "@odata.id": path,
        "@odata.type": "#Switch.v1_11_0.Switch",
        "Id": sid,
        "Name": f"{spec['kind']} {node}",
        "SwitchType": "PCIe",
        "Status": {"State": "Enabled", "Health": HEALTH.get(spec.get("health", ""), "OK")},
        "Ports": ref(f"{path}/Ports"),
        "Oem": {"Trellis": oem},
    }
    if spec.get("drained"):
        body["Status"]["State"] = "StandbyOffline"
    return body


def port_ids(domain: Domain, node: str) -> list[str]:
    spec = domain.nodes[node]
    if spec["kind"] == "ocs":
        return [str(p) for p in range(int(spec.get("ports") or 0))]
    return sorted(lk["id"] for lk in domain.links_of(node))


def _port_of(domain: Domain, link: dict[str, Any], node: str) -> str | None:
    """The Redfish port id of `link`'s end on switch or OCS `node` (None: not a switch)."""
    kind = domain.nodes.get(node, {}).get("kind")
    if kind == "ocs":
        end = link["a_port"] if link["a"] == node else link["b_port"]
        return str(end)
    if kind == "switch":
        return str(link["id"])
    return None


def port(domain: Domain, node: str, port_id: str) -> dict[str, Any]:
    spec = domain.nodes[node]
    sid = block_id(domain.name, node)
    if port_id not in port_ids(domain, node):
        raise error(404, "ResourceNotFound", "Port", port_id)
    path = f"{R}/Fabrics/{domain.name}/Switches/{sid}/Ports/{port_id}"
    ocs = spec["kind"] == "ocs"
    cable = None
    for lk in domain.links_of(node):
        if _port_of(domain, lk, node) == port_id and (not ocs or lk["a"] != lk["b"]):
            cable = lk
            break
    links: dict[str, Any] = {"ConnectedPorts": [], "AssociatedEndpoints": []}
    body: dict[str, Any] = {
        "@odata.id": path,
        "@odata.type": "#Port.v1_18_0.Port",
        "Id": port_id,
        "Name": f"port {port_id} of {node}",
        "PortId": port_id,
        "PortProtocol": "PCIe",
        "PortMedium": "Optical" if ocs else "Electrical",
        "Links": links,
    }
    oem: dict[str, Any] = {"Domain": domain.name}
    if cable is None:
        body["Status"] = {"State": "Enabled", "Health": "OK"}
        body["LinkStatus"] = "NoLink"
    else:
        other = cable["b"] if cable["a"] == node else cable["a"]
        other_port = _port_of(domain, cable, other)
        if other_port is not None:
            links["ConnectedPorts"].append(
                ref(
                    f"{R}/Fabrics/{domain.name}/Switches/"
                    f"{block_id(domain.name, other)}/Ports/{other_port}"
                )
            )
        elif other in domain.nodes:
            links["AssociatedEndpoints"].append(
                ref(f"{R}/Fabrics/{domain.name}/Endpoints/{block_id(domain.name, other)}")
            )
        health = cable.get("health", "healthy")
        body["Status"] = {"State": "Enabled", "Health": HEALTH.get(health, "OK")}
        body["LinkStatus"] = "LinkDown" if health == "failed" else "LinkUp"
        body["LinkState"] = "Disabled" if cable.get("drained") else "Enabled"
        body["MaxSpeedGbps"] = cable["capacity_gbps"]
        body["CurrentSpeedGbps"] = cable["capacity_gbps"]
        oem.update(
            Link=cable["id"], FreeGbps=cable.get("free_gbps", 0.0), LatencyNs=cable["latency_ns"]
        )
    if ocs:
        for c in domain.circuits:
            if c["ocs"] == node and port_id in (str(c["a_port"]), str(c["b_port"])):
                to = c["b_port"] if str(c["a_port"]) == port_id else c["a_port"]
                oem["CircuitTo"] = to
                oem["CircuitHost"] = c["host"]
    body["Oem"] = {"Trellis": oem}
    return body


def endpoint(domain: Domain, node: str, viewer: Viewer) -> dict[str, Any]:
    spec = domain.nodes[node]
    eid = block_id(domain.name, node)
    entity: dict[str, Any]
    if spec["kind"] == "host":
        entity = {"EntityType": "RootComplex", "EntityRole": "Initiator"}
    else:
        _, segment, _, entity_type = MEMBER[spec["device_kind"]]
        entity = {
            "EntityType": entity_type,
            "EntityRole": "Target",
            "EntityLink": ref(f"{R}/CompositionService/ResourceBlocks/{eid}/{segment}/{eid}"),
        }
    ports = []
    for lk in domain.links_of(node):
        other = lk["b"] if lk["a"] == node else lk["a"]
        other_port = _port_of(domain, lk, other)
        if other_port is not None:
            ports.append(
                ref(
                    f"{R}/Fabrics/{domain.name}/Switches/"
                    f"{block_id(domain.name, other)}/Ports/{other_port}"
                )
            )
    zones = []
    if spec["kind"] == "host":
        cids = domain.by_host.get(node, set())
    else:
        cids = {r["composition_id"] for r in domain.by_device.get(node, [])}
    zones = [
        ref(f"{R}/Fabrics/{domain.name}/Zones/{c}")
        for c in sorted(cids)
        if viewer.sees(domain.tenant_of(c))
    ]
    return {
        "@odata.id": f"{R}/Fabrics/{domain.name}/Endpoints/{eid}",
        "@odata.type": "#Endpoint.v1_8_2.Endpoint",
        "Id": eid,
        "Name": f"{spec['kind']} {node}",
        "EndpointProtocol": "PCIe",
        "ConnectedEntities": [entity],
        "Status": {"State": "Enabled", "Health": HEALTH.get(spec.get("health", ""), "OK")},
        "Links": {"ConnectedPorts": ports, "Zones": zones},
    }


def zone(domain: Domain, composition: str) -> dict[str, Any]:
    rows = domain.by_composition[composition]
    host = rows[0]["host"]
    members = [host, *sorted({r["device"] for r in rows})]
    return {
        "@odata.id": f"{R}/Fabrics/{domain.name}/Zones/{composition}",
        "@odata.type": "#Zone.v1_6_3.Zone",
        "Id": composition,
        "Name": f"zone of composition {composition}",
        "ZoneType": "ZoneOfEndpoints",
        "Status": {"State": "Enabled", "Health": "OK"},
        "Links": {
            "Endpoints": [
                ref(f"{R}/Fabrics/{domain.name}/Endpoints/{block_id(domain.name, m)}")
                for m in members
            ]
        },
        "Oem": {"Trellis": {"CompositionId": composition, "Tenant": rows[0]["tenant"]}},
    }


def memory_connections(domain: Domain, viewer: Viewer) -> list[tuple[str, dict[str, Any]]]:
    """(connection id, connections row) of every memory slice `viewer` may see."""
    out = []
    for row in domain.rows:
        spec = domain.nodes.get(row["device"], {})
        if spec.get("device_kind") == "memory" and viewer.sees(row["tenant"]):
            out.append((f"{row['composition_id']}.{row['device']}", row))
    return sorted(out, key=lambda item: item[0])


def connection(domain: Domain, cid: str, row: dict[str, Any]) -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/Fabrics/{domain.name}/Connections/{cid}",
        "@odata.type": "#Connection.v1_4_0.Connection",
        "Id": cid,
        "Name": f"memory slice of {row['device']} for {row['composition_id']}",
        "ConnectionType": "Memory",
        "Status": {"State": "Enabled", "Health": "OK"},
        "Links": {
            "InitiatorEndpoints": [
                ref(f"{R}/Fabrics/{domain.name}/Endpoints/{block_id(domain.name, row['host'])}")
            ],
            "TargetEndpoints": [
                ref(f"{R}/Fabrics/{domain.name}/Endpoints/{block_id(domain.name, row['device'])}")
            ],
        },
        "Oem": {
            "Trellis": {
                "CompositionId": row["composition_id"],
                "Tenant": row["tenant"],
                "CapacityGiB": row.get("capacity_gib"),
                "Paths": {row["device"]: row["path"]},
            }
        },
    }


__all__ = ["Domain", "R", "Reader", "RedfishError", "Viewer"]
