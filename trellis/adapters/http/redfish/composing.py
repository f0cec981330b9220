"""Redfish writes as the engine's intents (ARCHITECTURE §11): `POST /Systems` is a `compose`
and `DELETE /Systems/<id>` a `release`; `CompositionService.Compose` with a one-stanza
Manifest is the engine's `preview` query, `reserve` or `apply`; CompositionReservations are
its reservations. Each intent goes on the subject of the account's tenant, over that tenant's
own connection in secure mode, and the engine's answer maps back to HTTP (registries.py).
An `Idempotency-Key` header is the intent's `request_id`, so a retried request gets the
first answer.
"""

from __future__ import annotations

import collections
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec

from trellis.adapters.http.redfish import resources as rs
from trellis.adapters.http.redfish.accounts import Account
from trellis.adapters.http.redfish.handling import (
    Reply,
    dig,
    if_match,
    json_body,
    may_change,
    only,
    refuse_unknown,
    wrong_type,
)
from trellis.adapters.http.redfish.registries import RedfishError, error, from_engine, message
from trellis.adapters.http.redfish.reservation_duration import ReservationDuration
from trellis.adapters.http.redfish.resources import R, Reader, Viewer, ref
from trellis.adapters.http.server import Request
from trellis.adapters.nats.client import TrellisClient
from trellis.engine.core.ids import Labels, Text, is_valid_id
from trellis.engine.core.intents import MAX_DEVICE_REQUESTS, MAX_DEVICES, LeaseSeconds
from trellis.engine.core.model import MAX_QUANTITY, Name

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
#: A member request's schema property -> the device kind it asks for.
MEMBER_KINDS = {"Memory": "memory", "NetworkInterfaces": "nic", "Storage": "nvme"}
PROCESSOR_KINDS = {"GPU": "gpu", "Accelerator": "accelerator"}
#: What a constrained member may say, by collection: a constraint this service does not know
#: is refused, never dropped, so a system is never composed to less than was asked.
MEMBER_PROPERTIES = {
    "Processors": {"@Redfish.RequestedCount", "@Redfish.AllowOverprovisioning", "Model",
                   "ProcessorType"},
    "Memory": {"@Redfish.RequestedCount", "@Redfish.AllowOverprovisioning", "Model",
               "CapacityMiB"},
    "NetworkInterfaces": {"@Redfish.RequestedCount", "@Redfish.AllowOverprovisioning", "Model"},
    "Storage": {"@Redfish.RequestedCount", "@Redfish.AllowOverprovisioning", "Model"},
}  # fmt: skip
#: What a ComputerSystem request may say outside its members, as for a member's constraints:
#: anything else is refused, never dropped (a misspelt `Memory` or `LeaseSeconds` would compose
#: less than was asked, or a system without its lease).
SYSTEM_PROPERTIES = {"Name", "Description", "Links", "@Redfish.ZoneAffinity", "Oem",
                     *MEMBER_PROPERTIES}  # fmt: skip
LINKS_PROPERTIES = {"ResourceBlocks"}
TRELLIS_OEM_PROPERTIES = {"Tenant", "Labels", "LeaseSeconds"}
#: The Compose action's parameters, and what its Manifest and stanza may say.
COMPOSE_ACTION = "CompositionService.Compose"
COMPOSE_PARAMETERS = {"RequestType", "RequestFormat", "ReservationId", "Manifest", "Oem"}
MANIFEST_PROPERTIES = {"Description", "Expand", "Timestamp", "Stanzas"}
STANZA_PROPERTIES = {"StanzaType", "StanzaId", "Request", "Response"}
#: The blocks of a request, as an error's RelatedProperties names them (an RFC 6901 pointer).
BLOCKS_POINTER = "/Links/ResourceBlocks"
#: The most messages one refusal lists, one per block: a request may name thousands.
LISTED = 16
#: `@Redfish.RequestedCount`, and a memory slice's `CapacityMiB` (1 GiB at least, as the
#: pool's block counts slices in GiB; at most the engine's largest quantity).
RequestedCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_DEVICES)]
SliceMiB = Annotated[int, msgspec.Meta(ge=1024, le=int(MAX_QUANTITY) * 1024)]
REQUEST_TYPES = ("Preview", "PreviewReserve", "Apply")


