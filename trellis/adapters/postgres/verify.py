"""The database side of `trellis verify`: reading the log for an audit, and replaying the
projections next to the live ones to compare them row by row.

Read-only towards everything Trellis owns. The log is read one domain at a time through a
server-side cursor inside a read-only REPEATABLE READ transaction, a batch at a time, so a
million events never sit in memory at once; the domain's stream head and stored checkpoints
are read in that same snapshot, so events committed meanwhile cannot set them apart. The
fresh projections are built in temporary tables (`CREATE TEMP TABLE ... (LIKE <live>
INCLUDING ALL)`) on a connection of their own: temporary relations come first in every search
path, so the projection code writes them unchanged, they need no privilege beyond TEMP, and
they vanish with the connection, whatever happens to the audit.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import asyncpg
import msgspec

from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.store import EVENT_COLUMNS, event_from_row
from trellis.engine.core.audit import Finding, StoredCheckpoint
from trellis.engine.core.records import RecordedEvent
from trellis.projections.base import Fact, Projection
from trellis.projections.table import PostgresRows, Table

BATCH = 2000
MAX_DIFFERENCES = 20  # rows named per table and domain; the rest are counted


async def live_schema(conn: asyncpg.Connection) -> str:
    """The schema the log lives in (the connection's search path finds it)."""
    schema = await conn.fetchval(
        "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = to_regclass('trellis_events')"
    )
    if schema is None:
        raise LookupError("no Trellis log here: trellis_events not found in the search path")
    return str(schema)


async def domains(conn: asyncpg.Connection) -> list[str]:
    """Every domain with a stream head or an event (a tampered log may have one without the
    other)."""
    rows = await conn.fetch(
        "SELECT domain FROM trellis_streams UNION SELECT DISTINCT domain FROM trellis_events "
        "ORDER BY 1"
    )
    return [r["domain"] for r in rows]


class DomainSnapshot:
    """One domain as a single REPEATABLE READ snapshot shows it: its stream head, its stored
    checkpoints and its events agree with each other, whatever commits while they are read."""

    def __init__(
        self,
        conn: asyncpg.Connection,
        domain: str,
        head: tuple[int, int, str] | None,
        checkpoints: list[StoredCheckpoint] | None,
    ):
        self._conn = conn
        self.domain = domain
        self.head = head  # (version, position, hash) in trellis_streams, None without a row
        self.checkpoints = checkpoints  # by size; None: this database keeps no checkpoints

    async def events(self, batch: int = BATCH) -> AsyncIterator[list[RecordedEvent]]:
        """The domain's events in version order, `batch` at a time."""
        cursor = await self._conn.cursor(
            f"SELECT {EVENT_COLUMNS} FROM trellis_events WHERE domain = $1 "
            "ORDER BY version, position",
            self.domain,
        )
        while rows := await cursor.fetch(batch):
            yield [event_from_row(r) for r in rows]


@contextlib.asynccontextmanager
async def snapshot(conn: asyncpg.Connection, domain: str) -> AsyncIterator[DomainSnapshot]:
    """`domain` read in one read-only snapshot, open while the context is."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        # The first statement takes the snapshot: everything after reads the same moment.
        head = await stream_head(conn, domain)
        yield DomainSnapshot(conn, domain, head, await stored_checkpoints(conn, domain))


async def stream_head(conn: asyncpg.Connection, domain: str) -> tuple[int, int, str] | None:
    """The domain's row in trellis_streams: (version, position, hash)."""
    row = await conn.fetchrow(
        "SELECT version, position, hash FROM trellis_streams WHERE domain = $1", domain
    )
    return None if row is None else (row["version"], row["position"], row["hash"])


async def events_between(
    conn: asyncpg.Connection, domain: str, after: int, upto: int
) -> list[RecordedEvent]:
    """The domain's events with `after < version <= upto` (a short catch-up)."""
    rows = await conn.fetch(
        f"SELECT {EVENT_COLUMNS} FROM trellis_events WHERE domain = $1 AND version > $2 "
        "AND version <= $3 ORDER BY version",
        domain,
        after,
        upto,
    )
    return [event_from_row(r) for r in rows]


async def follower_checkpoints(
    conn: asyncpg.Connection, names: Sequence[str], domain: str
) -> dict[str, tuple[int, int]]:
    """How far each named follower (a projection, `relay:<stream>`) has applied `domain`:
    (version, position); a follower that never ran is absent."""
    rows = await conn.fetch(
        "SELECT follower, version, position FROM trellis_follower_checkpoints "
        "WHERE follower = ANY($1::text[]) AND domain = $2",
        list(names),
        domain,
    )
    return {r["follower"]: (r["version"], r["position"]) for r in rows}


async def stored_checkpoints(
    conn: asyncpg.Connection, domain: str
) -> list[StoredCheckpoint] | None:
    """Every stored signed Merkle checkpoint of `domain` (`trellis_checkpoints`, schema/010) by
    size, or None when this database has no such table (yet)."""
    if await conn.fetchval("SELECT to_regclass('trellis_checkpoints')") is None:
        return None
    rows = await conn.fetch(
        "SELECT size, root, note, recorded_at FROM trellis_checkpoints WHERE domain = $1 "
        "ORDER BY size",
        domain,
    )
    return [
        StoredCheckpoint(
            size=r["size"], root=r["root"], note=r["note"], recorded_at=r["recorded_at"]
        )
        for r in rows
    ]


class ProjectionReplay:
    """Fresh projections in temporary tables on `conn`, compared with the live ones in
    `schema`.

    `feed` folds one domain's facts into each projection up to a version of its own (the live
    projection's checkpoint), so both sides hold the same prefix of the log.
    """

    def __init__(self, conn: asyncpg.Connection, schema: str, projections: Sequence[Projection]):
        self._conn = conn
        self._schema = schema
        self._projections = list(projections)
        self.folded: dict[str, int] = {}  # projection -> version folded, for the current domain

    @property
    def tables(self) -> list[Table]:
        return [t for p in self._projections for t in p.tables]

    async def prepare(self) -> None:
        # Temporary tables are never analyzed and grow from empty as the replay folds: plan
        # each run, as the projections' own sessions do (adapters/postgres/sessions.py).
        for name, value in sessions.SETTINGS[sessions.PROJECTIONS].items():
            await self._conn.execute("SELECT set_config($1, $2, false)", name, value)
        for table in self.tables:
            await self._conn.execute(
                f"CREATE TEMP TABLE {table.name} "
                f"(LIKE {_quote(self._schema)}.{table.name} INCLUDING ALL)"
            )

    def start(self) -> None:
        """A new domain: nothing of it folded yet."""
        self.folded = {p.name: 0 for p in self._projections}

    async def feed(self, facts: Sequence[Fact], upto: dict[str, int]) -> None:
        """Fold `facts` (one domain's, in version order) into each projection, only those up to
        that projection's `upto` version."""
        folded = dict(self.folded)
        async with self._conn.transaction(), PostgresRows.batch(self._conn) as rows:
            for projection in self._projections:
                limit = upto.get(projection.name, 0)
                done = folded[projection.name]
                todo = [f for f in facts if done < f.record.version <= limit]
                if todo:
                    await projection.apply(rows, todo)
                    folded[projection.name] = todo[-1].record.version
        self.folded = folded  # once written

    async def compare(self, domain: str) -> list[Finding]:
        """Every row where a live table and the replay differ, by table and key (at most
        MAX_DIFFERENCES named per table; a last finding counts the rest)."""
        findings: list[Finding] = []
        for table in self.tables:
            findings += await self._compare(table, domain)
        return findings

    async def _compare(self, table: Table, domain: str) -> list[Finding]:
        keys = " AND ".join(f"f.{k} = l.{k}" for k in table.key)
        rows = await self._conn.fetch(
            f"SELECT to_jsonb(f) AS fresh, to_jsonb(l) AS live "
            f"  FROM (SELECT * FROM pg_temp.{table.name} WHERE domain = $1) f "
            f"  FULL JOIN (SELECT * FROM {_quote(self._schema)}.{table.name} "
            f"             WHERE domain = $1) l ON {keys} "
            f" WHERE to_jsonb(f) IS DISTINCT FROM to_jsonb(l)",
            domain,
        )
        findings = []
        decode = msgspec.json.Decoder().decode
        for row in rows[:MAX_DIFFERENCES]:
            fresh = decode(row["fresh"]) if row["fresh"] is not None else None
            live = decode(row["live"]) if row["live"] is not None else None
            either = fresh or live
            assert either is not None
            key = "/".join(str(either[k]) for k in table.key if k != "domain")
            columns: list[str] = []
            if live is None:
                what = "the replay has it, the live table does not"
            elif fresh is None:
                what = "the live table has it, the replay does not"
            else:
                columns = sorted(c for c in table.names if fresh.get(c) != live.get(c))
                what = f"differs in {', '.join(columns)}"
            findings.append(
                Finding(
                    check="projection",
                    domain=domain,
                    table=table.name,
                    key=key,
                    message=f"{table.name} row {key}: {what}",
                    details={
                        "columns": columns,
                        **({"live": {c: live.get(c) for c in columns}} if live else {}),
                        **({"replay": {c: fresh.get(c) for c in columns}} if fresh else {}),
                    },
                )
            )
        if len(rows) > MAX_DIFFERENCES:
            findings.append(
                Finding(
                    check="projection",
                    domain=domain,
                    table=table.name,
                    message=f"{table.name}: {len(rows) - MAX_DIFFERENCES} more rows differ",
                )
            )
        return findings


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
