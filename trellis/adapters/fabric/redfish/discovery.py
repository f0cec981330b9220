"""Discovery: read a fabric manager's Redfish model and build the topology document of
ARCHITECTURE §4, with the map the driver needs to act on what it names.

What is read (DMTF DSP0266 / the Fabric, Switch, Port, Endpoint, Zone, Connection and
MemoryChunks schemas), and what becomes of it (docs/fabric-drivers.md has the table):
- the fabric: `--fabric` names it (the last segment of its URI), else the service's only one;
- `Switches` and their `Ports`: a switch is a `switch` node, or an `ocs` node when it says
  `Oem.Trellis.Kind: "ocs"` (its ports are numbered by their URI's last segment, else their
  `PortId`);
- `Endpoints` (the collection, and every endpoint a port or switch links to: a service may
  leave some out of the collection): an initiator whose entity lies under `/Systems/<id>` is
  host `<id>`; a target's entities are its devices: a `Processor` is a gpu (`ProcessorType`
  GPU) or an accelerator, a `Drive` or `Volume` an nvme, a `NetworkController` a nic, and a
  `MemoryChunk` or a `CXLDevice` leads to its `MemoryDomain`, which is a memory pool (an
  endpoint with a processor is that processor: its memory chunks are the processor's own);
- cables: a port's `Links.ConnectedPorts` (to another switch's port: a switch-to-switch link;
  to a host's or a device's port: a link to that host or device), else its
  `Links.AssociatedEndpoints`. One link per cable, and one per device behind a cable that
  carries several. Capacity is the port's `CurrentSpeedGbps`, else `MaxSpeedGbps` (the lower
  end's on a switch-to-switch cable).
Ids are the last segment of each resource's `@odata.id`, never its `Id`; when two would be
the same, each is prefixed with its kind (`host-`, `switch-`, `gpu-`, ...), and when that is
still the same, it is the resource's path below `/redfish/v1` with `-` for `/`. Latency has no
Redfish source: switches, OCS and links take DEFAULT_LATENCY_NS unless the import overrides it.
Vendor and model come from the device's `Manufacturer` and `Model` (else its chassis');
generation, labels and cost from `Oem.Trellis` (`Generation`, `Labels`, `CostPerHour`), the
keys Trellis's own Redfish service writes.

What cannot be mapped is skipped and said in `notes`, never guessed silently.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping

import msgspec

from trellis.adapters.fabric.redfish.client import (
    HttpError,
    Json,
    RedfishClient,
    RedfishError,
    Unreachable,
)

#: Latency (ns) where Redfish has none: per switch and OCS passed, and per cable.
DEFAULT_LATENCY_NS: dict[str, int] = {"switch": 150, "ocs": 30, "link": 50}
#: Capacity (Gbps) of a cable whose ports give no speed at all.
DEFAULT_CAPACITY_GBPS = 64.0
_ID = re.compile(r"[^A-Za-z0-9_-]")
_MAX_ID = 64
_GIB_PER_MIB = 1 / 1024
_DEVICE_ENTITIES = {
    "Processor": "processor",
    "AccelerationFunction": "accelerator",
    "DisplayController": "gpu",
    "Drive": "nvme",
    "Volume": "nvme",
    "NetworkController": "nic",
    "MemoryChunk": "memory",
    "CXLDevice": "memory",
}


class DiscoveryError(Exception):
    """The service cannot be read as a fabric (none, several and none chosen, unreachable).

    `kind` says which, for a caller that answers each its own way (the CLI's exit codes):
    `unavailable` (no answer, or 503), `refused` (401), `forbidden` (403), `not_found` (no
    fabric of the name asked for), `error` (anything else)."""

    def __init__(self, message: str, *, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


class Ocs(msgspec.Struct, frozen=True, kw_only=True):
    """An optical circuit switch: its Switch resource and its ports by number."""

    switch: str
    ports: dict[int, str]


class FabricMap(msgspec.Struct, frozen=True, kw_only=True):
    """One fabric as Trellis sees it: the topology document to import, and where each node,
    cable and OCS port lives on the service."""

    fabric: str  # the Fabric resource's URI
    zones: str | None  # its Zones collection
    connections: str | None  # its Connections collection
    document: Json  # {"nodes": [...], "links": [...]}, ARCHITECTURE §4
    host_endpoints: dict[str, str]  # host -> the initiator endpoint zones name it by
    device_endpoints: dict[str, str]  # device -> its target endpoint
    memory_domains: dict[str, str]  # memory pool -> its MemoryDomain (chunks are made there)
    # memory pool -> (MinMemoryChunkSizeMiB, MemoryChunkIncrementMiB), None where not given
    chunking: dict[str, tuple[int | None, int | None]] = {}
    endpoint_nodes: dict[str, list[str]]  # endpoint -> the hosts or devices it stands for
    ocs: dict[str, Ocs]
    cables: dict[str, list[str]]  # link -> the switch ports whose state is its state
    notes: list[str]  # what was skipped or guessed, one sentence each

    def device_of_domain(self, domain_uri: str) -> str | None:
        for device, uri in self.memory_domains.items():
            if uri == domain_uri:
                return device
        return None


def last_segment(uri: str) -> str:
    return urllib.parse.unquote(uri.rstrip("/").rsplit("/", 1)[-1])


def parent(uri: str, levels: int = 1) -> str:
    for _ in range(levels):
        uri = uri.rstrip("/").rsplit("/", 1)[0]
    return uri


# A service's JSON is read as it should be, and a value of another type as absent: a vendor's
# odd field is never an AttributeError or a TypeError out of the driver.


def obj(value: object) -> Json:
    """`value` if it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def items(value: object) -> list[object]:
    """`value` if it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def ref(value: object) -> str | None:
    """The URI of a reference (`{"@odata.id": ...}`), None when `value` is none."""
    uri = obj(value).get("@odata.id")
    return uri if isinstance(uri, str) else None


def links(body: Json, name: str) -> list[str]:
    """The URIs of `Links.<name>` (a list of references, or one)."""
    value = obj(body.get("Links")).get(name)
    refs = value if isinstance(value, list) else [value]
    return [uri for uri in map(ref, refs) if uri is not None]


def trellis_oem(body: Json) -> Json:
    return obj(obj(body.get("Oem")).get("Trellis"))


def assign_ids(candidates: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Node ids for resources, given as (URI, kind): each URI's last segment; where two would
    be equal, `<kind>-<segment>`; where those are still equal, the URI's path below
    /redfish/v1 with `-` for `/`, and where even that is equal once cut to the id alphabet,
    8 hex digits of the URI's hash added. Ids are cut to the id alphabet and 64 characters."""
    by_uri = dict(candidates)
    plain = {uri: _clean(last_segment(uri)) for uri in by_uri}
    ids = {}
    for uri, name in plain.items():
        if _count(plain, name) == 1:
            ids[uri] = name
            continue
        kinded = {u: _clean(f"{by_uri[u]}-{n}") for u, n in plain.items() if n == name}
        if _count(kinded, kinded[uri]) == 1:
            ids[uri] = kinded[uri]
        else:
            ids[uri] = _clean(uri.removeprefix("/redfish/v1/").strip("/").replace("/", "-"))
    # Paths that differ only in characters outside the id alphabet (`h.1`, `h_1`) are equal
    # still: each takes 8 hex digits of its URI's hash.
    taken = Counter(ids.values())
    for uri, name in ids.items():
        if taken[name] > 1:
            ids[uri] = _clean(f"{name}-{hashlib.sha256(uri.encode()).hexdigest()[:8]}")
    return ids


def _count(names: Mapping[str, str], name: str) -> int:
    return sum(1 for n in names.values() if n == name)


def _clean(name: str) -> str:
    name = _ID.sub("_", name) or "_"
    if len(name) > _MAX_ID:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[: _MAX_ID - 9]}-{digest}"
    return name


