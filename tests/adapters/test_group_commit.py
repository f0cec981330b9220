"""Group commit: intents that arrive together share one append, and nobody hears back before
their event is committed (ARCHITECTURE §2 and §6). The writer's behaviour, on the in-memory
log (tests/adapters/memory_rig.py); PostgreSQL's own guarantees are tests/store_contract.py's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from integration.fabrics import expect_error, expect_ok, fabric, gpu
from memory_rig import CountingLog, Rig, in_memory

from trellis.adapters.clock import SystemClock
from trellis.adapters.memory import MemoryLog
from trellis.engine.core.intents import ImportTopology
from trellis.engine.core.records import verify_chain
from trellis.engine.service.writer import DomainWriter

DOMAIN = "hall-1"
N = 200


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    async with in_memory() as r:
        yield r


async def test_concurrent_intents_are_committed_in_batches_and_answered_after_commit(
    rig: Rig,
) -> None:
    # Given: an imported fabric.
    expect_ok(await rig.client.admin(DOMAIN, "import-topology", fabric()))
    imports = rig.log.appends
    unseen: list[int] = []

    async def add(i: int) -> dict[str, Any]:
        reply = await rig.client.admin(
            DOMAIN, "add-node", {"request_id": f"add-{i}", "node": gpu(f"gpu-n{i:03}")}
        )
        # The moment the reply is here, its event must be in the log.
        if reply.get("ok") and rig.log.counts()[0] < reply["position"]:
            unseen.append(i)
        return reply

    # When: N add-node intents are in flight together.
    replies = await asyncio.gather(*(add(i) for i in range(N)))

    # Then: all ok, each with its own position, and each in the log when its reply arrived.
    for reply in replies:
        expect_ok(reply)
    assert unseen == []
    positions = [r["position"] for r in replies]
    assert len(set(positions)) == N
    events = [e async for e in rig.log.read(DOMAIN)]
    assert [e.version for e in events] == list(range(1, N + 2))
    by_request = {e.causation_id: e.position for e in events[1:]}
    assert by_request == {f"add-{i}": positions[i] for i in range(N)}
    assert rig.log.appends - imports < N, "every intent had an append of its own: no batching"
    assert rig.log.counts() == (N + 1, N + 1)
    assert verify_chain(events) is None


async def test_rejections_inside_a_batch_do_not_spoil_the_others(rig: Rig) -> None:
    # Given: an imported fabric.
    expect_ok(await rig.client.admin(DOMAIN, "import-topology", fabric()))

    # When: good intents, intents for existing ids and pairs racing for one new id arrive together.
    good = [{"node": gpu(f"gpu-g{i:02}")} for i in range(40)]
    taken = [{"node": gpu("gpu-01")} for _ in range(40)]
    racing = [{"node": gpu(f"gpu-r{i % 10}")} for i in range(40)]  # four requests per id
    bodies = [body for trio in zip(good, taken, racing, strict=True) for body in trio]
    replies = await asyncio.gather(*(rig.client.admin(DOMAIN, "add-node", b) for b in bodies))

    # Then: each new id was added exactly once, by exactly one request; the rest are conflicts.
    winners: dict[str, int] = {}
    for body, reply in zip(bodies, replies, strict=True):
        node = body["node"]["id"]
        if reply["ok"]:
            assert node not in winners, f"{node} was added twice"
            winners[node] = reply["position"]
        else:
            assert node in {"gpu-01"} | {f"gpu-r{i}" for i in range(10)}, reply
            expect_error(reply, "conflict")
    assert set(winners) == {b["node"]["id"] for b in good + racing}
    added = [e async for e in rig.log.read(DOMAIN) if e.type == "NodeAdded"]
    assert {node_of(e.data): e.position for e in added} == winners


def node_of(data: bytes) -> str:
    """The node a NodeAdded event's data adds."""
    node: str = msgspec.json.decode(data)["node"]["id"]
    return node


async def test_a_request_that_reaches_a_closed_writer_is_answered_unavailable_at_once() -> None:
    """A router can find a domain's writer just before the domain is dropped (a paused engine
    woke to find another writing it, say) and hand it the request after its close. Nothing
    takes requests off a closed writer's queue: it must answer at once, not leave the client,
    and an engine stopping, waiting on a reply that never comes."""
    writer = DomainWriter(DOMAIN, MemoryLog(), SystemClock(), max_batch=64)
    await writer.close()
    intent = msgspec.convert({"request_id": "late", **fabric()}, ImportTopology)
    asked = asyncio.ensure_future(writer.request("operator", "import-topology", intent, "admin"))
    done, _ = await asyncio.wait({asked}, timeout=5)
    assert done, "a closed writer left the request waiting"
    answer = msgspec.json.decode(asked.result())
    expect_error(answer, "unavailable")
    assert "stopped writing domain" in answer["error"]["message"]


class BrokenLog(CountingLog):
    """A log whose appends fail with a message no client should read."""

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("connect to 10.1.2.3:5432 as trellis_owner failed")


async def test_an_unexpected_failure_answers_its_kind_and_incident_never_its_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with in_memory(log=BrokenLog()) as rig:
        with caplog.at_level(logging.ERROR, logger="trellis.engine.service.writer"):
            error = expect_error(
                await rig.client.admin(DOMAIN, "import-topology", fabric()), "unavailable"
            )
    assert "10.1.2.3" not in msgspec.json.encode(error).decode(), error
    incident = error["details"]["incident"]
    assert error["details"]["error"] == "RuntimeError", error
    assert f"RuntimeError, incident {incident} in the engine's log" in error["message"], error
    # The operator finds the whole story under that incident.
    (logged,) = [r for r in caplog.records if incident in r.getMessage()]
    assert logged.exc_info is not None and "10.1.2.3" in str(logged.exc_info[1])
