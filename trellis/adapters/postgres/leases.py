"""engine.service.ports.LeaseStore on PostgreSQL: writer leases with epochs, and engine heartbeats.

The tables and the check that fences appends are schema/008. Every time is the database's
clock_timestamp(), so no two engines' clocks are ever compared. Leases are taken, renewed and
handed over on a pool of their own, so a renewal never queues behind the engine's appends.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from trellis.engine.service.ports import Holder

_HEARTBEAT = """
INSERT INTO trellis_engines (id, name, serves_all, started_at, heartbeat_at)
VALUES ($1, $2, $3, clock_timestamp(), clock_timestamp())
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = clock_timestamp()
"""
_ALIVE = """
SELECT id FROM trellis_engines
 WHERE serves_all AND heartbeat_at > clock_timestamp() - $1 * interval '1 second' ORDER BY id
"""
# Free, or run out: the taker draws the next epoch (at least $4), which fences every older
# writer out.
_ACQUIRE = """
INSERT INTO trellis_writer_leases AS l (domain, holder, epoch, expires_at)
VALUES ($1, $2, GREATEST(1, $4), clock_timestamp() + $3 * interval '1 second')
    ON CONFLICT (domain) DO UPDATE
   SET holder = EXCLUDED.holder, epoch = GREATEST(l.epoch + 1, $4), expires_at = EXCLUDED.expires_at
 WHERE l.expires_at <= clock_timestamp()
RETURNING epoch
"""
# Only leases still running: one that ran out may be being taken over right now.
_RENEW = """
UPDATE trellis_writer_leases SET expires_at = clock_timestamp() + $3 * interval '1 second'
 WHERE holder = $1 AND domain = ANY($2::text[]) AND expires_at > clock_timestamp()
RETURNING domain, epoch
"""
_RELEASE = """
UPDATE trellis_writer_leases SET expires_at = clock_timestamp()
 WHERE domain = $1 AND holder = $2 AND epoch = $3
"""
_HOLDERS = """
SELECT domain, holder, epoch FROM trellis_writer_leases
 WHERE expires_at > clock_timestamp() ORDER BY domain
"""
_LEAVE = "DELETE FROM trellis_engines WHERE id = $1"


class PostgresLeases:
    """Writer leases in the schema named by the pool's search_path (migrations applied)."""

    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def heartbeat(
        self, engine: str, name: str, ttl: float, *, serves_all: bool = True
    ) -> list[str]:
        async with self._pool.acquire() as conn:
            await conn.execute(_HEARTBEAT, engine, name, serves_all)
            return [r["id"] for r in await conn.fetch(_ALIVE, ttl)]

    async def acquire(self, domain: str, engine: str, ttl: float, at_least: int = 0) -> int | None:
        epoch: int | None = await self._pool.fetchval(_ACQUIRE, domain, engine, ttl, at_least)
        return epoch

    async def renew(self, engine: str, domains: Sequence[str], ttl: float) -> dict[str, int]:
        if not domains:
            return {}
        rows = await self._pool.fetch(_RENEW, engine, list(domains), ttl)
        return {r["domain"]: r["epoch"] for r in rows}

    async def release(self, domain: str, engine: str, epoch: int) -> None:
        await self._pool.execute(_RELEASE, domain, engine, epoch)

    async def holders(self) -> list[Holder]:
        rows = await self._pool.fetch(_HOLDERS)
        return [Holder(domain=r["domain"], engine=r["holder"], epoch=r["epoch"]) for r in rows]

    async def leave(self, engine: str) -> None:
        await self._pool.execute(_LEAVE, engine)