class _Reader:
    """GETs of one crawl, each resource read once, many at a time."""

    def __init__(self, client: RedfishClient) -> None:
        self.client = client
        self._read: dict[str, asyncio.Task[Json | None]] = {}

    async def get(self, uri: str) -> Json | None:
        """The resource's body; None when it does not exist."""
        task = self._read.get(uri)
        if task is None:
            task = self._read[uri] = asyncio.ensure_future(self._fetch(uri))
        return await task

    async def all(self, uris: Iterable[str]) -> dict[str, Json]:
        unique = list(dict.fromkeys(uris))
        bodies = await asyncio.gather(*(self.get(u) for u in unique))
        return {u: b for u, b in zip(unique, bodies, strict=True) if b is not None}

    async def members(self, collection: Json | None, name: str) -> list[str]:
        uri = ref(obj(collection).get(name))
        return await self.client.members(uri) if uri is not None else []

    async def _fetch(self, uri: str) -> Json | None:
        resource = await self.client.get_or_none(uri)
        return resource.body if resource is not None else None


async def discover(
    client: RedfishClient,
    *,
    fabric: str | None = None,
    latency: Mapping[str, int] | None = None,
) -> FabricMap:
    """Read the service's fabric (the one named `fabric`, else its only one) and map it.

    Args:
        client: A client of the service.
        fabric: The fabric's id (its URI's last segment); None: the service's only fabric.
        latency: Overrides of DEFAULT_LATENCY_NS (`switch`, `ocs`, `link`) and of single
            nodes or links by id.

    Raises:
        DiscoveryError: No fabric to read, or the service could not be read.
    """
    try:
        return await _Crawl(_Reader(client), dict(latency or {})).run(fabric)
    except RedfishError as exc:
        raise DiscoveryError(
            f"cannot read the Redfish service at {client.origin}: {exc}", kind=_kind(exc)
        ) from None


