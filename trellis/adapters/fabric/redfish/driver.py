"""The Redfish fabric driver: engine.service.ports.FabricDriver on a fabric manager's Redfish
service (ARCHITECTURE §11, "Southbound"; docs/fabric-drivers.md has the mapping).

- bind, for a whole device: one `ZoneOfEndpoints` per composition in the fabric's `Zones`,
  naming the host's initiator endpoint and the device targets; binding another device of the
  composition adds its endpoint, unbinding takes it out, and the last unbind deletes the zone;
- bind, for a slice of a memory pool: a `MemoryChunk` of the slice's size in the pool's
  `MemoryDomain`, then a `Connection` of type `Memory` whose `MemoryChunkInfo` names it, from
  the host's initiator endpoint to the pool's target endpoint; unbind deletes both;
- create_circuit: `Oem.Trellis.CircuitTo` (a link to the other port) on both ports of an OCS,
  which is a `Switch` with `Oem.Trellis.Kind: "ocs"`; remove_circuit sets both to null.
Everything it creates or sets carries `Oem.Trellis.CompositionId` (circuits belong to a host,
not a composition) and `Oem.Trellis.Domain`, plus what it needs to read its work back exactly
(`Host`, `Device`, `Paths` or `Path`, `CapacityGiB`); `snapshot` reads back only resources so
tagged for the domain, and reports what else it finds holding the domain's devices or ports as
findings, without touching it. Changes carry `If-Match` (adapters/fabric/redfish/client.py).

Fencing (engine.service.ports.FabricDriver): the highest writer epoch seen per domain is recorded on
the Fabric resource (`Oem.Trellis.WriterEpochs`), read before every change and raised with
`If-Match` when a newer writer calls, so an engine that lost its lease is refused once its
successor has made a call, across processes. Redfish has no transaction across resources: a
stale writer that read the epoch just before its successor raised it can still make the one
change it was making (the window is one request), which the successor's reconciliation then
undoes. Beside each epoch the driver records the deployment (the log, schema/022) whose
engines drive the domain (`Oem.Trellis.WriterDeployments`): an engine of another deployment
is refused whatever its epoch, so two logs never take the domain from each other in turn.

The driver reads its own work back on every `snapshot`: the Zones and Connections collections
and the memory pools' MemoryChunks, each member read, and the OCS ports where cables are. A
deep read (the first of a domain, then every `resync_s` seconds) also reads every port of
every OCS, and members the last deep read found to be someone else's, which shallow reads
skip: a shallow read costs what this domain holds, not what the whole fabric manager does.
What the driver itself changed is known between reads; what someone else changed is seen at
the next read (or deep read). Discovery and reads run one at a time per domain and to their
end even when the caller gives up (the saga's deadline), so a slow service is still read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import msgspec

from trellis.adapters.fabric.in_turn import program_in_turn
from trellis.adapters.fabric.redfish.client import (
    HttpError,
    Json,
    RedfishClient,
    RedfishError,
    Resource,
    Unreachable,
)
from trellis.adapters.fabric.redfish.discovery import (
    DiscoveryError,
    FabricMap,
    discover,
    items,
    last_segment,
    links,
    obj,
    ref,
    trellis_oem,
)
from trellis.engine.core.errors import FabricError, WriterFenced
from trellis.engine.core.fabric import FabricBinding, FabricChange, FabricCircuit, FabricSnapshot

log = logging.getLogger(__name__)

#: Seconds between deep reads of a domain's fabric (and so the reconciliation timer's tick).
RESYNC_S = 15.0
#: Seconds before a map that lacked an id is read again from the service.
REDISCOVER_S = 5.0
_T = TypeVar("_T")


class _Zone(msgspec.Struct, kw_only=True):
    uri: str
    host: str
    endpoints: list[str]
    paths: dict[str, list[str]]  # device -> its path, as bound


class _Slice(msgspec.Struct, kw_only=True):
    host: str
    path: list[str]
    capacity_gib: float
    chunk: str | None = None
    connection: str | None = None


class _Foreign(msgspec.Struct, frozen=True):
    """A member that is not this domain's work."""

    said: list[str]  # what it makes us report
    zoned: list[str] = []  # the endpoints an untagged zone of this domain's devices holds


class _Held(msgspec.Struct, kw_only=True):
    """The driver's own work on one domain's fabric, as last read (and changed since)."""

    zones: dict[str, _Zone] = {}  # composition -> its zone
    slices: dict[tuple[str, str], _Slice] = {}  # (device, composition) -> its chunk and connection
    ports: dict[str, Json] = {}  # OCS port -> its Oem.Trellis, as last read
    findings: list[str] = []
    foreign: dict[str, _Foreign] = {}  # members not this domain's
    read_at: float | None = None  # of the last deep read (None: never read)
    stale: bool = True  # a change's outcome is unknown: read everything before the next one
    version: int = 0  # moved by every change, before and after: a read across one is stale


