"""A rebuild's rows: the projections' fold carried in memory from batch to batch, written to
Postgres once per batch with COPY.

A live follower's batch fetches the rows its events touch, folds them and writes them back
(projections/table.py): a few statements per table and batch. In a rebuild that fetch, the
jsonb round trip of every row carried from one batch to the next and the upsert's parameter
encoding took over half the time. A rebuild starts from empty tables and is their only
writer (projections/sink.py checks the checkpoints at every commit and hands over to the
ordinary follower if anyone else moved them), so the rows it needs are the rows it wrote:
ReplayRows keeps them in memory and answers a fetch from there. Postgres sees each batch's
end state once: rows new to it by COPY, rows it holds by the ordinary upsert, gone ones by
one DELETE.

Memory stays the size of what the recent batches touched, plus the key of every row written:
a row no fold fetched or wrote since the last commit is dropped (Postgres has it), and read
back from there should an event name it again. A row is handed to a fold as the table would
give it back (projections.table.as_stored), so the fold sees what a live follower's fetch
would have shown it, and the rows end byte for byte as the live followers leave them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import asyncpg
import msgspec

from trellis.projections.table import Key, Row, Table, as_stored, json_keys, json_rows

_json_encode = msgspec.json.Encoder().encode
_copy = msgspec.msgpack.Encoder().encode
_uncopy = msgspec.msgpack.Decoder().decode


class _TableState:
    """One table's rows as a rebuild holds them."""

    def __init__(self, table: Table):
        self.table = table
        self.held: dict[Key, Row] = {}  # rows in memory, newest state
        self.raw: set[Key] = set()  # held rows as a fold left them, not yet as stored
        self.touched: dict[Key, Row | None] = {}  # changes since the last commit (None: gone)
        self.used: set[Key] = set()  # keys handed to a fold or written since the last commit
        self.stored: set[Key] = set()  # keys Postgres holds as of the last commit
        self.dropped_groups: set[Key] = set()  # group prefixes with rows only Postgres holds
        self.groups: dict[Key, set[Key]] = {}  # group prefix -> held keys under it

    def hold(self, key: Key, row: Row) -> None:
        self.held[key] = row
        if self.table.group:
            self.groups.setdefault(key[: len(self.table.group)], set()).add(key)

    def release(self, key: Key) -> None:
        del self.held[key]
        self.raw.discard(key)
        if self.table.group:
            prefix = key[: len(self.table.group)]
            keys = self.groups[prefix]
            keys.discard(key)
            if not keys:
                del self.groups[prefix]

    def keep_used(self) -> None:
        """Drop the held rows no fold fetched or wrote since the last commit (Postgres has
        them), and start counting again. Rebuilt from what stays: most rows are dropped."""
        held = {k: row for k, row in self.held.items() if k in self.used}
        if self.table.group:
            n = len(self.table.group)
            self.dropped_groups.update(k[:n] for k in self.held if k not in held)
            self.groups = {}
            for key in held:
                self.groups.setdefault(key[:n], set()).add(key)
        self.held = held
        self.raw &= self.used
        self.touched = {}
        self.used = set()

    def handed(self, key: Key) -> Row:
        """A copy of a held row, as the table would give it back."""
        if key in self.raw:
            self.held[key] = as_stored(self.table, self.held[key])
            self.raw.discard(key)
        self.used.add(key)
        copied: Row = _uncopy(_copy(self.held[key]))
        return copied

    def dropped(self, key: Key) -> bool:
        """True when only Postgres holds the row of `key`."""
        return key in self.stored and key not in self.held and key not in self.touched