def _kind(exc: RedfishError) -> str:
    if isinstance(exc, Unreachable):
        return "unavailable"
    if isinstance(exc, HttpError):
        return {401: "refused", 403: "forbidden", 503: "unavailable"}.get(exc.status, "error")
    return "error"


class _Crawl:
    def __init__(self, reader: _Reader, latency: dict[str, int]) -> None:
        self.r = reader
        self.latency = latency
        self.notes: list[str] = []

    async def run(self, wanted: str | None) -> FabricMap:
        root = await self.r.get("/redfish/v1/")
        if root is None:
            raise DiscoveryError(f"{self.r.client.origin} has no Redfish service root")
        fabric_uri = await self._choose_fabric(root, wanted)
        fabric = await self.r.get(fabric_uri) or {}
        switch_uris = await self.r.members(fabric, "Switches")
        switches = await self.r.all(switch_uris)
        port_lists = await asyncio.gather(
            *(self.r.members(switches[s], "Ports") for s in switch_uris if s in switches)
        )
        port_owner = {p: s for s, ports in zip(switches, port_lists, strict=True) for p in ports}
        ports = await self.r.all(port_owner)
        endpoint_uris = await self.r.members(fabric, "Endpoints")
        for body in [*ports.values(), *switches.values()]:
            endpoint_uris += links(body, "AssociatedEndpoints") + links(body, "Endpoints")
        endpoints = await self.r.all(endpoint_uris)
        hosts, devices, endpoint_nodes = await self._endpoints(endpoints)
        for port in ports.values():  # hosts a cable names without an endpoint
            for peer in links(port, "ConnectedPorts"):
                system = _system_of(peer)
                if system is not None and peer not in port_owner:
                    hosts.setdefault(system, [])
        systems = await self.r.all(hosts)
        # A switch's Ports collection may leave out a port that a host's or device's own port
        # names as its peer (the hosts' processors' ports, and the endpoints'): those count too.
        processors = [p for s in systems.values() for p in await self.r.members(s, "Processors")]
        far = [p for e in endpoints.values() for p in links(e, "Ports")]
        for processor in (await self.r.all(processors)).values():
            far += await self.r.members(processor, "Ports")
        for body in (await self.r.all(far)).values():
            for peer in links(body, "ConnectedSwitchPorts") + links(body, "ConnectedPorts"):
                owner = next((s for s in switches if peer.startswith(f"{s}/Ports/")), None)
                if owner is not None and peer not in port_owner:
                    port_owner[peer] = owner
        ports = await self.r.all(port_owner)
        kinds = {
            **{uri: "host" for uri in hosts},
            **{s: _switch_kind(body) for s, body in switches.items()},
            **{uri: d["device_kind"] for uri, d in devices.items()},
        }
        ids = assign_ids(kinds.items())
        nodes = [self._host(ids[uri], systems.get(uri, {})) for uri in sorted(hosts)]
        ocs: dict[str, Ocs] = {}
        for uri, body in sorted(switches.items()):
            node, numbers = self._switch(ids[uri], body, uri, port_owner, ports)
            nodes.append(node)
            if numbers is not None:
                ocs[ids[uri]] = Ocs(switch=uri, ports=numbers)
        nodes += [{"id": ids[uri], **devices[uri]["spec"]} for uri in sorted(devices)]
        links_, cables = self._cables(ids, port_owner, ports, endpoints, endpoint_nodes, ocs)
        named = {
            e: sorted({ids[n] for n in nodes_ if n in ids}) for e, nodes_ in endpoint_nodes.items()
        }
        return FabricMap(
            fabric=fabric_uri,
            zones=_ref(fabric, "Zones"),
            connections=_ref(fabric, "Connections"),
            document={"nodes": nodes, "links": links_},
            host_endpoints={ids[h]: sorted(eps)[0] for h, eps in hosts.items() if eps},
            device_endpoints={ids[d]: devices[d]["endpoint"] for d in devices},
            memory_domains={ids[d]: d for d in devices if devices[d]["device_kind"] == "memory"},
            chunking={ids[d]: devices[d]["chunking"] for d in devices if "chunking" in devices[d]},
            endpoint_nodes={e: n for e, n in named.items() if n},
            ocs=ocs,
            cables=cables,
            notes=self.notes,
        )

    async def _choose_fabric(self, root: Json, wanted: str | None) -> str:
        collection = await self.r.members(root, "Fabrics")
        if wanted is not None:
            chosen = [f for f in collection if last_segment(f) == wanted]
            if not chosen:
                names = ", ".join(last_segment(f) for f in collection) or "none"
                raise DiscoveryError(
                    f"the service has no fabric {wanted!r} (it has: {names})", kind="not_found"
                )
            return chosen[0]
        if len(collection) != 1:
            names = ", ".join(last_segment(f) for f in collection) or "none"
            raise DiscoveryError(
                f"the service has {len(collection)} fabrics ({names}): name one with --fabric"
            )
        return collection[0]

    async def _endpoints(
        self, endpoints: dict[str, Json]
    ) -> tuple[dict[str, list[str]], dict[str, Json], dict[str, list[str]]]:
        """Hosts (System URI -> its initiator endpoints), devices (URI -> what it is), and
        which host or device URIs each endpoint stands for."""
        hosts: dict[str, list[str]] = {}
        devices: dict[str, Json] = {}
        endpoint_nodes: dict[str, list[str]] = {}
        for uri, body in sorted(endpoints.items()):
            entities = [e for e in items(body.get("ConnectedEntities")) if isinstance(e, dict)]
            stands_for: list[str] = []
            for entity in entities:
                link = ref(entity.get("EntityLink"))
                system = _system_of(link) if link is not None else None
                if system is not None and entity.get("EntityRole") in ("Initiator", "Both"):
                    hosts.setdefault(system, []).append(uri)
                    stands_for.append(system)
            if stands_for:
                endpoint_nodes[uri] = sorted(set(stands_for))
                continue
            found = await self._devices_of(entities)
            for device_uri, device in found.items():
                devices.setdefault(device_uri, {**device, "endpoint": uri})
            if found:
                endpoint_nodes[uri] = sorted(found)
            elif any(e.get("EntityType") in _DEVICE_ENTITIES for e in entities):
                self.notes.append(f"endpoint {uri} connects no device Trellis can use: skipped")
            elif any(e.get("EntityRole") in ("Initiator", "Both") for e in entities):
                # A host is a ComputerSystem the endpoint's entity links to; without that link
                # there is no host to name (a probe's whole import lost its hosts unsaid).
                self.notes.append(
                    f"endpoint {uri} is an initiator whose ConnectedEntities link to no "
                    "/redfish/v1/Systems/<id>: no host for it, skipped"
                )
        return hosts, devices, endpoint_nodes

    async def _devices_of(self, entities: list[Json]) -> dict[str, Json]:
        """The devices behind one target endpoint, by URI: its processors if it has any (its
        memory chunks are then the processor's own), else its memory pools, else its drives
        and network controllers."""
        typed: list[tuple[str, str]] = []  # (kind, entity URI)
        for entity in entities:
            kind = _DEVICE_ENTITIES.get(str(entity.get("EntityType")))
            link = ref(entity.get("EntityLink"))
            if entity.get("EntityRole") in ("Target", "Both") and kind and link is not None:
                typed.append((kind, link))
        processors = [(k, u) for k, u in typed if k in ("processor", "gpu", "accelerator")]
        if processors:
            bodies = await self.r.all(u for _, u in processors)
            return {
                u: await self._device(u, bodies.get(u, {}), _processor_kind(bodies.get(u, {}), k))
                for k, u in processors
            }
        memory = [u for k, u in typed if k == "memory"]
        if memory:
            return await self._memory_pools(memory)
        others = [(k, u) for k, u in typed if k in ("nvme", "nic")]
        bodies = await self.r.all(u for _, u in others)
        return {u: await self._device(u, bodies.get(u, {}), k) for k, u in others}

    async def _memory_pools(self, entities: list[str]) -> dict[str, Json]:
        """A memory chunk's pool is its MemoryDomain (…/MemoryDomains/<d>/MemoryChunks/<c>);
        a CXL logical device names its domains."""
        domains: list[str] = []
        for uri in entities:
            if "/MemoryChunks/" in uri:
                domains.append(parent(uri, 2))
            else:
                body = await self.r.get(uri) or {}
                domains += links(body, "MemoryDomains")
        pools = {}
        for uri, body in (await self.r.all(domains)).items():
            size = body.get("MemorySizeMiB")
            if not isinstance(size, int | float) or size <= 0:
                self.notes.append(f"memory domain {uri} gives no MemorySizeMiB: skipped")
                continue
            if body.get("AllowsMemoryChunkCreation") is False:
                self.notes.append(
                    f"memory domain {uri} does not allow memory chunk creation: slices of it "
                    "cannot be made"
                )
            device = await self._device(uri, body, "memory")
            device["spec"]["capacity_gib"] = size * _GIB_PER_MIB
            device["chunking"] = tuple(
                v if isinstance(v, int) and v > 0 else None
                for v in (body.get("MinMemoryChunkSizeMiB"), body.get("MemoryChunkIncrementMiB"))
            )
            pools[uri] = device
        return pools

    async def _device(self, uri: str, body: Json, kind: str) -> Json:
        chassis_uri = _chassis_of(uri)
        chassis = await self.r.get(chassis_uri) if chassis_uri else None
        oem = trellis_oem(body) or trellis_oem(chassis or {})
        spec: Json = {"kind": "device", "device_kind": kind}
        for field, key in (("vendor", "Manufacturer"), ("model", "Model")):
            value = body.get(key) or (chassis or {}).get(key)
            if isinstance(value, str) and value.strip():
                spec[field] = value.strip()[:64]
        if isinstance(oem.get("Generation"), int):
            spec["generation"] = oem["Generation"]
        if kind in ("gpu", "accelerator"):
            memory = obj(body.get("MemorySummary")).get("TotalMemorySizeMiB")
            if isinstance(memory, int | float) and memory > 0:
                spec["memory_gib"] = memory * _GIB_PER_MIB
        if kind == "nvme" and isinstance(body.get("CapacityBytes"), int):
            spec["capacity_gib"] = body["CapacityBytes"] / 2**30
        if isinstance(oem.get("CostPerHour"), int | float):
            spec["cost_per_hour"] = oem["CostPerHour"]
        if isinstance(oem.get("Labels"), dict) and oem["Labels"]:
            spec["labels"] = {str(k): str(v) for k, v in oem["Labels"].items()}
        return {"device_kind": kind, "spec": spec}

    def _host(self, node_id: str, system: Json) -> Json:
        node: Json = {"id": node_id, "kind": "host"}
        labels = trellis_oem(system).get("Labels")
        if isinstance(labels, dict) and labels:
            node["labels"] = {str(k): str(v) for k, v in labels.items()}
        return node

    def _switch(
        self,
        node_id: str,
        body: Json,
        uri: str,
        port_owner: dict[str, str],
        ports: dict[str, Json],
    ) -> tuple[Json, dict[int, str] | None]:
        kind = _switch_kind(body)
        node: Json = {"id": node_id, "kind": kind, "latency_ns": self._latency(node_id, kind)}
        labels = trellis_oem(body).get("Labels")
        if isinstance(labels, dict) and labels:
            node["labels"] = {str(k): str(v) for k, v in labels.items()}
        if kind != "ocs":
            return node, None
        numbers: dict[int, str] = {}
        for port in sorted(p for p, s in port_owner.items() if s == uri):
            number = _port_number(port, ports.get(port, {}))
            if number is None:
                self.notes.append(f"ocs port {port} has no number (URI or PortId): skipped")
            else:
                numbers[number] = port
        if not numbers:
            self.notes.append(f"ocs {uri} lists no numbered port: given one port")
        node["ports"] = max(numbers, default=0) + 1
        return node, numbers

    def _latency(self, node_or_link: str, kind: str) -> int:
        return self.latency.get(node_or_link, self.latency.get(kind, DEFAULT_LATENCY_NS[kind]))

    def _cables(
        self,
        ids: dict[str, str],
        port_owner: dict[str, str],
        ports: dict[str, Json],
        endpoints: dict[str, Json],
        endpoint_nodes: dict[str, list[str]],
        ocs: dict[str, Ocs],
    ) -> tuple[list[Json], dict[str, list[str]]]:
        """One link per cable (and per device behind a cable that carries several), and for
        each the switch ports whose state is the link's."""
        behind_port: dict[str, set[str]] = {}  # a host's or device's port -> its nodes
        for endpoint, standing_for in endpoint_nodes.items():
            for far in links(endpoints.get(endpoint, {}), "Ports"):
                behind_port.setdefault(far, set()).update(standing_for)
        numbers = {p: n for o in ocs.values() for n, p in o.ports.items()}
        made: dict[str, Json] = {}
        cables: dict[str, list[str]] = {}
        seen: set[frozenset[str]] = set()
        for uri in sorted(port_owner):
            port = ports.get(uri)
            if port is None:
                continue
            owner = ids[port_owner[uri]]
            name = _clean(f"{owner}-{last_segment(uri)}")
            peers = links(port, "ConnectedPorts")
            nodes: set[str] = set()
            for peer in peers:
                if peer in port_owner:  # a cable to another switch's port
                    if frozenset((uri, peer)) in seen:
                        continue
                    seen.add(frozenset((uri, peer)))
                    speeds = [s for s in (_speed(port), _speed(ports.get(peer, {}))) if s]
                    link = {"id": name, "a": owner, "b": ids[port_owner[peer]]}
                    link |= _port_field("a", uri, numbers) | _port_field("b", peer, numbers)
                    made[name] = self._link(link, min(speeds, default=None), uri)
                    cables[name] = [uri, peer]
                    continue
                system = _system_of(peer)
                behind = {system} if system else behind_port.get(peer, set())
                if not behind:
                    behind = self._associated(port, endpoint_nodes)
                if not behind:
                    self.notes.append(
                        f"port {uri} is cabled to {peer}, which is no host or device Trellis "
                        "found: skipped"
                    )
                nodes |= behind
            if not peers:
                nodes = self._associated(port, endpoint_nodes)
            nodes = {n for n in nodes if n in ids}
            for node in sorted(nodes, key=ids.__getitem__):
                link_id = name if len(nodes) == 1 else _clean(f"{name}-{ids[node]}")
                link = {"id": link_id, "a": owner, "b": ids[node], **_port_field("a", uri, numbers)}
                made[link_id] = self._link(link, _speed(port), uri)
                cables[link_id] = [uri]
        return [made[k] for k in sorted(made)], {k: cables[k] for k in sorted(made)}

    def _link(self, link: Json, speed: float | None, port: str) -> Json:
        if speed is None:
            self.notes.append(
                f"port {port} gives no CurrentSpeedGbps or MaxSpeedGbps: its cable counts "
                f"{DEFAULT_CAPACITY_GBPS:g} Gbps"
            )
        link["capacity_gbps"] = float(speed or DEFAULT_CAPACITY_GBPS)
        link["latency_ns"] = self._latency(link["id"], "link")
        return link

    def _associated(self, port: Json, endpoint_nodes: dict[str, list[str]]) -> set[str]:
        return {n for e in links(port, "AssociatedEndpoints") for n in endpoint_nodes.get(e, [])}