class RedfishFabric:
    """A FabricDriver on a Redfish fabric manager.

    Args:
        client: A client of the service (adapters/fabric/redfish/client.py).
        fabric: The fabric every domain uses (its URI's last segment); None: the fabric named
            like the domain, else the service's only one.
        resync_s: Seconds between deep reads; the reconciliation timer kicks the engine's
            fabric passes as often (adapters/fabric/redfish/watch.py).
        events_at: (host, port) to receive the service's events on, when it has an
            EventService (watch.py); None: health is polled only.
        poll_s: Seconds between polls of the ports' health.
    """

    def __init__(
        self,
        client: RedfishClient,
        *,
        fabric: str | None = None,
        resync_s: float = RESYNC_S,
        events_at: tuple[str, int] | None = None,
        poll_s: float = 5.0,
        deployment: str | None = None,
    ) -> None:
        self.client = client
        # This engine's deployment (its log's), recorded with the epochs; None: not checked.
        self.deployment = deployment
        self.fabric = fabric
        self.resync_s = resync_s
        self.events_at = events_at
        self.poll_s = poll_s
        self._maps: dict[str, FabricMap] = {}
        self._mapped_at: dict[str, float] = {}
        self._mapping: dict[str, asyncio.Future[FabricMap]] = {}
        self._reading: dict[str, tuple[bool, asyncio.Future[FabricSnapshot]]] = {}
        self._held: dict[str, _Held] = {}
        self._fences: dict[str, int] = {}
        self._epochless: set[str] = set()  # Fabric resources that refuse Oem.Trellis
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def close(self) -> None:
        await self.client.close()

    # -- the map -----------------------------------------------------------------------------

    async def fabric_map(self, domain: str, *, needs: tuple[str, ...] = ()) -> FabricMap:
        """The domain's fabric as discovered (adapters/fabric/redfish/discovery.py); read
        again when it lacks one of the node ids in `needs` (at most every REDISCOVER_S).

        Raises:
            FabricError: The service cannot be read, or names no fabric for the domain.
        """
        fmap = self._maps.get(domain)
        known = fmap is not None and all(_names(fmap, n) for n in needs)
        recent = time.monotonic() - self._mapped_at.get(domain, -math.inf) < REDISCOVER_S
        if fmap is not None and (known or recent):
            return fmap
        # One discovery at a time per domain, shielded: a caller that gives up (the saga's
        # deadline) leaves it running for the next, so a slow service is still mapped.
        mapping = self._mapping.get(domain)
        if mapping is None:
            mapping = self._mapping[domain] = _background(self._discover(domain))
            mapping.add_done_callback(lambda _: self._mapping.pop(domain, None))
        return await asyncio.shield(mapping)

    async def _discover(self, domain: str) -> FabricMap:
        try:
            fmap = await discover(self.client, fabric=await self._fabric_of(domain))
        except (DiscoveryError, RedfishError) as exc:
            raise FabricError(f"domain {domain}: {exc}") from None
        self._maps[domain] = fmap
        self._mapped_at[domain] = time.monotonic()
        return fmap

    async def _fabric_of(self, domain: str) -> str | None:
        if self.fabric is not None:
            return self.fabric
        fabrics = [last_segment(f) for f in await self.client.members("/redfish/v1/Fabrics")]
        if domain in fabrics:
            return domain
        if len(fabrics) == 1:
            return fabrics[0]
        raise FabricError(
            f"domain {domain}: the Redfish service has {len(fabrics)} fabrics "
            f"({', '.join(fabrics) or 'none'}) and none is named {domain!r}; "
            "name one with TRELLIS_REDFISH_FABRIC"
        )

    # -- the FabricDriver port ---------------------------------------------------------------

    async def create_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        """`Oem.Trellis.CircuitTo` on both ports; a no-op when exactly this circuit exists."""
        a, b = await self._circuit_ports(domain, circuit)
        async with self._lock(domain, f"ocs:{circuit.ocs}"):
            await self._fenced(domain, fence)
            held = self._held.setdefault(domain, _Held())
            await self._guarded(circuit.ocs, self._set_circuit(domain, circuit, a, b), held)

    async def remove_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        """Clear `Oem.Trellis.CircuitTo` on both ports; a no-op when this circuit is absent."""
        a, b = await self._circuit_ports(domain, circuit)
        async with self._lock(domain, f"ocs:{circuit.ocs}"):
            await self._fenced(domain, fence)
            held = self._held.setdefault(domain, _Held())
            await self._guarded(circuit.ocs, self._clear_circuit(domain, a, b), held)

    async def bind(self, domain: str, binding: FabricBinding, *, fence: int | None = None) -> None:
        """Zone a device to its host (a memory slice: a chunk and a connection); a no-op when
        exactly this binding exists."""
        _check_path(binding)
        fmap = await self.fabric_map(domain, needs=(binding.host, binding.device))
        host_ep, device_ep = self._endpoints(fmap, binding)
        async with self._lock(domain, binding.composition_id):
            await self._fenced(domain, fence)
            held = await self._current(domain, fmap)
            if binding.capacity_gib is not None:
                work = self._bind_slice(domain, fmap, held, binding, host_ep, device_ep)
            else:
                work = self._bind_zone(domain, fmap, held, binding, host_ep, device_ep)
            await self._guarded(binding.device, work, held)

    async def unbind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> None:
        """Take a device out of its composition's zone (a slice: delete its connection and
        chunk); a no-op when the host does not hold it for that composition."""
        fmap = await self.fabric_map(domain, needs=(binding.host, binding.device))
        _, device_ep = self._endpoints(fmap, binding)
        async with self._lock(domain, binding.composition_id):
            await self._fenced(domain, fence)
            held = await self._current(domain, fmap)
            if (binding.device, binding.composition_id) in held.slices:
                work = self._unbind_slice(held, binding)
            else:
                work = self._unbind_zone(fmap, held, binding, device_ep)
            await self._guarded(binding.device, work, held)

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        """The changes one request after another: Redfish has no batch of PATCHes."""
        await program_in_turn(self, domain, changes, fence=fence, started=started)

    async def snapshot(self, domain: str, *, fence: int | None = None) -> FabricSnapshot:
        """What the fabric manager holds of this domain's work, read from it."""
        fmap = await self.fabric_map(domain)
        await self._fenced(domain, fence)
        held = self._held.setdefault(domain, _Held())
        due = held.read_at is None or time.monotonic() - held.read_at >= self.resync_s
        return await self._fresh(domain, fmap, held, deep=due or held.stale)

    def findings(self, domain: str) -> list[str]:
        """What the last read of the domain's fabric found and cannot explain."""
        held = self._held.get(domain)
        return list(held.findings) if held is not None else []

    def fence_of(self, domain: str) -> int:
        """The highest writer epoch this driver has seen for `domain` (0: none yet)."""
        return self._fences.get(domain, 0)

    # -- reading back ------------------------------------------------------------------------

    async def _current(self, domain: str, fmap: FabricMap) -> _Held:
        """What the driver holds on the domain, read from the service first when it never
        was, or when a change's outcome is unknown (a lost answer)."""
        held = self._held.setdefault(domain, _Held())
        if held.stale:
            await self._fresh(domain, fmap, held, deep=True)
        return held

    async def _fresh(
        self, domain: str, fmap: FabricMap, held: _Held, *, deep: bool
    ) -> FabricSnapshot:
        """A read of the domain's work on the service. One read at a time per domain, shielded
        like discovery; a caller that wants a deep read and finds a shallow one running
        waits for it, then reads deeply."""
        while True:
            running = self._reading.get(domain)
            if running is None:
                running = (deep, _background(self._read(domain, fmap, held, deep=deep)))
                self._reading[domain] = running
                running[1].add_done_callback(lambda _: self._reading.pop(domain, None))
            was_deep, read = running
            try:
                snapshot = await asyncio.shield(read)
            except RedfishError as exc:
                raise FabricError(f"reading the fabric of {domain}: {exc}") from None
            if was_deep or not deep:
                return snapshot

    async def _read(
        self, domain: str, fmap: FabricMap, held: _Held, *, deep: bool
    ) -> FabricSnapshot:
        """Read the domain's work back. What it read replaces what `held` knows only when the
        driver changed nothing meanwhile (else `held`, kept up to date by the change, is
        newer); the snapshot is what was read either way."""
        version = held.version
        findings: list[str] = []
        devices = set(fmap.device_endpoints.values())
        # Members that are not this domain's, each with what it makes us report: a shallow
        # read skips those the last deep read found, so it costs what this domain holds.
        foreign: dict[str, _Foreign] = {}

        async def members(collection: str | None) -> list[Resource]:
            uris = await self._member_uris(collection)
            known = {} if deep else {u: held.foreign[u] for u in uris if u in held.foreign}
            for uri, seen in known.items():
                foreign[uri] = seen
                findings.extend(seen.said)
            read = await asyncio.gather(
                *(self.client.get_or_none(u) for u in uris if u not in known)
            )
            return [r for r in read if r is not None]

        def not_ours(uri: str, *said: str, zoned: list[str] | None = None) -> None:
            foreign[uri] = _Foreign(list(said), zoned or [])
            findings.extend(said)

        zones: dict[str, _Zone] = {}
        for zone in await members(fmap.zones):
            oem, endpoints = trellis_oem(zone.body), links(zone.body, "Endpoints")
            cid = oem.get("CompositionId")
            if oem.get("Domain") != domain:
                if not oem and devices & set(endpoints):  # another client's zone
                    not_ours(zone.uri, _foreign("zone", zone.uri, endpoints), zoned=endpoints)
                else:
                    not_ours(zone.uri)
                continue
            if not isinstance(cid, str) or not isinstance(oem.get("Host"), str):
                findings.append(f"zone {zone.uri} is tagged for {domain} but names no composition")
                continue
            if cid in zones:  # one zone per composition: the first is its zone
                findings.append(f"zones {zones[cid].uri} and {zone.uri} are both tagged for {cid}")
                continue
            zones[cid] = _Zone(
                uri=zone.uri, host=oem["Host"], endpoints=endpoints, paths=_paths(oem)
            )
        slices: dict[tuple[str, str], _Slice] = {}
        for connection in await members(fmap.connections):
            oem = trellis_oem(connection.body)
            if oem.get("Domain") != domain:
                targets = links(connection.body, "TargetEndpoints")
                theirs = not oem and devices & set(targets)
                said = [_foreign("connection", connection.uri, targets)] if theirs else []
                not_ours(connection.uri, *said)
                continue
            key, made = _slice(oem)
            chunks = [
                ref(obj(info).get("MemoryChunk"))
                for info in items(connection.body.get("MemoryChunkInfo"))
            ]
            if key is None or made is None:
                findings.append(
                    f"connection {connection.uri} is tagged for {domain} but unreadable"
                )
                continue
            made.connection, made.chunk = connection.uri, next((c for c in chunks if c), None)
            slices[key] = made
        chunks_read: set[str] = set()
        for pool in sorted(set(fmap.memory_domains.values())):
            for chunk in await members(f"{pool}/MemoryChunks"):
                oem = trellis_oem(chunk.body)
                key, made = _slice(oem)
                if oem.get("Domain") != domain or key is None or made is None:
                    not_ours(chunk.uri)
                    continue
                chunks_read.add(chunk.uri)
                if key not in slices:
                    made.chunk = chunk.uri  # a chunk without its connection: half made
                    slices[key] = made
                elif slices[key].chunk != chunk.uri:
                    findings.append(
                        f"memory chunk {chunk.uri} of {key[1]} is not the connected one"
                    )
        for made in slices.values():
            if made.connection is not None and made.chunk not in chunks_read:
                # The connection joins nothing: no slice (the engine unbinds and makes it anew).
                findings.append(f"connection {made.connection} names no memory chunk there is")
                made.chunk = None
        ports = dict(held.ports)
        watched = {p for o in fmap.ocs.values() for p in o.ports.values()}
        cabled = {p for ps in fmap.cables.values() for p in ps}
        for uri in sorted(watched if deep else watched & cabled):
            resource = await self.client.get_or_none(uri)
            ports[uri] = trellis_oem(resource.body) if resource is not None else {}
        for uri, oem in ports.items():
            if oem.get("CircuitTo") and oem.get("Domain") not in (domain, None):
                continue  # another domain's circuit
            if oem.get("CircuitTo") and oem.get("Domain") is None:
                findings.append(f"ocs port {uri} is in a circuit that is not Trellis's")
            elif (to := _circuit_to_in(oem)) is not None and _circuit_to_in(
                ports.get(to, {})
            ) != uri:
                findings.append(f"ocs port {uri} is in a circuit with {to}, which is not with it")
        read = _Held(zones=zones, slices=slices, ports=ports, findings=findings)
        held.findings, held.foreign = findings, foreign
        if held.version == version:
            held.zones, held.slices, held.ports = zones, slices, ports
            held.stale = False
            if deep:
                held.read_at = time.monotonic()
        return _snapshot(domain, fmap, read)

    async def _member_uris(self, collection: str | None) -> list[str]:
        if collection is None:
            return []
        try:
            return await self.client.members(collection)
        except HttpError as exc:
            if exc.status == 404:
                return []
            raise

    # -- zones ---------------------------------------------------------------------------------

    async def _bind_zone(
        self,
        domain: str,
        fmap: FabricMap,
        held: _Held,
        binding: FabricBinding,
        host_ep: str,
        device_ep: str,
    ) -> None:
        cid, device = binding.composition_id, binding.device
        for other_cid, other in held.zones.items():
            if other_cid != cid and device in other.paths and other.host != binding.host:
                raise FabricError(
                    f"{device} is already bound to host {other.host}", component=device
                )
        zone = held.zones.get(cid)
        bound = zone.paths.get(device) if zone is not None else None
        for uri, seen in held.foreign.items():  # another client's zone counts as much
            if device_ep in seen.zoned and bound is None:
                hosts = {n for e in seen.zoned for n in fmap.endpoint_nodes.get(e, [])}
                others = sorted(hosts & fmap.host_endpoints.keys() - {binding.host})
                if others:
                    raise FabricError(
                        f"{device} is already bound to host {others[0]} by zone {uri}, "
                        "not Trellis's",
                        component=device,
                    )
        if zone is not None:
            if bound is not None and bound != binding.path:
                raise FabricError(
                    f"{device} is already bound to {zone.host} for {cid} over {'>'.join(bound)}",
                    component=device,
                )

            def add(body: Json) -> Json | None:
                endpoints, oem = links(body, "Endpoints"), trellis_oem(body)
                paths = _paths(oem)
                if device_ep in endpoints and paths.get(device) == binding.path:
                    return None
                wanted = [*endpoints, *(e for e in (host_ep, device_ep) if e not in endpoints)]
                return {
                    "Links": {"Endpoints": [{"@odata.id": e} for e in wanted]},
                    "Oem": {"Trellis": {**oem, "Paths": {**paths, device: binding.path}}},
                }

            try:
                await self.client.update(zone.uri, add)
            except HttpError as exc:
                if exc.status != 404:
                    raise
                held.stale = True  # deleted by someone else: read again, then make it anew
                raise FabricError(f"zone {zone.uri} of {cid} vanished", component=device) from None
            zone.endpoints = sorted({*zone.endpoints, host_ep, device_ep})
            zone.paths[device] = list(binding.path)
            return
        if fmap.zones is None:
            raise FabricError(f"the fabric {fmap.fabric} has no Zones", component=device)
        body = {
            "Name": f"Trellis composition {cid}",
            "Description": f"Trellis composition {cid} of domain {domain}",
            "ZoneType": "ZoneOfEndpoints",
            "Links": {"Endpoints": [{"@odata.id": host_ep}, {"@odata.id": device_ep}]},
            "Oem": {
                "Trellis": {
                    "CompositionId": cid,
                    "Domain": domain,
                    "Host": binding.host,
                    "Paths": {device: binding.path},
                }
            },
        }
        uri = await self._create(held, fmap.zones, body)
        held.zones[cid] = _Zone(
            uri=uri, host=binding.host, endpoints=[host_ep, device_ep], paths={device: binding.path}
        )

    async def _unbind_zone(
        self, fmap: FabricMap, held: _Held, binding: FabricBinding, device_ep: str
    ) -> None:
        cid, device = binding.composition_id, binding.device
        zone = held.zones.get(cid)
        if zone is None or zone.host != binding.host or device not in zone.paths:
            return
        rest = {d: p for d, p in zone.paths.items() if d != device}
        if not rest:
            await self.client.delete(zone.uri, still=_tagged(cid))
            del held.zones[cid]
            return
        # An endpoint can stand for several devices (one cable to two memory domains): it
        # leaves the zone with the last of them.
        shared = any(fmap.device_endpoints.get(d) == device_ep for d in rest)

        def remove(body: Json) -> Json | None:
            oem = trellis_oem(body)
            paths = _paths(oem)
            if device not in paths:
                return None
            endpoints = links(body, "Endpoints")
            if not shared:
                endpoints = [e for e in endpoints if e != device_ep]
            kept = {d: p for d, p in paths.items() if d != device}
            return {
                "Links": {"Endpoints": [{"@odata.id": e} for e in endpoints]},
                # The whole object, whether the service merges a PATCH or replaces: a device
                # taken out is null (a merge keeps what it is not told to change).
                "Oem": {"Trellis": {**oem, "Paths": {**dict.fromkeys(paths), **kept}}},
            }

        await self.client.update(zone.uri, remove)
        zone.paths = rest
        if not shared:
            zone.endpoints = [e for e in zone.endpoints if e != device_ep]

    # -- memory slices -------------------------------------------------------------------------

    async def _bind_slice(
        self,
        domain: str,
        fmap: FabricMap,
        held: _Held,
        binding: FabricBinding,
        host_ep: str,
        device_ep: str,
    ) -> None:
        cid, device = binding.composition_id, binding.device
        assert binding.capacity_gib is not None
        pool = fmap.memory_domains.get(device)
        if pool is None:
            raise FabricError(f"{device} is no memory pool of {fmap.fabric}", component=device)
        if fmap.connections is None:
            raise FabricError(f"the fabric {fmap.fabric} has no Connections", component=device)
        key = (device, cid)
        made = held.slices.get(key)
        if made is not None and made.connection is not None and made.chunk is None:
            # Its chunk is gone: the connection joins nothing. Made anew, chunk first.
            await self.client.delete(made.connection, still=_tagged(cid))
            del held.slices[key]
            made = None
        if made is not None and made.connection is not None:
            if (made.host, made.path, made.capacity_gib) == (
                binding.host,
                binding.path,
                binding.capacity_gib,
            ):
                return
            raise FabricError(
                f"{device} is already bound to {made.host} for {cid} over {'>'.join(made.path)}",
                component=device,
            )
        tags = {
            "CompositionId": cid,
            "Domain": domain,
            "Device": device,
            "Host": binding.host,
            "Path": binding.path,
            "CapacityGiB": binding.capacity_gib,
        }
        if made is None or made.chunk is None:
            chunk_body = {
                "Name": f"Trellis {cid} {device}",
                "MemoryChunkSizeMiB": _chunk_size(fmap, device, binding.capacity_gib),
                "Oem": {"Trellis": tags},
            }
            chunk = await self._create(held, f"{pool}/MemoryChunks", chunk_body)
            made = held.slices[key] = _Slice(
                host=binding.host,
                path=list(binding.path),
                capacity_gib=binding.capacity_gib,
                chunk=chunk,
            )
        connection_body = {
            "Name": f"Trellis {cid} {device}",
            "ConnectionType": "Memory",
            "MemoryChunkInfo": [
                {"MemoryChunk": {"@odata.id": made.chunk}, "AccessCapabilities": ["Read", "Write"]}
            ],
            "Links": {
                "InitiatorEndpoints": [{"@odata.id": host_ep}],
                "TargetEndpoints": [{"@odata.id": device_ep}],
            },
            "Oem": {"Trellis": tags},
        }
        made.connection = await self._create(held, fmap.connections, connection_body)

    async def _unbind_slice(self, held: _Held, binding: FabricBinding) -> None:
        key = (binding.device, binding.composition_id)
        made = held.slices[key]
        if made.host != binding.host:
            return
        if made.connection is not None:
            await self.client.delete(made.connection, still=_tagged(binding.composition_id))
            made.connection = None
        if made.chunk is not None:
            await self.client.delete(made.chunk, still=_tagged(binding.composition_id))
        del held.slices[key]

    # -- circuits ------------------------------------------------------------------------------

    async def _circuit_ports(self, domain: str, circuit: FabricCircuit) -> tuple[str, str]:
        if circuit.a_port >= circuit.b_port:
            raise FabricError(
                f"circuit on {circuit.ocs} must name two ports with a_port < b_port, "
                f"got {circuit.a_port}-{circuit.b_port}",
                component=circuit.ocs,
            )
        fmap = await self.fabric_map(domain, needs=(circuit.ocs,))
        ocs = fmap.ocs.get(circuit.ocs)
        if ocs is None:
            raise FabricError(f"{circuit.ocs} is no OCS of {fmap.fabric}", component=circuit.ocs)
        missing = [p for p in (circuit.a_port, circuit.b_port) if p not in ocs.ports]
        if missing:
            raise FabricError(
                f"{circuit.ocs} has no port {missing[0]} on {fmap.fabric}", component=circuit.ocs
            )
        return ocs.ports[circuit.a_port], ocs.ports[circuit.b_port]

    async def _set_circuit(self, domain: str, circuit: FabricCircuit, a: str, b: str) -> None:
        held = self._held.setdefault(domain, _Held())
        for attempt in range(3):
            ends = [await self.client.get(a), await self.client.get(b)]
            for end, other, number in ((ends[0], b, circuit.a_port), (ends[1], a, circuit.b_port)):
                to = _circuit_to(end.body)
                if to is not None and to != other and await self._in_circuit(domain, end, to):
                    peer = last_segment(to)
                    raise FabricError(
                        f"{circuit.ocs} port {number} is already in circuit with port {peer}",
                        component=circuit.ocs,
                    )
            try:
                for end, other in ((ends[0], b), (ends[1], a)):
                    if _circuit_to(end.body) != other:
                        tags = {"CircuitTo": {"@odata.id": other}, "Domain": domain}
                        await self.client.patch(end, {"Oem": {"Trellis": tags}})
                        held.ports[end.uri] = tags
                return
            except HttpError as exc:
                if exc.status not in (412, 428) or attempt == 2:
                    raise

    async def _in_circuit(self, domain: str, end: Resource, to: str) -> bool:
        """Whether a port's `CircuitTo` is a circuit: the port it names names it back, or it
        is not this domain's (half of one of ours is no circuit, and may be overwritten)."""
        if trellis_oem(end.body).get("Domain") != domain:
            return True
        peer = await self.client.get_or_none(to)
        return peer is not None and _circuit_to(peer.body) == end.uri

    async def _clear_circuit(self, domain: str, a: str, b: str) -> None:
        held = self._held.setdefault(domain, _Held())
        for this, other in ((a, b), (b, a)):
            # Only this domain's half: a port tagged for another domain, or not at all, is
            # someone else's circuit, never cleared (ARCHITECTURE §11).
            change = await self.client.update(
                this,
                lambda body, other=other: (  # type: ignore[misc]
                    {"Oem": {"Trellis": {"CircuitTo": None}}}
                    if _circuit_to(body) == other and trellis_oem(body).get("Domain") == domain
                    else None
                ),
            )
            if change is not None:
                held.ports[this] = {"CircuitTo": None, "Domain": domain}

    # -- helpers -------------------------------------------------------------------------------

    def _endpoints(self, fmap: FabricMap, binding: FabricBinding) -> tuple[str, str]:
        host_ep = fmap.host_endpoints.get(binding.host)
        if host_ep is None:
            raise FabricError(
                f"host {binding.host} has no initiator endpoint on {fmap.fabric}",
                component=binding.host,
            )
        device_ep = fmap.device_endpoints.get(binding.device)
        if device_ep is None:
            raise FabricError(
                f"device {binding.device} has no endpoint on {fmap.fabric}",
                component=binding.device,
            )
        return host_ep, device_ep

    async def _create(self, held: _Held, collection: str, body: Json) -> str:
        try:
            made = await self.client.post(collection, body)
        except Unreachable:
            held.stale = True  # it may have been made: read before the next change
            raise
        except HttpError as exc:
            if exc.status < 400:  # a redirect, or a task that named nothing made: it may be
                held.stale = True
            raise
        held.foreign.pop(made, None)  # a service may give a deleted member's URI again
        return made

    async def _fenced(self, domain: str, fence: int | None) -> None:
        """Refuse a call from an older writer epoch than the fabric manager has seen for the
        domain; record a newer one on the Fabric resource."""
        if fence is None:
            return
        seen = self._fences.get(domain, 0)
        if fence < seen:
            raise WriterFenced(
                domain,
                f"the fabric has seen writer epoch {seen}; this call carries {fence}",
                seen=seen,
            )
        fmap = await self.fabric_map(domain)
        if fmap.fabric in self._epochless:
            self._fences[domain] = max(seen, fence)
            return

        def record(body: Json) -> Json | None:
            oem = trellis_oem(body)
            epochs = oem.get("WriterEpochs")
            epochs = epochs if isinstance(epochs, dict) else {}
            deployments = oem.get("WriterDeployments")
            deployments = deployments if isinstance(deployments, dict) else {}
            theirs = deployments.get(domain)
            if self.deployment is not None and theirs not in (None, self.deployment):
                # Not a successor but another log: drawing an epoch above its would only take
                # the domain in turn, each log undoing the other's work. Refused with no epoch
                # (seen 0), so the engine draws none above it.
                raise WriterFenced(
                    domain,
                    f"another deployment of Trellis ({theirs}) drives domain {domain} on this "
                    f"fabric manager; this engine's is {self.deployment}. Stop that one, then "
                    f"remove {domain} from Oem.Trellis.WriterEpochs and WriterDeployments of "
                    f"{fmap.fabric} to move the domain here (docs/fabric-drivers.md §3.6)",
                    seen=0,
                )
            recorded = epochs.get(domain, 0)
            if isinstance(recorded, int) and fence < recorded:
                raise WriterFenced(
                    domain,
                    f"the fabric manager has seen writer epoch {recorded}; this call carries "
                    f"{fence}",
                    seen=recorded,
                )
            change: Json = {}
            if recorded != fence:
                change["WriterEpochs"] = {**epochs, domain: fence}
            if self.deployment is not None and theirs is None:
                change["WriterDeployments"] = {**deployments, domain: self.deployment}
            return {"Oem": {"Trellis": change}} if change else None

        try:
            await self.client.update(fmap.fabric, record)
        except HttpError as exc:
            if exc.method != "PATCH" or exc.status not in (400, 405):
                raise FabricError(f"reading the writer epoch of {domain}: {exc}") from None
            # The service refuses Oem properties on its Fabric resource: the epoch can only
            # be checked in this process (docs/fabric-drivers.md §3.6).
            log.warning(
                "the fabric manager keeps no writer epoch on %s (%s): an engine that lost its "
                "lease is refused only by this process's own check",
                fmap.fabric,
                exc,
            )
            self._epochless.add(fmap.fabric)
        except RedfishError as exc:
            raise FabricError(f"reading the writer epoch of {domain}: {exc}") from None
        self._fences[domain] = max(seen, fence)

    async def _guarded(self, component: str, work: Awaitable[None], held: _Held) -> None:
        """Run one change; a failure of the service is a FabricError naming `component`. A
        read that overlaps the change does not overwrite what the change made known."""
        held.version += 1
        try:
            await work
        except asyncio.CancelledError:
            held.stale = True  # given up on mid-change (the saga's deadline): may be half-done
            raise
        except HttpError as exc:
            if exc.status >= 500:
                held.stale = True  # a 5xx may have half-done it
            raise FabricError(str(exc), component=component) from None
        except RedfishError as exc:
            raise FabricError(str(exc), component=component) from None
        finally:
            held.version += 1

    def _lock(self, domain: str, key: str) -> asyncio.Lock:
        return self._locks.setdefault((domain, key), asyncio.Lock())