class Composer:
    """The Systems collection and the composition actions, for the service's accounts."""

    def __init__(
        self,
        reader: Reader,
        client: TrellisClient,
        acting_as: Callable[[str], Awaitable[TrellisClient]],
        reservation_duration: ReservationDuration,
        *,
        writes: bool,
    ) -> None:
        self.reader = reader
        self._reservation_duration = reservation_duration  # a PreviewReserve's hold
        self.client = client  # the service's own: queries (a Preview)
        self._acting_as = acting_as  # the client that sends a tenant's intents
        self._writes = writes  # False: the service reads only

    # ---- Systems: compose and release ----

    async def systems(
        self, request: Request, method: str, parts: list[str], account: Account, viewer: Viewer
    ) -> Reply:
        if not parts:
            if method == "POST":
                return await self._compose(request, account)
            only(method, "GET", "POST")
            body = rs.systems_collection(await self.reader.all(), viewer)
            return Reply(body=body, allow="GET, HEAD, POST")
        if len(parts) == 1 and parts[0] in rs.CAPABILITIES.values():
            only(method, "GET")
            return Reply(body=rs.capabilities(parts[0]))
        if len(parts) in (2, 3) and parts[1] in rs.SYSTEM_MEMBERS:
            domain, composition = await self.reader.find_system(parts[0], viewer)
            if len(parts) == 2:
                body = rs.system_collection(domain, composition, parts[1])
            else:
                held = await self.reader.domain(domain)  # a whole pool's capacity
                body = rs.system_member(held, composition, parts[1], parts[2])
            only(method, "GET")  # once it is known to exist: a path that does not is 404
            return Reply(body=body)
        if len(parts) != 1:
            raise error(404, "ResourceNotFound", "Resource", "/".join(parts))
        cid = parts[0]
        domain, composition = await self.reader.find_system(cid, viewer)
        body = rs.system(domain, composition)
        if method == "DELETE":
            may_change(account)
            self._writable()
            if_match(request, body)
            return await self._release(request, domain, cid, composition["tenant"])
        only(method, "GET", "DELETE")
        return Reply(body=body, allow="GET, HEAD, DELETE")

    async def _compose(self, request: Request, account: Account) -> Reply:
        may_change(account)
        self._writable()
        body = json_body(request)
        _refuse_unknown_properties(body, "")
        tenant = _tenant_of(body, account)
        plan, manifest = await self._manifest(body)
        domain = plan.domain
        intent: dict[str, Any] = {"request_id": _request_id(request), **manifest}
        reply = await (await self._acting_as(tenant)).intent(domain, tenant, "compose", intent)
        if not reply.get("ok"):
            raise await self._refusal(plan, reply, Viewer(account.tenant))
        self.reader.wrote(domain, reply.get("position"))
        result = reply["result"]
        cid = result["composition_id"]
        # The answer is built from the engine's committed reply (what the compose decided),
        # not read back: the projections reach that position a moment later, and any read
        # after this one waits for it (Reader.wrote).
        composition = {
            **result,
            "tenant": tenant,
            "labels": intent.get("labels", {}),
            "reason": intent.get("reason", ""),
        }
        system = rs.system(domain, composition)
        return Reply(
            status=201,
            body=system,
            headers=[("Location", f"{R}/Systems/{cid}")],
            allow="GET, HEAD, DELETE",
        )

    # ---- CompositionService.Compose and CompositionReservations ----

    async def compose_action(self, request: Request, account: Account) -> Reply:
        """`CompositionService.Compose` with a one-stanza Manifest: `Preview` is the engine's
        `preview` query (nothing written), `PreviewReserve` its `reserve` intent, `Apply` its
        `apply` intent, of a `ReservationId` or of the Manifest."""
        may_change(account)
        body = json_body(request)
        _refuse_unknown_parameters(body)
        request_type = body.get("RequestType")
        if request_type is None:
            raise error(400, "ActionParameterMissing", COMPOSE_ACTION, "RequestType")
        if not isinstance(request_type, str):
            raise wrong_type(request_type, "RequestType")
        if request_type not in REQUEST_TYPES:
            raise error(400, "PropertyValueNotInList", str(request_type), "RequestType")
        request_format = body.get("RequestFormat")
        # An Apply of a reservation carries no manifest, so ARCHITECTURE §11 lets it leave the
        # format out; every other request says it.
        by_reservation = request_type == "Apply" and "ReservationId" in body
        if request_format is None and not by_reservation:
            raise error(400, "ActionParameterMissing", COMPOSE_ACTION, "RequestFormat")
        if request_format is not None and not isinstance(request_format, str):
            raise wrong_type(request_format, "RequestFormat")
        if request_format not in (None, "Manifest"):
            raise error(400, "PropertyValueNotInList", str(request_format), "RequestFormat")
        answer: dict[str, Any] = {"RequestFormat": "Manifest", "RequestType": request_type}
        rid = body.get("ReservationId")
        if rid is not None:
            if request_type != "Apply":
                raise error(400, "PropertyValueFormatError", str(rid), "ReservationId",
                            resolution="Only an Apply names a ReservationId.")  # fmt: skip
            if not isinstance(rid, str):
                raise wrong_type(rid, "ReservationId")
            if not is_valid_id(rid):
                raise error(404, "ResourceNotFound", "CompositionReservation", _shown(rid))
            self._writable()
            return await self._apply_reservation(request, account, rid, body, answer)
        stanza, system_request = _stanza(body)
        _refuse_unknown_properties(system_request, "Manifest/Stanzas/0/Request/")
        tenant = _tenant_of(system_request, account)
        plan, manifest = await self._manifest(system_request)
        domain = plan.domain
        stanza = {k: v for k, v in stanza.items() if k != "Response"}
        if request_type == "Preview":
            # The tenant's own view, so its previews are metered as its views are (a preview
            # places: it is not cheap), and under its identity in secure mode.
            acting = await self._acting_as(tenant)
            reply = await acting.view(domain, tenant, "preview", {"manifest": manifest})
            if not reply.get("ok"):
                raise from_engine(reply.get("error", {}), "ResourceBlock")
            chosen = reply["result"]
            stanza["Response"] = _blocks_request(domain, chosen["host"], chosen["devices"])
            answer["Manifest"] = {"Stanzas": [stanza]}
            return Reply(body=answer, allow="POST", etag=False)
        self._writable()
        acting = await self._acting_as(tenant)
        if request_type == "PreviewReserve":
            intent = {
                "request_id": _request_id(request),
                "manifest": manifest,
                "duration_seconds": self._reservation_duration.seconds,
            }
            reply = await acting.intent(domain, tenant, "reserve", intent)
            if not reply.get("ok"):
                raise await self._refusal(plan, reply, Viewer(account.tenant))
            self.reader.wrote(domain, reply.get("position"))
            made = reply["result"]
            stanza["Response"] = _blocks_request(domain, made["host"], made["devices"])
            answer["Manifest"] = {"Stanzas": [stanza]}
            answer["ReservationId"] = made["reservation_id"]
            location = f"{R}/CompositionService/CompositionReservations/{made['reservation_id']}"
            return Reply(body=answer, headers=[("Location", location)], allow="POST", etag=False)
        intent = {"request_id": _request_id(request), "manifest": manifest}
        reply = await acting.intent(domain, tenant, "apply", intent)
        if not reply.get("ok"):
            raise await self._refusal(plan, reply, Viewer(account.tenant))
        system = self._applied(domain, tenant, reply, manifest)
        stanza["Response"] = system
        answer["Manifest"] = {"Stanzas": [stanza]}
        return Reply(body=answer, headers=[("Location", system["@odata.id"])], allow="POST",
                     etag=False)  # fmt: skip

    async def _apply_reservation(
        self, request: Request, account: Account, rid: str, body: dict[str, Any],
        answer: dict[str, Any],
    ) -> Reply:  # fmt: skip
        viewer = Viewer(account.tenant)
        found = await self._find_reservation(rid, viewer)
        if found is not None:
            domains, tenant = [found[0]], str(found[1]["tenant"])
        else:
            # Not live: ask the engine anyway, as the account's tenant, so that one of its own
            # that has ended (expired, cancelled, applied) is refused saying so.
            domains = await self.reader.domains()
            tenant = account.tenant or dig(body, "Oem", "Trellis", "Tenant")
            if not isinstance(tenant, str) or not is_valid_id(tenant):
                raise error(404, "ResourceNotFound", "CompositionReservation", rid)
        acting = await self._acting_as(tenant)
        intent = {"request_id": _request_id(request), "reservation_id": rid}
        for domain in domains:
            reply = await acting.intent(domain, tenant, "apply", intent)
            if not reply.get("ok") and reply.get("error", {}).get("code") == "not_found":
                continue
            manifest: dict[str, Any] = {}
            if found is not None:
                manifest = {
                    "labels": found[1].get("labels", {}),
                    "reason": found[1].get("reason", ""),
                }
            system = self._applied(domain, tenant, reply, manifest)
            answer["ReservationId"] = rid
            return Reply(body=answer | {"Manifest": {"Stanzas": [{
                "StanzaType": "ComposeSystem", "StanzaId": rid, "Response": system}]}},
                headers=[("Location", system["@odata.id"])], allow="POST", etag=False)  # fmt: skip
        raise error(404, "ResourceNotFound", "CompositionReservation", rid)

    async def _refusal(self, plan: _Plan, reply: dict[str, Any], viewer: Viewer) -> RedfishError:
        """The engine's refusal of a plan's intent, when it found no room for named blocks
        held now: per block, SpecifiedResourceAlreadyReserved naming the reservation when
        `viewer` may see it (the reserver is to apply it instead), else ResourceBlockInUse
        (another tenant's reservation is not named to it)."""
        failure = reply.get("error", {})
        if failure.get("code") in ("no_capacity", "no_path") and plan.device_ids:
            now = await self.reader.domain(plan.domain)
            said = []
            for device in plan.device_ids:
                block = rs.block_id(plan.domain, device)
                reservation = None if device in now.by_device else _holding(now, device, viewer)
                if reservation is not None:
                    said.append(
                        message(
                            "SpecifiedResourceAlreadyReserved",
                            block,
                            reservation,
                            resolution=f"Apply reservation {reservation} (the Compose action,"
                            " RequestType Apply, with its ReservationId), or delete it, or select"
                            " a different resource block and resubmit the request.",
                        )
                    )
                elif device in now.by_device or device in now.reserved:
                    said.append(message("ResourceBlockInUse", block))
            if said:
                return RedfishError(409, said)
        return from_engine(failure, "ResourceBlock")

    def _applied(
        self, domain: str, tenant: str, reply: dict[str, Any], manifest: dict[str, Any]
    ) -> dict[str, Any]:
        """The ComputerSystem an apply (or compose) answered, or its Redfish refusal."""
        if not reply.get("ok"):
            raise from_engine(reply.get("error", {}), "CompositionReservation")
        self.reader.wrote(domain, reply.get("position"))
        composition = {
            **reply["result"],
            "tenant": tenant,
            "labels": manifest.get("labels", {}),
            "reason": manifest.get("reason", ""),
        }
        return rs.system(domain, composition)

    async def _find_reservation(
        self, rid: str, viewer: Viewer
    ) -> tuple[str, dict[str, Any]] | None:
        """The domain and engine answer of live reservation `rid` that `viewer` may see."""
        for d in await self.reader.all():
            for r in d.reservations:
                if r["reservation_id"] == rid and viewer.sees(str(r["tenant"])):
                    return d.name, r
        return None

    async def reservations(
        self, request: Request, method: str, parts: list[str], account: Account, viewer: Viewer
    ) -> Reply:
        base = f"{R}/CompositionService/CompositionReservations"
        if not parts:
            only(method, "GET")
            members = [
                f"{base}/{r['reservation_id']}"
                for d in await self.reader.all()
                for r in d.reservations
                if viewer.sees(str(r["tenant"]))
            ]
            name = "Composition Reservations"
            kind = "CompositionReservationCollection"
            return Reply(body=rs.collection(base, kind, name, sorted(members)))
        if len(parts) != 1:
            raise error(404, "ResourceNotFound", "Resource", "/".join(parts))
        found = await self._find_reservation(parts[0], viewer)
        if found is None:
            raise error(404, "ResourceNotFound", "CompositionReservation", parts[0])
        domain, reservation = found
        body = _reservation(domain, reservation)
        allow = "GET, HEAD, DELETE"
        if method == "DELETE":
            may_change(account)
            self._writable()
            if_match(request, body)
            tenant = str(reservation["tenant"])
            intent = {"request_id": _request_id(request), "reservation_id": parts[0]}
            acting = await self._acting_as(tenant)
            reply = await acting.intent(domain, tenant, "cancel-reservation", intent)
            if not reply.get("ok"):
                raise from_engine(reply.get("error", {}), "CompositionReservation")
            self.reader.wrote(domain, reply.get("position"))
            return Reply(status=204, body=None, allow=allow)
        only(method, "GET", "DELETE")
        return Reply(body=body, allow=allow)

    async def _manifest(self, body: dict[str, Any]) -> tuple[_Plan, dict[str, Any]]:
        """The engine's manifest (a compose body without request_id) for a ComputerSystem
        request, checked against the read model, and the plan it came from."""
        plan = await self._plan(body)
        manifest: dict[str, Any] = {}
        if plan.host is not None:
            manifest["host"] = plan.host
        else:
            manifest["host_selector"] = {"labels": {}}
        if plan.device_ids:
            manifest["device_ids"] = plan.device_ids
        if plan.devices:
            manifest["devices"] = plan.devices
        for prop in ("Name", "Description"):  # the system's Name, so Name first
            reason = _checked(body.get(prop, ""), Text, prop)
            if reason:
                manifest["reason"] = reason
                break
        oem = _trellis_oem(body)
        if "Labels" in oem:
            manifest["labels"] = _checked(oem["Labels"], Labels, "Oem/Trellis/Labels")
        if "LeaseSeconds" in oem:
            where = "Oem/Trellis/LeaseSeconds"
            manifest["lease_seconds"] = _checked(oem["LeaseSeconds"], LeaseSeconds, where)
        return plan, manifest

    def _writable(self) -> None:
        if not self._writes:
            raise error(
                501,
                "GeneralError",
                resolution="In secure mode the Redfish service reads only: compose and release "
                "over NATS with the tenant's identity (docs/redfish.md).",
            )

    async def _plan(self, body: dict[str, Any]) -> _Plan:
        """What a POST to Systems asks for, checked against the read model."""
        links = body.get("Links", {})
        if not isinstance(links, dict):
            raise wrong_type(links, "Links")
        blocks = links.get("ResourceBlocks", [])
        if not isinstance(blocks, list):
            raise wrong_type(blocks, "Links/ResourceBlocks")
        if len(blocks) > MAX_DEVICES + 1:
            raise error(400, "PropertyValueOutOfRange", f"{len(blocks)} blocks",
                        "Links/ResourceBlocks", resolution=f"List one Compute block and at "
                        f"most {MAX_DEVICES} device blocks.")  # fmt: skip
        prefix = f"{R}/CompositionService/ResourceBlocks/"
        ids: list[str] = []
        for item in blocks:
            target = item.get("@odata.id") if isinstance(item, dict) else None
            if not isinstance(target, str) or not target.startswith(prefix):
                raise error(400, "ResourceBlockInvalid", str(target),
                            related=[BLOCKS_POINTER])  # fmt: skip
            ids.append(target.removeprefix(prefix).rstrip("/"))
        unnamed = [b for b in ids if not _is_block_id(b)]
        if unnamed:
            raise _each_block("ResourceBlockNotFound", [_shown(b) for b in unnamed])
        twice = sorted(b for b, n in collections.Counter(ids).items() if n > 1)
        if twice:
            raise _each_block(
                "ResourceBlockInvalid",
                twice,
                resolution="The resource block is listed more than once; list each block "
                "once and resubmit the request.",
                related=[BLOCKS_POINTER],
            )
        members = _member_requests(body)
        zone = body.get("@Redfish.ZoneAffinity")
        names = set()
        for bid in ids:
            domain_name, _, _ = bid.partition(".")
            names.add(domain_name)
        if zone is not None:
            if not isinstance(zone, str):
                raise wrong_type(zone, "@Redfish.ZoneAffinity")
            names.add(zone.rstrip("/").rsplit("/", 1)[-1])
        if len(names) > 1:
            raise error(400, "IncompatibleZone")
        known = await self.reader.domains()
        if names:
            domain_name = names.pop()
        elif len(known) == 1:
            domain_name = known[0]
        else:
            raise error(400, "PropertyMissing", "@Redfish.ZoneAffinity")
        if domain_name not in known:
            if zone is not None and not ids:
                raise error(400, "PropertyValueNotInList", str(zone), "@Redfish.ZoneAffinity")
            raise _each_block("ResourceBlockNotFound", ids)
        domain = await self.reader.domain(domain_name)
        missing = [b for b in ids if rs.split_id(b)[1] not in domain.nodes or
                   domain.kind(rs.split_id(b)[1]) not in ("host", "device")]  # fmt: skip
        if missing:
            raise _each_block("ResourceBlockNotFound", missing)
        nodes = [rs.split_id(b)[1] for b in ids]
        hosts = [n for n in nodes if domain.kind(n) == "host"]
        devices = [n for n in nodes if domain.kind(n) == "device"]
        if len(hosts) > 1:
            raise RedfishError(
                400,
                [
                    message(
                        "ResourceBlockInvalid",
                        rs.block_id(domain_name, h),
                        resolution="A composed system has one Compute block; list one.",
                    )
                    for h in hosts[1:]
                ],
            )
        if not devices and not members:
            raise error(400, "PropertyMissing", "Links/ResourceBlocks",
                        resolution="A composed system has at least one device: list a device "
                        "block beside the Compute block, or ask for devices with Processors, "
                        "Memory, NetworkInterfaces or Storage members.")  # fmt: skip
        if devices and not hosts:
            raise error(
                400,
                "ResourceBlockInvalid",
                "Links/ResourceBlocks",
                resolution="A composition of specific blocks names one Compute block (the "
                "host) beside its device blocks.",
            )
        # Blocks in use are the engine's to refuse (see _refusal), not checked here: a retry
        # with the same Idempotency-Key must reach the engine to get its first answer.
        return _Plan(
            domain=domain_name, host=hosts[0] if hosts else None, device_ids=devices,
            devices=members,
        )  # fmt: skip

    async def _release(self, request: Request, domain: str, cid: str, tenant: str) -> Reply:
        intent = {"request_id": _request_id(request), "composition_id": cid}
        reply = await (await self._acting_as(tenant)).intent(domain, tenant, "release", intent)
        if not reply.get("ok"):
            raise from_engine(reply.get("error", {}), "ComputerSystem")
        self.reader.wrote(domain, reply.get("position"))
        return Reply(status=204, body=None, allow="GET, HEAD, DELETE")


