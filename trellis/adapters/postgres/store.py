"""The EventStore port on PostgreSQL (asyncpg): the append-only log and the request-id table.

Driver errors are translated at this boundary: a lost race becomes ConcurrencyConflict, an event
the log refuses (schema/007) becomes EventRefused, a database that cannot be reached or cannot
commit becomes StoreUnavailable.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.privileges import bypasses_privileges
from trellis.engine.core import replies
from trellis.engine.core.errors import (
    ConcurrencyConflict,
    EventRefused,
    StoreUnavailable,
    WriterFenced,
)
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent, hash_of
from trellis.engine.service.ports import (
    Appended,
    PendingReply,
    StoredReply,
    stored_replies,
)

log = logging.getLogger(__name__)

_CONFLICT_STATES = {"TR001", asyncpg.UniqueViolationError.sqlstate}
_FENCED = "TR004"  # schema/008: the writer's epoch is not the domain's, or its lease ran out
# What the log cannot hold: schema/007's refusal of an id or integer that validation let pass
# (TR003), schema/012's of an event recorded before its predecessor (TR005), and data the json
# type or its text cannot represent (invalid_text_representation, untranslatable_character).
# Retrying cannot help.
_REFUSED_STATES = {"TR003", "TR005", "22P02", "22P05"}
_PAGE = 2000
# A hung database must turn into `unavailable` well inside a client's 10 s request timeout:
# connecting, acquiring, running a statement and resetting a broken connection are each bounded.
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 2.5
ACQUIRE_TIMEOUT_S = 2.0
# An append is four quick round trips: far less idle time than this. An engine with writer
# leases bounds it by its lease tick instead (adapters/bootstrap.py).
IDLE_IN_APPEND_S = 5.0

# The event columns in the order RecordedEvent takes them (verify reads the log with them too).
EVENT_COLUMNS = (
    "id, domain, version, position, type, schema_version, recorded_at, actor, causation_id, "
    "correlation_id, data, prev_hash, hash"
)

# One statement, so one round trip and its own transaction: the events, numbered and chained
# by the caller, and the requests' stored answers, each success answer completed with the
# position its event drew (or the head's, for an answer without events) as it is stored.
# Both come as JSON arrays of objects (_EventRow, _AnswerRow): one encoding in C, where an
# array parameter per column cost asyncpg Python-level type checks for every element.
_APPEND = """
WITH ev AS (
    INSERT INTO trellis_events (id, domain, version, type, schema_version, recorded_at, actor,
                                causation_id, correlation_id, data, prev_hash, hash, fence)
    SELECT e.id, $1, e.version, e.type, e.schema_version, e.recorded_at, e.actor,
           e.causation_id, e.correlation_id, e.data::json, e.prev_hash, e.hash, $3
      FROM json_to_recordset($2::json)
           AS e(id uuid, version bigint, type text, schema_version int, recorded_at timestamptz,
                actor text, causation_id text, correlation_id text, data text, prev_hash text,
                hash text)
     ORDER BY e.version
    RETURNING version, position
), rq AS (
    INSERT INTO trellis_requests (domain, actor, request_id, verb, body_hash, reply, position,
                                  fence)
    SELECT $1, r.actor, r.request_id, r.verb, r.body_hash,
           CASE WHEN r.tail IS NULL THEN r.head
                ELSE r.head || coalesce(ev.position, r.known)::text || r.tail END,
           coalesce(ev.position, r.known), $3
      FROM json_to_recordset($4::json)
           AS r(actor text, request_id text, verb text, body_hash text, head text, tail text,
                version bigint, known bigint)
      LEFT JOIN ev ON ev.version = r.version
)
SELECT version, position FROM ev
"""


class _EventRow(msgspec.Struct):
    """An event as _APPEND takes it: numbered, and chained to the one before."""

    id: uuid.UUID
    version: int
    type: str
    schema_version: int
    recorded_at: datetime
    actor: str
    causation_id: str
    correlation_id: str
    data: str  # the payload's JSON text, stored byte for byte (the hash covers it)
    prev_hash: str
    hash: str


class _AnswerRow(msgspec.Struct):
    """A stored answer as _APPEND takes it: a success in two pieces around its position (with
    tail; else whole, tail None), and where its position comes from (its event's version, or
    the known head position)."""

    actor: str
    request_id: str
    verb: str
    body_hash: str
    head: str
    tail: str | None
    version: int | None
    known: int | None


_json_encode = msgspec.json.Encoder().encode


@contextlib.contextmanager
def _translated(domain: str, expected: int = 0) -> Iterator[None]:
    """Map asyncpg's errors onto the engine's error tree."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        if exc.sqlstate in _CONFLICT_STATES:
            raise ConcurrencyConflict(domain, expected) from exc
        if exc.sqlstate == _FENCED:
            raise WriterFenced(domain, str(exc)) from exc
        if exc.sqlstate in _REFUSED_STATES:
            raise EventRefused(str(exc)) from exc
        if exc.sqlstate and exc.sqlstate[:2] in ("08", "53", "57", "58"):
            # connection, resources, operator intervention (shutdown), system errors
            raise StoreUnavailable(_named(exc)) from exc
        raise
    except (OSError, TimeoutError, asyncpg.InterfaceError) as exc:
        raise StoreUnavailable(_named(exc)) from exc


