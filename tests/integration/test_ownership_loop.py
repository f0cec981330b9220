"""The ownership loop keeps ticking whatever one tick meets (engine/service/router.py).

An engine renews its writer leases, drops what it lost and claims what is free from one loop;
if a tick waits for ever (here: a drop whose writer waits on a row lock the database holds it
at, as a restarting or busy database can leave any step), the engine would never take a free
lease again. Real Postgres throughout: the wait is a real lock wait.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric, fetch, gpu
from harness import Harness, serving

from trellis.engine.core.errors import StoreUnavailable

TTL = 1.0  # seconds a writer lease lasts: what a tick, a load and a drop are each given
EVERY = 4  # versions between the writer's snapshots
DOMAIN = "hall"


@pytest_asyncio.fixture
async def engine(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, lease_ttl=TTL, snapshot_every=EVERY
    ) as h:
        yield h


async def lease(database_url: str, schema: str) -> tuple[str, int] | None:
    """(holder, epoch) of the domain's writer lease while it runs, else None."""
    rows = await fetch(
        database_url,
        schema,
        "SELECT holder, epoch FROM trellis_writer_leases"
        " WHERE domain = $1 AND expires_at > clock_timestamp()",
        DOMAIN,
    )
    return (rows[0]["holder"], rows[0]["epoch"]) if rows else None


