"""The engine as a NATS micro service (ADR-32, nats-py's `nats.micro`), so NATS tooling sees it:
`$SRV.PING`, `$SRV.INFO` and `$SRV.STATS` (each also `.trellis-engine` and
`.trellis-engine.<id>`) answer with the engine's identity, its endpoints (the intake's
subjects) and their request counts, error counts and processing times: `nats micro ls`,
`nats micro info trellis-engine`, `nats micro stats trellis-engine`. STATS also says which
domains the engine writes now (metadata `writes`, comma-separated, and `writes_count`).

nats.micro answers the `$SRV` subjects; the endpoints it reports are the intake's own
subscriptions (adapters/nats/intake.py), counted by an `EndpointCount` each. nats.micro's own
endpoints cannot carry the intake without breaking the contract:
- a nats.micro endpoint awaits its handler before it takes the next message (nats-py runs a
  subscription's callbacks one at a time), so requests would be served one after another: no
  group commit, and one compose waiting for its fabric saga would hold up every request behind
  it, intents of other domains included;
- it counts an error only when the handler raises, and then replies with an empty body and
  `Nats-Service-Error` headers in place of the reply envelope (ARCHITECTURE §3).
So the intake goes on serving each request in its own task, in the queue group engines fail
over by, and counts it on its endpoint when it answers (an `ok: false` reply is an error); the
`EngineService` reports these counts through nats.micro's public `info()` and `stats()`.

nats.micro answers a discovery request on whatever reply subject it names, which would let
anyone have the engine publish its PING answer into the bucket or the event stream; the
`EngineService` answers only where `may_answer` allows (the intake's reply rule,
adapters/nats/replies.py) and drops the rest unanswered.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro.service import (
    SEMVER_REGEX,
    EndpointInfo,
    EndpointStats,
    Service,
    ServiceConfig,
    ServiceInfo,
    ServiceStats,
)

from trellis import DISTRIBUTION

SERVICE_NAME = "trellis-engine"
#: Reported when the installed version is no semantic version (micro requires one).
UNVERSIONED = "0.0.0"


def package_version() -> str:
    """The installed package's version, as the micro service reports it."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return UNVERSIONED
    return version if SEMVER_REGEX.match(version) else UNVERSIONED


class EndpointCount:
    """One endpoint of the service: a subject the intake serves, and what it answered."""

    def __init__(self, name: str, subject: str, queue_group: str, metadata: dict[str, str]) -> None:
        self.name = name
        self.subject = subject
        self.queue_group = queue_group
        self.metadata = metadata
        self.requests = 0  # received (as nats.micro counts them)
        self.errors = 0
        self.processing_ns = 0
        self.answered = 0
        self.last_error = ""

    def received(self) -> int:
        """Count a request in; the clock reading its `done` takes."""
        self.requests += 1
        return time.perf_counter_ns()

    def done(self, started_ns: int, error: str | None = None) -> None:
        """The request was answered (`error`: its error reply, as "code: message")."""
        self.processing_ns += time.perf_counter_ns() - started_ns
        self.answered += 1
        if error is not None:
            self.errors += 1
            self.last_error = error

    def info(self) -> EndpointInfo:
        return EndpointInfo(
            name=self.name,
            subject=self.subject,
            queue_group=self.queue_group,
            metadata=dict(self.metadata),
        )

    def stats(self) -> EndpointStats:
        return EndpointStats(
            name=self.name,
            subject=self.subject,
            queue_group=self.queue_group,
            num_requests=self.requests,
            num_errors=self.errors,
            processing_time=self.processing_ns,
            average_processing_time=self.processing_ns // self.answered if self.answered else 0,
            last_error=self.last_error,
        )


class EngineService(Service):
    """nats.micro's service, reporting the intake's endpoints (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        *,
        metadata: dict[str, str],
        may_answer: Callable[[Msg], bool] = lambda msg: True,
        now: Callable[[], dict[str, str]] = dict,
    ):
        self._may_answer = may_answer
        self._now = now
        super().__init__(
            nc,
            ServiceConfig(
                name=SERVICE_NAME,
                version=package_version(),
                description="Trellis engine: composes devices over the fabric (intents, "
                "admin verbs, queries and tenant views)",
                metadata=metadata,
            ),
        )
        self.endpoints: list[EndpointCount] = []

    def add(
        self, name: str, subject: str, queue_group: str, metadata: dict[str, str]
    ) -> EndpointCount:
        """Report one more endpoint; the caller subscribes to it and counts on it."""
        endpoint = EndpointCount(name, subject, queue_group, metadata)
        self.endpoints.append(endpoint)
        return endpoint

    def info(self) -> ServiceInfo:
        info: ServiceInfo = super().info()
        return dataclasses.replace(info, endpoints=[e.info() for e in self.endpoints])

    def stats(self) -> ServiceStats:
        """The endpoints' counts, and in the metadata what `now` says of this moment (which
        domains the engine writes: `trellis engines` asks every engine for it)."""
        stats: ServiceStats = super().stats()
        return dataclasses.replace(
            stats,
            endpoints=[e.stats() for e in self.endpoints],
            metadata={**stats.metadata, **self._now()},
        )

    # nats.micro subscribes these handlers (looked up on the instance) to the $SRV subjects;
    # each answers only where `may_answer` allows.

    async def _handle_ping_request(self, msg: Msg) -> None:
        if self._may_answer(msg):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg: Msg) -> None:
        if self._may_answer(msg):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg: Msg) -> None:
        if self._may_answer(msg):
            await super()._handle_stats_request(msg)
