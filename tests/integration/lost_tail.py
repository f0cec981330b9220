"""What a promoted standby that lacked the last commits holds (docs/deployment.md §3), made by
hand: the owner deletes a domain's events past a version behind the append-only triggers and
sets the stream's head back to it. The followers' checkpoints stay where they were, unless
`relay_checkpoint`: the relay's goes back with the log, as when the standby lacked its moves
too. `signed_checkpoints`: the signed checkpoints past it go too, as they would (each was
committed after the events it covers). `reuse_positions`: the next events take the positions
the lost ones had, as in a log restored from a backup (pg_dump keeps the sequence's value)."""

from __future__ import annotations

import asyncpg


async def lose_tail(
    owner_url: str,
    schema: str,
    domain: str,
    keep: int,
    *,
    relay_checkpoint: bool = False,
    reuse_positions: bool = False,
    signed_checkpoints: bool = False,
) -> None:
    """Leave `domain`'s log at version `keep`."""
    sql = await asyncpg.connect(owner_url, server_settings={"search_path": schema})
    try:
        async with sql.transaction():
            await sql.execute("ALTER TABLE trellis_events DISABLE TRIGGER USER")
            await sql.execute("ALTER TABLE trellis_streams DISABLE TRIGGER USER")
            await sql.execute(
                "DELETE FROM trellis_events WHERE domain = $1 AND version > $2", domain, keep
            )
            await sql.execute(
                "UPDATE trellis_streams s SET version = e.version, position = e.position, "
                "hash = e.hash, recorded_at = e.recorded_at FROM trellis_events e "
                "WHERE s.domain = $1 AND e.domain = $1 AND e.version = $2",
                domain, keep,
            )  # fmt: skip
            if relay_checkpoint:
                await sql.execute(
                    "UPDATE trellis_follower_checkpoints c SET version = e.version, "
                    "position = e.position FROM trellis_events e "
                    "WHERE c.follower LIKE 'relay:%' AND c.domain = $1 "
                    "AND e.domain = $1 AND e.version = $2",
                    domain, keep,
                )  # fmt: skip
            if signed_checkpoints:
                await sql.execute("ALTER TABLE trellis_checkpoints DISABLE TRIGGER USER")
                await sql.execute(
                    "DELETE FROM trellis_checkpoints WHERE domain = $1 AND size > $2", domain, keep
                )
                await sql.execute("ALTER TABLE trellis_checkpoints ENABLE TRIGGER USER")
            if reuse_positions:
                await sql.execute(
                    "SELECT setval(pg_get_serial_sequence('trellis_events', 'position'), "
                    "(SELECT max(position) FROM trellis_events))"
                )
            await sql.execute("ALTER TABLE trellis_events ENABLE TRIGGER USER")
            await sql.execute("ALTER TABLE trellis_streams ENABLE TRIGGER USER")
    finally:
        await sql.close()
