"""Losing a writer lease, on the in-memory log and leases (their rules are the PostgreSQL
schema's: tests/store_contract.py). An engine that believes it still holds a lease another has
taken over can neither commit (the log checks the epoch) nor program the hardware (the fabric
keeps the highest epoch it saw); an engine whose own count merely ran out keeps a lease the
store still holds. Two engines over real NATS and PostgreSQL: tests/integration/test_fencing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio
from integration.fabrics import expect_error, expect_ok, fabric
from memory_rig import CountingLog, Rig, in_memory

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.memory import MemoryLeases
from trellis.engine.core.errors import WriterFenced
from trellis.engine.core.fabric import FabricBinding

TTL = 30.0  # long by the engines' own clocks: only the store's clock runs a lease out here
NIC = {"host": "host-01", "devices": [{"kind": "nic"}]}


class StoreClock:
    """The lease store's clock, moved by the test."""

    def __init__(self) -> None:
        self.at = 0.0

    def __call__(self) -> float:
        return self.at


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[Rig, Rig, StoreClock]]:
    """Two engines on one log, one lease store and one simulated fabric."""
    clock = StoreClock()
    leases = MemoryLeases(clock)
    log, hardware = CountingLog(leases), SimulatedFabric()
    async with contextlib.AsyncExitStack() as stack:
        a, b = [
            await stack.enter_async_context(
                in_memory(log=log, leases=leases, fabric=hardware, with_leases=True, lease_ttl=TTL)
            )
            for _ in range(2)
        ]
        yield a, b, clock


async def test_an_ex_writer_that_thinks_it_still_writes_can_neither_commit_nor_program(
    pair: tuple[Rig, Rig, StoreClock],
) -> None:
    a, b, clock = pair
    expect_ok(await a.client.admin("hall", "import-topology", fabric()))
    epoch = a.engine.fence("hall")
    assert epoch is not None and "hall" in a.engine.domains

    # Given: the store's lease runs out while a still counts it held (paused past it, say),
    # and b takes the domain over and programs the fabric under its own epoch.
    clock.at += TTL + 1
    expect_ok(await b.client.intent("hall", "acme", "compose", {"request_id": "b-1", **NIC}))
    assert b.engine.fence("hall") == epoch + 1
    assert a.fabric.fence_of("hall") == epoch + 1

    # When: the ex-writer acts on its old lease...
    late = msgspec.json.encode({"request_id": "late-1", **NIC})
    reply = msgspec.json.decode(await a.engine.handle("intent", "hall", "acme", "compose", late))

    # Then: the log refused its commit, and it let go of the domain...
    assert "no longer writes" in expect_error(reply, "unavailable")["message"]
    assert "late-1" not in {e.causation_id for e in a.log.all_events()}
    for _ in range(100):  # the drop runs in a task of its own
        if "hall" not in a.engine.domains:
            break
        await asyncio.sleep(0.01)
    assert "hall" not in a.engine.domains
    # ...and the hardware refuses its epoch, whatever it tries.
    binding = FabricBinding(
        host="host-01", device="gpu-01", path=["host-01", "sw-1", "gpu-01"], composition_id="c"
    )
    with pytest.raises(WriterFenced):
        await a.fabric.bind("hall", binding, fence=epoch)
    assert "c" not in {bound.composition_id for bound in (await a.fabric.snapshot("hall")).bindings}


async def test_a_writer_whose_own_count_ran_out_keeps_a_lease_the_store_still_holds() -> None:
    """An event loop held up past the engine's own count of its lease (a long decision) is
    not a lost lease: the store, which renews only a lease that never lapsed, decides."""
    async with in_memory(with_leases=True, lease_ttl=3.0) as rig:
        expect_ok(await rig.client.admin("hall", "import-topology", fabric()))
        epoch = rig.engine.fence("hall")
        served = rig.engine.custody._served["hall"]
        assert served.lease is not None

        # The writer finds its count run out before a batch: it renews out of turn, commits.
        served.lease.until = 0.0
        reply = await rig.client.intent("hall", "acme", "compose", {"request_id": "u-1", **NIC})
        cid = expect_ok(reply)["composition_id"]
        # The lease keeper finds it run out: the store's renewal under our epoch keeps it.
        served.lease.until = 0.0
        await rig.engine.custody._own_tick()
        assert rig.engine.custody._served.get("hall") is served
        assert rig.engine.fence("hall") == epoch
        reply = await rig.client.intent(
            "hall", "acme", "release", {"request_id": "u-2", "composition_id": cid}
        )
        assert expect_ok(reply)["state"] == "released"
        assert rig.engine.custody._served.get("hall") is served


async def test_a_fabric_that_saw_a_later_epoch_than_the_log_has_the_next_lease_drawn_above_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new deployment (a new log, its leases from epoch 1) driving a fabric an older one
    drove at epoch 7: refused once, the engine takes its lease again at 8 at once."""
    hardware = SimulatedFabric()
    old = FabricBinding(host="host-01", device="x", path=["host-01", "x"], composition_id="old")
    await hardware.bind("hall", old, fence=7)  # the older deployment's last call
    await hardware.unbind("hall", old, fence=7)
    async with in_memory(fabric=hardware, with_leases=True, lease_ttl=TTL) as rig:
        expect_ok(await rig.client.admin("hall", "import-topology", fabric()))
        # The first pass over the fabric (under epoch 1) is refused; the client resends.
        body = {"request_id": "c-1", **NIC}
        for _ in range(100):
            reply = await rig.client.intent("hall", "acme", "compose", body)
            if reply.get("ok"):
                break
            await asyncio.sleep(0.02)
        assert expect_ok(reply)["state"] == "active", reply
        assert rig.engine.fence("hall") == 8
        assert hardware.fence_of("hall") == 8
    said = [r.getMessage() for r in caplog.records if "writing it" in r.getMessage()]
    assert said == [
        "domain hall: this engine stops writing it: the fabric has seen writer epoch 7",
        # Said as loud as the stop: an operator who read the one looks for the other.
        "domain hall: writing it again under epoch 8",
    ]
