"""The Redfish service (`trellis up --redfish PORT`): HTTP in front of the engine's NATS
contract, like any other client (ARCHITECTURE §11).

- Reads: resources.py builds each resource from the engine's `topology` and `connections`
  answers, asked at or after the last position this service's writes reached.
- Writes: `POST /Systems` becomes a `compose` intent and `DELETE /Systems/<id>` a `release`,
  on the subject of the account's tenant (an Administrator names the tenant in
  `Oem.Trellis.Tenant`); the engine decides, the log records, and the answer maps back to
  HTTP (registries.py). An `Idempotency-Key` header is the intent's `request_id`, so a
  retried POST gets the first answer.
- In secure mode the service reads as the operator and sends each tenant's intents over a
  connection of that tenant's own NATS identity (`tenant_connection`).
- Accounts and sessions (accounts.py; their resources in account_service.py) are the
  service's only state of its own.

It runs on the shared HTTP server (adapters/http/server.py): the same Host and Origin checks
as the fabric page and metrics, one request per connection.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import re
import ssl
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from trellis.adapters.http.redfish import resources as rs
from trellis.adapters.http.redfish.account_service import account_service, session_service
from trellis.adapters.http.redfish.accounts import Account, AccountStore
from trellis.adapters.http.redfish.events import EventFeed, event_service
from trellis.adapters.http.redfish.handling import (
    Reply,
    dig,
    if_match,
    json_body,
    matches,
    may_change,
    only,
)
from trellis.adapters.http.redfish.metadata import metadata_xml
from trellis.adapters.http.redfish.registries import RedfishError, error, from_engine, message
from trellis.adapters.http.redfish.resources import R, Reader, Viewer, ref
from trellis.adapters.http.server import DEFAULT_HOST, HttpServer, Request, Response, Stream
from trellis.adapters.nats.client import TrellisClient
from trellis.engine.core.ids import is_valid_id

log = logging.getLogger(__name__)

JSON = "application/json; charset=utf-8"
METHODS = ("GET", "HEAD", "POST", "PATCH", "PUT", "DELETE", "OPTIONS")
#: Paths answered without credentials (DSP0266 §13.3.1).
OPEN = {"/redfish", "/redfish/v1", f"{R}/$metadata", f"{R}/odata"}
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
#: A member request's schema property -> the device kind it asks for.
MEMBER_KINDS = {"Memory": "memory", "NetworkInterfaces": "nic", "Storage": "nvme"}
PROCESSOR_KINDS = {"GPU": "gpu", "Accelerator": "accelerator"}
#: How long a `PreviewReserve` holds what it reserved (CompositionService.ReservationDuration).
RESERVATION_SECONDS = 300
REQUEST_TYPES = ("Preview", "PreviewReserve", "Apply")


class RedfishService:
    """Serves `/redfish/v1` at `host`:`port` as a NATS client of the engine."""

    def __init__(
        self,
        nc: NATS,
        accounts: AccountStore,
        domains: Callable[[], Awaitable[list[str]]],
        *,
        prefix: str = "trellis",
        host: str = DEFAULT_HOST,
        port: int = 0,
        allowed_hosts: Iterable[str] = (),
        ssl_context: ssl.SSLContext | None = None,
        writes: bool = True,
        tenant_connection: Callable[[str], Awaitable[NATS | None]] | None = None,
    ) -> None:
        self.accounts = accounts
        # Secure mode: the service's own connection is the operator's, which may not publish
        # tenants' intents; each tenant's intents go over a connection of that tenant's
        # identity (`tenant_connection`, None for a tenant never issued one). Without one,
        # and with `writes` False, the service reads only.
        self.writes = writes
        self._tenant_connection = tenant_connection
        self._tenant_clients: dict[str, TrellisClient] = {}
        self.client = TrellisClient(nc, prefix=prefix)
        self.reader = Reader(self.client, domains)
        self.uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"trellis:{prefix}:redfish")
        self.events = EventFeed(nc, self.client, prefix)
        self._server = HttpServer(
            self.handle,
            host=host,
            port=port,
            allowed_hosts=allowed_hosts,
            methods=METHODS,
            ssl=ssl_context,
        )

    @property
    def url(self) -> str:
        return self._server.url

    async def start(self) -> None:
        await self.events.start()
        try:
            await self._server.start()
        except OSError:
            await self.events.close()
            raise

    async def close(self) -> None:
        await self.events.close()
        await self._server.close()
        for client in self._tenant_clients.values():
            with contextlib.suppress(NatsError):
                await client.nc.close()

    async def _acting_as(self, tenant: str) -> TrellisClient:
        """The client that sends `tenant`'s intents: its own identity's in secure mode."""
        if self._tenant_connection is None:
            return self.client
        known = self._tenant_clients.get(tenant)
        if known is None:
            nc = await self._tenant_connection(tenant)
            if nc is None:
                raise error(
                    403,
                    "InsufficientPrivilege",
                    resolution=f"Tenant {tenant} has no NATS identity in secure mode; issue "
                    f"one with `trellis tenant add {tenant}` and resubmit the request.",
                )
            known = self._tenant_clients[tenant] = TrellisClient(nc, prefix=self.client.prefix)
        return known

    # ---- HTTP ----

    async def handle(self, request: Request) -> Response | Stream:
        path = request.path.rstrip("/") or "/"
        try:
            names = [
                urllib.parse.unquote(item.partition("=")[0])
                for item in request.raw_query.split("&")
                if item
            ]
            if any(n.startswith("$") or n in ("only", "excerpt") for n in names):
                raise error(501, "QueryNotSupported")
            if request.headers.get("odata-version", "4.0") != "4.0":
                raise error(412, "PreconditionFailed")
            if request.method == "POST" and path.endswith("/Members"):
                # DSP0266: a POST to a collection's Members is a POST to the collection.
                path = path.removesuffix("/Members")
            if path == "/redfish":
                return _json(200, {"v1": f"{R}/"}, (("Allow", "GET, HEAD"),))
            if path == f"{R}/$metadata":
                return self._static(request, metadata_xml(), "application/xml")
            if path == f"{R}/odata":
                return self._static(request, msgspec.json.encode(rs.odata_document()), JSON)
            account = None
            if path not in OPEN and not (
                path == f"{R}/SessionService/Sessions" and request.method == "POST"
            ):
                account = self._authenticate(request)
            if path == f"{R}/EventService/SSE":
                only("GET" if request.method == "HEAD" else request.method, "GET")
                assert account is not None
                return Stream("text/event-stream", self.events.stream(account.tenant))
            reply = await self._route(request, path, account)
        except RedfishError as exc:
            headers = exc.headers
            if exc.status == 401:
                headers += (("WWW-Authenticate", 'Basic realm="Trellis Redfish"'),)
            if exc.status == 405:
                headers += (("Allow", _allowed(path)),)
            return Response(exc.status, JSON, exc.body(), (*_COMMON, *headers))
        except (NatsError, TimeoutError) as exc:
            log.warning("redfish: the engine did not answer: %r", exc)
            body = RedfishError(503, [message("ServiceTemporarilyUnavailable", "1")]).body()
            return Response(503, JSON, body, (*_COMMON, ("Retry-After", "1")))
        except Exception:
            log.exception("redfish: %s %s failed", request.method, request.path)
            body = RedfishError(500, [message("InternalError")]).body()
            return Response(500, JSON, body, _COMMON)
        return self._render(request, reply)

    def _static(self, request: Request, body: bytes, content_type: str) -> Response:
        if request.method not in ("GET", "HEAD"):
            raise error(405, "OperationNotAllowed")
        tag = rs.etag(body)
        headers = (*_COMMON, ("Allow", "GET, HEAD"), ("ETag", tag))
        if matches(request.headers.get("if-none-match"), tag):
            return Response(304, content_type, b"", headers)
        return Response(200, content_type, body, headers)

    def _render(self, request: Request, reply: Reply) -> Response:
        headers = [*_COMMON, ("Allow", reply.allow), *reply.headers]
        if reply.body is None:
            return Response(reply.status, JSON, b"", tuple(headers))
        body = msgspec.json.encode(reply.body)
        if reply.etag and "@odata.id" in reply.body:
            tag = rs.etag(reply.body)
            headers.append(("ETag", tag))
            if request.method in ("GET", "HEAD") and matches(
                request.headers.get("if-none-match"), tag
            ):
                return Response(304, JSON, b"", tuple(headers))
        if "@odata.id" in reply.body:
            odata_type = str(reply.body.get("@odata.type", "#")).lstrip("#")
            schema = odata_type.split(".")[0]
            headers.append(("Link", f"<{R}/$metadata#{schema}>; rel=describedby"))
        return Response(reply.status, JSON, body, tuple(headers))

    def _authenticate(self, request: Request) -> Account:
        token = request.headers.get("x-auth-token")
        if token:
            found = self.accounts.by_token(token)
            if found is None:
                raise error(401, "NoValidSession")
            return found[1]
        auth = request.headers.get("authorization", "")
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "basic":
            try:
                user, colon, password = (
                    base64.b64decode(value, validate=True).decode().partition(":")
                )
            except (binascii.Error, UnicodeDecodeError):
                raise error(401, "NoValidSession") from None
            account = self.accounts.check(user, password) if colon else None
            if account is not None:
                return account
        raise error(401, "NoValidSession")

    # ---- routing ----

    async def _route(self, request: Request, path: str, account: Account | None) -> Reply:
        method = "GET" if request.method == "HEAD" else request.method
        if path == R:
            only(method, "GET")
            return Reply(body=rs.service_root(self.uuid))
        assert account is not None or path == f"{R}/SessionService/Sessions"
        parts = path.removeprefix(f"{R}/").split("/")
        top = parts[0]
        if top == "SessionService":
            return session_service(self.accounts, request, method, parts[1:], account)
        assert account is not None
        viewer = Viewer(account.tenant)
        if top == "AccountService":
            return account_service(self.accounts, request, method, parts[1:], account)
        if top == "Systems":
            return await self._systems(request, method, parts[1:], account, viewer)
        if top == "CompositionService":
            if parts[1:2] == ["Actions"]:
                if parts[2:] != ["CompositionService.Compose"]:
                    raise error(404, "ResourceNotFound", "Resource", "/".join(parts))
                only(method, "POST")
                return await self._compose_action(request, account)
            if parts[1:2] == ["CompositionReservations"]:
                return await self._reservations(request, method, parts[2:], account, viewer)
            only(method, "GET")
            return await self._composition(parts[1:], viewer)
        if top == "Fabrics":
            only(method, "GET")
            return await self._fabrics(parts[1:], viewer)
        if top == "EventService" and len(parts) == 1:
            only(method, "GET")
            return Reply(body=event_service())
        raise error(404, "ResourceNotFound", "Resource", path)

    async def _composition(self, parts: list[str], viewer: Viewer) -> Reply:
        base = f"{R}/CompositionService"
        if not parts:
            return Reply(body=rs.composition_service(RESERVATION_SECONDS))
        what, rest = parts[0], parts[1:]
        if what in ("ResourceBlocks", "ActivePool", "FreePool") and not rest:
            domains = await self.reader.all()
            members = []
            for d in domains:
                for node in d.of_kind("host", "device"):
                    if what != "ResourceBlocks":
                        state = rs.BlockState(d, node, viewer)
                        if (what == "ActivePool") != (state.pool == "Active"):
                            continue
                        if what == "FreePool" and state.pool != "Free":
                            continue
                    members.append(f"{base}/ResourceBlocks/{rs.block_id(d.name, node)}")
            names = {"ResourceBlocks": "Resource Blocks", "ActivePool": "Active Pool"}
            return Reply(
                body=rs.collection(
                    f"{base}/{what}",
                    "ResourceBlockCollection",
                    names.get(what, "Free Pool"),
                    members,
                )
            )
        if what == "ResourceBlocks" and rest:
            domain_name, node = rs.split_id(rest[0])
            domain = await self._domain(domain_name, "ResourceBlock", rest[0])
            if domain.nodes.get(node, {}).get("kind") not in ("host", "device"):
                raise error(404, "ResourceNotFound", "ResourceBlock", rest[0])
            if len(rest) == 1:
                return Reply(body=rs.resource_block(domain, node, viewer))
            if len(rest) == 3:
                return Reply(body=rs.block_member(domain, node, rest[1], rest[2]))
        if what == "ResourceZones":
            if not rest:
                members = [f"{base}/ResourceZones/{d}" for d in await self.reader.domains()]
                return Reply(body=rs.collection(f"{base}/ResourceZones", "ZoneCollection",
                                                "Resource Zones", members))  # fmt: skip
            if len(rest) == 1:
                domain = await self._domain(rest[0], "Zone", rest[0])
                return Reply(body=rs.resource_zone(domain))
        raise error(404, "ResourceNotFound", "Resource", "/".join(parts))

    async def _domain(self, name: str, kind: str, rid: str) -> rs.Domain:
        try:
            return await self.reader.domain(name)
        except RedfishError:
            raise error(404, "ResourceNotFound", kind, rid) from None

    async def _fabrics(self, parts: list[str], viewer: Viewer) -> Reply:
        if not parts:
            names = await self.reader.domains()
            members = [f"{R}/Fabrics/{d}" for d in names]
            return Reply(body=rs.collection(f"{R}/Fabrics", "FabricCollection", "Fabrics", members))
        domain = await self._domain(parts[0], "Fabric", parts[0])
        base = f"{R}/Fabrics/{domain.name}"
        rest = parts[1:]
        if not rest:
            return Reply(body=rs.fabric(domain))
        what, rest = rest[0], rest[1:]
        if what == "Switches":
            switches = domain.of_kind("switch", "ocs")
            if not rest:
                members = [f"{base}/Switches/{rs.block_id(domain.name, s)}" for s in switches]
                return Reply(body=rs.collection(f"{base}/Switches", "SwitchCollection",
                                                "Switches", members))  # fmt: skip
            sw_domain, node = rs.split_id(rest[0])
            if sw_domain != domain.name or node not in switches:
                raise error(404, "ResourceNotFound", "Switch", rest[0])
            if len(rest) == 1:
                return Reply(body=rs.switch(domain, node))
            if rest[1] == "Ports" and len(rest) == 2:
                members = [f"{base}/Switches/{rest[0]}/Ports/{p}"
                           for p in rs.port_ids(domain, node)]  # fmt: skip
                return Reply(body=rs.collection(f"{base}/Switches/{rest[0]}/Ports",
                                                "PortCollection", "Ports", members))  # fmt: skip
            if rest[1] == "Ports" and len(rest) == 3:
                return Reply(body=rs.port(domain, node, rest[2]))
        if what == "Endpoints":
            nodes = domain.of_kind("host", "device")
            if not rest:
                members = [f"{base}/Endpoints/{rs.block_id(domain.name, n)}" for n in nodes]
                return Reply(body=rs.collection(f"{base}/Endpoints", "EndpointCollection",
                                                "Endpoints", members))  # fmt: skip
            ep_domain, node = rs.split_id(rest[0])
            if len(rest) == 1 and ep_domain == domain.name and node in nodes:
                return Reply(body=rs.endpoint(domain, node, viewer))
        if what == "Zones":
            compositions = domain.compositions(viewer)
            if not rest:
                members = [f"{base}/Zones/{c}" for c in compositions]
                return Reply(body=rs.collection(f"{base}/Zones", "ZoneCollection", "Zones",
                                                members))  # fmt: skip
            if len(rest) == 1 and rest[0] in compositions:
                return Reply(body=rs.zone(domain, rest[0]))
        if what == "Connections":
            slices = dict(rs.memory_connections(domain, viewer))
            if not rest:
                members = [f"{base}/Connections/{c}" for c in sorted(slices)]
                return Reply(body=rs.collection(f"{base}/Connections", "ConnectionCollection",
                                                "Connections", members))  # fmt: skip
            if len(rest) == 1 and rest[0] in slices:
                return Reply(body=rs.connection(domain, rest[0], slices[rest[0]]))
        raise error(404, "ResourceNotFound", "Resource", "/".join(parts))

    # ---- Systems: compose and release ----

    async def _systems(
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
        tenant = _tenant_of(body, account)
        plan, manifest = await self._manifest(body)
        domain = plan.domain
        intent: dict[str, Any] = {"request_id": _request_id(request), **manifest}
        reply = await (await self._acting_as(tenant)).intent(domain, tenant, "compose", intent)
        if not reply.get("ok"):
            failure = reply.get("error", {})
            if failure.get("code") in ("no_capacity", "no_path") and plan.device_ids:
                now = await self.reader.domain(domain)
                held = [d for d in plan.device_ids if d in now.by_device or d in now.reserved]
                if held:
                    raise RedfishError(
                        409,
                        [message("ResourceBlockInUse", rs.block_id(domain, d)) for d in held],
                    )
            raise from_engine(failure, "ResourceBlock")
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

    async def _compose_action(self, request: Request, account: Account) -> Reply:
        """`CompositionService.Compose` with a one-stanza Manifest: `Preview` is the engine's
        `preview` query (nothing written), `PreviewReserve` its `reserve` intent, `Apply` its
        `apply` intent, of a `ReservationId` or of the Manifest."""
        may_change(account)
        body = json_body(request)
        request_format = body.get("RequestFormat")
        if request_format is None:
            raise error(400, "PropertyMissing", "RequestFormat")
        if request_format != "Manifest":
            raise error(400, "PropertyValueNotInList", str(request_format), "RequestFormat")
        request_type = body.get("RequestType")
        if request_type is None:
            raise error(400, "PropertyMissing", "RequestType")
        if request_type not in REQUEST_TYPES:
            raise error(400, "PropertyValueNotInList", str(request_type), "RequestType")
        answer: dict[str, Any] = {"RequestFormat": "Manifest", "RequestType": request_type}
        rid = body.get("ReservationId")
        if rid is not None:
            if request_type != "Apply":
                raise error(400, "PropertyValueFormatError", str(rid), "ReservationId",
                            resolution="Only an Apply names a ReservationId.")  # fmt: skip
            if not isinstance(rid, str) or not is_valid_id(rid):
                raise error(404, "ResourceNotFound", "CompositionReservation", str(rid))
            self._writable()
            return await self._apply_reservation(request, account, rid, body, answer)
        stanza, system_request = _stanza(body)
        tenant = _tenant_of(system_request, account)
        plan, manifest = await self._manifest(system_request)
        domain = plan.domain
        stanza = {k: v for k, v in stanza.items() if k != "Response"}
        if request_type == "Preview":
            reply = await self.client.query(
                domain, "preview", {"manifest": manifest, "tenant": tenant}
            )
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
                "duration_seconds": RESERVATION_SECONDS,
            }
            reply = await acting.intent(domain, tenant, "reserve", intent)
            if not reply.get("ok"):
                raise from_engine(reply.get("error", {}), "ResourceBlock")
            self.reader.wrote(domain, reply.get("position"))
            made = reply["result"]
            stanza["Response"] = _blocks_request(domain, made["host"], made["devices"])
            answer["Manifest"] = {"Stanzas": [stanza]}
            answer["ReservationId"] = made["reservation_id"]
            location = f"{R}/CompositionService/CompositionReservations/{made['reservation_id']}"
            return Reply(body=answer, headers=[("Location", location)], allow="POST", etag=False)
        intent = {"request_id": _request_id(request), "manifest": manifest}
        reply = await acting.intent(domain, tenant, "apply", intent)
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

    async def _reservations(
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
        reason = body.get("Description") or body.get("Name")
        if isinstance(reason, str) and reason:
            manifest["reason"] = reason
        labels = dig(body, "Oem", "Trellis", "Labels")
        if labels is not None:
            manifest["labels"] = labels
        lease = dig(body, "Oem", "Trellis", "LeaseSeconds")
        if lease is not None:
            manifest["lease_seconds"] = lease
        return plan, manifest

    def _writable(self) -> None:
        if not self.writes and self._tenant_connection is None:
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
            raise error(400, "PropertyValueFormatError", "Links", "Links")
        blocks = links.get("ResourceBlocks", [])
        if not isinstance(blocks, list):
            raise error(400, "PropertyValueFormatError", "ResourceBlocks", "Links/ResourceBlocks")
        prefix = f"{R}/CompositionService/ResourceBlocks/"
        ids: list[str] = []
        for item in blocks:
            target = item.get("@odata.id") if isinstance(item, dict) else None
            if not isinstance(target, str) or not target.startswith(prefix):
                raise error(400, "ResourceBlockInvalid", str(target),
                            related=["Links/ResourceBlocks"])  # fmt: skip
            ids.append(target.removeprefix(prefix).rstrip("/"))
        twice = sorted({b for b in ids if ids.count(b) > 1})
        if twice:
            raise RedfishError(
                400,
                [
                    message(
                        "ResourceBlockInvalid",
                        b,
                        resolution="The resource block is listed more than once; list each "
                        "block once and resubmit the request.",
                        related=["Links/ResourceBlocks"],
                    )
                    for b in twice
                ],
            )
        members = _member_requests(body)
        zone = body.get("@Redfish.ZoneAffinity")
        names = set()
        for bid in ids:
            domain_name, _, _ = bid.partition(".")
            names.add(domain_name)
        if zone is not None:
            if not isinstance(zone, str):
                raise error(400, "PropertyValueFormatError", str(zone), "@Redfish.ZoneAffinity")
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
            raise RedfishError(400, [message("ResourceBlockNotFound", b) for b in ids])
        domain = await self.reader.domain(domain_name)
        missing = [b for b in ids if rs.split_id(b)[1] not in domain.nodes or
                   domain.kind(rs.split_id(b)[1]) not in ("host", "device")]  # fmt: skip
        if missing:
            raise RedfishError(400, [message("ResourceBlockNotFound", b) for b in missing])
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
            raise error(400, "PropertyMissing", "Links/ResourceBlocks")
        if devices and not hosts:
            raise error(
                400,
                "ResourceBlockInvalid",
                "Links/ResourceBlocks",
                resolution="A composition of specific blocks names one Compute block (the "
                "host) beside its device blocks.",
            )
        in_use = [d for d in devices if d in domain.by_device or _whole_reserved(domain, d)]
        if in_use:
            raise RedfishError(
                409, [message("ResourceBlockInUse", rs.block_id(domain_name, d)) for d in in_use]
            )
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


class _Plan(msgspec.Struct, kw_only=True):
    domain: str
    host: str | None
    device_ids: list[str]
    devices: list[dict[str, Any]]


_COMMON = (("OData-Version", "4.0"), ("Cache-Control", "no-cache"))


def _json(status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...]) -> Response:
    return Response(status, JSON, msgspec.json.encode(body), (*_COMMON, *headers))


def _allowed(path: str) -> str:
    if path == f"{R}/Systems" or path.endswith(("/Accounts", "/Sessions")):
        return "GET, HEAD, POST"
    if path.endswith("/CompositionService.Compose"):
        return "POST"
    if path.startswith((f"{R}/Systems/", f"{R}/SessionService/Sessions/",
                        f"{R}/CompositionService/CompositionReservations/")):  # fmt: skip
        return "GET, HEAD, DELETE"
    if path.startswith(f"{R}/AccountService/Accounts/"):
        return "GET, HEAD, PATCH, DELETE"
    return "GET, HEAD"


def _request_id(request: Request) -> str:
    key = request.headers.get("idempotency-key")
    if key is None:
        return str(uuid.uuid4())
    if not _REQUEST_ID.fullmatch(key):
        raise error(400, "PropertyValueFormatError", key, "Idempotency-Key")
    return key


def _whole_reserved(domain: rs.Domain, device: str) -> bool:
    """A device a reservation holds whole (a memory pool's reserved slice leaves room)."""
    return device in domain.reserved and domain.nodes[device].get("device_kind") != "memory"


def _stanza(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one `ComposeSystem` stanza of a Compose action's Manifest, and its Request."""
    manifest = body.get("Manifest")
    if manifest is None:
        raise error(400, "PropertyMissing", "Manifest")
    stanzas = manifest.get("Stanzas") if isinstance(manifest, dict) else None
    if not isinstance(stanzas, list) or len(stanzas) != 1 or not isinstance(stanzas[0], dict):
        raise error(400, "PropertyValueFormatError", "Stanzas", "Manifest/Stanzas",
                    resolution="A Manifest holds one ComposeSystem stanza; send one per "
                    "request.")  # fmt: skip
    stanza = stanzas[0]
    kind = stanza.get("StanzaType")
    if kind != "ComposeSystem":
        raise error(400, "PropertyValueNotInList", str(kind), "Manifest/Stanzas/0/StanzaType")
    system_request = stanza.get("Request")
    if not isinstance(system_request, dict):
        raise error(400, "PropertyMissing", "Manifest/Stanzas/0/Request")
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


def _tenant_of(body: dict[str, Any], account: Account) -> str:
    """Whose request: the account's tenant, or the one an Administrator names in
    `Oem.Trellis.Tenant`."""
    oem_tenant = dig(body, "Oem", "Trellis", "Tenant")
    if account.tenant is not None:
        if oem_tenant is not None and oem_tenant != account.tenant:
            raise error(403, "InsufficientPrivilege")
        return account.tenant
    if oem_tenant is None:
        raise error(400, "PropertyMissing", "Oem/Trellis/Tenant")
    if not isinstance(oem_tenant, str) or not is_valid_id(oem_tenant):
        raise error(400, "PropertyValueFormatError", str(oem_tenant), "Oem/Trellis/Tenant")
    return oem_tenant


def _member_requests(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The `devices` entries of a constrained compose: each member with
    `@Redfish.RequestedCount` under Processors, Memory, NetworkInterfaces or Storage."""
    devices: list[dict[str, Any]] = []
    for prop in ("Processors", "Memory", "NetworkInterfaces", "Storage"):
        group = body.get(prop)
        if group is None:
            continue
        members = group.get("Members") if isinstance(group, dict) else None
        if not isinstance(members, list):
            raise error(400, "PropertyValueFormatError", prop, f"{prop}/Members")
        for i, member in enumerate(members):
            where = f"{prop}/Members/{i}"
            if not isinstance(member, dict):
                raise error(400, "PropertyValueFormatError", str(member), where)
            count = member.get("@Redfish.RequestedCount", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise error(400, "PropertyValueFormatError", str(count),
                            f"{where}/@Redfish.RequestedCount")  # fmt: skip
            entry: dict[str, Any] = {"count": count}
            if prop == "Processors":
                ptype = member.get("ProcessorType", "GPU")
                if ptype not in PROCESSOR_KINDS:
                    raise error(400, "PropertyValueNotInList", str(ptype),
                                f"{where}/ProcessorType")  # fmt: skip
                entry["kind"] = PROCESSOR_KINDS[ptype]
            else:
                entry["kind"] = MEMBER_KINDS[prop]
            model = member.get("Model")
            if isinstance(model, str):
                entry["models"] = [model]
            if prop == "Memory":
                mib = member.get("CapacityMiB")
                if not isinstance(mib, int | float) or isinstance(mib, bool) or mib <= 0:
                    raise error(400, "PropertyMissing", f"{where}/CapacityMiB")
                entry["capacity_gib"] = mib / 1024
            devices.append(entry)
    return devices
