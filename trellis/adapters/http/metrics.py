"""The metrics endpoint of `trellis up --metrics-port`: Prometheus text on `/metrics`,
`/healthz` (200 while the engine serves and its checks pass, 503 otherwise, with a JSON body
naming each check, and, per domain, the log's head and how far each of its followers got:
adapters/health.py; `/readyz` is the same, by its Kubernetes name), and `/livez`.

`/livez` checks nothing but that the engine's event loop answers. A Kubernetes liveness probe
restarts what fails it: an outage of Postgres, NATS or the fabric manager fails `/healthz`,
and restarting the engine would mend none of them, while a loop frozen for good fails both.

Served by the small HTTP server on the engine's own event loop (server.py): the gauges read the
engine's state and the health checks ask its store and NATS connection, all without crossing
threads. prometheus-client's own server runs in a thread of its own, where neither could be
done safely.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from trellis.adapters.http.server import DEFAULT_HOST, HttpServer, Request, Response

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
        details: Callable[[], dict[str, Any]] | None = None,
        allowed_hosts: Iterable[str] = (),
    ):
        super().__init__(self._answer, host=host, port=port, allowed_hosts=allowed_hosts)
        self._registry = registry
        self._checks = dict(checks)
        self._details = details or dict

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
        if request.path == "/livez":
            # Answered on the engine's loop: that it answers is the check.
            return Response(200, "application/json", b'{"status": "ok"}\n')
        if request.path in ("/healthz", "/health", "/readyz"):
            healthy, checks = await self.health()
            status = "ok" if healthy else "unavailable"
            body = json.dumps({"status": status, "checks": checks, **self._details()})
            return Response(200 if healthy else 503, "application/json", body.encode() + b"\n")
        return Response(404, "text/plain", b"not found: try /metrics, /healthz or /livez\n")
