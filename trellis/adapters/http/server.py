"""The small HTTP server under the engine's own web endpoints (metrics.py, fabric_page.py,
redfish/).

It runs on the engine's event loop, so a handler may read the engine's state or await its NATS
connection without crossing threads. One request per connection, then close: a scrape or a
page load needs no keep-alive. A handler answers a `Request` with a `Response` (a whole body),
or with a `Stream` (an open-ended body, such as server-sent events) that runs until the client
leaves or the server closes. A server answers GET and HEAD only unless it is given more
`methods` (the Redfish service's writes); a request of those carries its body, read by its
Content-Length (at most 1 MiB). Given an `ssl` context, it serves HTTPS.

Every request is checked before any handler sees it (ARCHITECTURE §10, Health): its `Host` must
be the address the server is bound to, or a name given to it (`allowed_hosts`: a name alone
also with the server's port, a name with a port as given), else `421 Misdirected Request`. A
request with two Host headers is `400` (RFC 9112 §3.2); an absolute-form target's authority
is its Host, checked the same way. That defeats DNS rebinding: a hostile web page whose
name was made to resolve to 127.0.0.1 still sends its own name as the Host, so the browser of
an operator who opened it can read nothing. A request with an `Origin` (a browser's fetch or
EventSource from a page) must come from one of those same authorities with the server's own
scheme (or https for a name given to it: a proxy that ends TLS), else `403`.

The server's own refusals (a malformed request, a body over 1 MiB: 413, a request line and
headers over 16 KiB: 431, a method it does not take: 405, or one HTTP does not define: 501, a
Host or Origin it does not serve) are plain text, or whatever `render_error` makes of them (the
Redfish service's error bodies). After refusing a request it did not read whole, it drops what
the client still sends for a moment before closing (_linger), so the answer is read, not reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl as ssl_module
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import NamedTuple

DEFAULT_HOST = "127.0.0.1"
_READ_TIMEOUT_S = 5.0
_MAX_HEAD = 16 * 1024  # a request line and headers; a browser sends well under this
_MAX_BODY = 1024 * 1024  # a request body (only where the server takes more than GET and HEAD)
_REASONS = {200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 302: "Found"}
_REASONS |= {304: "Not Modified", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden"}
_REASONS |= {404: "Not Found", 405: "Method Not Allowed", 406: "Not Acceptable"}
_REASONS |= {409: "Conflict", 411: "Length Required", 412: "Precondition Failed"}
_REASONS |= {413: "Content Too Large", 415: "Unsupported Media Type", 421: "Misdirected Request"}
_REASONS |= {428: "Precondition Required", 429: "Too Many Requests"}
_REASONS |= {431: "Request Header Fields Too Large", 500: "Internal Server Error"}
_REASONS |= {501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable"}
_READ_ONLY = frozenset({"GET", "HEAD"})
#: The methods of HTTP (RFC 9110 §9): one of these a server does not take is 405, any other 501.
_KNOWN = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
#: After refusing a request it did not read whole, the server reads and drops what the client
#: still sends, this long and this much at most, before it closes: a close with unread data
#: sends a TCP reset, which can destroy the answer before the client reads it.
_LINGER_S = 2.0
_LINGER_BYTES = 4 * _MAX_BODY
#: Headers a request may carry once (two Hosts or lengths: which one is meant is unknowable).
_SINGLE = frozenset({"host", "content-length"})
_DIGITS = re.compile(r"[0-9]{1,19}")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a field name (RFC 9110 5.1)
_PORTED = re.compile(r".*:[0-9]+")  # an allowed name that names its port
_PATH = re.compile(r"[A-Za-z0-9\-._~%!$&'()*+,;=:@/]*")  # RFC 3986 path characters


class Request(NamedTuple):
    method: str  # GET or HEAD, or one of the server's `methods`: nothing else reaches a handler
    path: str
    query: dict[str, str]  # the last value of each name
    headers: dict[str, str]  # names lower-cased
    body: bytes = b""  # only for a server that takes more than GET and HEAD
    raw_query: str = ""  # the query string as sent (`query` drops names without a value)
    peer: str = ""  # the client's address (IP), for limits per client


class Response(NamedTuple):
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


class Stream(NamedTuple):
    """A body sent as it comes, chunk by chunk, until `chunks` ends or the client leaves."""

    content_type: str
    chunks: AsyncIterator[bytes]
    headers: tuple[tuple[str, str], ...] = ()


_HEAD_TOO_LARGE = Response(431, "text/plain", b"request line and headers too large\n")

Handler = Callable[[Request], Awaitable[Response | Stream]]
#: Remakes one of the server's own refusals (a plain-text Response) in the handler's shape.
ErrorRenderer = Callable[[Response], Response]


class HttpServer:
    """Serves `handler` at `host`:`port` (0: a free port; `url` says which), to requests whose
    Host is that address or one of `allowed_hosts` (names, with or without a port)."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        allowed_hosts: Iterable[str] = (),
        methods: Iterable[str] = _READ_ONLY,
        ssl: ssl_module.SSLContext | None = None,
        render_error: ErrorRenderer | None = None,
    ):
        self._handler = handler
        self._render_error = render_error
        self._methods = frozenset(methods) | _READ_ONLY
        self._ssl = ssl
        self._host = host
        self._port = port
        self._names = {name.strip().lower() for name in allowed_hosts if name.strip()}
        self._named = {_without_port(name) for name in self._names}
        self._authorities: frozenset[str] = frozenset()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """The server's base address, e.g. http://127.0.0.1:9464."""
        assert self._server is not None, "not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"

    async def start(self) -> None:
        """Listen.

        Raises:
            OSError: the address cannot be bound (in use, or not this machine's).
        """
        self._server = await asyncio.start_server(
            self._on_connection, self._host, self._port, ssl=self._ssl, limit=_MAX_HEAD
        )
        bound = self.url.split("://", 1)[1]
        port = bound.rsplit(":", 1)[1]
        bare = {name for name in self._names if not _PORTED.fullmatch(name)}
        self._authorities = frozenset({bound, *self._names, *(f"{n}:{port}" for n in bare)})

    async def close(self) -> None:
        """Stop listening and end every connection, open streams included."""
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
                request = _parse(head, self._methods)
            except asyncio.LimitOverrunError:
                # What came is kept, so a HEAD is still answered without a body (the rest is
                # dropped by _linger).
                head, request = await _buffered(reader), _HEAD_TOO_LARGE
            except asyncio.IncompleteReadError as exc:
                head, request = exc.partial, _parse(b"")  # answered 400
            except TimeoutError:
                head, request = await _buffered(reader), _parse(b"")
            if not isinstance(request, Response):
                request = request._replace(peer=_peer(writer))
                if request.method not in _READ_ONLY:
                    request = await _with_body(reader, request)
            unread = isinstance(request, Response)  # refused before it was read whole
            refusal = request if isinstance(request, Response) else self._refusal(request)
            if refusal is not None and self._render_error is not None:
                refusal = self._render_error(refusal)
            answer: Response | Stream
            if refusal is not None:
                answer = refusal
            else:
                assert isinstance(request, Request)
                answer = await self._handler(request)
            if isinstance(answer, Stream):
                await _stream(writer, answer, body=not head.startswith(b"HEAD "))
            else:
                extra = "".join(f"{name}: {value}\r\n" for name, value in answer.headers)
                writer.write(
                    f"HTTP/1.1 {answer.status} {_REASONS[answer.status]}\r\n"
                    f"Content-Type: {answer.content_type}\r\n{extra}"
                    f"Content-Length: {len(answer.body)}\r\nConnection: close\r\n\r\n".encode()
                )
                if not head.startswith(b"HEAD "):
                    writer.write(answer.body)
                await writer.drain()
            if unread:
                await _linger(reader, writer)
        except ConnectionError:
            pass  # the client left
        except asyncio.CancelledError:
            pass  # the server closes; the connection with it
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    def _refusal(self, request: Request) -> Response | None:
        """421 for a Host that is not this server's, 403 for a foreign Origin; None: serve."""
        host = request.headers.get("host", "").lower()
        if host not in self._authorities:
            known = ", ".join(sorted(self._authorities))
            told = host or "a request without a Host"
            why = f"this server answers to {known}, not to {told} (see --allow-host)\n"
            return Response(421, "text/plain", why.encode())
        origin = request.headers.get("origin")
        if origin is not None and not self._own_origin(origin.lower()):
            return Response(403, "text/plain", b"a page of another origin may not ask this\n")
        return None

    def _own_origin(self, origin: str) -> bool:
        """Whether `origin` (scheme://host[:port]) is one of this server's: its own scheme and
        an allowed authority, or https and a name given to it (a proxy in front that ends TLS)."""
        scheme, sep, authority = origin.partition("://")
        if not sep or authority not in self._authorities:
            return False
        own = "https" if self._ssl is not None else "http"
        return scheme == own or (scheme == "https" and _without_port(authority) in self._named)


