"""The client resends a request unanswered within an attempt's wait, as it is (issue 25 item 1;
ARCHITECTURE §3: a resend with the same request_id is safe). NATS may hand a request to a
frozen engine's subscription until the server drops it; the resend reaches another engine."""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg

from trellis.adapters.nats import client as client_module
from trellis.adapters.nats.client import TrellisClient


async def test_a_request_a_frozen_engine_swallowed_is_sent_again_as_it_was(
    nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "ATTEMPT_S", 0.3)
    seen: list[bytes] = []
    async with TrellisClient.connected(nats_url, prefix=subject_prefix, timeout=5) as client:

        async def engine(msg: Msg) -> None:
            seen.append(msg.data)
            if len(seen) > 1:  # the first landed on a frozen engine: no answer
                await msg.respond(b'{"ok": true, "result": {}, "position": 0}')

        await client.nc.subscribe(f"{subject_prefix}.intent.hall.acme.compose", cb=engine)
        reply = await client.intent("hall", "acme", "compose", {"host": "host-01"})

    assert reply["ok"] is True
    assert len(seen) == 2 and seen[0] == seen[1]  # the same request_id, the same body
    assert msgspec.json.decode(seen[0])["request_id"]


async def test_nobody_answering_is_a_timeout_after_the_whole_wait(
    nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "ATTEMPT_S", 0.2)
    async with TrellisClient.connected(nats_url, prefix=subject_prefix, timeout=1.0) as client:

        async def frozen(msg: Msg) -> None:
            return None

        await client.nc.subscribe(f"{subject_prefix}.query.hall.free", cb=frozen)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(nats.errors.TimeoutError):
            await client.query("hall", "free")
        assert loop.time() - started >= 1.0


async def test_no_engine_subscribed_is_said_at_once(nats_url: str, subject_prefix: str) -> None:
    async with TrellisClient.connected(nats_url, prefix=subject_prefix, timeout=5) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(nats.errors.NoRespondersError):
            await client.query("hall", "free")
        assert loop.time() - started < 1.0
