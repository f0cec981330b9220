"""The metrics endpoint of `trellis up --metrics-port`: Prometheus text on `/metrics`, and
`/healthz` (200 while the engine serves and its checks pass, 503 otherwise, with a JSON body
naming each check).

A small HTTP/1.0-style server on the engine's own event loop (one request per connection, then
close): the gauges read the engine's state and the health checks ask its store and NATS
connection, all without crossing threads. prometheus-client's own server runs in a thread of
its own, where neither could be done safely.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
#: A health check: True when what it checks is fine. It must finish promptly on its own.
Check = Callable[[], Awaitable[bool]]
_READ_TIMEOUT_S = 5.0
_MAX_HEAD = 16 * 1024  # a request line and headers; a scrape sends a few hundred bytes
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS |= {503: "Service Unavailable"}


class MetricsServer:
    """Serves `registry` on /metrics and the `checks` on /healthz, at `host`:`port` (0: a free
    port; `url` says which)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        checks: Mapping[str, Check],
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
    ):
        self._registry = registry
        self._checks = dict(checks)
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

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
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def health(self) -> tuple[bool, dict[str, bool]]:
        """Whether every check passes, and each one's result (a check that raises fails)."""
        results = await asyncio.gather(
            *(c() for c in self._checks.values()), return_exceptions=True
        )
        passed = {name: r is True for name, r in zip(self._checks, results, strict=True)}
        return all(passed.values()), passed

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                head = b""  # answered 400
            status, content_type, body = await self._answer(head)
            writer.write(
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if not head.startswith(b"HEAD "):
                writer.write(body)
            await writer.drain()
        except ConnectionError:
            pass  # the scraper left
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, head: bytes) -> tuple[int, str, bytes]:
        """Status, content type and body for a request whose line and headers are `head`."""
        line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(line) != 3 or len(head) > _MAX_HEAD:
            return 400, "text/plain", b"bad request\n"
        method, target, _ = line
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        path = target.split("?", 1)[0]
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        if path in ("/healthz", "/health"):
            healthy, checks = await self.health()
            body = json.dumps({"status": "ok" if healthy else "unavailable", "checks": checks})
            return (200 if healthy else 503), "application/json", body.encode() + b"\n"
        return 404, "text/plain", b"not found: try /metrics or /healthz\n"
