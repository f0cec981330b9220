"""The Redfish service (`trellis up --redfish PORT`): HTTP in front of the engine's NATS
contract, like any other client (ARCHITECTURE §11).

- Reads: resources.py builds each resource from the engine's `topology` and `connections`
  answers, asked at or after the last position this service's writes reached.
- Writes (composing.py): `POST /Systems` becomes a `compose` intent and `DELETE
  /Systems/<id>` a `release`, on the subject of the account's tenant (an Administrator names
  the tenant in `Oem.Trellis.Tenant`); the engine decides, the log records, and the answer
  maps back to HTTP (registries.py).
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
import ssl
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from trellis.adapters.http.redfish import reservation_duration
from trellis.adapters.http.redfish import resources as rs
from trellis.adapters.http.redfish.account_service import account_service, session_service
from trellis.adapters.http.redfish.accounts import Account, AccountStore
from trellis.adapters.http.redfish.composing import Composer
from trellis.adapters.http.redfish.events import EventFeed, event_service
from trellis.adapters.http.redfish.handling import (
    Reply,
    admin_only,
    if_match,
    json_body,
    matches,
    only,
    patched,
    with_notes,
    wrong_type,
)
from trellis.adapters.http.redfish.login_guard import LoginGuard
from trellis.adapters.http.redfish.metadata import metadata_xml
from trellis.adapters.http.redfish.registries import RedfishError, error, message
from trellis.adapters.http.redfish.resources import R, Reader, Viewer
from trellis.adapters.http.redfish.session_timeout import SessionTimeout
from trellis.adapters.http.server import DEFAULT_HOST, HttpServer, Request, Response, Stream
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.foreign import Counted

log = logging.getLogger(__name__)

JSON = "application/json; charset=utf-8"
METHODS = ("GET", "HEAD", "POST", "PATCH", "PUT", "DELETE", "OPTIONS")
#: Paths answered without credentials (DSP0266 §13.3.1).
OPEN = {"/redfish", "/redfish/v1", f"{R}/$metadata", f"{R}/odata"}


#: The file beside the accounts file that keeps CompositionService.ReservationDuration.
RESERVATION_DURATION_FILE = "redfish-reservation-duration.json"
#: The file beside the accounts file that keeps SessionService.SessionTimeout.
SESSION_TIMEOUT_FILE = "redfish-session-timeout.json"


class RedfishObserver(Protocol):
    """What the service tells the engine's metrics (adapters/instruments.py)."""

    def redfish_answered(self, method: str, status: int) -> None: ...

    def redfish_login_refused(self, reason: str) -> None:
        """`missing` (no credentials), `credentials` (a wrong name or password, or a header
        that is none), `session` (an unknown token) or `throttled` (past a budget of failed
        logins)."""


