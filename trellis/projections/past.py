"""The projections at a past moment: folded in memory from a snapshot of their live rows.

A query with `at` (ARCHITECTURE §4) must answer exactly what it answered live then. The live
tables only know the present, so the answer is folded again: the projections' own `apply`
code runs over MemoryRows (a projections.table.RowSource held in a dict) from the newest
`read_models` snapshot at or before the target event, over the events up to it. The answer is
then built by the same projections.read_models.Answers code as a live one, from rows stored as
the tables would store them (projections.table.as_stored).

Snapshots keep only rows that may still change. A row that no later event changes (an ended
composition: Table.final) stays in the live table as it ended; a past answer reads it from
there when it ended at or before the snapshot, and the fold holds every row that changed
after it. So a snapshot stays the size of the live fabric, not of all history.

`save_snapshot` runs in the projection sink's batch transaction (projections/sink.py) when the
batch reaches a multiple of its `snapshot_every` versions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg
import msgspec

from trellis.engine.core.checkpoints import Signer
from trellis.engine.core.records import Head, RecordedEvent
from trellis.engine.service.follower import DomainLog
from trellis.engine.service.ports import Snapshot, SnapshotStore
from trellis.engine.service.snapshots import first_usable, seal
from trellis.projections.base import Fact, Projection
from trellis.projections.history import Window, interval_query, last_ended_query
from trellis.projections.table import Key, Row, Table, as_stored

# Bump when a projection's fold changes meaning, so older read-model snapshots are ignored;
# a change of the tables' shape changes the format by itself.
FOLD_REVISION = 2  # 2: a lease-expired interval ends at its release (history.py)
_BATCH = 1000

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def _tables(projections: Sequence[Projection]) -> list[Table]:
    return [t for p in projections for t in p.tables]


def format_of(projections: Sequence[Projection]) -> str:
    """The read-model snapshot format of these projections' tables and folds."""
    shape = [
        [t.name, [[c.name, c.type] for c in t.columns], t.key, t.group, t.final]
        for t in _tables(projections)
    ]
    text = msgspec.json.encode([FOLD_REVISION, shape])
    return f"read_models-{hashlib.sha256(text).hexdigest()[:16]}"


async def save_snapshot(
    conn: asyncpg.Connection, projections: Sequence[Projection], last: RecordedEvent, signer: Signer
) -> None:
    """Snapshot the live rows of `last`'s domain, as of `last` (the caller's transaction has
    just folded it), sealed with `signer` (engine/service/snapshots.py)."""
    body = {
        t.name: [t.decode(r) for r in await conn.fetch(t.select_live, last.domain)]
        for t in _tables(projections)
    }
    snapshot = Snapshot(
        domain=last.domain,
        kind="read_models",
        version=last.version,
        position=last.position,
        hash=last.hash,
        recorded_at=last.recorded_at,
        format=format_of(projections),
        body=_encode(body),
    )
    await conn.execute(
        "INSERT INTO trellis_snapshots "
        "(domain, kind, version, position, hash, format, body, signature) "
        "VALUES ($1, 'read_models', $2, $3, $4, $5, $6, $7) "
        "ON CONFLICT (domain, kind, version) DO NOTHING",
        snapshot.domain,
        snapshot.version,
        snapshot.position,
        snapshot.hash,
        snapshot.format,
        snapshot.body,
        seal(signer, snapshot),
    )


class MemoryRows:
    """A RowSource held in memory: rows by table and key, as the tables would store them."""

    def __init__(self, tables: Iterable[Table], rows: dict[str, list[Row]] | None = None):
        self._tables = {t.name: t for t in tables}
        self._rows: dict[str, dict[Key, Row]] = {name: {} for name in self._tables}
        for name, stored in (rows or {}).items():
            table = self._tables[name]  # KeyError: a snapshot of other tables (format check)
            self._rows[name] = {table.key_of(r): r for r in stored}

    async def fetch(self, table: Table, by: tuple[str, ...], keys: Sequence[Key]) -> list[Row]:
        stored = self._rows[table.name]
        if by == table.key:
            found = [stored[k] for k in keys if k in stored]
        else:
            wanted = set(keys)
            found = [r for k, r in stored.items() if k[: len(by)] in wanted]
        # Copies: a fold changes the rows it fetched in place before it writes them back.
        return [_decode(_encode(r)) for r in found]

    async def write(self, table: Table, gone: Sequence[Key], kept: Sequence[Row]) -> None:
        stored = self._rows[table.name]
        for key in gone:
            stored.pop(key, None)
        for row in kept:
            stored[table.key_of(row)] = as_stored(table, row)

    def rows(self, name: str) -> list[Row]:
        """Every row of a table, in key order."""
        stored = self._rows[name]
        return [stored[k] for k in sorted(stored)]


