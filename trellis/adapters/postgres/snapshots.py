"""engine.service.ports.SnapshotStore over the trellis_snapshots table (schema/012).

Candidates are read newest first, a few at a time, joined with the log so that a snapshot
whose event the log does not hold with the same position and hash (a restored or altered
database, a snapshot of another log) is skipped with a warning rather than trusted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import asyncpg

from trellis.engine.service.ports import Snapshot

log = logging.getLogger(__name__)

_SAVE = """
INSERT INTO trellis_snapshots (domain, kind, version, position, hash, format, body)
VALUES ($1, $2, $3, $4, $5, $6, $7)
    ON CONFLICT (domain, kind, version) DO NOTHING
"""
_CANDIDATES = """
SELECT s.domain, s.kind, s.version, s.position, s.hash, s.format, s.body, s.taken_at,
       e.position AS log_position, e.hash AS log_hash, e.recorded_at AS log_time
  FROM trellis_snapshots s
  LEFT JOIN trellis_events e ON e.domain = s.domain AND e.version = s.version
 WHERE s.domain = $1 AND s.kind = $2 AND s.version <= $3
 ORDER BY s.version DESC
 LIMIT $4
"""
_PAGE = 4


class PostgresSnapshots:
    """Snapshots in the pool's schema (the engine's role may insert and read them)."""

    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def save(self, snapshot: Snapshot) -> None:
        await self._pool.execute(
            _SAVE,
            snapshot.domain,
            snapshot.kind,
            snapshot.version,
            snapshot.position,
            snapshot.hash,
            snapshot.format,
            snapshot.body,
        )

    async def candidates(
        self, domain: str, kind: str, *, at_most_version: int | None = None
    ) -> AsyncIterator[Snapshot]:
        below = at_most_version if at_most_version is not None else 2**63 - 1
        while True:
            rows = await self._pool.fetch(_CANDIDATES, domain, kind, below, _PAGE)
            for row in rows:
                if (row["log_position"], row["log_hash"]) != (row["position"], row["hash"]):
                    log.warning(
                        "snapshot of %s at version %d ignored: the log does not hold that event "
                        "(position %s, hash %s)",
                        domain,
                        row["version"],
                        row["position"],
                        row["hash"][:12],
                    )
                    continue
                yield Snapshot(
                    domain=domain,
                    kind=row["kind"],
                    version=row["version"],
                    position=row["position"],
                    hash=row["hash"],
                    recorded_at=row["log_time"],
                    format=row["format"],
                    body=bytes(row["body"]),
                )
            if len(rows) < _PAGE:
                return
            below = rows[-1]["version"] - 1
