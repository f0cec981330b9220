"""Projection tables as a batch's fold sees them: rows fetched in bulk, changed in memory and
written back in bulk, inside the runner's transaction.

Why not one SQL statement per event: a statement is a network round trip, and replaying the log
would then run at round-trip speed, far below the rate of merely reading the log (ARCHITECTURE
§10 asks rebuilds to reach 30% of that). Instead each batch costs a few statements per table,
whatever its size: one SELECT for the rows its events touch, one DELETE and one upsert at the
end. The fold between them is plain Python over dicts, one `match` arm per event type in each
projection module. The statements are generated from the column list below, so a table's SQL
shape lives next to its definition and cannot drift from it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any, Protocol

import asyncpg
import msgspec

Row = dict[str, Any]
Key = tuple[Any, ...]

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class Column:
    """A column and its Postgres type. Rows and keys travel as one JSON document per statement,
    so the connection needs no custom codecs (the runner may be handed someone else's pool)."""

    name: str
    type: str


@dataclass(frozen=True)
class Table:
    """One projection table: its columns, primary key and the key prefix rows are grouped by."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    group: tuple[str, ...] = ()  # a key prefix fetched whole, e.g. all rows of one composition
    # Rows that no later event changes (an ended composition): `final` says which, in SQL,
    # and `final_position` names the column holding the position where each became final.
    # A read-model snapshot leaves them out; a past answer reads them from the live table.
    final: str | None = None
    final_position: str | None = None
    # A row's key. It runs for every row a fold touches: an itemgetter, which builds the
    # tuple in C, called directly (no method in between).
    key_of: Callable[[Row], Key] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        get = operator.itemgetter(*self.key)
        one: Callable[[Row], Key] = lambda row: (get(row),)  # noqa: E731
        object.__setattr__(self, "key_of", get if len(self.key) > 1 else one)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @cached_property
    def types(self) -> dict[str, str]:
        return {c.name: c.type for c in self.columns}

    @cached_property
    def json_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.type == "jsonb")

    def _keys_in(self, columns: tuple[str, ...], *, distinct: bool = False) -> str:
        """The keys of $1, a JSON array of arrays (one per key, in `columns` order), as rows
        with the columns' names."""
        picked = ", ".join(f"(k->>{i})::{self.types[c]} AS {c}" for i, c in enumerate(columns))
        select = "SELECT DISTINCT" if distinct else "SELECT"
        return f"{select} {picked} FROM json_array_elements($1::json) AS k"

    def _select_by(self, columns: tuple[str, ...]) -> str:
        """The rows whose `columns` (the key, or a prefix of it) are one of the keys in $1.

        Each key is looked up on its own (LATERAL; OFFSET 0 keeps the planner from joining it
        flat). As a join, Postgres could not know how few keys there are (it takes a JSON
        array for 100 rows) and hashed them to scan the whole table, which on a table of tens
        of thousands of rows read them all in every pass of a follower. The projections'
        sessions plan each run (adapters/postgres/sessions.py), so each lookup takes the index
        the table's present size calls for."""
        matches = " AND ".join(f"{c} = k.{c}" for c in columns)
        return (
            f"SELECT {', '.join(f't.{n}' for n in self.names)}\n"
            f"  FROM ({self._keys_in(columns, distinct=True)}) AS k,\n"
            f"       LATERAL (SELECT * FROM {self.name} WHERE {matches} OFFSET 0) AS t"
        )

    @cached_property
    def select_by_key(self) -> str:
        return self._select_by(self.key)

    @cached_property
    def select_by_group(self) -> str:
        return self._select_by(self.group)

    @cached_property
    def delete_by_key(self) -> str:
        return (
            f"DELETE FROM {self.name}\n"
            f" WHERE ({', '.join(self.key)}) IN ({self._keys_in(self.key)})"
        )

    @cached_property
    def upsert(self) -> str:
        """Insert or replace the rows of $1, a JSON array of row objects. A JSON null becomes
        SQL NULL there; in a jsonb column the fold's None means JSON null, and stays so."""
        values = ", ".join(
            f"coalesce(u.{c}, 'null')" if c in self.json_columns else f"u.{c}" for c in self.names
        )
        columns = ", ".join(f"{c.name} {c.type}" for c in self.columns)
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in self.names if c not in self.key)
        on_conflict = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
        return (
            f"INSERT INTO {self.name} ({', '.join(self.names)})\n"
            f"SELECT {values}\n"
            f"  FROM json_to_recordset($1::json) AS u({columns})\n"
            f"    ON CONFLICT ({', '.join(self.key)}) {on_conflict}"
        )

    @cached_property
    def select_live(self) -> str:
        """Every row of one domain that may still change (all of them without `final`)."""
        where = "domain = $1" + (f" AND NOT ({self.final})" if self.final else "")
        return f"SELECT {', '.join(self.names)} FROM {self.name} WHERE {where}"

    def decode(self, record: Any) -> Row:
        """A fetched record as a row: jsonb columns decoded."""
        row = dict(record)
        for c in self.json_columns:
            row[c] = _json_decode(row[c])
        return row