class ReplayRows:
    """projections.table.RowSource for a rebuild of one domain's projection tables.

    Args:
        pool: reads back rows dropped from memory (committed, so any connection sees them).
        tables: every table the projections own, empty when the rebuild starts.
    """

    def __init__(self, pool: asyncpg.Pool, tables: Iterable[Table]):
        tables = list(tables)
        # Keys start with the domain, so other domains' rows (a rebuild of several) never
        # meet the rows this one holds.
        assert all(t.key[0] == "domain" for t in tables), [t.name for t in tables]
        self._pool = pool
        self._state = {t.name: _TableState(t) for t in tables}

    async def fetch(self, table: Table, by: tuple[str, ...], keys: Sequence[Key]) -> list[Row]:
        state = self._state[table.name]
        if by == table.key:
            await self._read_back(state, [k for k in keys if state.dropped(k)], table.key)
            return [state.handed(k) for k in keys if k in state.held]
        await self._read_back(state, [p for p in keys if p in state.dropped_groups], table.group)
        state.dropped_groups.difference_update(keys)
        return [state.handed(k) for p in keys for k in state.groups.get(p, ())]

    async def write(self, table: Table, gone: Sequence[Key], kept: Sequence[Row]) -> None:
        state = self._state[table.name]
        for key in gone:
            if key in state.held:
                state.release(key)
            if key in state.stored:
                state.touched[key] = None
            else:
                state.touched.pop(key, None)  # Postgres never saw it: nothing to write
        for row in kept:
            key = table.key_of(row)
            state.hold(key, row)
            state.raw.add(key)
            state.touched[key] = row
            state.used.add(key)

    def changes(self) -> list[Changes]:
        """Take every change since the last call, for `write` (the rows in memory now count
        them as written), and drop from memory what no fold fetched or wrote since then."""
        taken = []
        for state in self._state.values():
            gone = sorted(k for k, row in state.touched.items() if row is None)
            kept = [(k, row) for k, row in state.touched.items() if row is not None]
            taken.append(
                Changes(
                    state.table,
                    gone,
                    changed=[row for k, row in kept if k in state.stored],
                    new=[row for k, row in kept if k not in state.stored],
                )
            )
            state.stored.difference_update(gone)
            state.stored.update(k for k, _ in kept)
            state.keep_used()
        return taken

    async def _read_back(self, state: _TableState, keys: list[Key], by: tuple[str, ...]) -> None:
        """Hold again the committed rows under `keys` (of columns `by`) dropped from memory."""
        if not keys:
            return
        table = state.table
        sql = table.select_by_key if by == table.key else table.select_by_group
        async with self._pool.acquire() as conn:
            records = await conn.fetch(sql, json_keys(keys))
        for record in records:
            row = table.decode(record)
            key = table.key_of(row)
            # Only a row this replay wrote and has not deleted or changed since.
            if key in state.stored and key not in state.held and key not in state.touched:
                state.hold(key, row)


class Changes(NamedTuple):
    """One table's changes over some batches: keys gone, rows Postgres holds in an older
    state, rows new to it."""

    table: Table
    gone: list[Key]
    changed: list[Row]
    new: list[Row]


async def write(conn: asyncpg.Connection, changes: Sequence[Changes]) -> None:
    """Write `changes` in the caller's transaction: a DELETE, an upsert and a COPY per table
    at most."""
    for table, gone, changed, new in changes:
        if gone:
            await conn.execute(table.delete_by_key, json_keys(gone))
        if changed:
            await conn.execute(table.upsert, json_rows(changed))
        if new:
            await conn.copy_records_to_table(
                table.name, records=_records(table, new), columns=table.names
            )


def _records(table: Table, rows: Sequence[Row]) -> list[Sequence[Any]]:
    """Rows as COPY takes them: values in column order (picked in C), jsonb values as text."""
    values = operator.itemgetter(*table.names)  # every table has several columns: tuples
    json_at = [i for i, c in enumerate(table.names) if c in table.json_columns]
    if not json_at:
        return [values(row) for row in rows]
    records: list[Sequence[Any]] = []
    for row in rows:
        record = list(values(row))
        for i in json_at:
            # A jsonb None is JSON null, as the upsert stores it, never SQL NULL.
            record[i] = _json_encode(record[i]).decode()
        records.append(record)
    return records