def _holding(domain: rs.Domain, device: str, viewer: Viewer) -> str | None:
    """The id of a live reservation holding `device` that `viewer` may see, if any."""
    for reservation in domain.reservations:
        held = {d["id"] for d in reservation.get("devices", [])}
        if device in held and viewer.sees(str(reservation["tenant"])):
            return str(reservation["reservation_id"])
    return None


class _Plan(msgspec.Struct, kw_only=True):
    domain: str
    host: str | None
    device_ids: list[str]
    devices: list[dict[str, Any]]


def _request_id(request: Request) -> str:
    key = request.headers.get("idempotency-key")
    if key is None:
        return str(uuid.uuid4())
    if not _REQUEST_ID.fullmatch(key):
        raise error(400, "PropertyValueFormatError", key, "Idempotency-Key")
    return key


def _stanza(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one `ComposeSystem` stanza of a Compose action's Manifest, and its Request."""
    manifest = body.get("Manifest")
    if manifest is None:
        raise error(400, "ActionParameterMissing", COMPOSE_ACTION, "Manifest")
    if not isinstance(manifest, dict):
        raise wrong_type(manifest, "Manifest")
    stanzas = manifest.get("Stanzas")
    if stanzas is not None and not isinstance(stanzas, list):
        raise wrong_type(stanzas, "Manifest/Stanzas")
    if not stanzas:  # none, or an empty list: the registry's own case
        raise error(400, "EmptyManifest")
    if len(stanzas) != 1:
        raise error(400, "PropertyValueFormatError", _shown(stanzas), "Manifest/Stanzas",
                    resolution="A Manifest holds one ComposeSystem stanza; send one per "
                    "request.")  # fmt: skip
    stanza = stanzas[0]
    if not isinstance(stanza, dict):
        raise wrong_type(stanza, "Manifest/Stanzas/0")
    refuse_unknown(stanza, STANZA_PROPERTIES, "Manifest/Stanzas/0/", action=COMPOSE_ACTION)
    kind = stanza.get("StanzaType")
    if kind != "ComposeSystem":
        raise error(400, "PropertyValueNotInList", str(kind), "Manifest/Stanzas/0/StanzaType")
    system_request = stanza.get("Request")
    if system_request is None:  # a stanza with no request: EmptyManifest's other case
        raise error(400, "EmptyManifest")
    if not isinstance(system_request, dict):
        raise wrong_type(system_request, "Manifest/Stanzas/0/Request")
    return stanza, system_request


def _blocks_request(domain: str, host: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    """A ComputerSystem request naming the blocks chosen: a preview's or a reservation's."""
    blocks = [host, *dict.fromkeys(str(d["id"]) for d in devices)]
    prefix = f"{R}/CompositionService/ResourceBlocks"
    return {"Links": {"ResourceBlocks": [ref(f"{prefix}/{rs.block_id(domain, b)}")
                                         for b in blocks]}}  # fmt: skip


def _reservation(domain: str, reservation: dict[str, Any]) -> dict[str, Any]:
    rid = str(reservation["reservation_id"])
    request = _blocks_request(domain, str(reservation["host"]), reservation["devices"])
    return {
        "@odata.id": f"{R}/CompositionService/CompositionReservations/{rid}",
        "@odata.type": "#CompositionReservation.v1_0_2.CompositionReservation",
        "Id": rid,
        "Name": f"Composition Reservation {rid}",
        "ReservationTime": str(reservation["made_at"]),
        "Client": str(reservation["tenant"]),
        "ReservedResourceBlocks": request["Links"]["ResourceBlocks"],
        "Manifest": {
            "Description": str(reservation.get("reason") or ""),
            "Timestamp": str(reservation["made_at"]),
            "Expand": "None",
            # No `Request` in the stanza: Manifest's Request type is open (AdditionalProperties)
            # but DMTF's Service Validator fails any property in it, its `Links` included. The
            # blocks it would name are ReservedResourceBlocks.
            "Stanzas": [{"StanzaType": "ComposeSystem", "StanzaId": rid}],
        },
        "Oem": {"Trellis": {"ExpiresAt": str(reservation["expires_at"])}},
    }


def _refuse_unknown_properties(system_request: dict[str, Any], where: str) -> None:
    """Refuse a ComputerSystem request (at `where`) saying what this service does not take, at
    its top level, in its `Links`, its `Oem` and its `Oem.Trellis` (members: _member_requests)."""
    refuse_unknown(system_request, SYSTEM_PROPERTIES, where)
    links = system_request.get("Links")
    if isinstance(links, dict):
        refuse_unknown(links, LINKS_PROPERTIES, f"{where}Links/")
    oem = system_request.get("Oem")
    if isinstance(oem, dict):
        refuse_unknown(oem, {"Trellis"}, f"{where}Oem/")
        trellis = oem.get("Trellis")
        if isinstance(trellis, dict):
            refuse_unknown(trellis, TRELLIS_OEM_PROPERTIES, f"{where}Oem/Trellis/")


def _refuse_unknown_parameters(body: dict[str, Any]) -> None:
    """Refuse a Compose action with a parameter it does not take, as bmcweb does
    (`ActionParameterUnknown`); its stanza's Request is checked as a POST to Systems is."""
    refuse_unknown(body, COMPOSE_PARAMETERS, action=COMPOSE_ACTION)
    manifest = body.get("Manifest")
    if isinstance(manifest, dict):
        refuse_unknown(manifest, MANIFEST_PROPERTIES, "Manifest/", action=COMPOSE_ACTION)
    oem = body.get("Oem")
    if isinstance(oem, dict):
        refuse_unknown(oem, {"Trellis"}, "Oem/", action=COMPOSE_ACTION)
        trellis = oem.get("Trellis")
        if isinstance(trellis, dict):
            refuse_unknown(trellis, {"Tenant"}, "Oem/Trellis/", action=COMPOSE_ACTION)


def _tenant_of(body: dict[str, Any], account: Account) -> str:
    """Whose request: the account's tenant, or the one an Administrator names in
    `Oem.Trellis.Tenant`."""
    oem_tenant = _trellis_oem(body).get("Tenant")
    if account.tenant is not None:
        if oem_tenant is not None and oem_tenant != account.tenant:
            raise error(403, "InsufficientPrivilege")
        return account.tenant
    if oem_tenant is None:
        raise error(400, "PropertyMissing", "Oem/Trellis/Tenant")
    if not isinstance(oem_tenant, str):
        raise wrong_type(oem_tenant, "Oem/Trellis/Tenant")
    if not is_valid_id(oem_tenant):
        raise error(400, "PropertyValueFormatError", _shown(oem_tenant), "Oem/Trellis/Tenant")
    return oem_tenant


def _member_requests(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The `devices` entries of a constrained compose: each member with
    `@Redfish.RequestedCount` under Processors, Memory, NetworkInterfaces or Storage."""
    devices: list[dict[str, Any]] = []
    for prop, known in MEMBER_PROPERTIES.items():
        group = body.get(prop)
        if group is None:
            continue
        if not isinstance(group, dict):
            raise wrong_type(group, prop)
        members = group.get("Members")
        if members is None:
            raise error(400, "PropertyMissing", f"{prop}/Members")
        if not isinstance(members, list):
            raise wrong_type(members, f"{prop}/Members")
        if len(devices) + len(members) > MAX_DEVICE_REQUESTS:
            raise error(400, "PropertyValueOutOfRange", f"{len(members)} members",
                        f"{prop}/Members", resolution=f"Ask for at most {MAX_DEVICE_REQUESTS} "
                        "members in all; one member may ask for many devices with "
                        "@Redfish.RequestedCount.")  # fmt: skip
        for i, member in enumerate(members):
            where = f"{prop}/Members/{i}"
            if not isinstance(member, dict):
                raise wrong_type(member, where)
            unknown = sorted(set(member) - known)
            if unknown:
                raise RedfishError(400, [
                    message("PropertyUnknown", f"{where}/{k}", resolution="This service "
                            f"composes by {', '.join(sorted(known))} only; remove the other "
                            "constraints and resubmit the request.")
                    for k in unknown[:LISTED]
                ])  # fmt: skip
            if member.get("@Redfish.AllowOverprovisioning", False) is not False:
                raise error(400, "PropertyValueNotInList",
                            _shown(member["@Redfish.AllowOverprovisioning"]),
                            f"{where}/@Redfish.AllowOverprovisioning",
                            resolution="This service never overprovisions "
                            "(AllowOverprovisioning is false).")  # fmt: skip
            count = member.get("@Redfish.RequestedCount", 1)
            entry: dict[str, Any] = {
                "count": _checked(count, RequestedCount, f"{where}/@Redfish.RequestedCount")
            }
            if prop == "Processors":
                ptype = _checked(member.get("ProcessorType", "GPU"), str, f"{where}/ProcessorType")
                if ptype not in PROCESSOR_KINDS:
                    raise error(400, "PropertyValueNotInList", _shown(ptype),
                                f"{where}/ProcessorType")  # fmt: skip
                entry["kind"] = PROCESSOR_KINDS[ptype]
            else:
                entry["kind"] = MEMBER_KINDS[prop]
            if "Model" in member:
                entry["models"] = [_checked(member["Model"], Name, f"{where}/Model")]
            if prop == "Memory":
                if "CapacityMiB" not in member:
                    raise error(400, "PropertyMissing", f"{where}/CapacityMiB")
                mib = _checked(member["CapacityMiB"], SliceMiB, f"{where}/CapacityMiB")
                entry["capacity_gib"] = mib / 1024
            devices.append(entry)
    return devices


def _each_block(name: str, blocks: list[str], **kwargs: Any) -> RedfishError:
    """A 400 with message `name` for each of `blocks`, the first LISTED of them: the rest are
    counted in the last message's resolution."""
    messages = [message(name, b, **kwargs) for b in blocks[:LISTED]]
    if len(blocks) > LISTED:
        messages.append(message("GeneralError", resolution=f"{len(blocks) - LISTED} more "
                                "blocks have the same problem as those listed."))  # fmt: skip
    return RedfishError(400, messages)


def _is_block_id(bid: str) -> bool:
    """Whether `bid` has a block id's shape, `<domain>.<node id>`."""
    domain, dot, node = bid.partition(".")
    return bool(dot) and is_valid_id(domain) and is_valid_id(node)


def _trellis_oem(body: dict[str, Any]) -> dict[str, Any]:
    """The request's `Oem.Trellis` object ({} when absent)."""
    oem = body.get("Oem", {})
    if not isinstance(oem, dict):
        raise wrong_type(oem, "Oem")
    trellis = oem.get("Trellis", {})
    if not isinstance(trellis, dict):
        raise wrong_type(trellis, "Oem/Trellis")
    return trellis


def _checked(value: Any, kind: Any, where: str) -> Any:
    """`value` if it is of type `kind` (the engine's bounds for what it becomes), else the
    Redfish error naming the request's property `where`, not the engine's field."""
    try:
        return msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as exc:
        why = str(exc).split(" - at ", 1)[0]
        resolution = f"{why}: correct {where} and resubmit the request."
        if ", got `" in why:
            raise wrong_type(value, where, resolution) from None
        if why.startswith(("Expected `int` ", "Expected `float` ")):
            name = "PropertyValueOutOfRange"
        else:
            name = "PropertyValueFormatError"
        raise error(400, name, _shown(value), where, resolution=resolution) from None


def _shown(value: Any) -> str:
    """A request's value as a message argument: its JSON, cut short (a value may be huge)."""
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return text if len(text) <= 64 else f"{text[:61]}..."