async def _buffered(reader: asyncio.StreamReader) -> bytes:
    """What the client sent that was not read yet (up to _MAX_HEAD; nothing if it sent
    nothing more)."""
    with contextlib.suppress(TimeoutError):
        return await asyncio.wait_for(reader.read(_MAX_HEAD), 0.1)
    return b""


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Say the answer is whole, then drop what the client still sends until it closes (or
    _LINGER_S and _LINGER_BYTES pass), so that the close sends no reset over the answer."""
    if writer.can_write_eof():  # not over TLS, whose close_notify is sent at the close
        writer.write_eof()
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_LINGER_S):
            while dropped < _LINGER_BYTES and (chunk := await reader.read(64 * 1024)):
                dropped += len(chunk)


def _peer(writer: asyncio.StreamWriter) -> str:
    address = writer.get_extra_info("peername")
    return str(address[0]) if isinstance(address, tuple) and address else ""


def _without_port(authority: str) -> str:
    """`authority`'s host: `name` of `name:8443`, `[::1]` of `[::1]:8080`."""
    return authority.rsplit(":", 1)[0] if _PORTED.fullmatch(authority) else authority


async def _stream(writer: asyncio.StreamWriter, stream: Stream, *, body: bool) -> None:
    """Send `stream`: its headers, then (unless `body` is False: a HEAD) its chunks."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in stream.headers)
    writer.write(
        f"HTTP/1.1 200 OK\r\nContent-Type: {stream.content_type}\r\n{extra}"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode()
    )
    try:
        if body:
            async for chunk in stream.chunks:
                writer.write(chunk)
                await writer.drain()
        else:
            await writer.drain()
    finally:
        aclose = getattr(stream.chunks, "aclose", None)
        if aclose is not None:
            await aclose()


async def _with_body(reader: asyncio.StreamReader, request: Request) -> Request | Response:
    """`request` with the body its Content-Length announces (none without one)."""
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        return Response(411, "text/plain", b"send a Content-Length, not chunks\n")
    length_field = request.headers.get("content-length", "0")
    if not _DIGITS.fullmatch(length_field):  # int() would take "+5", " 5" and "5_0"
        return Response(400, "text/plain", b"bad Content-Length\n")
    length = int(length_field)
    if length > _MAX_BODY:
        return Response(413, "text/plain", b"request body too large\n")
    try:
        body = await asyncio.wait_for(reader.readexactly(length), _READ_TIMEOUT_S)
    except (asyncio.IncompleteReadError, TimeoutError):
        return Response(400, "text/plain", b"incomplete body\n")
    return request._replace(body=body)


def _parse(head: bytes, methods: frozenset[str] = _READ_ONLY) -> Request | Response:
    """The request whose line and headers are `head`, or the error response it deserves."""
    if len(head) > _MAX_HEAD:
        return _HEAD_TOO_LARGE
    first, *fields = head.decode("latin-1").split("\r\n")
    line = first.split()
    if len(line) != 3:
        return Response(400, "text/plain", b"bad request\n")
    method, target, _ = line
    if method not in _KNOWN:
        return Response(501, "text/plain", b"not a method of HTTP this server knows\n")
    if method not in methods:
        allowed = ", ".join(sorted(methods))
        return Response(405, "text/plain", f"only {allowed}\n".encode(), (("Allow", allowed),))
    headers: dict[str, str] = {}
    for field in fields:
        if not field:
            continue  # the blank line that ends the head
        name, colon, value = field.partition(":")
        # RFC 9112 5.1: a field line is a name, then at once a colon; whitespace before the
        # colon (or a line with none) is a 400, lest a proxy read another header than we do.
        if not colon or not _TOKEN.fullmatch(name):
            return Response(400, "text/plain", b"bad header field\n")
        name = name.lower()
        if name in _SINGLE and name in headers:
            return Response(400, "text/plain", f"more than one {name} header\n".encode())
        headers[name] = value.strip()
    if target.startswith("/"):  # origin-form: a path ("//x" too, not an authority) and query
        path, _, raw_query = target.partition("?")
        if not _PATH.fullmatch(path):
            return Response(400, "text/plain", b"bad request target\n")
    else:  # absolute-form: its authority is the Host (RFC 9112 §3.2.2)
        try:
            parts = urllib.parse.urlsplit(target)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            return Response(400, "text/plain", b"bad request target\n")
        headers["host"] = parts.netloc
        path, raw_query = parts.path or "/", parts.query
    query = dict(urllib.parse.parse_qsl(raw_query))
    return Request(method, path, query, headers, raw_query=raw_query)