def _named(exc: BaseException) -> str:
    """`TimeoutError: no answer`, or `TimeoutError` alone when it says nothing more (not a
    dangling `TimeoutError: `)."""
    said = str(exc)
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


class PostgresEventStore:
    """Append-only log in the schema named by the pool's search_path."""

    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        schema: str | None = None,
        owner_dsn: str | None = None,
        min_size: int = 1,
        max_size: int = 8,
        idle_in_transaction_s: float = IDLE_IN_APPEND_S,
        application_name: str = sessions.ENGINE,
    ) -> PostgresEventStore:
        """Connect a pool (optionally pinned to `schema`) and bring the schema up to date. The
        server ends a session left idle inside a transaction (an append) for
        `idle_in_transaction_s`. `application_name` says what the sessions are for
        (adapters/postgres/sessions.py).

        With `owner_dsn`, the owner migrates and gives the pool's role the engine's privileges
        (adapters/postgres/privileges.py); without it the pool's own role migrates, which only
        a role that owns the schema can do (nothing to apply needs no privilege but reading).
        A role that could bypass append-only is logged as a warning.

        Raises:
            StoreUnavailable: Postgres cannot be reached (yet).
            MigrationError: See `adapters.postgres.migrations.migrate`.
        """
        from trellis.adapters.postgres.migrations import migrate, migration_files, prepare_schema

        with _translated("*"):
            pool = await connect_pool(
                dsn,
                schema=schema,
                min_size=min_size,
                max_size=max_size,
                connect_timeout=CONNECT_TIMEOUT_S,
                command_timeout=COMMAND_TIMEOUT_S,
                idle_in_transaction_s=idle_in_transaction_s,
                application_name=application_name,
            )
        try:
            with _translated("*"):
                async with pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
                    applied = []
                    if owner_dsn:
                        applied = await prepare_schema(
                            owner_dsn, schema, await conn.fetchval("SELECT current_user")
                        )
                    applied += await migrate(conn)
                    if applied and len(applied) < len(migration_files()):  # not a new schema
                        log.warning(
                            "migrated the schema: %s applied",
                            ", ".join(f"{v:03d}" for v in applied),
                        )
                    if await bypasses_privileges(conn):
                        log.warning(
                            "the engine's Postgres role %s owns the log or is a superuser, so "
                            "only triggers keep the log append-only; give the engine a role of "
                            "its own and TRELLIS_DATABASE_OWNER_URL "
                            "(docs/security.md, Least privilege)",
                            await conn.fetchval("SELECT current_user"),
                        )
        except BaseException:
            pool.terminate()
            raise
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        # acquire(timeout=) also bounds the reset of a connection that broke mid-query.
        async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
            rows: list[asyncpg.Record] = await conn.fetch(query, *args)
            return rows

    async def domains(self) -> list[str]:
        with _translated("*"):
            rows = await self._fetch("SELECT domain FROM trellis_streams ORDER BY domain")
        return [r["domain"] for r in rows]

    async def head(self, domain: str) -> Head:
        with _translated(domain):
            rows = await self._fetch(
                "SELECT version, position, hash FROM trellis_streams WHERE domain = $1", domain
            )
        return Head(rows[0]["version"], rows[0]["position"], rows[0]["hash"]) if rows else Head()

    async def last_position(self) -> int:
        # One row per domain, each holding its head's position: no scan of the log.
        rows = await self._fetch("SELECT coalesce(max(position), 0) AS p FROM trellis_streams")
        return int(rows[0]["p"])

    async def locate(self, domain: str, at: datetime | int) -> tuple[Head, datetime] | None:
        """The domain's last event at or before `at` (a time, or a log position)."""
        column = "position" if isinstance(at, int) else "recorded_at"
        with _translated(domain):
            rows = await self._fetch(
                "SELECT version, position, hash, recorded_at FROM trellis_events "
                f"WHERE domain = $1 AND {column} <= $2 ORDER BY {column} DESC, version DESC "
                "LIMIT 1",
                domain,
                at,
            )
        if not rows:
            return None
        row = rows[0]
        return Head(row["version"], row["position"], row["hash"]), row["recorded_at"]

    async def read(
        self, domain: str, after_version: int = 0, limit: int | None = None
    ) -> AsyncIterator[RecordedEvent]:
        """One domain's events in version order (at most `limit`), paged so no transaction
        stays open."""
        left = limit
        while left is None or left > 0:
            page = _PAGE if left is None else min(_PAGE, left)
            with _translated(domain):
                rows = await self._fetch(
                    f"SELECT {EVENT_COLUMNS} FROM trellis_events "
                    "WHERE domain = $1 AND version > $2 ORDER BY version LIMIT $3",
                    domain,
                    after_version,
                    page,
                )
            for row in rows:
                yield event_from_row(row)
            if len(rows) < page:
                return
            after_version = rows[-1]["version"]
            left = None if left is None else left - len(rows)

    async def read_all(self, after_position: int = 0) -> AsyncIterator[RecordedEvent]:
        """Every domain's events in global position order (auditors, projections, the relay)."""
        while True:
            with _translated("*"):
                rows = await self._fetch(
                    f"SELECT {EVENT_COLUMNS} FROM trellis_events WHERE position > $1 "
                    "ORDER BY position LIMIT $2",
                    after_position,
                    _PAGE,
                )
            for row in rows:
                yield event_from_row(row)
            if len(rows) < _PAGE:
                return
            after_position = rows[-1]["position"]

    async def find_replies(
        self, domain: str, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], StoredReply]:
        if not keys:
            return {}
        with _translated(domain):
            rows = await self._fetch(
                "SELECT actor, request_id, verb, body_hash, reply FROM trellis_requests "
                "WHERE domain = $1 AND (actor, request_id) IN "
                "(SELECT * FROM unnest($2::text[], $3::text[]))",
                domain,
                [a for a, _ in keys],
                [r for _, r in keys],
            )
        return {
            (r["actor"], r["request_id"]): StoredReply(
                actor=r["actor"],
                request_id=r["request_id"],
                verb=r["verb"],
                body_hash=r["body_hash"],
                reply=r["reply"].encode(),
            )
            for r in rows
        }

    async def barrier(self) -> None:
        # A transactional message writes WAL, so its commit waits for the synchronous standby
        # (synchronous_commit) like an append's, covering every commit before it; it changes
        # no table, and any role may send it.
        with _translated("*"):
            async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn, conn.transaction():
                await conn.execute("SELECT pg_logical_emit_message(true, 'trellis', 'barrier')")

    async def append(
        self,
        domain: str,
        expected: Head,
        events: Sequence[PendingEvent],
        replies_: Sequence[PendingReply],
        fence: int | None = None,
    ) -> Appended:
        """Append `events` right after `expected` and store `replies_`, in one transaction,
        under the writer epoch `fence` (the log refuses a stale one: WriterFenced)."""
        rows = _chain(domain, expected, events)
        answers = [_answer_row(expected, r) for r in replies_]
        positions: dict[int, int] = {}
        if rows or answers:
            with _translated(domain, expected.version):
                async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
                    inserted = await conn.fetch(
                        _APPEND,
                        domain,
                        _json_encode(rows).decode(),
                        fence,
                        _json_encode(answers).decode(),
                    )
            positions = {r["version"]: r["position"] for r in inserted}
        stored = stored_replies(expected, replies_, positions)
        recorded = [_recorded_from_row(domain, row, positions[row.version]) for row in rows]
        head = (
            Head(recorded[-1].version, recorded[-1].position, recorded[-1].hash)
            if recorded
            else expected
        )
        return Appended(recorded, stored, head)


