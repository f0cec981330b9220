"""The projections as a follower's sink: each domain's events folded into the projection tables.

An engine follows each domain it serves with an engine.service.follower.Follower over this sink. A
batch of one domain's events is applied to every projection in one transaction, together with
each projection's checkpoint for that domain (trellis_follower_checkpoints, schema/005), so
tables and checkpoints always agree. The checkpoint rows are locked (FOR UPDATE) first: two
followers of the same domain (an engine handing a domain over, `trellis projections rebuild`
while the engine runs) take turns, and one that finds a checkpoint already past part of its
batch skips that part. One that finds a checkpoint behind what it was handed (someone
rebuilt) raises Rewound and resumes from there.

A checkpoint names its event by version and position. One the log no longer holds (the log
lost its tail in a failover to a standby without it, and was written on since: docs/
deployment.md §3) means the tables hold what the log does not: the domain's rows are emptied and
its log folded again from the start, with a warning.

Checkpoints are per projection, so a projection added later catches up on its own. Every
`snapshot_every` versions the batch also snapshots the domain's live rows, for answers at past
moments (projections/past.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncGenerator, Iterator, Sequence

import asyncpg

from trellis.engine.core.checkpoints import Signer
from trellis.engine.core.records import RecordedEvent
from trellis.engine.service.follower import DomainLog, Follower, Progress, Rewound, Stalled
from trellis.projections import follower_checkpoints
from trellis.projections.base import Fact, Projection
from trellis.projections.compositions import CompositionsProjection
from trellis.projections.connections import ConnectionsProjection
from trellis.projections.devices import DevicesProjection
from trellis.projections.history import HistoryProjection
from trellis.projections.past import format_of, save_snapshot
from trellis.projections.replay import Changes, ReplayRows, write
from trellis.projections.table import PostgresRows, Table

log = logging.getLogger("trellis.projections")

SINK_NAME = "projections"

_ENSURE = """
INSERT INTO trellis_follower_checkpoints (follower, domain, version, position)
SELECT name, $2, 0, 0 FROM unnest($1::text[]) AS name
    ON CONFLICT (follower, domain) DO NOTHING
"""
_READ = f"""
SELECT c.follower, c.version, c.position, {follower_checkpoints.HELD} AS held
  FROM trellis_follower_checkpoints c WHERE c.follower = ANY($1::text[]) AND c.domain = $2
"""
_LOCK = _READ + " ORDER BY c.follower FOR UPDATE OF c"
_SAVE = """
UPDATE trellis_follower_checkpoints AS c SET version = u.version, position = u.position
  FROM unnest($1::text[], $3::bigint[], $4::bigint[]) AS u(follower, version, position)
 WHERE c.follower = u.follower AND c.domain = $2
