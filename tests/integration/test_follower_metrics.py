"""The follower process's counters on the engine's /metrics (TRELLIS_FOLLOWERS=process).

The relay runs in the follower process by default, and counted the foreign messages it passed
there, where no scrape saw them: the engine's /metrics showed trellis_foreign_messages_total
with no sample. The process now reports its counters to the engine over a pipe, and the engine
counts them under the same names and labels as inline followers do, across restarts. Each
foreign message counts once, however often the relay reads the domain's end past it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from fabrics import expect_ok, fabric
from follower_rig import until
from harness import Harness, serving

from trellis.adapters.follow_process import CommitSignal
from trellis.adapters.http.redfish.serve import RedfishOptions
from trellis.engine.service.follower import Progress

DOMAIN = "hall-1"
GPU = {"host": "host-01", "devices": [{"kind": "gpu"}]}
SAMPLE = f'trellis_foreign_messages_total{{consumer="relay",domain="{DOMAIN}"}}'


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        followers="process",
        metrics_at=("127.0.0.1", 0),
    ) as harness:
        assert isinstance(harness.followers, CommitSignal), "the engine follows inline"
        yield harness


async def foreign(h: Harness, count: int) -> None:
    """`count` messages on the domain's event subjects that are no event of the log."""
    js = h.client.nc.jetstream()
    for n in range(count):
        await js.publish(f"{h.client.prefix}.events.{DOMAIN}.NodeAdded", b"not an event %d" % n)


async def counted(h: Harness, expected: float, within: float = 20.0, sample: str = SAMPLE) -> None:
    """Until the engine's /metrics shows `sample` (the relay's count of foreign messages) at
    `expected`."""
    assert h.metrics_url is not None

    async def value() -> float | None:
        text = await asyncio.to_thread(read, f"{h.metrics_url}/metrics")
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return None

    deadline = asyncio.get_running_loop().time() + within
    while (seen := await value()) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"{sample} is {seen}"
        await asyncio.sleep(0.1)


def read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text: str = reply.read().decode()
        return text


async def test_the_relays_foreign_messages_reach_the_engines_metrics_across_restarts(
    h: Harness,
) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    await foreign(h, 2)  # back to back: each counts, not only the last one read
    held = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", GPU))  # relayed past them
    await counted(h, 2.0)

    # A killed follower process is restarted; its successor's counts add to the engine's.
    keeper = h.follower_process
    assert keeper is not None and keeper.pid is not None
    first = keeper.pid
    os.kill(first, signal.SIGKILL)
    await until("the follower process restarted", lambda: keeper.pid not in (None, first))
    await foreign(h, 1)
    release = {"composition_id": held["composition_id"]}
    expect_ok(await h.client.intent(DOMAIN, "acme", "release", release))
    await counted(h, 3.0)


async def test_a_foreign_message_counts_once_however_often_the_end_is_read_past_it(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, metrics_at=("127.0.0.1", 0)
    ) as h:
        expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
        await h.relayed(DOMAIN)
        relay = h.relay
        head = await h.store.head(DOMAIN)
        done = Progress(head.version, head.position)
        await foreign(h, 1)
        # A batch refused twice, or a publish that timed out, reads the end again.
        async with relay.pool.acquire() as conn:
            await relay._domain_end(conn, DOMAIN, done)
            await foreign(h, 1)
            await relay._domain_end(conn, DOMAIN, done)
            await relay._domain_end(conn, DOMAIN, done)
        assert relay.foreign.counts[DOMAIN] == 2
        await counted(h, 2.0)


async def test_the_redfish_event_feed_counts_the_foreign_messages_it_skips(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    """Every consumer of the contract counts what it skips (ARCHITECTURE §3): the Redfish
    service's event feed, too, on the engine's /metrics."""
    options = RedfishOptions(accounts=tmp_path / "accounts.json", admin_password="Adm1n-pass!")
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        metrics_at=("127.0.0.1", 0),
        redfish=options,
    ) as h:
        expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
        await foreign(h, 2)
        # The feed reads every domain's subjects at once: no one domain to label it with.
        await counted(h, 2.0, sample='trellis_foreign_messages_total{consumer="redfish",domain=""}')
