"""Replies go only to the requester's own inbox (ARCHITECTURE §3; issue 21 finding 1).

A request names its reply subject itself. A tenant that set it to another tenant's KV key or to
an event subject had the engine, under its own identity, overwrite that KV value and put a
non-event into the stream, which stopped the domain's relay. Every such request is now dropped
unanswered, before anything is decided: plain mode by the engine's rule, secure mode by the
rule and by the engine's NATS permissions (it may publish only to inboxes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest_asyncio
from fabrics import expect_ok, fabric, row_counts
from harness import Harness, bucket_values, serving
from nats.aio.client import Client as NATS
from test_secure_mode import ACME, GLOBEX, OPERATOR, Rig, imported, secured

from trellis.adapters.nats.auth import inbox_prefix, public_key
from trellis.adapters.nats.jetstream import bucket_name, stream_name
from trellis.adapters.nats.micro import SERVICE_NAME

DOMAIN = "hall-1"
GPU = {"host": "host-01", "devices": [{"kind": "gpu"}]}
SLICE = {"host": "host-01", "devices": [{"kind": "memory", "capacity_gib": 64}]}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


def hostile_replies(prefix: str, composition: str) -> list[str]:
    """Reply subjects that are no inbox: another tenant's KV key, an event subject, the
    checkpoint stream, a bare subject of the prefix."""
    return [
        f"$KV.{bucket_name(prefix)}.{DOMAIN}.composition.{composition}",
        f"{prefix}.events.{DOMAIN}.CompositionReleased",
        f"{prefix}.checkpoints.{DOMAIN}",
        f"{prefix}.intent.{DOMAIN}.globex.release",
        "_INBOX",  # no dot: not an inbox either
        # Inboxes in name only: nobody can subscribe to these alone, or the answer reaches
        # everyone waiting on an inbox (the intent was decided, with no one to answer).
        "_INBOX.",
        "_INBOX..x",
        "_INBOX.a..b",
        "_INBOX.>",
        "_INBOX.*",
    ]


async def stream_messages(nc: NATS, prefix: str) -> int:
    return (await nc.jetstream().stream_info(stream_name(prefix))).state.messages


async def send_with_reply(nc: NATS, subject: str, body: dict[str, Any], reply: str) -> None:
    await nc.publish(subject, msgspec.json.encode(body), reply=reply)
    await nc.flush()


async def test_a_request_whose_reply_is_no_inbox_is_dropped_and_changes_nothing(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    # Given: globex holds a composition, relayed to the stream and its KV key.
    prefix, nc = h.client.prefix, h.client.nc
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    theirs = expect_ok(await h.client.intent(DOMAIN, "globex", "compose", GPU))
    cid = theirs["composition_id"]
    await h.relayed(DOMAIN)
    values, messages = (
        await bucket_values(nc.jetstream(), prefix),
        await stream_messages(nc, prefix),
    )
    rows = await row_counts(database_url, pg_schema)

    # When: acme sends requests on its own subjects, each naming a reply subject that is no
    # inbox, and intents without any reply subject at all.
    for i, reply in enumerate(hostile_replies(prefix, cid)):
        await send_with_reply(nc, f"{prefix}.view.{DOMAIN}.acme.free", {}, reply)
        await send_with_reply(nc, f"{prefix}.query.{DOMAIN}.topology", {}, reply)
        compose = {"request_id": f"hostile-{i}", **GPU}
        await send_with_reply(nc, f"{prefix}.intent.{DOMAIN}.acme.compose", compose, reply)
        for verb in ("PING", "INFO", "STATS"):  # the engine's NATS micro service, too
            await send_with_reply(nc, f"$SRV.{verb}.{SERVICE_NAME}", {}, reply)
    await nc.publish(
        f"{prefix}.intent.{DOMAIN}.acme.compose", msgspec.json.encode({"request_id": "nr", **GPU})
    )
    # A request with an inbox is answered, after all of those were seen (one connection, in
    # order, to the one engine).
    expect_ok(await h.client.view(DOMAIN, "acme", "free"))
    await h.relayed(DOMAIN)

    # Then: nothing was written to the log, the stream or the bucket.
    assert await row_counts(database_url, pg_schema) == rows
    assert await stream_messages(nc, prefix) == messages
    assert await bucket_values(nc.jetstream(), prefix) == values
    # And the domain keeps serving and relaying.
    mine = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", SLICE))
    assert mine["state"] == "active"
    await h.relayed(DOMAIN)
    assert await stream_messages(nc, prefix) > messages


async def test_an_answer_carries_no_header_of_its_request(h: Harness) -> None:
    """The answer went out with the request's own headers: a request sent with `Status: 503`
    was committed, and its client read the answer as "no responders"."""
    prefix, nc = h.client.prefix, h.client.nc
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    headers = {"Status": "503", "X-Echo": "hello"}
    compose = msgspec.json.encode({"request_id": "with-headers", **GPU})
    answer = await nc.request(
        f"{prefix}.intent.{DOMAIN}.acme.compose", compose, timeout=10, headers=headers
    )
    assert not answer.headers, answer.headers
    assert expect_ok(msgspec.json.decode(answer.data))["state"] == "active"


async def test_in_secure_mode_a_tenant_cannot_have_the_engine_answer_anywhere_but_its_inbox(
    tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    async with secured(tmp_path, database_url, pg_schema) as rig:
        await _secure_injections(rig, database_url, pg_schema)


async def _secure_injections(rig: Rig, database_url: str, pg_schema: str) -> None:
    await imported(rig)
    acme, globex = await rig.connect(ACME), await rig.connect(GLOBEX)
    operator = await rig.connect(OPERATOR)
    theirs = expect_ok(await globex.client.intent(DOMAIN, "globex", "compose", GPU))
    await until_relayed(rig)
    js = operator.nc.jetstream()
    values, messages = (
        await bucket_values(js, rig.prefix),
        await stream_messages(operator.nc, rig.prefix),
    )
    rows = await row_counts(database_url, pg_schema)
    globex_inbox = inbox_prefix(public_key(rig.secure.credentials(GLOBEX).seed()))
    operator_inbox = inbox_prefix(public_key(rig.secure.credentials(OPERATOR).seed()))

    # acme's own subjects, answered into the bucket, the stream, or another identity's inbox.
    hostile = [*hostile_replies(rig.prefix, theirs["composition_id"]), f"{globex_inbox}.x.y"]
    hostile.append(f"{operator_inbox}.x.y")
    spy = await globex.nc.subscribe(f"{globex_inbox}.x.>")
    for i, reply in enumerate(hostile):
        await send_with_reply(acme.nc, f"{rig.prefix}.view.{DOMAIN}.acme.free", {}, reply)
        compose = {"request_id": f"hostile-{i}", **GPU}
        await send_with_reply(acme.nc, f"{rig.prefix}.intent.{DOMAIN}.acme.compose", compose, reply)
    expect_ok(await acme.client.view(DOMAIN, "acme", "free"))
    await until_relayed(rig)
    await globex.nc.flush()

    assert spy.pending_msgs == 0  # globex's inbox heard nothing of acme's requests
    assert await row_counts(database_url, pg_schema) == rows
    assert await stream_messages(operator.nc, rig.prefix) == messages
    assert await bucket_values(js, rig.prefix) == values
    # acme itself is served as before.
    assert expect_ok(await acme.client.intent(DOMAIN, "acme", "compose", GPU))["state"] == "active"


async def until_relayed(rig: Rig) -> None:
    head = (await rig.running.store.head(DOMAIN)).position
    assert await rig.running.followers.wait_for("relay", DOMAIN, head, 10)
    await asyncio.sleep(0)
