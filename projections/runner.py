"""The projection runner: follows the global log and folds it into the projection tables.

It reads the log in position order from the lowest checkpoint and applies it in batches, one
transaction per batch holding the rows of every projection and their checkpoints; so after a
crash the tables and checkpoints agree, and the runner resumes where the last commit left off
with nothing applied twice. Reading by position is safe because appends are serialised
(schema/001): an event that commits late never has a lower position than one already seen.

The checkpoint rows are locked (FOR UPDATE) at the start of each batch, which makes the runner
safe to run in every engine instance against the same tables: a runner that finds a checkpoint
already past part of its batch skips that part, and one that finds a checkpoint behind what it
has read (someone rebuilt) starts over from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import asyncpg

from engine.records import RecordedEvent
from projections.base import Fact, Projection
from projections.compositions import CompositionsProjection
from projections.connections import ConnectionsProjection
from projections.devices import DevicesProjection

log = logging.getLogger("trellis.projections")

_ENSURE_CHECKPOINTS = """
INSERT INTO trellis_checkpoints (name, position)
SELECT name, 0 FROM unnest($1::text[]) AS name
    ON CONFLICT (name) DO NOTHING
"""

# Row locks serialise runners per projection; rebuild takes them too, before truncating.
_LOCK_CHECKPOINTS = """
SELECT name, position FROM trellis_checkpoints WHERE name = ANY($1::text[]) ORDER BY name
   FOR UPDATE
"""

_READ_CHECKPOINTS = "SELECT name, position FROM trellis_checkpoints WHERE name = ANY($1::text[])"

_SAVE_CHECKPOINTS = """
UPDATE trellis_checkpoints AS c SET position = u.position
  FROM unnest($1::text[], $2::bigint[]) AS u(name, position)
 WHERE c.name = u.name