def _background(work: Coroutine[Any, Any, _T]) -> asyncio.Future[_T]:
    """A task that runs to its end whoever waits for it; its failure is never left unread."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _names(fmap: FabricMap, node: str) -> bool:
    return node in fmap.host_endpoints or node in fmap.device_endpoints or node in fmap.ocs


def _check_path(binding: FabricBinding) -> None:
    if not binding.path or binding.path[0] != binding.host:
        raise FabricError(
            f"path of {binding.device} does not start at host {binding.host}",
            component=binding.device,
        )
    if binding.path[-1] != binding.device:
        raise FabricError(
            f"path to {binding.device} ends at {binding.path[-1]}", component=binding.device
        )


def _tagged(cid: str) -> Callable[[Json], bool]:
    """Delete only what is still tagged with this composition (never another's resource)."""
    return lambda body: trellis_oem(body).get("CompositionId") == cid


def _chunk_size(fmap: FabricMap, pool: str, capacity_gib: float) -> int:
    """The slice in MiB, rounded up to what the pool can make (its MinMemoryChunkSizeMiB
    and MemoryChunkIncrementMiB, as discovery read them)."""
    least, step = fmap.chunking.get(pool, (None, None))
    size = math.ceil(capacity_gib * 1024)
    if step:
        size = math.ceil(size / step) * step
    return max(size, least or 0)


def _foreign(kind: str, uri: str, endpoints: list[str]) -> str:
    named = ", ".join(last_segment(e) for e in sorted(endpoints))
    return f"{kind} {uri}, not Trellis's, holds endpoints of this domain: {named}"


def _paths(oem: Json) -> dict[str, list[str]]:
    """A zone's `Oem.Trellis.Paths`, without the devices taken out (null)."""
    paths = oem.get("Paths")
    if not isinstance(paths, dict):
        return {}
    return {str(d): [str(n) for n in p] for d, p in paths.items() if isinstance(p, list)}


def _circuit_to(body: Json) -> str | None:
    return _circuit_to_in(trellis_oem(body))


def _circuit_to_in(oem: Json) -> str | None:
    """The other port of a port's circuit, from its `Oem.Trellis`."""
    return ref(oem.get("CircuitTo"))


def _slice(oem: Json) -> tuple[tuple[str, str] | None, _Slice | None]:
    cid, device, host = oem.get("CompositionId"), oem.get("Device"), oem.get("Host")
    path, capacity = oem.get("Path"), oem.get("CapacityGiB")
    if not (isinstance(cid, str) and isinstance(device, str) and isinstance(host, str)):
        return None, None
    if not isinstance(path, list) or not isinstance(capacity, int | float):
        return None, None
    return (device, cid), _Slice(host=host, path=[str(p) for p in path], capacity_gib=capacity)


def _snapshot(domain: str, fmap: FabricMap, held: _Held) -> FabricSnapshot:
    bindings = [
        FabricBinding(host=z.host, device=d, path=list(p), composition_id=cid)
        for cid, z in held.zones.items()
        for d, p in z.paths.items()
        if fmap.device_endpoints.get(d) in z.endpoints
    ]
    for (device, cid), made in held.slices.items():
        # A chunk without its connection, or a connection without its chunk, is no slice: an
        # empty path makes it differ from any binding the log wants, so the engine takes it
        # away (or makes it anew).
        whole = made.connection is not None and made.chunk is not None
        path = list(made.path) if whole else []
        bindings.append(
            FabricBinding(
                host=made.host,
                device=device,
                path=path,
                composition_id=cid,
                capacity_gib=made.capacity_gib,
            )
        )
    circuits = set()
    number = {uri: (name, n) for name, o in fmap.ocs.items() for n, uri in o.ports.items()}
    ours = {uri: oem for uri, oem in held.ports.items() if oem.get("Domain") == domain}
    for uri, oem in ours.items():
        # Only ports tagged for this domain, at both ends: another domain's circuit, or one
        # not Trellis's, is no circuit of this domain (the engine would take it away).
        other = _circuit_to_in(oem)
        if other is None or uri not in number or other not in number:
            continue
        if _circuit_to_in(ours.get(other, {})) != uri:
            continue  # half a circuit: not one (the engine makes it again if the log has it)
        (ocs, a), (_, b) = number[uri], number[other]
        circuits.add(FabricCircuit(ocs=ocs, a_port=min(a, b), b_port=max(a, b)))
    return FabricSnapshot(
        circuits=sorted(circuits, key=lambda c: (c.ocs, c.a_port, c.b_port)),
        bindings=sorted(bindings, key=lambda b: (b.host, b.device, b.composition_id)),
        findings=list(held.findings),
    )
