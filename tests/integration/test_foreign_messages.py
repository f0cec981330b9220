"""No message can stop a consumer (ARCHITECTURE §3; issue 21, findings 1 and 7).

Anything published on the stream's subjects or put in the bucket that is not the contract's (a
reply body injected there, a stray publish, garbage) is skipped and counted by every consumer
of the contract: the relay, `watch`, `composition list`, the fabric page and the example
scheduler. Before, one such message stopped the domain's relay for good, blanked the page and
made `watch` and `composition list` exit 70. In plain mode any client may publish there, which
is how these tests put the foreign messages in.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric
from harness import Harness, cli_env, run_cli, serving

from trellis.adapters.entrypoints.cli.queries import composition_rows
from trellis.adapters.nats.jetstream import bucket_name, stream_name

DOMAIN = "hall-1"
GPU = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["H100"]}]}
SLICE = {"host": "host-01", "devices": [{"kind": "memory", "capacity_gib": 64}]}
# A reply body, as the reply-subject injection put one there, and bytes that are no JSON.
FOREIGN = [
    b'{"ok":true,"result":{"devices":[]},"position":3,"replayed":false}',
    b"\xff\x00 not json",
    b'{"id":"00000000-0000-4000-8000-000000000009","domain":"hall-1","version":99}',
]


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        page_at=("127.0.0.1", 0),
        metrics_at=("127.0.0.1", 0),
    ) as harness:
        yield harness


async def pollute(h: Harness) -> None:
    """Foreign messages on the domain's event subjects and foreign values in its keys."""
    nc, prefix = h.client.nc, h.client.prefix
    js = nc.jetstream()
    for body in FOREIGN:
        await js.publish(f"{prefix}.events.{DOMAIN}.CompositionReleased", body)
    kv = await js.key_value(bucket_name(prefix))
    await kv.put(f"{DOMAIN}.composition.c-forged", FOREIGN[0])
    await kv.put(f"{DOMAIN}.device.gpu-01", b"garbage")  # over a real key's value
    await kv.put(f"{DOMAIN}.nonsense", b"{}")


async def test_the_relay_skips_foreign_messages_and_keeps_relaying(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    await h.relayed(DOMAIN)
    await pollute(h)

    # The last message on the domain's subjects is foreign when the next events are relayed.
    composed = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", GPU))
    await h.relayed(DOMAIN, timeout=10)  # before: the relay stopped here for good
    js = h.client.nc.jetstream()
    last = await js.get_last_msg(stream_name(h.client.prefix), f"{h.client.prefix}.events.>")
    assert json.loads(last.data)["type"] == "CompositionActivated"
    kv = await js.key_value(bucket_name(h.client.prefix))
    value = json.loads((await kv.get(f"{DOMAIN}.composition.{composed['composition_id']}")).value)
    assert value["state"] == "active"
    assert h.relay.foreign.counts.get(DOMAIN, 0) >= 1
    # An expected case, read past in the pass that met it: not a relay that "stopped", with
    # a traceback in the engine's log.
    assert h.relay.resyncs >= 1
    assert [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()] == []
    # And it is counted where operators look.
    assert h.metrics_url is not None
    metrics = await asyncio.to_thread(read, f"{h.metrics_url}/metrics")
    assert f'trellis_foreign_messages_total{{consumer="relay",domain="{DOMAIN}"}}' in metrics


def read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text: str = reply.read().decode()
        return text


async def test_watch_and_composition_list_skip_what_is_not_the_contracts(
    h: Harness, tmp_path: Path, nats_url: str, database_url: str, pg_schema: str
) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    await h.relayed(DOMAIN)
    await pollute(h)  # between the import's event and the compose's
    composed = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", SLICE))
    await h.relayed(DOMAIN)
    env = cli_env(tmp_path, nats_url, database_url, pg_schema, h.client.prefix)

    code, out, err = await run_cli(env, "composition", "list", "--domain", DOMAIN)
    assert code == 0, err
    assert composed["composition_id"] in out and "c-forged" not in out
    events = (await h.store.head(DOMAIN)).version
    code, out, err = await run_cli(
        env, "watch", "--domain", DOMAIN, "--from-start", "--count", str(events), "-o", "json"
    )
    assert code == 0, err
    shown = [json.loads(line) for line in out.splitlines()]
    assert [e["version"] for e in shown] == list(range(1, events + 1))
    assert "not an event of the log" in err  # logged once


async def test_the_page_shows_no_foreign_value_and_keeps_following(h: Harness) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    await h.relayed(DOMAIN)
    await pollute(h)
    composed = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", SLICE))
    await h.relayed(DOMAIN)

    assert h.page_url is not None
    snapshot = await asyncio.to_thread(first_snapshot, h.page_url)
    values = snapshot["values"]
    assert f"{DOMAIN}.composition.{composed['composition_id']}" in values
    assert f"{DOMAIN}.composition.c-forged" not in values
    assert f"{DOMAIN}.nonsense" not in values
    # Its last value in the bucket is garbage: the page keeps showing the one before.
    assert values[f"{DOMAIN}.device.gpu-01"]["kind"] == "gpu"  # type: ignore[index]
    for value in values.values():
        assert isinstance(value, dict)


def first_snapshot(page_url: str) -> dict[str, object]:
    """The first server-sent event of the page's feed: the snapshot of the bucket."""
    with urllib.request.urlopen(f"{page_url}/events", timeout=10) as stream:
        event = ""
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "snapshot":
                data: dict[str, object] = json.loads(line.removeprefix("data: "))
                return data
    raise AssertionError("no snapshot")


async def test_composition_list_skips_a_composition_released_while_it_reads(h: Harness) -> None:
    """The list reads the bucket's keys, then each value: a composition released in between
    has no value any more, which made `composition list` exit 70 under churn (SRE probe)."""
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    kept = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", GPU))
    gone = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", SLICE))
    await h.relayed(DOMAIN)
    kv = await h.client.nc.jetstream().key_value(bucket_name(h.client.prefix))

    class ReleasedAfterListing:
        async def keys(self) -> list[str]:
            keys: list[str] = await kv.keys()
            release = {"composition_id": gone["composition_id"]}
            expect_ok(await h.client.intent(DOMAIN, "acme", "release", release))
            await h.relayed(DOMAIN)
            return keys

        async def get(self, key: str) -> Any:
            return await kv.get(key)

    rows = await composition_rows(ReleasedAfterListing(), DOMAIN)  # type: ignore[arg-type]
    assert [r["id"] for r in rows] == [kept["composition_id"]]
