"""A small Redfish client on asyncio streams: GET, POST, PATCH and DELETE of JSON resources,
with Basic or session authentication, ETags and `If-Match` (DMTF DSP0266).

The standard library and nothing else: a fabric driver needs a handful of verbs on one service,
and an HTTP dependency would be one more thing for every deployment to carry. HTTP/1.1 with
keep-alive where the service keeps connections open (a POST always opens a connection of its
own, so a request that might have been carried out is never sent twice), bodies by
Content-Length, chunked or up to the close (an HTTP/1.0 service such as DMTF's Mockup Server).

Concurrency is bounded (`max_in_flight`): a fabric manager is one service, often a small one,
and a burst of requests must queue here rather than overflow its listen backlog.

A read answered `5xx` is sent again, twice at most, after 0.1 s and then 0.2 s, or after the
service's `Retry-After` (5 s at most) (a GET changes nothing); a change is not (its `5xx` fails
the step, ARCHITECTURE §11). A task monitor answering 503 is polled again, as a running task.

Changes carry `If-Match` with the ETag of the last read when the service gives ETags (the
`ETag` header, else the body's `@odata.etag`), never `*`. `update` and `delete` read first and
retry after a fresh read when the service answers 412 (the resource changed since) or 428 (it
wants `If-Match`), so a concurrent change is never overwritten.

With `auth="session"` the client logs in once (`POST /redfish/v1/SessionService/Sessions`,
DSP0266's session login) and sends the `X-Auth-Token` it got; a `401` (the session expired or
was deleted) logs in again and sends the request once more, which is safe since a refused
request was not carried out. `close` logs out. A service checks a session token cheaply, where
Basic costs it a password hash on every request (Trellis's own service: about 40 ms each).

A change answered `202 Accepted` is a task (DSP0266's asynchronous operations): the client
polls the `Location` it names until the task ends, and the operation's own answer is the
answer (tasks.py reads a task monitor's and a Task resource's). A task that does not end
within `task_timeout` is asked to stop (`DELETE` of its monitor) and counts as unanswered.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import ssl
import urllib.parse
from collections.abc import Callable
from typing import Any

import msgspec

from trellis.adapters.fabric.redfish.tasks import (
    Ended,
    Running,
    TaskFailedState,
    read_answer,
    retry_after_s,
)

SERVICE_ROOT = "/redfish/v1"
#: Where DSP0266 puts the sessions collection (a login POSTs there).
SESSIONS = f"{SERVICE_ROOT}/SessionService/Sessions"
#: Seconds one request may take, connecting included, unless the client says otherwise.
DEFAULT_TIMEOUT_S = 5.0
#: Seconds a task (a change answered 202) may run before the client gives up on it.
DEFAULT_TASK_TIMEOUT_S = 30.0
#: The first wait between polls of a task, doubled up to the longest (seconds); a service's
#: `Retry-After` is taken within the same bounds' reach of the task's deadline.
TASK_POLL_FIRST_S, TASK_POLL_LONGEST_S = 0.05, 1.0
#: Fresh reads after a 412 or 428 before `update` and `delete` give up.
PRECONDITION_RETRIES = 3
#: Reads sent again after a 5xx (a busy or restarting service; a GET changes nothing), the
#: first after READ_RETRY_FIRST_S, each next after twice the wait before it, or after the
#: service's `Retry-After` up to READ_RETRY_LONGEST_S.
READ_RETRIES, READ_RETRY_FIRST_S, READ_RETRY_LONGEST_S = 2, 0.1, 5.0
#: Pages of one collection read before it counts as endless.
MAX_PAGES = 1000
_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024

Json = dict[str, Any]


class RedfishError(Exception):
    """A request to the Redfish service failed; `uri` names the resource."""

    def __init__(self, message: str, *, uri: str = ""):
        super().__init__(message)
        self.uri = uri


class Unreachable(RedfishError):
    """No answer: the connection was refused, reset or timed out, or TLS failed."""


class Unreadable(RedfishError):
    """The service answered, but not in a shape a Redfish client can read (a collection
    whose `Members` is no list of references, or whose pages never end)."""


class HttpError(RedfishError):
    """The service answered with an error status; `message` carries its first
    `@Message.ExtendedInfo` message, when it sent one."""

    def __init__(
        self,
        method: str,
        uri: str,
        status: int,
        message: str = "",
        *,
        retry_after: float | None = None,
    ):
        said = f": {message}" if message else ""
        super().__init__(f"{method} {uri} answered {status}{said}", uri=uri)
        self.method = method
        self.status = status
        self.retry_after = retry_after  # the service's Retry-After, in seconds


class TaskFailed(HttpError):
    """A change the service took as a task, and the task ended other than `Completed`."""

    def __init__(self, method: str, uri: str, state: str, message: str = ""):
        super().__init__(
            method, uri, 500, f"its task ended {state}" + (f": {message}" if message else "")
        )
        self.state = state


class Resource(msgspec.Struct, frozen=True):
    """One resource as read: its JSON body and its ETag (None: the service gives none)."""

    uri: str
    body: Json
    etag: str | None


class _Response(msgspec.Struct, frozen=True):
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes
    reusable: bool


def service_base(url: str) -> tuple[str, str]:
    """Split a service URL, given with or without `/redfish/v1`, into its origin
    (`scheme://host:port`) and the path before `/redfish` (usually empty, unless the service
    sits behind a proxy under a prefix).

    Raises:
        ValueError: `url` is no http(s) URL.
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is no http:// or https:// URL of a Redfish service")
    if parts.username or parts.password:
        raise ValueError("give the Redfish credentials apart, not inside the URL")
    path = parts.path.rstrip("/")
    prefix = path[: path.find("/redfish")] if "/redfish" in path else path
    return f"{parts.scheme}://{parts.netloc}", prefix


