"""engine.service.ports.SnapshotStore in memory, checked against a MemoryLog as the PostgreSQL store
checks against the log: a snapshot whose event the log does not hold with that position and
hash is skipped with a warning."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec

from trellis.adapters.memory.log import MemoryLog
from trellis.engine.service.ports import Snapshot

log = logging.getLogger(__name__)


class MemorySnapshots:
    def __init__(self, log_: MemoryLog):
        self._log = log_
        self._saved: dict[tuple[str, str, int], Snapshot] = {}

    async def save(self, snapshot: Snapshot) -> None:
        # One per (domain, kind, version), the first kept, as ON CONFLICT DO NOTHING does.
        self._saved.setdefault((snapshot.domain, snapshot.kind, snapshot.version), snapshot)

    async def candidates(
        self, domain: str, kind: str, *, at_most_version: int | None = None
    ) -> AsyncIterator[Snapshot]:
        limit = at_most_version if at_most_version is not None else 2**63 - 1
        chosen = sorted(
            (s for (d, k, v), s in self._saved.items() if d == domain and k == kind and v <= limit),
            key=lambda s: s.version,
            reverse=True,
        )
        for snapshot in chosen:
            event = self._log.event(domain, snapshot.version)
            if event is None or (event.position, event.hash) != (snapshot.position, snapshot.hash):
                log.warning(
                    "snapshot of %s at version %d ignored: the log does not hold that event",
                    domain,
                    snapshot.version,
                )
                continue
            # The event's time, as the PostgreSQL store reads it from the log.
            yield msgspec.structs.replace(snapshot, recorded_at=event.recorded_at)
