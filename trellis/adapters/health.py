"""How far each domain's log followers trail its log, for `/healthz` and the metrics.

Every second the engine's domains' heads (as its writers hold them) are compared with the
followers' checkpoints in PostgreSQL (`trellis_follower_checkpoints`, where every sink moves
its own in the transaction that applies its batch, inline or in the follower process alike):
the projections (the slowest of them) and the event relay (the JetStream stream and the KV
bucket). engine.core.lag judges them; the last judgement is what the health check and the gauges
report. A relay stopped by a message it cannot pass, or by an event too large to publish,
thus fails the health check within TRELLIS_HEALTH_STALL_SECONDS of its last move (see
`stall_threshold`), naming the domain and the part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import asyncpg
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from trellis.engine.core.lag import LagTracker, PartHealth

log = logging.getLogger(__name__)

EVERY_S = 1.0
_CHECKPOINTS = """
SELECT follower, domain, version, position FROM trellis_follower_checkpoints
 WHERE domain = ANY($1::text[])
"""


def stall_threshold(detect_within_s: float) -> float:
    """How long a part must be seen stalled for `/healthz` to fail within `detect_within_s` of
    its last move (ARCHITECTURE §10: "within 60 s"): sampled every `EVERY_S`, a move is seen up
    to one sample late and a stall judged up to one sample after it is due, so two samples
    less (one at least). Judged at the whole setting, it failed 62-63 s after (SRE probe)."""
    return max(EVERY_S, detect_within_s - 2 * EVERY_S)


class FollowerHealth:
    """Samples the followers of the domains `heads()` names (domain -> head version and
    position).

    Args:
        pool: reads the checkpoints table (a pool of the projections' or any reader's).
        heads: the log's head of every domain the engine writes now.
        parts: part name -> its checkpoint's name (each projection, and the relay).
        tracker: the judge, with its bounds.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        heads: Callable[[], dict[str, tuple[int, int]]],
        parts: dict[str, str],
        tracker: LagTracker,
    ):
        self._pool = pool
        self._heads = heads
        self._parts = parts
        self.tracker = tracker
        self.report: list[PartHealth] = []
        self.sampled = False  # a first sample was taken
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="follower-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def problems(self) -> list[str]:
        return [part.reason for part in self.report if not part.ok]

    def domains(self) -> dict[str, dict[str, object]]:
        """Per domain: the log's head, and each part's position and state (/healthz)."""
        out: dict[str, dict[str, object]] = {}
        for part in self.report:
            domain = out.setdefault(
                part.domain,
                {"head": {"version": part.head, "position": part.head_position}, "parts": {}},
            )
            parts = domain["parts"]
            assert isinstance(parts, dict)
            parts[part.part] = {
                "version": part.version,
                "position": part.position,
                "behind": part.behind,
                "stalled_seconds": part.stalled_s,
                "ok": part.ok,
                **({"problem": part.reason} if part.reason else {}),
            }
        return out

    async def sample(self) -> None:
        heads = self._heads()
        rows = await self._pool.fetch(_CHECKPOINTS, list(heads)) if heads else []
        applied = {(r["domain"], r["follower"]): (r["version"], r["position"]) for r in rows}
        followers = {
            # A sink that never ran for the domain has applied nothing.
            (domain, part): applied.get((domain, name), (0, 0))
            for domain in heads
            for part, name in self._parts.items()
        }
        self.report = self.tracker.observe(time.monotonic(), heads, followers)
        self.sampled = True

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as exc:  # Postgres away: the store's own check says so
                log.debug("follower health: cannot sample: %r", exc)
            await asyncio.sleep(EVERY_S)


class FollowerGauges(Collector):
    """The last judgement as gauges: one to alert on, `trellis_follower_stalled`."""

    def __init__(self, health: FollowerHealth):
        self._health = health

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stalled, behind, seconds = families = self._families()
        for part in self._health.report:
            labels = [part.domain, part.part]
            stalled.add_metric(labels, 0.0 if part.ok else 1.0)
            behind.add_metric(labels, part.behind)
            seconds.add_metric(labels, part.stalled_s)
        return iter(families)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        labels = ["domain", "part"]
        return [
            GaugeMetricFamily(
                "trellis_follower_stalled",
                "1 while a follower of the domain's log (projections, relay) has stalled or "
                "fallen too far behind it (the health check fails then); 0 otherwise",
                labels=labels,
            ),
            GaugeMetricFamily(
                "trellis_follower_behind_events",
                "Events the follower trails the domain's log by",
                labels=labels,
            ),
            GaugeMetricFamily(
                "trellis_follower_stalled_seconds",
                "Seconds the follower has been behind the log without moving (0: caught up or "
                "moving)",
                labels=labels,
            ),
        ]
