"""engine.service.ports.SnapshotStore over the trellis_snapshots table (schema/012, 019).

Candidates are read newest first, a few at a time, joined with the log so that a snapshot
whose event the log does not hold with the same position and hash (a restored or altered
database, a snapshot of another log) is skipped with a warning rather than trusted. Each is
saved with its seal by the deployment's checkpoint key (engine/service/snapshots.py), and one
whose seal does not verify (an altered body, a row from before seals, another key's) is skipped
with a warning too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg

from trellis.engine.core.checkpoints import Signer
from trellis.engine.service.ports import Snapshot
from trellis.engine.service.snapshots import is_sealed, seal, skipped

_SAVE = """
INSERT INTO trellis_snapshots (domain, kind, version, position, hash, format, body, signature)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
    ON CONFLICT (domain, kind, version) DO NOTHING
"""
_CANDIDATES = """
SELECT s.domain, s.kind, s.version, s.position, s.hash, s.format, s.body, s.signature,
       e.position AS log_position, e.hash AS log_hash, e.recorded_at AS log_time
  FROM trellis_snapshots s
  LEFT JOIN trellis_events e ON e.domain = s.domain AND e.version = s.version
 WHERE s.domain = $1 AND s.kind = $2 AND s.version <= $3
 ORDER BY s.version DESC
 LIMIT $4
"""
_PAGE = 4


class PostgresSnapshots:
    """Snapshots in the pool's schema (the engine's role may insert and read them), sealed
    and checked with `signer`, the deployment's checkpoint key: the engine and the follower
    process must hold the same one to use each other's."""

    def __init__(self, pool: asyncpg.Pool, signer: Signer):
        self._pool = pool
        self._signer = signer

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
            seal(self._signer, snapshot),
        )

    async def candidates(
        self, domain: str, kind: str, *, at_most_version: int | None = None
    ) -> AsyncIterator[Snapshot]:
        below = at_most_version if at_most_version is not None else 2**63 - 1
        while True:
            rows = await self._pool.fetch(_CANDIDATES, domain, kind, below, _PAGE)
            for row in rows:
                version, hash = row["version"], row["hash"]
                if (row["log_position"], row["log_hash"]) != (row["position"], hash):
                    why = f"the log does not hold that event (position {row['position']})"
                    skipped(domain, kind, version, hash, why)
                    continue
                snapshot = Snapshot(
                    domain=domain,
                    kind=row["kind"],
                    version=version,
                    position=row["position"],
                    hash=hash,
                    recorded_at=row["log_time"],
                    format=row["format"],
                    body=bytes(row["body"]),
                )
                if row["signature"] is None:
                    skipped(domain, kind, version, hash, "it is not sealed (taken before seals)")
                elif not is_sealed(self._signer.verifier, snapshot, row["signature"]):
                    why = (
                        "its seal does not verify with this deployment's checkpoint key: altered, "
                        "or sealed under another key"
                    )
                    skipped(domain, kind, version, hash, why)
                else:
                    yield snapshot
            if len(rows) < _PAGE:
                return
            below = rows[-1]["version"] - 1