def _ref(body: Json, name: str) -> str | None:
    return ref(body.get(name))


def _system_of(uri: str) -> str | None:
    """`/redfish/v1/Systems/<id>` for any URI at or below a system."""
    parts = uri.rstrip("/").split("/")
    try:
        at = parts.index("Systems")
    except ValueError:
        return None
    return "/".join(parts[: at + 2]) if len(parts) > at + 1 else None


def _chassis_of(uri: str) -> str | None:
    parts = uri.rstrip("/").split("/")
    if "Chassis" not in parts:
        return None
    at = parts.index("Chassis")
    return "/".join(parts[: at + 2]) if len(parts) > at + 2 else None


def _switch_kind(body: Json) -> str:
    return "ocs" if trellis_oem(body).get("Kind") == "ocs" else "switch"


def _processor_kind(body: Json, entity_kind: str) -> str:
    if entity_kind == "gpu" or body.get("ProcessorType") == "GPU":
        return "gpu"
    return "accelerator"


def _port_number(uri: str, body: Json) -> int | None:
    for candidate in (last_segment(uri), body.get("PortId")):
        if isinstance(candidate, str) and candidate.isdigit():
            return int(candidate)
    return None


def _port_field(end: str, port_uri: str, numbers: dict[str, int]) -> Json:
    number = numbers.get(port_uri)
    return {f"{end}_port": number} if number is not None else {}


def _speed(port: Json) -> float | None:
    for key in ("CurrentSpeedGbps", "MaxSpeedGbps"):
        value = port.get(key)
        if isinstance(value, int | float) and value > 0:
            return float(value)
    return None