class RedfishClient:
    """A client of one Redfish service.

    Args:
        url: The service's base URL, with or without `/redfish/v1`.
        user: The account (None: no authentication).
        password: Its password.
        auth: "basic" (HTTP Basic on every request) or "session" (log in once, then send
            the session's token).
        timeout: Seconds each request may take, connecting included.
        task_timeout: Seconds a change the service runs as a task may take to end.
        max_in_flight: Requests in flight at once; more wait their turn.
        ssl_context: For https URLs (default: the system's trust store, verified).
    """

    def __init__(
        self,
        url: str,
        user: str | None = None,
        password: str | None = None,
        *,
        auth: str = "basic",
        timeout: float = DEFAULT_TIMEOUT_S,
        task_timeout: float = DEFAULT_TASK_TIMEOUT_S,
        max_in_flight: int = 4,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.origin, self._prefix = service_base(url)
        parts = urllib.parse.urlsplit(self.origin)
        self._host = parts.hostname or ""
        self._tls = parts.scheme == "https"
        self._port = parts.port or (443 if self._tls else 80)
        self._ssl = (ssl_context or ssl.create_default_context()) if self._tls else None
        if auth not in ("basic", "session"):
            raise ValueError(f"auth {auth!r}: give basic or session")
        self._authorization = (
            "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()
            if user and auth == "basic"
            else None
        )
        self._login_body = (
            msgspec.json.encode({"UserName": user, "Password": password or ""})
            if user and auth == "session"
            else None
        )
        # The token, and the session's URI to log out at (None: the service named none).
        self._session: tuple[str, str | None] | None = None
        self._logging_in = asyncio.Lock()
        self.timeout = timeout
        self.task_timeout = task_timeout
        self._slots = asyncio.Semaphore(max_in_flight)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.requests = 0  # sent, for tests and benchmarks

    @property
    def root(self) -> str:
        """The service root's URI, as `@odata.id` values name it."""
        return f"{SERVICE_ROOT}/"

    async def close(self) -> None:
        """Log out (a session's DELETE, best effort) and close the kept connections."""
        session, self._session = self._session, None
        if session is not None and session[1] is not None:
            with contextlib.suppress(RedfishError):
                await self._send_once("DELETE", session[1], token=session[0])
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()

    # -- the verbs ---------------------------------------------------------------------------

    async def get(self, uri: str) -> Resource:
        """Read one resource.

        Raises:
            HttpError: The service answered an error (404: no such resource; a 5xx after
                READ_RETRIES more tries).
            Unreachable: It did not answer.
        """
        wait = READ_RETRY_FIRST_S
        for attempt in range(READ_RETRIES + 1):
            try:
                response = await self._request("GET", uri)
                break
            except HttpError as exc:
                if exc.status < 500 or attempt == READ_RETRIES:
                    raise
                asked = min(exc.retry_after or 0.0, READ_RETRY_LONGEST_S)
            await asyncio.sleep(max(wait, asked))
            wait *= 2
        body = _json(response.body, "GET", uri, response.status)
        etag = response.headers.get("etag") or body.get("@odata.etag")
        return Resource(uri=uri, body=body, etag=etag if isinstance(etag, str) else None)

    async def get_or_none(self, uri: str) -> Resource | None:
        """Read one resource; None when the service says it does not exist (404)."""
        try:
            return await self.get(uri)
        except HttpError as exc:
            # Only the resource's own 404: a login's (a service without SessionService) says
            # nothing of the resource, and read as "no service root".
            if exc.status == 404 and exc.method == "GET":
                return None
            raise

    async def members(self, collection: str) -> list[str]:
        """The member URIs of a collection, following `Members@odata.nextLink` pages.

        Raises:
            Unreadable: `Members` is no list of references, or the pages come round again or
                run past MAX_PAGES.
        """
        uris: list[str] = []
        pages: set[str] = set()
        page: str | None = collection
        while page is not None:
            if page in pages or len(pages) == MAX_PAGES:
                raise Unreadable(
                    f"GET {collection}: its pages do not end (at {page}, page {len(pages) + 1})",
                    uri=collection,
                )
            pages.add(page)
            body = (await self.get(page)).body
            members = body.get("Members", [])
            if not isinstance(members, list):
                raise Unreadable(f"GET {page}: Members is no list", uri=page)
            for number, member in enumerate(members):
                uri = member.get("@odata.id") if isinstance(member, dict) else None
                if not isinstance(uri, str):
                    raise Unreadable(f"GET {page}: member {number} has no @odata.id", uri=page)
                uris.append(uri)
            next_link = body.get("Members@odata.nextLink")
            page = next_link if isinstance(next_link, str) else None
        return uris

    async def post(self, collection: str, body: Json) -> str:
        """Create a member of a collection; the new member's URI. A service may answer 201
        or 204; either way its `Location` header names the new resource (a relative one is
        resolved against the collection).

        Raises:
            HttpError: The service refused it, said neither where nor what it made, or
                answered anything but a creation (a redirect, a 200; a task that ended
                without naming what it made).
            Unreachable: It did not answer, or its task did not end in time or lost its
                monitor (the member may or may not exist now).
        """
        response = await self._request("POST", collection, body, fresh=True)
        if response.status not in (201, 204):
            raise HttpError("POST", collection, response.status, "not a creation (201 or 204)")
        location = response.headers.get("location")
        if not location and response.body:
            made = _json(response.body, "POST", collection, response.status).get("@odata.id")
            location = made if isinstance(made, str) else None
        if not location:
            raise HttpError("POST", collection, response.status, "no Location for the new member")
        return self._path_of(urllib.parse.urljoin(self._prefix + collection, location))

    async def patch(self, resource: Resource, change: Json) -> None:
        """Change a resource as read (`If-Match` its ETag, when it has one)."""
        await self._request("PATCH", resource.uri, change, etag=resource.etag)

    async def update(self, uri: str, change: Callable[[Json], Json | None]) -> Json | None:
        """Read `uri`, then PATCH what `change(body)` returns (None: nothing to change), with
        `If-Match` the ETag just read; after a 412 or 428, read again and retry. The PATCH
        sent, or None.

        Raises:
            HttpError: The service refused the change (a 412 or 428 after the last retry too).
            Unreachable: It did not answer.
        """
        for attempt in range(PRECONDITION_RETRIES + 1):
            resource = await self.get(uri)
            patch = change(resource.body)
            if patch is None:
                return None
            try:
                await self.patch(resource, patch)
                return patch
            except HttpError as exc:
                if exc.status not in (412, 428) or attempt == PRECONDITION_RETRIES:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises

    async def delete(self, uri: str, still: Callable[[Json], bool] = lambda _: True) -> bool:
        """Delete `uri` if it exists and `still(body)` holds when read, with `If-Match` the
        ETag just read; after a 412 or 428, read again and retry. True when this deleted it;
        False when it was gone already (or `still` said no).

        Raises:
            HttpError: The service refused the deletion.
            Unreachable: It did not answer.
        """
        for attempt in range(PRECONDITION_RETRIES + 1):
            resource = await self.get_or_none(uri)
            if resource is None or not still(resource.body):
                return False
            try:
                await self._request("DELETE", uri, etag=resource.etag)
                return True
            except HttpError as exc:
                if exc.status == 404:
                    return False  # someone else deleted it between our read and our delete
                if exc.status not in (412, 428) or attempt == PRECONDITION_RETRIES:
                    raise
        raise AssertionError("unreachable")

    # -- HTTP --------------------------------------------------------------------------------

    def _path_of(self, uri: str) -> str:
        """The path of a URI or URL the service gave (`Location` may be absolute)."""
        parts = urllib.parse.urlsplit(uri)
        path = parts.path or "/"
        if self._prefix and path.startswith(self._prefix + "/redfish"):
            path = path[len(self._prefix) :]
        return path

    async def _request(
        self,
        method: str,
        uri: str,
        body: Json | None = None,
        *,
        etag: str | None = None,
        fresh: bool = False,
    ) -> _Response:
        payload = msgspec.json.encode(body) if body is not None else None
        response = await self._send(method, uri, payload, etag, fresh)
        if response.status == 202:  # a task: its end is the answer
            response = await self._task_end(method, uri, response)
        if response.status >= 400:
            raise HttpError(
                method,
                uri,
                response.status,
                _error_message(response.body),
                retry_after=retry_after_s(response.headers),
            )
        if response.status >= 300:  # redirects are not followed: the service is elsewhere
            where = response.headers.get("location", "nowhere")
            raise HttpError(method, uri, response.status, f"redirected to {where}, not followed")
        return response

    async def _send(
        self,
        method: str,
        uri: str,
        payload: bytes | None = None,
        etag: str | None = None,
        fresh: bool = False,
    ) -> _Response:
        """One request and its answer, whatever its status; with a session, logged in first,
        and once more when the service no longer knows the session (401)."""
        once = functools.partial(self._send_once, method, uri, payload, etag, fresh)
        if self._login_body is None:
            return await once()
        token = await self._token()
        response = await once(token=token)
        if response.status != 401:
            return response
        return await once(token=await self._token(expired=token))

    async def _token(self, expired: str | None = None) -> str:
        """The session's token: logging in when there is none yet, or when the one given
        has expired (unless another request logged in again meanwhile)."""
        async with self._logging_in:
            if self._session is not None and self._session[0] != expired:
                return self._session[0]
            assert self._login_body is not None
            answer = await self._send_once("POST", SESSIONS, self._login_body, fresh=True)
            if answer.status >= 300:
                raise HttpError("POST", SESSIONS, answer.status, _error_message(answer.body))
            token = answer.headers.get("x-auth-token")
            if not token:
                raise HttpError("POST", SESSIONS, answer.status, "no X-Auth-Token: no session")
            location = answer.headers.get("location")
            made = self._path_of(urllib.parse.urljoin(SESSIONS, location)) if location else None
            replaced, self._session = self._session, (token, made)
            if replaced is not None and replaced[1] not in (None, made):
                # The one it replaces, should the service still keep it (a service that
                # refuses a token it issued must not fill its sessions with ours).
                with contextlib.suppress(RedfishError):
                    await self._send_once("DELETE", replaced[1] or "", token=token)
            return token

    async def _send_once(
        self,
        method: str,
        uri: str,
        payload: bytes | None = None,
        etag: str | None = None,
        fresh: bool = False,
        *,
        token: str | None = None,
    ) -> _Response:
        path = self._prefix + uri if uri.startswith("/redfish") else uri
        head = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self._host_header()}",
            "Accept: application/json",
            "OData-Version: 4.0",
            "User-Agent: trellis-redfish",
        ]
        if token is not None:
            head.append(f"X-Auth-Token: {token}")
        elif self._authorization:
            head.append(f"Authorization: {self._authorization}")
        if payload is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        elif method in ("POST", "PATCH", "DELETE"):
            head.append("Content-Length: 0")
        if etag is not None:
            head.append(f"If-Match: {etag}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + (payload or b"")
        async with self._slots:
            self.requests += 1
            try:
                async with asyncio.timeout(self.timeout):
                    return await self._exchange(method, request, fresh=fresh)
            except TimeoutError:
                raise Unreachable(
                    f"{method} {uri}: no answer within {self.timeout:g} s", uri=uri
                ) from None
            except (OSError, ssl.SSLError, asyncio.IncompleteReadError, ValueError) as exc:
                reason = str(exc) or type(exc).__name__
                raise Unreachable(f"{method} {uri}: {reason}", uri=uri) from None

    async def _task_end(self, method: str, uri: str, accepted: _Response) -> _Response:
        """Poll the task a `202` names until it ends; the operation's own answer.

        Raises:
            HttpError: The 202 named no task.
            TaskFailed: The task ended other than `Completed`.
            Unreachable: Its monitor went (404) before it ended, or it did not end within
                `task_timeout` (then it is asked to stop): the change may or may not be made.
        """
        location = accepted.headers.get("location")
        if not location:
            raise HttpError(method, uri, 202, "accepted as a task, but no Location names it")
        monitor = self._path_of(urllib.parse.urljoin(self._prefix + uri, location))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.task_timeout
        wait = TASK_POLL_FIRST_S
        hint = read_answer(accepted.status, accepted.headers, accepted.body)
        while True:
            if isinstance(hint, Running) and hint.retry_after is not None:
                # Within reason: `Retry-After: 0` must not become a poll loop.
                wait = max(hint.retry_after, TASK_POLL_FIRST_S)
            left = deadline - loop.time()
            if left <= 0:
                raise Unreachable(
                    f"{method} {uri}: its task {monitor} did not end within "
                    f"{self.task_timeout:g} s ({await self._cancel(monitor)})",
                    uri=uri,
                )
            await asyncio.sleep(min(wait, left))
            wait = min(wait * 2, TASK_POLL_LONGEST_S)
            polled = await self._send("GET", monitor)
            if polled.status == 404:
                raise Unreachable(
                    f"{method} {uri}: its task monitor {monitor} is gone (404) before it said "
                    "how the task ended",
                    uri=uri,
                )
            hint = read_answer(polled.status, polled.headers, polled.body)
            if isinstance(hint, TaskFailedState):
                raise TaskFailed(method, uri, hint.state, hint.message)
            if isinstance(hint, Ended):
                return _Response(hint.status, hint.headers, hint.body, False)

    async def _cancel(self, monitor: str) -> str:
        """Ask the service to stop a task (DSP0266: DELETE of its monitor); what it said."""
        try:
            answer = await self._send("DELETE", monitor)
        except Unreachable as exc:
            return f"asking it to stop got no answer: {exc}"
        return f"asked to stop, the service answered {answer.status}"

    def _host_header(self) -> str:
        default = 443 if self._tls else 80
        host = f"[{self._host}]" if ":" in self._host else self._host
        return host if self._port == default else f"{host}:{self._port}"

    async def _exchange(self, method: str, request: bytes, *, fresh: bool) -> _Response:
        """Send on an idle kept-alive connection (for a request that may be sent twice) or a
        new one; a kept one the service closed meanwhile is retried once on a new one."""
        while self._idle and not fresh:
            reader, writer = self._idle.pop()
            try:
                return await self._on(reader, writer, method, request)
            except (OSError, asyncio.IncompleteReadError, _ClosedBeforeAnswer):
                continue  # the service closed it while idle: try another, or a new one
        reader, writer = await asyncio.open_connection(
            self._host, self._port, ssl=self._ssl, server_hostname=self._host if self._ssl else None
        )
        try:
            return await self._on(reader, writer, method, request)
        except _ClosedBeforeAnswer:
            raise ConnectionResetError("the service closed the connection unanswered") from None

    async def _on(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        method: str,
        request: bytes,
    ) -> _Response:
        keep = False
        try:
            writer.write(request)
            await writer.drain()
            response = await _read_response(reader, method)
            keep = response.reusable
            return response
        finally:
            if keep:
                self._idle.append((reader, writer))
            else:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()


class _ClosedBeforeAnswer(Exception):
    """The connection ended before the first byte of an answer."""


async def _read_response(reader: asyncio.StreamReader, method: str) -> _Response:
    status_line = await reader.readline()
    if not status_line:
        raise _ClosedBeforeAnswer
    version, _, rest = status_line.decode("latin-1").strip().partition(" ")
    code = rest.split(" ", 1)[0]
    if not version.startswith("HTTP/") or not code.isdigit():
        raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
    status = int(code)
    headers: dict[str, str] = {}
    size = 0
    while True:
        line = await reader.readline()
        size += len(line)
        if size > _MAX_HEAD:
            raise ValueError("response headers too large")
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
        return await _read_response(reader, method)
    closes = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
    if method == "HEAD" or status in (204, 304):
        return _Response(status, headers, b"", not closes)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return _Response(status, headers, await _read_chunked(reader), not closes)
    if "content-length" in headers:
        length = int(headers["content-length"])
        if not 0 <= length <= _MAX_BODY:
            raise ValueError(f"response body of {length} bytes")
        return _Response(status, headers, await reader.readexactly(length), not closes)
    return _Response(status, headers, await _read_to_close(reader), False)


async def _read_to_close(reader: asyncio.StreamReader) -> bytes:
    """A body without Content-Length or chunks: everything up to the close, which may come
    in several pieces."""
    body = bytearray()
    while piece := await reader.read(64 * 1024):
        body += piece
        if len(body) > _MAX_BODY:
            raise ValueError("response body too large")
    return bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(body)
        if len(body) + size > _MAX_BODY:
            raise ValueError("response body too large")
        body += await reader.readexactly(size)
        await reader.readline()


def _json(data: bytes, method: str, uri: str, status: int) -> Json:
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        raise HttpError(method, uri, status, "the answer is not JSON") from None
    if not isinstance(body, dict):
        raise HttpError(method, uri, status, "the answer is not a JSON object")
    return body


def _error_message(data: bytes) -> str:
    """The first message of a Redfish error body, if there is one."""
    try:
        body = msgspec.json.decode(data)
        error = body["error"]
        info = error.get("@Message.ExtendedInfo") or []
        message = info[0].get("Message") if info else error.get("message")
        return str(message) if message else ""
    except Exception:
        return ""
