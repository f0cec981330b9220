"""Two engines, one writer per domain, fenced at the resources (issue 9 item 7).

Two engines on the same NATS, Postgres, schema and (simulated) hardware, as a deployment runs
them. Each domain is written by the engine holding its writer lease; the other forwards the
domain's requests to it. An engine that believes it still holds a lease another has taken
over (paused past it, say, with a clock that did not notice) can neither commit (the log
checks the writer epoch under the lease row's lock) nor program the hardware (the fabric keeps
the highest epoch it has seen): the test makes one believe exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric, fetch
from harness import Harness, serving

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.postgres.store import IDLE_IN_APPEND_S
from trellis.engine.core.errors import WriterFenced
from trellis.engine.core.fabric import FabricBinding
from trellis.engine.core.spread import spread
from trellis.engine.service.router import Engine

TTL = 1.0  # seconds a writer lease lasts: short, so takeovers are quick
DOMAINS = [f"hall-{i}" for i in range(6)]
NIC = {"host": "host-01", "devices": [{"kind": "nic"}]}


@pytest_asyncio.fixture
async def pair(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[tuple[Harness, Harness, SimulatedFabric]]:
    """Two engines sharing servers, schema, subjects and one simulated fabric."""
    hardware = SimulatedFabric()
    async with contextlib.AsyncExitStack() as stack:
        harnesses = [
            await stack.enter_async_context(
                serving(
                    nats_url,
                    database_url,
                    pg_schema,
                    subject_prefix,
                    fabric=hardware,
                    lease_ttl=TTL,
                )
            )
            for _ in range(2)
        ]
        yield harnesses[0], harnesses[1], hardware


async def holders(database_url: str, schema: str) -> dict[str, tuple[str, int]]:
    """domain -> (holding engine, epoch) for the leases that have not run out."""
    rows = await fetch(
        database_url,
        schema,
        "SELECT domain, holder, epoch FROM trellis_writer_leases "
        "WHERE expires_at > clock_timestamp()",
    )
    return {r["domain"]: (r["holder"], r["epoch"]) for r in rows}


async def until(check: object, seconds: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"no {what} within {seconds}s"
        await asyncio.sleep(0.05)


async def test_each_domain_has_one_writer_spread_over_the_engines_and_requests_reach_it(
    pair: tuple[Harness, Harness, SimulatedFabric], database_url: str, pg_schema: str
) -> None:
    a, b, _ = pair
    engines = {a.engine.identity: a.engine, b.engine.identity: b.engine}
    for domain in DOMAINS:
        expect_ok(await a.client.admin(domain, "import-topology", fabric()))

    # Each domain ends up written by the engine it is placed on (engine/core/spread.py: 3 and
    # 3), once both have been up long enough for the first to hand domains over.
    wanted = spread(DOMAINS, engines)

    # A lease is taken before its domain is loaded: an engine writes the domain once it has
    # caught up with the log, a moment after the lease row says so.
    async def spread_out() -> bool:
        held = await holders(database_url, pg_schema)
        return all(
            held.get(d, ("", 0))[0] == wanted[d]
            and [e.identity for e in engines.values() if d in e.domains] == [wanted[d]]
            for d in DOMAINS
        )

    await until(spread_out, 10 * TTL + 5, "spread of the domains over both engines")

    # Whichever engine a client's request lands on, it reaches the writer and is answered.
    for client in (a.client, b.client):
        for domain in DOMAINS:
            composed = expect_ok(await client.intent(domain, "acme", "compose", NIC))
            cid = composed["composition_id"]
            expect_ok(await client.intent(domain, "acme", "release", {"composition_id": cid}))
            topology = expect_ok(await client.query(domain, "topology"))
            assert topology["circuits"] == []


async def test_an_ex_writer_that_thinks_it_still_writes_can_neither_commit_nor_program(
    pair: tuple[Harness, Harness, SimulatedFabric], database_url: str, pg_schema: str
) -> None:
    a, b, hardware = pair
    expect_ok(await a.client.admin("hall", "import-topology", fabric()))
    held = await holders(database_url, pg_schema)
    old, epoch = held["hall"]
    ex, successor = (a.engine, b.engine) if a.engine.identity == old else (b.engine, a.engine)

    # Given: the writer stops renewing (as if paused) but goes on believing it holds the
    # lease; the other engine takes the domain over.
    stalled = pause_renewals(ex)
    try:
        await until(
            lambda: _held_by(database_url, pg_schema, successor.identity),
            5 * TTL + 5,
            "takeover",
        )
        await successor_is_writing(successor, database_url, pg_schema)
        assert hardware.fence_of("hall") > epoch  # the successor's first fabric pass

        # When: the ex-writer acts on its old lease...
        late = msgspec.json.encode({"request_id": "late-1", **NIC})
        reply = msgspec.json.decode(await ex.handle("intent", "hall", "acme", "compose", late))
        # Then: the log refused its commit, and it let go of the domain.
        assert "no longer writes" in expect_error(reply, "unavailable")["message"]
        written = await fetch(
            database_url,
            pg_schema,
            "SELECT count(*) AS n FROM trellis_events WHERE causation_id = 'late-1'",
        )
        assert written[0]["n"] == 0
        await until(lambda: _not_writing(ex, "hall"), 5, "the ex-writer to let the domain go")
        # ...and the hardware refuses its epoch, whatever it tries.
        binding = FabricBinding(
            host="host-01",
            device="nic-01",
            path=["host-01", "sw-1", "nic-01"],
            composition_id="c-late",
        )
        with pytest.raises(WriterFenced):
            await hardware.bind("hall", binding, fence=epoch)
        assert (await hardware.snapshot("hall")).bindings == []
        # The domain's writer is the successor, and it serves (a client that first lands on
        # the ex-writer hears `unavailable` and resends, as the contract says).
        body = {"request_id": "after-1", **NIC}
        for _ in range(20):
            reply = await a.client.intent("hall", "acme", "compose", body)
            if reply["ok"] or reply["error"]["code"] != "unavailable":
                break
        assert expect_ok(reply)["state"] == "active"
    finally:
        stalled.cancel()


async def test_a_writer_stopped_inside_an_append_holds_a_takeover_up_no_longer_than_its_lease(
    pair: tuple[Harness, Harness, SimulatedFabric], database_url: str, pg_schema: str
) -> None:
    """A writer stopped (SIGSTOP) between an append's statements keeps the lease row locked
    by the log's fence check, and a takeover waits for that lock. The server ends the stopped
    append's session within a lease tick, before the lease can run out: the takeover waits for
    the lease alone, and the append never commits."""
    a, b, _ = pair
    expect_ok(await a.client.admin("hall", "import-topology", fabric()))
    old, epoch = (await holders(database_url, pg_schema))["hall"]
    ex, successor = (a, b.engine) if a.engine.identity == old else (b, a.engine)

    # Given: the writer stops renewing in the middle of an append that the log has fenced
    # (an answer stored under its epoch: the lease row is locked FOR SHARE until it ends).
    stalled = pause_renewals(ex.engine)
    conn = await ex.store._pool.acquire()
    try:
        await conn.transaction().start()
        await conn.execute(
            "INSERT INTO trellis_requests"
            " (domain, actor, request_id, verb, body_hash, reply, position, fence)"
            " VALUES ('hall', 'acme', 'stopped-1', 'compose', '', '{}', 0, $1)",
            epoch,
        )
        # Then: the other engine takes the domain over when the lease runs out, not when an
        # append idle for IDLE_IN_APPEND_S (an engine's bound without leases) would end.
        await until(
            lambda: _held_by(database_url, pg_schema, successor.identity),
            IDLE_IN_APPEND_S - 1,
            "takeover",
        )
        await successor_is_writing(successor, database_url, pg_schema)
        # ...and the stopped append can never commit: the server has ended its session.
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError)):
            await conn.execute("COMMIT")
        stored = await fetch(
            database_url,
            pg_schema,
            "SELECT count(*) AS n FROM trellis_requests WHERE request_id = 'stopped-1'",
        )
        assert stored[0]["n"] == 0
    finally:
        stalled.cancel()
        await ex.store._pool.release(conn)


def pause_renewals(engine: Engine) -> asyncio.Task[None]:
    """Stop `engine` renewing its writer leases, while it keeps counting them as held; a task
    that keeps it so until cancelled."""
    for task in engine.custody._tasks:  # the test plays the paused process's clock
        if task.get_name() == "writer-leases":
            task.cancel()

    async def believe() -> None:
        while True:
            for served in engine.custody._served.values():
                if served.lease is not None:
                    served.lease.until = math.inf
            await asyncio.sleep(0.01)

    return asyncio.create_task(believe())


async def _held_by(database_url: str, schema: str, engine: str) -> bool:
    return (await holders(database_url, schema)).get("hall", ("", 0))[0] == engine


async def _not_writing(engine: Engine, domain: str) -> bool:
    return domain not in engine.domains


async def successor_is_writing(engine: Engine, database_url: str, schema: str) -> None:
    await until(lambda: _writes(engine), 5, "the successor to take the domain up")
    sync = engine.fabric_sync("hall")
    assert sync is not None
    await asyncio.wait_for(sync.wait_idle(), 5)


async def _writes(engine: Engine) -> bool:
    return "hall" in engine.domains