@pytest.mark.parametrize("noticed_by", ["tick", "request"])
async def test_a_drop_that_hangs_does_not_stop_the_engine_taking_the_lease_back(
    engine: Harness, database_url: str, pg_schema: str, noticed_by: str
) -> None:
    """`noticed_by`: who finds the lease lost first, the ownership loop or a request (which
    drops and loads the domain holding the lock every load takes, the loop's too)."""
    h = engine
    expect_ok(await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp", **fabric()}))
    held = await lease(database_url, pg_schema)
    assert held is not None and held[0] == h.engine.identity
    epoch = held[1]
    version = (await h.store.head(DOMAIN)).version
    due = (version // EVERY + 1) * EVERY  # the version of the writer's next snapshot

    # Given: the writer's next snapshot waits on a row lock (another session inserts the same
    # snapshot row and keeps its transaction open), so closing the writer waits for it.
    blocker = await asyncpg.connect(database_url, server_settings={"search_path": pg_schema})
    try:
        block = blocker.transaction()
        await block.start()
        await blocker.execute(
            "INSERT INTO trellis_snapshots (domain, kind, version, position, hash, format, body)"
            " VALUES ($1, 'state', $2, 1, repeat('0', 64), 'blocker', ''::bytea)",
            DOMAIN,
            due,
        )
        for n in range(due - version):
            node = {"request_id": f"add-{n}", "node": gpu(f"gpu-1{n}")}
            expect_ok(await h.client.admin(DOMAIN, "add-node", node))
        writer = h.engine.custody._served[DOMAIN].writer
        assert writer.head.version >= due and writer._saving  # the save is under way

        # When: the lease runs out in the store (as after a pause or a database restart): the
        # next tick, or a request, finds it lost and drops the domain, whose writer cannot end.
        await fetch(
            database_url,
            pg_schema,
            "UPDATE trellis_writer_leases SET expires_at = clock_timestamp() WHERE domain = $1",
            DOMAIN,
        )
        if noticed_by == "request":
            lease_here = h.engine.custody._served[DOMAIN].lease
            assert lease_here is not None
            lease_here.until = 0.0  # the engine's own count ran out too, as after a pause
            early = {"request_id": "early", "node": gpu("gpu-19")}
            expect_ok(await h.client.admin(DOMAIN, "add-node", early))

        # Then: the loop goes on without that drop and takes the free lease again, under a
        # newer epoch, and the domain commits under it.
        deadline = asyncio.get_running_loop().time() + 10 * TTL
        while True:
            now = await lease(database_url, pg_schema)
            if now is not None and now[1] > epoch and DOMAIN in h.engine.domains:
                break
            assert asyncio.get_running_loop().time() < deadline, f"no takeover: {now}"
            await asyncio.sleep(0.05)
        assert now[0] == h.engine.identity
        assert h.engine.fence(DOMAIN) == now[1]
        assert h.engine.custody._served[DOMAIN].writer is not writer
        added = {"request_id": "after", "node": gpu("gpu-20")}
        expect_ok(await h.client.admin(DOMAIN, "add-node", added))
    finally:
        await blocker.close()  # ends the blocking transaction: the old writer's save goes on

    # The old writer committed nothing under its superseded epoch after the new one began.
    fences = await fetch(
        database_url,
        pg_schema,
        "SELECT fence FROM trellis_events WHERE domain = $1 ORDER BY version",
        DOMAIN,
    )
    seen = [r["fence"] for r in fences]
    assert seen == sorted(seen) and seen[-1] == now[1], seen
    # ...and once its save went through, the drop ended; the followers still follow.
    deadline = asyncio.get_running_loop().time() + 10 * TTL
    while h.engine.custody._background:
        assert asyncio.get_running_loop().time() < deadline, h.engine.custody._background
        await asyncio.sleep(0.05)
    await h.projected(DOMAIN)
    await h.relayed(DOMAIN)


async def paused_once(h: Harness, caplog: pytest.LogCaptureFixture, paused: asyncio.Event) -> None:
    """After the pause `paused` marks, and the ticks after it: no ERROR, the pause said, and
    the engine writes the domain again."""
    caplog.set_level(logging.INFO, logger="trellis.engine.service.custody")
    await asyncio.wait_for(paused.wait(), 5 * TTL)
    await asyncio.sleep(3 * TTL)  # the tick after the pause, and the next
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [m for level, m in said if level == "ERROR"] == [], said
    assert any("did not run for" in m for _, m in said), said
    expect_ok(await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp-2", **fabric()}))


async def test_a_pause_during_a_tick_is_no_error_of_the_tick(
    engine: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped while a tick runs finds the tick's timeout past when it runs again:
    that time was not the tick's, which finishes once the loop runs."""
    h = engine
    expect_ok(await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp", **fabric()}))
    ownership = h.engine.custody._ownership
    assert ownership is not None
    beat = ownership.heartbeat
    paused = asyncio.Event()

    async def heartbeat_through_a_pause() -> None:
        if not paused.is_set():
            paused.set()
            time.sleep(2.5 * TTL)  # the event loop does not run: as under SIGSTOP
        await beat()

    ownership.heartbeat = heartbeat_through_a_pause  # type: ignore[method-assign]
    await paused_once(h, caplog, paused)


async def lease_store_of(h: Harness) -> tuple[Any, Callable[..., Awaitable[Any]]]:
    """The engine's lease store, once the engine writes DOMAIN, and the store's own heartbeat
    (a test puts a heartbeat of its own in its place)."""
    expect_ok(await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp", **fabric()}))
    ownership = h.engine.custody._ownership
    assert ownership is not None
    store = ownership._leases
    return store, store.heartbeat


async def test_a_pause_inside_a_lease_store_call_is_no_error_of_the_call(
    engine: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped while the lease store answers finds the call's own time bound past
    when it runs again: that time was not the call's, which gets its bound again and ends."""
    h = engine
    store, beat = await lease_store_of(h)
    paused = asyncio.Event()

    async def heartbeat_paused_midway(*args: Any, **kwargs: Any) -> Any:
        if not paused.is_set():
            paused.set()
            await asyncio.sleep(0)  # the call has begun: its time bound runs
            time.sleep(2.5 * TTL)  # the event loop does not run: as under SIGSTOP
        return await beat(*args, **kwargs)

    store.heartbeat = heartbeat_paused_midway  # type: ignore[method-assign]
    await paused_once(h, caplog, paused)


async def test_a_driver_timer_that_fires_through_a_pause_is_no_error_of_the_tick(
    engine: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped while the log's pool opens a connection for the tick: the pool's own
    acquire timer (wall time) is past when the process runs again, and the call fails at once
    (CI saw `writer lease tick failed`: StoreUnavailable, TimeoutError, in a frozen-engine
    chaos run). That failure is the pause's, said as such; the next tick tries again."""
    h = engine
    expect_ok(await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp", **fabric()}))
    store = h.engine.custody._store
    domains = store.domains
    paused = asyncio.Event()

    async def domains_timed_out_by_a_pause() -> list[str]:
        if paused.is_set():
            return await domains()
        paused.set()
        try:
            async with asyncio.timeout(0.5 * TTL):  # as the pool's acquire bounds a connect
                await asyncio.sleep(0)
                time.sleep(2.5 * TTL)  # the event loop does not run: as under SIGSTOP
                await asyncio.sleep(TTL)  # the connect goes on, past the timer
        except TimeoutError as exc:
            raise StoreUnavailable(f"TimeoutError: {exc}") from exc
        raise AssertionError("the timer did not fire")

    store.domains = domains_timed_out_by_a_pause  # type: ignore[method-assign]
    await paused_once(h, caplog, paused)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert any("tick failed after the pause" in m for level, m in said if level == "WARNING")


def hold_engine_row(
    url: str, schema: str, engine_id: str, locked: threading.Event, resumed: threading.Event
) -> None:
    """In a thread of its own: lock the engine's heartbeat row until `resumed`, and 0.3 s
    longer (the engine's loop then runs again before its statement can end)."""

    async def hold() -> None:
        conn = await asyncpg.connect(url, server_settings={"search_path": schema})
        try:
            async with conn.transaction():
                await conn.execute(
                    "SELECT 1 FROM trellis_engines WHERE id = $1 FOR UPDATE", engine_id
                )
                locked.set()
                while not resumed.is_set():
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
        finally:
            await conn.close()

    asyncio.run(hold())


async def test_a_pause_while_a_lease_statement_waits_is_no_error_of_the_driver(
    engine: Harness, database_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped while its heartbeat statement waits in Postgres: when it runs again,
    no answer has come yet, and a timer the driver armed for the statement is long past. The
    ownership loop's own bound gives the call its time again (above); a statement timeout of
    the driver's would fail it (CI saw `writer lease tick failed`: TimeoutError in
    bind_execute), so the lease pool has none."""
    h = engine
    store, beat = await lease_store_of(h)
    paused = asyncio.Event()

    async def heartbeat_waiting_through_a_pause(*args: Any, **kwargs: Any) -> Any:
        if paused.is_set():
            return await beat(*args, **kwargs)
        paused.set()
        locked, resumed = threading.Event(), threading.Event()
        holder = threading.Thread(
            target=hold_engine_row,
            args=(database_url, pg_schema, h.engine.identity, locked, resumed),
            daemon=True,
        )
        holder.start()
        assert locked.wait(10)
        call = asyncio.ensure_future(beat(*args, **kwargs))
        await asyncio.sleep(0.1)  # the statement is sent and waits for the row
        time.sleep(2.5 * TTL)  # the event loop does not run: as under SIGSTOP
        resumed.set()
        return await call

    store.heartbeat = heartbeat_waiting_through_a_pause  # type: ignore[method-assign]
    await paused_once(h, caplog, paused)


async def test_a_pause_while_a_drop_ends_is_no_error_of_the_drop(
    engine: Harness, database_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped just after it began to stop writing a domain (CI's frozen-engine run
    handed a domain over a moment before its SIGSTOP): the drop's wait for the writer to end
    is past when it runs again. That time was not the ending's, which gets its bound again."""
    h = engine
    expect_ok(await h.client.admin(DOMAIN, "import-topology", {"request_id": "imp", **fabric()}))
    writer = h.engine.custody._served[DOMAIN].writer
    close = writer.close
    paused = asyncio.Event()

    async def close_through_a_pause() -> None:
        paused.set()
        time.sleep(2.5 * TTL)  # the event loop does not run: as under SIGSTOP
        await close()

    writer.close = close_through_a_pause  # type: ignore[method-assign]
    # The lease runs out in the store: the next tick finds it lost and drops the domain.
    await fetch(
        database_url,
        pg_schema,
        "UPDATE trellis_writer_leases SET expires_at = clock_timestamp() WHERE domain = $1",
        DOMAIN,
    )
    await paused_once(h, caplog, paused)
    said = [m for _, m in ((r.levelname, r.getMessage()) for r in caplog.records)]
    assert any("stops writing it" in m for m in said), said