def _answer_row(expected: Head, reply: PendingReply) -> _AnswerRow:
    if reply.ok:
        head, tail = replies.ok_around_position(reply.body)
        text, rest = head.decode(), tail.decode()
    else:
        text, rest = reply.body.decode(), None
    event = reply.event_index
    version = None if event is None else expected.version + event + 1
    known = expected.position if event is None else None
    return _AnswerRow(
        reply.actor, reply.request_id, reply.verb, reply.body_hash, text, rest, version, known
    )


def _chain(domain: str, expected: Head, events: Sequence[PendingEvent]) -> list[_EventRow]:
    """Number the events after `expected` and link each hash to the one before."""
    rows = []
    prev, version = expected.hash, expected.version
    for ev in events:
        version += 1
        digest = hash_of(ev, prev, domain, version)
        rows.append(
            _EventRow(
                uuid.UUID(ev.id),
                version,
                ev.type,
                ev.schema_version,
                ev.recorded_at,
                ev.actor,
                ev.causation_id,
                ev.correlation_id,
                ev.data.decode(),
                prev,
                digest,
            )
        )
        prev = digest
    return rows


def _recorded_from_row(domain: str, row: _EventRow, position: int) -> RecordedEvent:
    return RecordedEvent(
        id=str(row.id),
        domain=domain,
        version=row.version,
        position=position,
        type=row.type,
        schema_version=row.schema_version,
        recorded_at=row.recorded_at,
        actor=row.actor,
        causation_id=row.causation_id,
        correlation_id=row.correlation_id,
        data=row.data.encode(),
        prev_hash=row.prev_hash,
        hash=row.hash,
    )