"""


class EventSource(Protocol):
    """Where the runner reads the log: every domain's events in global position order
    (adapters.postgres.store.PostgresEventStore is one)."""

    def read_all(self, after_position: int = 0) -> AsyncIterator[RecordedEvent]: ...


class ProjectionStalled(RuntimeError):
    """The log holds an event this code cannot decode (written by a newer engine, or damaged).

    The runner applies everything before it and stops there: skipping it would make the read
    models silently disagree with the log. It retries, so upgrading the code unblocks it.
    """

    def __init__(self, position: int, type_: str, cause: str):
        super().__init__(f"cannot project event {position} ({type_}): {cause}")
        self.position = position
        self.type = type_


class _Rewind(Exception):
    """A checkpoint moved behind what this runner has read (a rebuild elsewhere): read again."""


def default_projections() -> list[Projection]:
    """The projections the queries read: compositions, connections, devices."""
    return [CompositionsProjection(), ConnectionsProjection(), DevicesProjection()]


class ProjectionRunner:
    """Keeps a set of projections up to date with the log.

    Args:
        pool: asyncpg pool whose search_path holds the log and the projection tables
            (migrations already applied, as PostgresEventStore.open does).
        source: reads the log in position order.
        projections: what to fold; `default_projections()` when omitted.
        batch_size: events per transaction.
        poll_interval: seconds between looks at the log when nobody calls `notify()`; it
            covers events another engine instance appended.
        owns_pool: close `pool` in `close()`.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        source: EventSource,
        *,
        projections: Sequence[Projection] | None = None,
        batch_size: int = 1000,
        poll_interval: float = 1.0,
        owns_pool: bool = False,
    ):
        self._pool = pool
        self._source = source
        self._projections = list(projections if projections is not None else default_projections())
        self._names = [p.name for p in self._projections]
        if len(set(self._names)) != len(self._names):
            raise ValueError(f"projection names must be unique: {self._names}")
        self._batch_size = batch_size
        self._poll_interval = poll_interval
        self._owns_pool = owns_pool
        self._checkpoints: dict[str, int] = dict.fromkeys(self._names, 0)
        self._loaded = False  # checkpoints read from the database since start
        self._lock = asyncio.Lock()  # one catch-up or rebuild at a time in this process
        self._poke = asyncio.Event()
        self._advanced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    @property
    def tables(self) -> list[str]:
        """Every table the projections own, in a fixed order."""
        return [t.name for p in self._projections for t in p.tables]

    @property
    def position(self) -> int:
        """The log position every projection has committed (the lowest checkpoint)."""
        return min(self._checkpoints.values(), default=0)

    @property
    def checkpoints(self) -> dict[str, int]:
        return dict(self._checkpoints)

    def notify(self) -> None:
        """Poke the background task: the log has grown (call after each commit)."""
        self._poke.set()

    async def start(self) -> None:
        """Run in the background until `stop()`: catch up now, then after every `notify()`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="projection-runner")

    async def stop(self) -> None:
        """Stop the background task. A batch in flight is rolled back, not half-applied."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        await self.stop()
        if self._owns_pool:
            await self._pool.close()

    async def wait_for(self, position: int, timeout: float = 5.0) -> bool:
        """True once every projection includes `position`; False if that takes over `timeout`.

        Without a background task the caller's own task catches up."""
        if self.position >= position:
            return True
        if self._task is None:
            try:
                await asyncio.wait_for(self.catch_up(), timeout)
            except TimeoutError:
                pass
            except Exception:
                # The answer is still "not there yet"; the reason goes to the log.
                log.warning("projections cannot catch up to %d", position, exc_info=True)
            return self.position >= position
        self.notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.position < position:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            advanced = self._advanced
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(advanced.wait(), remaining)
        return True

    async def catch_up(self, until: int | None = None) -> int:
        """Apply the log up to its end (or to position `until`); return how many events.

        Raises:
            ProjectionStalled: an event cannot be decoded; everything before it is applied.
        """
        async with self._lock:
            return await self._catch_up(until)

    async def rebuild(self) -> int:
        """Empty every projection table, reset the checkpoints and replay the whole log.

        Queries see the tables empty, then filling, until the replay ends; `wait_for` blocks
        them meanwhile, since the position starts again from zero. Returns the events applied.
        """
        async with self._lock:
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(_ENSURE_CHECKPOINTS, self._names)
                await conn.fetch(_LOCK_CHECKPOINTS, self._names)
                if self.tables:
                    await conn.execute(f"TRUNCATE {', '.join(self.tables)}")
                await conn.execute(_SAVE_CHECKPOINTS, self._names, [0] * len(self._names))
            self._checkpoints = dict.fromkeys(self._names, 0)
            return await self._catch_up(None)

    # ---- internals ----

    async def _run(self) -> None:
        failures = 0
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # Python 3.11's wait_for can swallow a cancel that lands as the poke arrives
                # (the wait returns normally); stop() must still stop us.
                raise asyncio.CancelledError
            self._poke.clear()
            try:
                await self.catch_up()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # stop() cancelled us mid-batch and the driver answered the cancellation
                    # with an error of its own (asyncpg does, when the session is gone): it is
                    # still a stop, not a failure to retry.
                    raise asyncio.CancelledError from exc
                # The database may be restarting or the log may hold an event from a newer
                # engine: keep trying, slower and slower, and say so each time.
                failures += 1
                log.exception("projection runner failed (attempt %d)", failures)
                await asyncio.sleep(min(30.0, 0.05 * 2**failures))
                continue
            try:
                await asyncio.wait_for(self._poke.wait(), self._poll_interval)
            except TimeoutError:
                self._loaded = False  # a quiet moment: look at the checkpoints themselves again

    async def _catch_up(self, until: int | None) -> int:
        # After a notify the checkpoints are not read again: each commit locks and checks them
        # anyway (a runner behind another skips what it did, one that finds them moved back
        # rewinds). Polls read them, so a rebuild elsewhere is noticed without new events.
        if not self._loaded:
            await self._load_checkpoints()
        while True:
            try:
                return await self._drain(until)
            except _Rewind:
                log.info("projection checkpoints moved back (a rebuild?); reading again")
                await self._load_checkpoints()

    async def _load_checkpoints(self) -> None:
        async with self._pool.acquire() as conn:
            await conn.execute(_ENSURE_CHECKPOINTS, self._names)
            rows = await conn.fetch(_READ_CHECKPOINTS, self._names)
        self._set_checkpoints({r["name"]: r["position"] for r in rows})
        self._loaded = True

    async def _drain(self, until: int | None) -> int:
        cursor = self.position  # every event up to here is in every projection
        applied = 0
        batch: list[Fact] = []
        stream = self._source.read_all(cursor)
        try:
            async for record in stream:
                if until is not None and record.position > until:
                    break
                try:
                    fact = Fact(record, record.event())
                except Exception as exc:
                    if batch:
                        await self._commit(batch, cursor)
                        applied += len(batch)
                    raise ProjectionStalled(record.position, record.type, str(exc)) from exc
                batch.append(fact)
                if len(batch) >= self._batch_size:
                    await self._commit(batch, cursor)
                    applied += len(batch)
                    cursor = batch[-1].record.position
                    batch = []
            if batch:
                await self._commit(batch, cursor)
                applied += len(batch)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        return applied

    async def _commit(self, batch: list[Fact], cursor: int) -> None:
        """Fold one batch into every projection and move their checkpoints, atomically.

        `cursor` is where the batch's stream began: each projection must have a checkpoint at
        or past it, or events before the batch would be missing from it.
        """
        last = batch[-1].record.position
        async with self._pool.acquire() as conn, conn.transaction():
            locked = {
                r["name"]: r["position"] for r in await conn.fetch(_LOCK_CHECKPOINTS, self._names)
            }
            if any(locked[name] < cursor for name in self._names):
                raise _Rewind
            for projection in self._projections:
                done = locked[projection.name]
                facts = (
                    batch
                    if done < batch[0].record.position
                    else [f for f in batch if f.record.position > done]
                )
                if facts:
                    await projection.apply(conn, facts)
            # Never move a checkpoint back: another runner may already be past this batch.
            saved = {name: max(locked[name], last) for name in self._names}
            await conn.execute(_SAVE_CHECKPOINTS, list(saved), list(saved.values()))
        self._set_checkpoints(saved)

    def _set_checkpoints(self, checkpoints: dict[str, int]) -> None:
        self._checkpoints = {name: checkpoints.get(name, 0) for name in self._names}
        # Wake every wait_for; each re-checks the position against its own target.
        advanced, self._advanced = self._advanced, asyncio.Event()
        advanced.set()
