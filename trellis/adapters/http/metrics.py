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
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from trellis.adapters.http.server import DEFAULT_HOST, HttpServer, Request, Response


@dataclass(frozen=True)
class Verdict:
    """A check's answer: whether it passes, and the problems it names (one sentence each),
    taken from one reading of what it checks, so the two cannot disagree."""

    ok: bool
    problems: tuple[str, ...] = ()

    @classmethod
    def of(cls, problems: Iterable[str | None]) -> Verdict:
        """Passes when `problems` (None: no problem) names none."""
        found = tuple(p for p in problems if p)
        return cls(not found, found)


#: A health check: True (or a passing Verdict) when what it checks is fine. It must finish
#: promptly on its own.
Check = Callable[[], Awaitable[bool | Verdict]]


def problems_check(read: Callable[[], Iterable[str | None]]) -> Check:
    """A check that passes when `read()` names no problem (None: none), and names what it
    finds in /healthz's `problems`: `read` is called once per answer, for both, when the check
    is called (with the other checks' synchronous readings: MetricsServer.health)."""

    def check() -> Awaitable[Verdict]:
        return _ready(Verdict.of(read()))

    return check


async def _ready(verdict: Verdict) -> Verdict:
    return verdict


def health_body(
    results: Mapping[str, bool | Verdict | BaseException], details: Mapping[str, Any]
) -> tuple[bool, dict[str, Any]]:
    """Whether every check passed, and /healthz's body: each check's result, `problems` (the
    details' own, then each check's, in the checks' order) and the other details. Each check
    is read once, so its entry in `checks` and its lines in `problems` come from one answer
    (a check that raised fails, naming no problem)."""
    checks: dict[str, bool] = {}
    problems = list(details.get("problems", ()))
    for name, result in results.items():
        verdict = result if isinstance(result, Verdict) else Verdict(result is True)
        checks[name] = verdict.ok
        problems.extend(verdict.problems)
    healthy = all(checks.values())
    body = {
        "status": "ok" if healthy else "unavailable",
        "checks": checks,
        "problems": problems,
        **{key: value for key, value in details.items() if key != "problems"},
    }
    return healthy, body


class MetricsServer(HttpServer):
    """Serves `registry` on /metrics and the `checks` on /healthz, at `host`:`port` (0: a free
    port; `url` says which). `details` adds to /healthz's body: its `problems` come first in
    the body's, before the checks' own (a Verdict's)."""

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

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether every check passes, and /healthz's body (`health_body`): every check run
        once. The details and every check's synchronous reading are taken in one stretch,
        before anything is awaited, so they read the same state (the followers' report, say)."""
        details = self._details()
        pending = [check() for check in self._checks.values()]
        results = await asyncio.gather(*pending, return_exceptions=True)
        return health_body(dict(zip(self._checks, results, strict=True)), details)

    async def _answer(self, request: Request) -> Response:
        if request.path == "/metrics":
            return Response(200, CONTENT_TYPE_LATEST, generate_latest(self._registry))
        if request.path == "/livez":
            # Answered on the engine's loop: that it answers is the check.
            return Response(200, "application/json", b'{"status": "ok"}\n')
        if request.path in ("/healthz", "/health", "/readyz"):
            healthy, body = await self.health()
            text = json.dumps(body).encode() + b"\n"
            return Response(200 if healthy else 503, "application/json", text)
        return Response(404, "text/plain", b"not found: try /metrics, /healthz or /livez\n")
