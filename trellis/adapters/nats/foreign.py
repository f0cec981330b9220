"""What a consumer of the stream or the bucket does with a message that is not the contract's
(ARCHITECTURE §3): skip it, count it, log it once. Anyone allowed to publish on the stream's
subjects (plain mode: any client) can put anything there; no such message may stop a domain's
relay, blank the page, or end `watch`."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

Counted = Callable[[str, str], None]  # (consumer, domain): a metric's increment


class ForeignMessages:
    """Skipped messages of one consumer (`relay`, `page`, `watch`, ...): counted per domain
    it was reading, logged the first time for each. `on_skip` feeds a metric
    (trellis_foreign_messages_total{consumer, domain}); the domain label is the one the
    consumer reads, never a token of the message, so a flood cannot add series."""

    def __init__(self, consumer: str, on_skip: Counted | None = None):
        self.consumer = consumer
        self.on_skip = on_skip
        self.counts: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def skipped(self, domain: str, where: str) -> None:
        """A message at `where` (a stream sequence, a key) was not the contract's."""
        first = domain not in self.counts
        self.counts[domain] = self.counts.get(domain, 0) + 1
        if first:
            log.warning(
                "%s: skipped a message that is not %s at %s (domain %s); every further one "
                "is skipped and counted in trellis_foreign_messages_total, not logged",
                self.consumer,
                "an event of the log" if where.startswith("seq") else "a value of the contract",
                where,
                domain or "*",
            )
        if self.on_skip is not None:
            self.on_skip(self.consumer, domain)