class RowSource(Protocol):
    """Where a batch's rows come from and go to: the projection tables in Postgres
    (PostgresRows), or a fold held in memory for a past moment (projections/past.py)."""

    async def fetch(self, table: Table, by: tuple[str, ...], keys: Sequence[Key]) -> list[Row]:
        """The rows whose columns `by` (the key, or the group prefix) equal one of `keys`."""
        ...

    async def write(self, table: Table, gone: Sequence[Key], kept: Sequence[Row]) -> None:
        """Delete the keys `gone`, then insert or replace the rows `kept`."""
        ...


class PostgresRows:
    """RowSource over the projection tables, inside the caller's transaction, for one batch's
    folds (`PostgresRows.batch`). Reads go at once; writes are queued and leave together, as
    one statement: one round trip per batch for every table, not two per table."""

    def __init__(self, conn: asyncpg.Connection):
        self.conn = conn  # the sink's transaction
        self._writes: list[Statement] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def batch(cls, conn: asyncpg.Connection, *then: Statement) -> AsyncIterator[PostgresRows]:
        """Rows for one batch's folds in `conn`'s transaction; on leaving, every write they
        queued goes, then `then`, in one statement (nothing goes if the folds raised)."""
        rows = cls(conn)
        yield rows
        await rows._send(*then)

    async def fetch(self, table: Table, by: tuple[str, ...], keys: Sequence[Key]) -> list[Row]:
        sql = table.select_by_key if by == table.key else table.select_by_group
        records = await self.conn.fetch(sql, json_keys(keys))
        return [table.decode(r) for r in records]

    async def write(self, table: Table, gone: Sequence[Key], kept: Sequence[Row]) -> None:
        """Queue the writes for the end of the batch. A table's rows are fetched before its
        writes and not after (each projection fetches, folds, then writes its own tables)."""
        # In key order, so that two transactions writing the same rows lock them in one order.
        if gone:
            self._writes.append((table.delete_by_key, [json_keys(sorted(gone))]))
        if kept:
            rows = sorted(kept, key=table.key_of)
            self._writes.append((table.upsert, [json_rows(rows)]))

    async def _send(self, *more: Statement) -> None:
        """Run the writes queued so far, then `more`, as one statement."""
        statements, self._writes = [*self._writes, *more], []
        if statements:
            await self.conn.execute(*one_statement(statements))


Statement = tuple[str, Sequence[Any]]  # SQL with $1, $2... and its arguments
_PARAMETER = re.compile(r"\$(\d+)")


def one_statement(statements: Sequence[Statement]) -> tuple[Any, ...]:
    """Several data-changing statements as one: all but the last as WITH queries, their
    parameters numbered on. Postgres runs each WITH query to completion whether or not it is
    read, all on one snapshot: fine for writes to different rows (a table's deletions and
    upserts never share a key, and none reads what another writes)."""
    if len(statements) == 1:
        sql, args = statements[0]
        return (sql, *args)
    parts: list[str] = []
    values: list[Any] = []
    for sql, args in statements:
        parts.append(_numbered_from(sql, len(values)))
        values.extend(args)
    *withs, last = parts
    joined = ",\n".join(f"w{i} AS (\n{sql}\n)" for i, sql in enumerate(withs))
    return (f"WITH {joined}\n{last}", *values)


@functools.lru_cache(maxsize=256)
def _numbered_from(sql: str, shift: int) -> str:
    """`sql` with each parameter $n made $(n + shift)."""
    return _PARAMETER.sub(lambda m: f"${int(m.group(1)) + shift}", sql)


def json_keys(keys: Sequence[Key]) -> str:
    """Keys as the statements' $1 takes them: one JSON array per key."""
    return _json_encode(keys).decode()


def json_rows(rows: Sequence[Row]) -> str:
    """Rows as the upsert's $1 takes them: one JSON encoding, done in C. An array parameter
    per column, as before, cost asyncpg several Python-level type checks per element."""
    return _json_encode(rows).decode()


