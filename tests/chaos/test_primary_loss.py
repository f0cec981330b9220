"""Losing the PostgreSQL primary loses no acknowledged intent (issue 25 item 2; ARCHITECTURE
§10): a real primary with a synchronous standby (tests/chaos/postgres_pair.py), an engine
given both hosts, clients that resend with the same request_id until answered.

1. The primary is killed (kill -9) under load and the standby promoted: every acknowledged
   intent is in the new primary's log exactly once, and the engine serves again.
2. The standby goes first, so commits wait for it and are given up; then the primary is
   lost. A resend must not be answered from a commit only the primary held (docs/deployment.md,
   the gap the engine's barrier closes): every acknowledged intent is in the promoted standby's
   log exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import nats.errors
import pytest
from integration.fabrics import one_switch
from integration.harness import engine_at
from postgres_pair import PostgresPair

from trellis.adapters.nats.client import TrellisClient
from trellis.engine.core.throttle import RateLimit

# Slow; and alone, for it times the contract's promises on the machine's two cores.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

DOMAIN = "hall"
WORKERS = 6
GPUS = 16
REQUEST_TIMEOUT_S = 3.0


class Load:
    """What the clients were told: acknowledged request ids, by phase, with their times."""

    def __init__(self) -> None:
        self.phase = "before"
        self.acked: dict[str, tuple[str, float]] = {}  # request id -> (phase, monotonic time)
        self.progress = asyncio.Event()

    def ack(self, request_id: str) -> None:
        self.acked[request_id] = (self.phase, time.monotonic())
        self.progress.set()

    def count(self, phase: str) -> Counter[str]:
        """Acknowledged composes per worker in `phase`."""
        return Counter(
            rid.split("-")[0] for rid, (p, _) in self.acked.items() if p == phase and "-c-" in rid
        )

    async def until(self, done: Callable[[], bool], timeout: float = 120.0) -> None:
        async with asyncio.timeout(timeout):
            while True:
                self.progress.clear()
                if done():
                    return
                await self.progress.wait()


async def answered(client: TrellisClient, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    """The contract's client: resend with the same request_id on a timeout, no responders,
    `unavailable` or `throttled`, until the engine gives another answer."""
    while True:
        try:
            reply = await client.intent(DOMAIN, "acme", verb, body)
        except (nats.errors.Error, TimeoutError):
            reply = None
        code = (reply or {}).get("error", {}).get("code")
        if reply is not None and code not in ("unavailable", "throttled"):
            return reply
        await asyncio.sleep(0.1)


async def work(client: TrellisClient, worker: str, load: Load, stop: asyncio.Event) -> None:
    """Compose a GPU and release it, again and again: ids `<worker>-c-<n>`, `<worker>-r-<n>`."""
    n = 0
    while not stop.is_set():
        rid = f"{worker}-c-{n}"
        reply = await answered(client, "compose", {"request_id": rid, "host": "host-01",
                                                   "devices": [{"kind": "gpu"}]})  # fmt: skip
        assert reply.get("ok") is True, reply
        load.ack(rid)
        rid = f"{worker}-r-{n}"
        body = {"request_id": rid, "composition_id": reply["result"]["composition_id"]}
        reply = await answered(client, "release", body)
        assert reply.get("ok") is True, reply
        load.ack(rid)
        n += 1


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[PostgresPair]:
    servers = PostgresPair(tmp_path / "pg")
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


@contextlib.asynccontextmanager
async def loaded(
    pair: PostgresPair, nats_url: str, prefix: str, lease_ttl: float
) -> AsyncIterator[tuple[Load, asyncio.Event]]:
    """An engine over the pair, the domain imported, WORKERS clients composing and releasing
    until the event is set; on exit, the clients' last answers are awaited."""
    async with (
        engine_at(
            nats_url,
            pair.url,
            owner_url=pair.owner_url,
            prefix=prefix,
            lease_ttl=lease_ttl,
            rate_limit=RateLimit(0),
        ),
        TrellisClient.connected(
            nats_url, prefix=prefix, timeout=REQUEST_TIMEOUT_S, name="primary-loss-client"
        ) as client,
    ):
        imported = await client.admin(DOMAIN, "import-topology", one_switch(GPUS))
        assert imported.get("ok") is True, imported
        load, stop = Load(), asyncio.Event()
        workers = [asyncio.create_task(work(client, f"w{i}", load, stop)) for i in range(WORKERS)]
        try:
            yield load, stop
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), 120)


async def recorded(pair: PostgresPair) -> Counter[str]:
    """The request ids that caused each compose and release in the (new) primary's log."""
    conn = await asyncpg.connect(pair.owner_url)
    try:
        rows = await conn.fetch(
            "SELECT causation_id FROM trellis_events WHERE domain = $1 "
            "AND type IN ('CompositionRequested', 'CompositionReleased')",
            DOMAIN,
        )
    finally:
        await conn.close()
    return Counter(r["causation_id"] for r in rows)


def every_acknowledged_once(load: Load, log: Counter[str]) -> None:
    missing = [rid for rid in load.acked if log[rid] == 0]
    doubled = [rid for rid in load.acked if log[rid] > 1]
    assert (missing, doubled) == ([], []), f"lost {missing}, recorded twice {doubled}"


async def test_a_primary_killed_under_load_loses_no_acknowledged_intent(
    pair: PostgresPair, nats_url: str, subject_prefix: str
) -> None:
    async with loaded(pair, nats_url, subject_prefix, lease_ttl=3.0) as (load, _):
        await load.until(lambda: len(load.acked) >= 60)
        load.phase = "lost"
        await asyncio.to_thread(pair.kill_primary)
        await asyncio.to_thread(pair.standby.promote)
        promoted = time.monotonic()
        load.phase = "promoted"
        workers = [f"w{i}" for i in range(WORKERS)]
        await load.until(lambda: all(load.count("promoted")[w] >= 3 for w in workers))
    first = min(t for p, t in load.acked.values() if p == "promoted")
    every_acknowledged_once(load, await recorded(pair))
    print(
        f"primary killed: {len(load.acked)} intents acknowledged, 0 lost, 0 double; "
        f"served again {first - promoted:.2f} s after the promotion"
    )


async def test_with_the_standby_away_no_acknowledged_intent_is_lost_with_the_primary(
    pair: PostgresPair, nats_url: str, subject_prefix: str
) -> None:
    # A lease longer than the standby's absence: the engine keeps writing the domain while
    # its commits wait, which is when a resend could be answered from the primary alone.
    async with loaded(pair, nats_url, subject_prefix, lease_ttl=30.0) as (load, _):
        await load.until(lambda: len(load.acked) >= 30)
        load.phase = "standby away"
        await asyncio.to_thread(pair.kill_standby)
        gone = time.monotonic()
        await asyncio.sleep(8)  # commits wait for the standby, are given up, and are resent
        load.phase = "lost"
        await asyncio.to_thread(pair.kill_primary)
        await asyncio.to_thread(pair.standby.start)
        await asyncio.to_thread(pair.standby.promote)
        load.phase = "promoted"
        workers = [f"w{i}" for i in range(WORKERS)]
        await load.until(lambda: all(load.count("promoted")[w] >= 3 for w in workers))
    # A commit the standby confirmed just before it died may be answered just after.
    away = sorted(t - gone for p, t in load.acked.values() if p == "standby away")
    every_acknowledged_once(load, await recorded(pair))
    # Nothing could be made durable while the standby was away, so nothing was acknowledged.
    assert [t for t in away if t > 1.0] == [], away
    print(f"standby away, then primary lost: {len(load.acked)} acknowledged, 0 lost, 0 double")