def event_from_row(row: asyncpg.Record) -> RecordedEvent:
    """A row of trellis_events (selected with EVENT_COLUMNS) as a RecordedEvent."""
    # Unpacked by position, in EVENT_COLUMNS' order: a third faster than by name, and every
    # read of the log (engine start, followers, rebuilds) passes here once per event.
    (
        id,
        domain,
        version,
        position,
        type,
        schema_version,
        at,
        actor,
        cause,
        corr,
        data,
        prev,
        digest,
    ) = row
    return RecordedEvent(
        id=str(id),
        domain=domain,
        version=version,
        position=position,
        type=type,
        schema_version=schema_version,
        recorded_at=at,
        actor=actor,
        causation_id=cause,
        correlation_id=corr,
        data=data.encode(),
        prev_hash=prev,
        hash=digest,
    )


async def connect_pool(
    dsn: str,
    *,
    schema: str | None = None,
    min_size: int = 1,
    max_size: int = 8,
    connect_timeout: float = 5.0,
    command_timeout: float | None = None,
    idle_in_transaction_s: float = 30.0,
    durable_commits: bool = True,
    application_name: str = sessions.DEFAULT,
) -> asyncpg.Pool:
    """The one way Trellis connects to Postgres: a pool pinned to `schema` (when given) by a
    startup parameter. The event store bounds its commands; background readers (projections,
    the relay) may run long batches, so by default they are not cut off.

    A session that sits in an open transaction for `idle_in_transaction_s` is ended by the
    server: an engine paused (or hung) mid-transaction must not keep the locks a successor
    needs (the writer lease row, a follower's checkpoint) for ever.

    With `durable_commits=False` a commit does not wait for its WAL to reach disk (nor a
    synchronous standby): for what can be rebuilt from the log (the projections, the relay's
    checkpoint), which then takes no turn in the log's own flushes. A crash may lose its last
    commits (never part of one): the follower resumes from the checkpoint before them.

    `application_name` names the sessions in pg_stat_activity, and gives them the settings
    that purpose needs (adapters/postgres/sessions.py)."""
    settings = {
        **sessions.SETTINGS.get(application_name, {}),
        "application_name": application_name,
        "idle_in_transaction_session_timeout": f"{int(idle_in_transaction_s * 1000)}",
    }
    if not durable_commits:
        settings["synchronous_commit"] = "off"
    return await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        server_settings={**settings, **({"search_path": schema} if schema else {})},
        timeout=connect_timeout,
        command_timeout=command_timeout,
        reset=_keep_session,
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Hand a connection back to the pool as it is. asyncpg always rolls back an open
    transaction first; the default reset's RESET ALL / UNLISTEN / advisory unlock round trip
    undoes nothing here (no user of these pools sets session state, and every lock is
    transaction-scoped), and it cost a round trip per transaction."""