def as_stored(table: Table, row: Row) -> Row:
    """`row` as the table gives it back: each value in its column's type, jsonb objects with
    their keys in jsonb's order (shorter keys first, then bytewise). A fold kept in memory
    stores rows so, and its answers are then the tables' answers, byte for byte."""
    stored: Row = {}
    for c in table.names:
        value = row[c]
        kind = table.types[c]
        if value is None:
            stored[c] = None
        elif kind == "jsonb":
            stored[c] = _jsonb(_json_decode(_json_encode(value)))
        elif kind == "float8":
            stored[c] = float(value)
        elif kind in ("bigint", "integer"):
            stored[c] = int(value)
        elif kind == "timestamptz":
            assert isinstance(value, datetime) and value.tzinfo is not None, (c, value)
            stored[c] = value
        else:
            stored[c] = value
    return stored


def _jsonb(value: Any) -> Any:
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: (len(k.encode()), k.encode()))
        return {k: _jsonb(value[k]) for k in keys}
    if isinstance(value, list):
        return [_jsonb(v) for v in value]
    return value


class Rows:
    """One table's rows for the length of one batch: a cache over the database plus the changes.

    `get` and `group` fetch what is not cached yet (one statement each; `prefetch` and
    `prefetch_groups` fetch many keys in one), `put` and `delete` change the cache, and `flush`
    writes every changed key once, in its final state. Missing rows are cached as None so a key
    is fetched at most once per batch.
    """

    def __init__(self, table: Table, source: RowSource):
        self.table = table
        self._source = source
        self._rows: dict[Key, Row | None] = {}
        self._dirty: dict[Key, None] = {}  # changed keys, in the order they first changed
        self._groups: dict[Key, set[Key]] = {}  # group prefix -> keys cached under it
        self._fetched_groups: set[Key] = set()
        # `put` runs for every row a fold changes (three in four events): what it needs of
        # the table, looked up once.
        self._key_of = table.key_of
        self._group_len = len(table.group)

    async def prefetch(self, keys: Iterable[Key]) -> None:
        """Fetch every key not cached yet, in one statement (a SELECT: no order to keep)."""
        missing = list(set(keys) - self._rows.keys())
        if not missing:
            return
        for row in await self._source.fetch(self.table, self.table.key, missing):
            self._cache(row)
        for key in missing:
            self._rows.setdefault(key, None)

    async def prefetch_groups(self, prefixes: Iterable[Key]) -> None:
        """Fetch every row under each prefix not fetched yet, in one statement."""
        missing = list(set(prefixes) - self._fetched_groups)
        if not missing:
            return
        for row in await self._source.fetch(self.table, self.table.group, missing):
            self._cache(row)
        self._fetched_groups.update(missing)

    async def get(self, key: Key) -> Row | None:
        if key not in self._rows:
            await self.prefetch([key])
        return self._rows[key]

    async def group(self, prefix: Key) -> list[Row]:
        """The live rows under `prefix` (changes of this batch included), in key order."""
        if prefix not in self._fetched_groups:
            await self.prefetch_groups([prefix])
        keys = sorted(self._groups.get(prefix, ()))
        return [row for k in keys if (row := self._rows[k]) is not None]

    def put(self, row: Row) -> None:
        """Insert or replace a row; it is written by `flush`."""
        key = self._key_of(row)
        self._rows[key] = row
        self._dirty[key] = None
        if self._group_len:
            self._grouped(key)

    def delete(self, key: Key) -> None:
        self._rows[key] = None
        self._dirty[key] = None

    def cached(self) -> list[Row]:
        """Every live row cached so far (for folds that scan what the batch already fetched)."""
        return [row for row in self._rows.values() if row is not None]

    async def flush(self) -> None:
        """Write every changed key in its final state, in the order each first changed (a
        source that needs key order sorts: PostgresRows does, a rebuild's rows need none)."""
        rows = self._rows
        gone = [k for k in self._dirty if rows[k] is None]
        kept = [row for k in self._dirty if (row := rows[k]) is not None]
        await self._source.write(self.table, gone, kept)
        self._dirty.clear()

    def _cache(self, row: Row) -> None:
        # A row this batch already holds is newer than the database's copy.
        key = self._key_of(row)
        if key in self._rows:
            return
        self._rows[key] = row
        if self._group_len:
            self._grouped(key)

    def _grouped(self, key: Key) -> None:
        self._groups.setdefault(key[: self._group_len], set()).add(key)