"""


def default_projections() -> list[Projection]:
    """The projections the queries read: compositions, connections, history, devices."""
    return [
        CompositionsProjection(),
        ConnectionsProjection(),
        HistoryProjection(),
        DevicesProjection(),
    ]


class ProjectionSink:
    """Folds domains' events into projection tables (engine.service.follower.Sink).

    Args:
        pool: asyncpg pool whose search_path holds the log and the projection tables
            (migrations already applied, as PostgresEventStore.open does).
        projections: what to fold; `default_projections()` when omitted.
        snapshot_every: snapshot a domain's live rows (projections/past.py) in the batch that
            reaches each multiple of this many versions; 0: never.
        signer: the deployment's checkpoint key, which seals each snapshot (needed with
            `snapshot_every`: an unsealed snapshot is never used).
    """

    name = SINK_NAME

    def __init__(
        self,
        pool: asyncpg.Pool,
        projections: Sequence[Projection] | None = None,
        *,
        snapshot_every: int = 0,
        signer: Signer | None = None,
    ):
        if snapshot_every and signer is None:
            raise ValueError("snapshot_every needs the signer that seals the snapshots")
        self.pool = pool
        self._snapshot_every = snapshot_every
        self._signer = signer
        self._projections = list(projections if projections is not None else default_projections())
        self._names = [p.name for p in self._projections]
        if len(set(self._names)) != len(self._names):
            raise ValueError(f"projection names must be unique: {self._names}")
        self._seen: dict[str, int] = {}  # domain -> the lowest checkpoint as last seen

    @property
    def checkpoint_names(self) -> list[str]:
        """The projections' names, which key their checkpoints."""
        return list(self._names)

    @property
    def projections(self) -> list[Projection]:
        """What the sink folds, in the order it folds them."""
        return list(self._projections)

    @property
    def table_defs(self) -> list[Table]:
        """Every table the projections own, in a fixed order."""
        return [t for p in self._projections for t in p.tables]

    @property
    def tables(self) -> list[str]:
        """The names of `table_defs`."""
        return [t.name for t in self.table_defs]

    async def resume(self, domain: str) -> tuple[int, Progress]:
        async with self.pool.acquire() as conn:
            await conn.execute(_ENSURE, self._names, domain)
            rows = await conn.fetch(_READ, self._names, domain)
            if not all(r["held"] for r in rows):
                await self._start_again(conn, domain)
                rows = await conn.fetch(_READ, self._names, domain)
        lowest = min((Progress(r["version"], r["position"]) for r in rows), key=_version)
        self._seen[domain] = lowest.version
        return lowest.version, lowest

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        """Fold one batch into every projection and move their checkpoints, atomically."""
        facts: list[Fact] = []
        stalled: Stalled | None = None
        for record in records:
            try:
                facts.append(Fact(record, record.event()))
            except Exception as exc:  # a newer engine's event, or damage: stop before it
                stalled = Stalled(Progress(), record.position, f"{record.type}: {exc}")
                break
        progress = await self._commit(domain, facts, records[0].version) if facts else None
        if stalled is not None:
            stalled.progress = progress or await self._lowest(domain)
            raise stalled
        assert progress is not None
        return progress

    async def refresh(self, domain: str) -> None:
        """A quiet moment: a checkpoint below what we last saw means someone rebuilt; one
        naming an event the log no longer holds, that the domain is to be folded again."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(_READ, self._names, domain)
        if _lowest(rows).version < self._seen.get(domain, 0) or not all(r["held"] for r in rows):
            raise Rewound

    async def _lowest(self, domain: str) -> Progress:
        async with self.pool.acquire() as conn:
            return _lowest(await conn.fetch(_READ, self._names, domain))

    async def _start_again(self, conn: asyncpg.Connection, domain: str) -> None:
        """A checkpoint names an event the log no longer holds (it lost its tail in a failover
        to a standby without it, and was written on since): the tables hold what the log does
        not. Empty the domain's rows and fold it again from its first event."""
        async with conn.transaction():
            locked = await conn.fetch(_LOCK, self._names, domain)
            lost = [r["version"] for r in locked if not r["held"]]
            if not lost:
                return  # another follower started it again first
            log.warning(
                "projections of domain %s: the log no longer holds version %d that they "
                "followed (a failover to a standby without it?); folding the domain again "
                "from the start",
                domain,
                max(lost),
            )
            await _start_over(conn, self, domain)

    async def _commit(self, domain: str, facts: list[Fact], first: int) -> Progress:
        last = facts[-1].record
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(_LOCK, self._names, domain)
            locked = {r["follower"]: Progress(r["version"], r["position"]) for r in rows}
            held = {r["follower"]: r["held"] for r in rows}
            if len(locked) < len(self._names) or any(
                cp.version < first - 1 for cp in locked.values()
            ):
                raise Rewound  # events before this batch would be missing from a projection
            if not all(held.values()):
                raise Rewound  # the log lost what a checkpoint names: the resume folds again
            # Never move a checkpoint back: another follower may already be past this batch.
            saved = {
                name: max(cp, Progress(last.version, last.position), key=_version)
                for name, cp in locked.items()
            }
            save = (
                _SAVE,
                [
                    list(saved),
                    domain,
                    [cp.version for cp in saved.values()],
                    [cp.position for cp in saved.values()],
                ],
            )
            # Every table's writes and the checkpoints: one statement, one round trip.
            async with PostgresRows.batch(conn, save) as rows:
                for projection in self._projections:
                    done = locked[projection.name].version
                    todo = [f for f in facts if f.record.version > done]
                    if todo:
                        await projection.apply(rows, todo)
            # A snapshot is of every table at exactly `last` (none may be past it already).
            exact = all(cp.version <= last.version for cp in locked.values())
            if (
                exact
                and self._snapshot_every
                and _crosses(first - 1, last.version, self._snapshot_every)
            ):
                assert self._signer is not None  # checked at __init__
                await save_snapshot(conn, self._projections, last, self._signer)
        lowest = min(saved.values(), key=_version)
        self._seen[domain] = lowest.version
        return lowest


def _version(progress: Progress) -> int:
    return progress.version


def _lowest(rows: Sequence[asyncpg.Record]) -> Progress:
    return min((Progress(r["version"], r["position"]) for r in rows), key=_version)


