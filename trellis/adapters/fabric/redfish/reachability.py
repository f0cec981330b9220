"""Whether the fabric manager answers, for `/healthz`, the metrics and the log.

The watch (watch.py) reads the service root at every health poll and tells `Reachability`
what came of it. While it does not answer, every compose fails, so the health check's `fabric`
check fails too, one problem per domain the engine writes, naming the service, since when and
the last error. The log gets the first failure, a reminder every `remind_s` (with the count of
failed attempts), and one line when it answers again: a poll every few seconds must not
become a warning every few seconds.

Time comes in (`now`, wall-clock seconds), so the collapsing is tested without waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: Seconds between reminders that the fabric manager still does not answer.
REMIND_S = 300.0


class Reachability:
    """The fabric manager at `url` as last polled.

    Args:
        url: The service's origin, for the messages.
        remind_s: Seconds between the log's reminders while it stays unreachable.
    """

    def __init__(self, url: str, *, remind_s: float = REMIND_S) -> None:
        self.url = url
        self.remind_s = remind_s
        self.since: float | None = None  # the first failure of this outage (None: it answers)
        self.error = ""  # the last failure's
        self.attempts = 0  # failed polls in this outage
        self._reminded_at = 0.0

    @property
    def ok(self) -> bool:
        return self.since is None

    def failed(self, now: float, error: str) -> tuple[int, str] | None:
        """A poll got no answer: the line to log (level, message), None when it is not due."""
        self.error = error
        self.attempts += 1
        if self.since is None:
            self.since = self._reminded_at = now
            return logging.WARNING, (
                f"fabric manager unreachable at {self.url}: {error} (composes fail until it "
                f"answers; reminders every {self.remind_s:g} s)"
            )
        if now - self._reminded_at < self.remind_s:
            return None
        self._reminded_at = now
        return logging.WARNING, (
            f"fabric manager still unreachable at {self.url} after {now - self.since:.0f} s "
            f"({self.attempts} attempts): {error}"
        )

    def answered(self, now: float) -> tuple[int, str] | None:
        """A poll got an answer: the line to log when that ends an outage, else None."""
        if self.since is None:
            return None
        line = (
            f"fabric manager reachable again at {self.url} after {now - self.since:.0f} s "
            f"({self.attempts} failed attempts)"
        )
        self.since, self.error, self.attempts = None, "", 0
        return logging.INFO, line

    def problem(self, domain: str) -> str | None:
        """Why the domain's fabric cannot do its job now (None: it answers)."""
        if self.since is None:
            return None
        since = datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds")
        return (
            f"fabric of domain {domain}: fabric manager unreachable at {self.url} "
            f"since {since}: {self.error}"
        )


class FabricGauges(Collector):
    """`trellis_fabric_reachable{domain}`: 1 while the fabric manager answers, else 0."""

    def __init__(self, reach: Reachability, domains: Callable[[], list[str]]) -> None:
        self._reach = reach
        self._domains = domains

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter([self._family()])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for domain in self._domains():
            family.add_metric([domain], 1.0 if self._reach.ok else 0.0)
        return iter([family])

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "trellis_fabric_reachable",
            "1 while the domain's fabric manager answers the health poll, 0 while it does not "
            "(the health check fails then and composes fail)",
            labels=["domain"],
        )