class Unobserved:
    def redfish_answered(self, method: str, status: int) -> None:
        pass

    def redfish_login_refused(self, reason: str) -> None:
        pass


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
        on_foreign: Counted | None = None,
        observer: RedfishObserver | None = None,
    ) -> None:
        self.accounts = accounts
        self.logins = LoginGuard()
        self._observer = observer or Unobserved()
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
        # A message in the stream that is no event: skipped and counted (ARCHITECTURE §3).
        self.events = EventFeed(nc, self.client, prefix, on_foreign)
        # Kept beside the accounts: both are the service's own settings, not the engine's.
        self.reservation_duration = reservation_duration.ReservationDuration(
            accounts.path.with_name(RESERVATION_DURATION_FILE)
        )
        self.session_timeout = SessionTimeout(
            accounts, accounts.path.with_name(SESSION_TIMEOUT_FILE)
        )
        self.composer = Composer(
            self.reader,
            self.client,
            self._acting_as,
            self.reservation_duration,
            writes=writes or tenant_connection is not None,
        )
        self._server = HttpServer(
            self.handle,
            host=host,
            port=port,
            allowed_hosts=allowed_hosts,
            methods=METHODS,
            ssl=ssl_context,
            render_error=_redfish_refusal,
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
        answer = await self._answer(request)
        self._observer.redfish_answered(
            request.method, 200 if isinstance(answer, Stream) else answer.status
        )
        return answer

    async def _answer(self, request: Request) -> Response | Stream:
        path = request.path.rstrip("/") or "/"
        try:
            names = [
                urllib.parse.unquote(item.partition("=")[0])
                for item in request.raw_query.split("&")
                if item
            ]
            if request.method == "POST" and path.endswith("/Members"):
                # DSP0266: a POST to a collection's Members is a POST to the collection.
                path = path.removesuffix("/Members")
            account = None
            # Who asks comes first: without credentials, anything but the open paths is 401,
            # whatever else is wrong with the request.
            if path not in OPEN and not (
                path == f"{R}/SessionService/Sessions" and request.method == "POST"
            ):
                account = await self._authenticate(request)
            # DSP0266: a service ignores a query parameter it does not support unless it
            # begins with `$` (`only` and `excerpt` included).
            if any(n.startswith("$") for n in names):
                raise error(501, "QueryNotSupported")
            version = request.headers.get("odata-version", "4.0")
            if version != "4.0":
                raise error(412, "HeaderInvalid", f"OData-Version: {version[:32]}",
                            resolution="Send OData-Version: 4.0, or no OData-Version.")  # fmt: skip
            content_type = request.headers.get("content-type")
            if request.body and content_type is not None and not _is_json(content_type):
                raise error(415, "GeneralError",
                            resolution="Send the body as application/json.")  # fmt: skip
            if path == "/redfish":
                only("GET" if request.method == "HEAD" else request.method, "GET")
                return _json(200, {"v1": f"{R}/"}, (("Allow", "GET, HEAD"),))
            if path == f"{R}/$metadata":
                return self._static(request, metadata_xml(), "application/xml")
            if path == f"{R}/odata":
                return self._static(request, msgspec.json.encode(rs.odata_document()), JSON)
            if path == f"{R}/EventService/SSE":
                only("GET" if request.method == "HEAD" else request.method, "GET")
                assert account is not None
                chunks = self._while_valid(request, account, self.events.stream(account.tenant))
                # The HTTP server says Cache-Control: no-store for every stream.
                return Stream("text/event-stream", chunks, (("OData-Version", "4.0"),))
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
        payload = reply.body
        if reply.etag and "@odata.id" in reply.body:
            tag = rs.etag(reply.body)
            headers.append(("ETag", tag))
            payload = {**reply.body, "@odata.etag": tag}  # for clients that keep bodies
            if request.method in ("GET", "HEAD") and matches(
                request.headers.get("if-none-match"), tag
            ):
                return Response(304, JSON, b"", tuple(headers))
        body = msgspec.json.encode(payload)
        if "@odata.id" in reply.body:
            odata_type = str(reply.body.get("@odata.type", "#")).lstrip("#")
            schema = odata_type.split(".")[0]
            headers.append(("Link", f"<{R}/$metadata#{schema}>; rel=describedby"))
        return Response(reply.status, JSON, body, tuple(headers))

    async def _authenticate(self, request: Request) -> Account:
        token = request.headers.get("x-auth-token")
        if token:
            found = self.accounts.by_token(token)
            if found is None:
                self._observer.redfish_login_refused("session")
                raise error(401, "NoValidSession")
            return found[1]
        auth = request.headers.get("authorization", "")
        if not auth:  # a client's first ask, before it sends what it has: nobody guessing
            self._observer.redfish_login_refused("missing")
            raise error(401, "NoValidSession")
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "basic":
            try:
                user, colon, password = (
                    base64.b64decode(value, validate=True).decode().partition(":")
                )
            except (binascii.Error, UnicodeDecodeError):
                colon = ""
            if colon:
                return await self.login(request, user, password)
        self._observer.redfish_login_refused("credentials")  # another scheme, or no Basic
        raise error(401, "NoValidSession")

    async def login(self, request: Request, user: str, password: str) -> Account:
        """The account these credentials prove, else 401; 429 past a budget of failed logins
        (login_guard.py), unless they were proven lately (no hash then)."""
        account = self.accounts.proven(user, password)
        if account is not None:
            return account
        wait = self.logins.wait_s(request.peer, user)
        if wait:
            self._observer.redfish_login_refused("throttled")
            resolution = (
                "Too many failed logins from this address: wait as Retry-After says, then "
                "resubmit the request with the right credentials."
            )
            text = [message("ServiceTemporarilyUnavailable", str(wait), resolution=resolution)]
            raise RedfishError(429, text, (("Retry-After", str(wait)),))
        account = await self.accounts.verify(user, password)
        if account is None:
            self.logins.failed(request.peer, user)
            self._observer.redfish_login_refused("credentials")
            raise error(401, "NoValidSession")
        return account

    async def _while_valid(
        self, request: Request, account: Account, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """`chunks` until the credentials that opened the stream stop being valid (the session
        ended, the password changed, the account was disabled or deleted): checked before
        each chunk, so nothing more is sent to them."""
        token = request.headers.get("x-auth-token")
        password_hash = account.hash
        try:
            async for chunk in chunks:
                current = self.accounts.get(account.user_name)
                if (
                    current is not account
                    or not current.enabled
                    or current.hash != password_hash
                    or (token is not None and not self.accounts.has_session(token))
                ):
                    return
                yield chunk
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

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
            return await session_service(
                self.session_timeout, self.login, request, method, parts[1:], account
            )
        assert account is not None
        viewer = Viewer(account.tenant)
        if top == "AccountService":
            return await account_service(self.accounts, request, method, parts[1:], account)
        if top == "Systems":
            return await self.composer.systems(request, method, parts[1:], account, viewer)
        if top == "CompositionService":
            if parts[1:2] == ["Actions"]:
                if parts[2:] != ["CompositionService.Compose"]:
                    raise error(404, "ResourceNotFound", "Resource", "/".join(parts))
                only(method, "POST")
                # An action's If-Match is the ETag of the resource it acts on (DSP0266).
                if_match(request, self._composition_service())
                return await self.composer.compose_action(request, account)
            if parts[1:2] == ["CompositionReservations"]:
                return await self.composer.reservations(request, method, parts[2:], account, viewer)
            if not parts[1:] and method == "PATCH":
                return self._patch_composition_service(request, account)
            # What does not exist is 404 whatever the method; what does, 405 to all but GET.
            reply = await self._composition(parts[1:], viewer)
            only(method, "GET")
            return reply
        if top == "Fabrics":
            reply = await self._fabrics(parts[1:], viewer)
            only(method, "GET")
            return reply
        if top == "EventService" and len(parts) == 1:
            only(method, "GET")
            return Reply(body=event_service())
        raise error(404, "ResourceNotFound", "Resource", path)

    def _composition_service(self) -> dict[str, Any]:
        return rs.composition_service(reservation_duration.text(self.reservation_duration.seconds))

    def _patch_composition_service(self, request: Request, account: Account) -> Reply:
        """An Administrator sets ReservationDuration, the one writable property: it holds
        the reservations made from then on."""
        admin_only(account)
        current = self._composition_service()
        if_match(request, current)
        body, notes = patched(json_body(request), {"ReservationDuration"}, current)
        if "ReservationDuration" in body:
            self.reservation_duration.set(_seconds(body["ReservationDuration"]))
        return Reply(body=with_notes(self._composition_service(), notes), allow="GET, HEAD, PATCH")

    async def _composition(self, parts: list[str], viewer: Viewer) -> Reply:
        base = f"{R}/CompositionService"
        if not parts:
            return Reply(body=self._composition_service(), allow="GET, HEAD, PATCH")
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


_COMMON = (("OData-Version", "4.0"), ("Cache-Control", "no-cache"))


def _redfish_refusal(plain: Response) -> Response:
    """One of the HTTP server's own refusals (malformed request, Host, Origin, size, method)
    as a Redfish error body, its plain text the resolution."""
    if plain.status == 405:
        messages = [message("OperationNotAllowed")]
    else:
        messages = [message("GeneralError", resolution=plain.body.decode().strip())]
    body = RedfishError(plain.status, messages).body()
    return Response(plain.status, JSON, body, (*_COMMON, *plain.headers))


def _json(status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...]) -> Response:
    return Response(status, JSON, msgspec.json.encode(body), (*_COMMON, *headers))


def _seconds(value: Any) -> int:
    """ReservationDuration's seconds: Redfish's type is an ISO 8601 duration, and ARCHITECTURE
    §11 speaks of seconds, so a whole number of seconds is taken too."""
    if isinstance(value, str):
        parsed = reservation_duration.parse(value)
        if parsed is None:
            raise error(400, "PropertyValueFormatError", value, "ReservationDuration")
        seconds = parsed
    elif isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    else:
        raise wrong_type(value, "ReservationDuration")
    low, high = reservation_duration.SECONDS_RANGE
    if not low <= seconds <= high:
        raise error(400, "PropertyValueOutOfRange", str(value), "ReservationDuration")
    return seconds


def _is_json(content_type: str) -> bool:
    """Whether a request's Content-Type is JSON (`application/json`, any parameters)."""
    return content_type.partition(";")[0].strip().lower() == "application/json"


def _allowed(path: str) -> str:
    below_systems = path.removeprefix(f"{R}/Systems/")
    if below_systems in rs.CAPABILITIES.values() or "/" in below_systems.rstrip("/"):
        return "GET, HEAD"  # the capabilities, and what a system holds (its Processors...)
    if path == f"{R}/Systems" or path.endswith(("/Accounts", "/Sessions")):
        return "GET, HEAD, POST"
    if path.endswith("/CompositionService.Compose"):
        return "POST"
    if path.startswith((f"{R}/Systems/", f"{R}/SessionService/Sessions/",
                        f"{R}/CompositionService/CompositionReservations/")):  # fmt: skip
        return "GET, HEAD, DELETE"
    if path.startswith(f"{R}/AccountService/Accounts/"):
        return "GET, HEAD, PATCH, DELETE"
    if path in (f"{R}/CompositionService", f"{R}/SessionService"):
        return "GET, HEAD, PATCH"
    return "GET, HEAD"