def _crosses(before: int, after: int, every: int) -> bool:
    """True when a multiple of `every` lies in (before, after]."""
    return after // every > before // every


async def rebuild(
    pool: asyncpg.Pool, log: DomainLog, domains: Sequence[str], *, batch_size: int = 10_000
) -> int:
    """Empty every projection table, reset the checkpoints and replay the log of `domains`,
    `batch_size` events per transaction; then record the folds the tables hold
    (`rebuild_if_folds_changed`).

    Queries see the tables empty, then filling, until the replay ends; engines following the
    domains notice the checkpoints moved back and take part. Returns the events the rebuilt
    projections hold, whoever applied them (`trellis projections rebuild` once printed "from 0
    events" when the engine's follower had replayed the log first).
    """
    sink = ProjectionSink(pool)
    async with pool.acquire() as conn, conn.transaction():
        # Locks every checkpoint row first, so no follower commits between truncate and reset.
        await conn.execute(
            "SELECT 1 FROM trellis_follower_checkpoints WHERE follower = ANY($1::text[]) "
            "FOR UPDATE",
            sink.checkpoint_names,
        )
        await _start_over(conn, sink)
    held = 0
    for domain in domains:
        # Around the call, not inside it: the replay's rows are freed (by reference counting)
        # before the collector runs again, or its first pass would scan every one of them.
        with _collector_paused():
            await _replay(sink, log, domain, batch_size)
        # The rest, if the replay handed over (or the log grew since): the ordinary way.
        follower = Follower(domain, log, sink, batch_size=batch_size)
        await follower.catch_up()
        held += follower.progress.version  # versions are gap-free: the events folded
    async with pool.acquire() as conn:  # the folds the tables now hold (rebuild_if_...)
        await conn.execute(_SET_FORMAT, format_of(sink.projections))
    return held


_FORMAT_LOCK = "SELECT pg_advisory_lock(hashtext(current_schema() || '.trellis_projection_format'))"
_FORMAT_UNLOCK = (
    "SELECT pg_advisory_unlock(hashtext(current_schema() || '.trellis_projection_format'))"
)
_SET_FORMAT = """
INSERT INTO trellis_projection_format (format) VALUES ($1)
ON CONFLICT (only_row) DO UPDATE SET format = excluded.format, set_at = now()
"""


async def rebuild_if_folds_changed(
    pool: asyncpg.Pool, events: DomainLog, domains: Sequence[str]
) -> str | None:
    """Rebuild the projections when their tables were written by other folds than this
    code's (`format_of`: an upgrade changed a fold's meaning or a table's shape; a schema from
    before the format was kept counts as other); the format they were written with, or None
    when nothing was rebuilt.

    A fold that changed meaning leaves the rows it wrote before as they were, and the new rows
    beside them differ (`trellis verify` names them, an export copies them): the tables are
    only right folded again from the log. One process at a time (a session advisory lock):
    engines started together rebuild once, the others find the format current."""
    current = format_of(default_projections())
    async with pool.acquire() as conn:
        await conn.execute(_FORMAT_LOCK)
        try:
            stored = await conn.fetchval("SELECT format FROM trellis_projection_format")
            if stored == current:
                return None
            if stored is None and not domains:  # a new log: nothing was folded yet
                await conn.execute(_SET_FORMAT, current)
                return None
            log.warning(
                "the projections were folded by %s, this engine folds %s: rebuilding them "
                "from the log (%d domain%s)",
                stored or "an older version",
                current,
                len(domains),
                "" if len(domains) == 1 else "s",
            )
            held = await rebuild(pool, events, domains)
            log.warning("the projections are rebuilt: %d events folded again", held)
            return stored or ""
        finally:
            await conn.execute(_FORMAT_UNLOCK)


async def _start_over(
    conn: asyncpg.Connection, sink: ProjectionSink, domain: str | None = None
) -> None:
    """Empty the projection tables and move their checkpoints back to the start: of every
    domain, or of `domain` alone. The caller holds the checkpoint rows locked."""
    names = sink.checkpoint_names
    if domain is None:
        if sink.tables:
            await conn.execute(f"TRUNCATE {', '.join(sink.tables)}")
        await conn.execute(
            "UPDATE trellis_follower_checkpoints SET version = 0, position = 0 "
            "WHERE follower = ANY($1::text[])",
            names,
        )
        return
    for table in sink.tables:
        await conn.execute(f"DELETE FROM {table} WHERE domain = $1", domain)
    await conn.execute(_SAVE, names, domain, [0] * len(names), [0] * len(names))