class PastReader:
    """projections.read_models.RowReader over a fold in memory, plus the ended rows of the live
    tables that ended at or before the snapshot it started from (`since`)."""

    def __init__(self, db: asyncpg.Pool, memory: MemoryRows, since: int):
        self._db = db
        self.memory = memory
        self.since = since

    async def compositions(self, domain: str, ids: Sequence[str]) -> list[Row]:
        held = {r["composition_id"]: r for r in self.memory.rows("proj_compositions")}
        found = [held[i] for i in ids if i in held]
        missing = [i for i in ids if i not in held]
        if missing and self.since:
            found += await self._ended("proj_compositions", domain, "composition_id", missing)
        return sorted(found, key=lambda r: r["composition_id"])

    async def component(self, domain: str, component_id: str) -> Row | None:
        return next(
            (r for r in self.memory.rows("proj_components") if r["id"] == component_id), None
        )

    async def connections(self, domain: str, filters: dict[str, str]) -> list[Row]:
        rows = self.memory.rows("proj_connections")
        return _in_order([r for r in rows if all(r[c] == v for c, v in filters.items())])

    async def connected(self, domain: str, kind: str, target: str) -> list[Row]:
        rows = self.memory.rows("proj_connections")
        if kind in ("device", "host"):
            picked = [r for r in rows if r[kind] == target]
        elif kind == "composition":
            picked = [r for r in rows if r["composition_id"] == target]
        elif kind == "link":
            picked = [r for r in rows if target in r["links"]]
        else:  # a switch or an OCS: the paths passing it
            picked = [r for r in rows if target in r["path"]]
        return _in_order(picked)

    async def intervals(self, domain: str, window: Window) -> list[Row]:
        rows = [r for r in self.memory.rows("proj_history_intervals") if window.holds(r)]
        if self.since:
            ended = interval_query(domain, window, ended_by=self.since)
            rows += [dict(r) for r in await self._db.fetch(*ended)]
        return sorted(rows, key=lambda r: (r["start_position"], r["device"]))

    async def last_ended(self, domain: str, device: str) -> Row | None:
        rows = [
            r
            for r in self.memory.rows("proj_history_intervals")
            if r["device"] == device and r["end_position"] is not None
        ]
        if self.since:
            record = await self._db.fetchrow(*last_ended_query(domain, device, ended_by=self.since))
            rows += [] if record is None else [dict(record)]
        return max(rows, key=lambda r: r["end_position"], default=None)

    async def _ended(self, name: str, domain: str, column: str, ids: list[str]) -> list[Row]:
        table = self.memory._tables[name]
        assert table.final and table.final_position
        records = await self._db.fetch(
            f"SELECT {', '.join(table.names)} FROM {table.name} WHERE domain = $1 "
            f"AND {column} = ANY($2::text[]) AND ({table.final}) "
            f"AND {table.final_position} <= $3",
            domain,
            ids,
            self.since,
        )
        return [table.decode(r) for r in records]


def _in_order(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: (r["host"], r["composition_id"], r["device"]))


async def fold_past(
    db: asyncpg.Pool,
    log: DomainLog,
    snapshots: SnapshotStore | None,
    projections: Sequence[Projection],
    domain: str,
    head: Head,
) -> PastReader:
    """The projections right after the domain's event `head`, folded in memory from the newest
    usable snapshot at or before it (or from the first event)."""
    tables = _tables(projections)
    found: tuple[Snapshot, MemoryRows] | None = None
    if snapshots is not None:
        candidates = snapshots.candidates(domain, "read_models", at_most_version=head.version)
        found = await first_usable(
            candidates, format_of(projections), lambda s: MemoryRows(tables, _decode(s.body))
        )
    after, since = (found[0].version, found[0].position) if found else (0, 0)
    memory = found[1] if found else MemoryRows(tables)
    batch: list[Fact] = []
    async for record in log.read(domain, after_version=after, limit=head.version - after):
        batch.append(Fact(record, record.event()))
        if len(batch) == _BATCH:
            await _apply(projections, memory, batch)
            batch = []
    if batch:
        await _apply(projections, memory, batch)
    return PastReader(db, memory, since)


async def _apply(projections: Sequence[Projection], memory: MemoryRows, facts: list[Fact]) -> Any:
    for projection in projections:
        await projection.apply(memory, facts)
