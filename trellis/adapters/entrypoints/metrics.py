"""The metrics endpoint of `trellis up --metrics-port`: Prometheus text on `/metrics`, and
`/healthz` (200 while the engine serves and its checks pass, 503 otherwise, with a JSON body
naming each check).

Served by the small HTTP server on the engine's own event loop (httpd.py): the gauges read the
engine's state and the health checks ask its store and NATS connection, all without crossing
threads. prometheus-client's own server runs in a thread of its own, where neither could be
done safely.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from trellis.adapters.entrypoints.httpd import DEFAULT_HOST, HttpServer, Request, Response

#: A health check: True when what it checks is fine. It must finish promptly on its own.
Check = Callable[[], Awaitable[bool]]


class MetricsServer(HttpServer):
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
        super().__init__(self._answer, host=host, port=port)
        self._registry = registry
        self._checks = dict(checks)

    async def health(self) -> tuple[bool, dict[str, bool]]:
        """Whether every check passes, and each one's result (a check that raises fails)."""
        results = await asyncio.gather(
            *(c() for c in self._checks.values()), return_exceptions=True
        )
        passed = {name: r is True for name, r in zip(self._checks, results, strict=True)}
        return all(passed.values()), passed

    async def _answer(self, request: Request) -> Response:
        if request.path == "/metrics":
            return Response(200, CONTENT_TYPE_LATEST, generate_latest(self._registry))
        if request.path in ("/healthz", "/health"):
            healthy, checks = await self.health()
            body = json.dumps({"status": "ok" if healthy else "unavailable", "checks": checks})
            return Response(200 if healthy else 503, "application/json", body.encode() + b"\n")
        return Response(404, "text/plain", b"not found: try /metrics or /healthz\n")