async def _replay(sink: ProjectionSink, log: DomainLog, domain: str, batch_size: int) -> None:
    """Fold `domain`'s log into the emptied tables with the rows carried in memory
    (projections/replay.py) while no one else moves its checkpoints.

    Each batch is written while the next is folded, and the log is read ahead of the fold:
    Postgres stores and reads on its own core while this one folds.

    Stops, and leaves the rest to an ordinary follower, at an event it cannot decode (which
    that follower reports as it always does) or when another follower has committed since
    this one's last batch (the rows in memory no longer are the tables').
    """
    saved, _ = await sink.resume(domain)
    if saved != 0:
        return
    rows = ReplayRows(sink.pool, sink.table_defs)
    writes = _Writes(sink, domain)

    async def fold(facts: list[Fact]) -> bool:
        for projection in sink.projections:
            await projection.apply(rows, facts)
        last = facts[-1].record
        return await writes.start(rows.changes(), Progress(last.version, last.position))

    try:
        # Closed on leaving, so the reader stops at once when the replay stops early.
        async with contextlib.aclosing(_read_ahead(log, domain, batch_size)) as batches:
            async for records in batches:
                facts: list[Fact] = []
                for record in records:
                    try:
                        facts.append(Fact(record, record.event()))
                    except Exception:
                        break
                if facts and not await fold(facts):
                    break
                if len(facts) < len(records):
                    break
    finally:
        # The batch in flight was folded from the log as it stands: finish it, whatever
        # stopped the replay (the log read failing, say).
        await writes.settle()


class _Writes:
    """A replay's batches written in order, one at a time, each while the next is folded."""

    def __init__(self, sink: ProjectionSink, domain: str):
        self._sink = sink
        self._domain = domain
        self._committed = Progress()
        self._in_flight: tuple[asyncio.Task[bool], Progress] | None = None

    async def start(self, changes: list[Changes], progress: Progress) -> bool:
        """Wait for the batch in flight, then start writing this one; False (nothing more
        written) when a checkpoint moved under the replay."""
        if not await self.settle():
            return False
        task = asyncio.create_task(
            _write_batch(self._sink, self._domain, changes, self._committed, progress)
        )
        self._in_flight = (task, progress)
        return True

    async def settle(self) -> bool:
        """Wait for the batch in flight; False when it found a checkpoint moved."""
        if self._in_flight is None:
            return True
        task, progress = self._in_flight
        self._in_flight = None
        if not await task:
            return False
        self._committed = progress
        return True


async def _read_ahead(
    log: DomainLog, domain: str, batch_size: int
) -> AsyncGenerator[list[RecordedEvent], None]:
    """`domain`'s log in lists of `batch_size` records, the next read while the caller works
    on one."""
    queue: asyncio.Queue[list[RecordedEvent] | Exception | None] = asyncio.Queue(maxsize=1)

    async def read() -> None:
        try:
            batch: list[RecordedEvent] = []
            async for record in log.read(domain):
                batch.append(record)
                if len(batch) == batch_size:
                    await queue.put(batch)
                    batch = []
            if batch:
                await queue.put(batch)
            await queue.put(None)
        except Exception as exc:  # the caller's to raise, after the batches before it
            await queue.put(exc)

    reader = asyncio.create_task(read())
    try:
        while (records := await queue.get()) is not None:
            if isinstance(records, Exception):
                raise records
            yield records
    finally:
        reader.cancel()


async def _write_batch(
    sink: ProjectionSink,
    domain: str,
    changes: list[Changes],
    expected: Progress,
    progress: Progress,
) -> bool:
    """Write a replayed batch and move the checkpoints to `progress`, in one transaction;
    False (nothing written) when a checkpoint is no longer `expected`."""
    names = sink.checkpoint_names
    async with sink.pool.acquire() as conn, conn.transaction():
        locked = [
            Progress(r["version"], r["position"]) for r in await conn.fetch(_LOCK, names, domain)
        ]
        if len(locked) < len(names) or any(cp != expected for cp in locked):
            return False
        await write(conn, changes)
        await conn.execute(
            _SAVE, names, domain, [progress.version] * len(names), [progress.position] * len(names)
        )
    return True


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No automatic garbage collection for the length of a replay.

    The rows held in memory are long-lived and many; at the default thresholds the collector
    scanned them again and again, a third of a rebuild's time. What a replay leaves behind is
    freed by reference counting (its few cycles wait for the next collection after it). The
    first collection after the pause scans every object allocated during it that is still
    alive: leave it once the replay's rows are gone."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
