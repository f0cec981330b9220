"""The small HTTP server under the engine's own web endpoints (metrics.py, fabric_page.py).

It runs on the engine's event loop, so a handler may read the engine's state or await its NATS
connection without crossing threads. One request per connection, then close: a scrape or a
page load needs no keep-alive. A handler answers a `Request` with a `Response` (a whole body),
or with a `Stream` (an open-ended body, such as server-sent events) that runs until the client
leaves or the server closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

DEFAULT_HOST = "127.0.0.1"
_READ_TIMEOUT_S = 5.0
_MAX_HEAD = 16 * 1024  # a request line and headers; a browser sends well under this
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS |= {502: "Bad Gateway", 503: "Service Unavailable"}


class Request(NamedTuple):
    method: str  # GET or HEAD: nothing else reaches a handler
    path: str
    query: dict[str, str]  # the last value of each name


class Response(NamedTuple):
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


class Stream(NamedTuple):
    """A body sent as it comes, chunk by chunk, until `chunks` ends or the client leaves."""

    content_type: str
    chunks: AsyncIterator[bytes]


Handler = Callable[[Request], Awaitable[Response | Stream]]


class HttpServer:
    """Serves `handler` at `host`:`port` (0: a free port; `url` says which)."""

    def __init__(self, handler: Handler, *, host: str = DEFAULT_HOST, port: int = 0):
        self._handler = handler
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """The server's base address, e.g. http://127.0.0.1:9464."""
        assert self._server is not None, "not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    async def start(self) -> None:
        """Listen.

        Raises:
            OSError: the address cannot be bound (in use, or not this machine's).
        """
        self._server = await asyncio.start_server(self._on_connection, self._host, self._port)

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
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                head = b""  # answered 400
            request = _parse(head)
            if isinstance(request, Response):
                answer: Response | Stream = request
            else:
                answer = await self._handler(request)
            if isinstance(answer, Stream):
                await _stream(writer, answer)
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
        except ConnectionError:
            pass  # the client left
        except asyncio.CancelledError:
            pass  # the server closes; the connection with it
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()


async def _stream(writer: asyncio.StreamWriter, stream: Stream) -> None:
    writer.write(
        f"HTTP/1.1 200 OK\r\nContent-Type: {stream.content_type}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode()
    )
    try:
        async for chunk in stream.chunks:
            writer.write(chunk)
            await writer.drain()
    finally:
        aclose = getattr(stream.chunks, "aclose", None)
        if aclose is not None:
            await aclose()


def _parse(head: bytes) -> Request | Response:
    """The request whose line and headers are `head`, or the error response it deserves."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(line) != 3 or len(head) > _MAX_HEAD:
        return Response(400, "text/plain", b"bad request\n")
    method, target, _ = line
    if method not in ("GET", "HEAD"):
        return Response(405, "text/plain", b"only GET and HEAD\n")
    parts = urllib.parse.urlsplit(target)
    return Request(method, parts.path, dict(urllib.parse.parse_qsl(parts.query)))
