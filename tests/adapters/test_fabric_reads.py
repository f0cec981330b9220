"""A slow fabric manager's read runs on after its caller gave up, for the next caller
(engine/service/fabric_report.Reads): every `fabric check` of a manager that took 8 s to read
gave up at 5 s, and no check could ever answer (the southbound probe)."""

from __future__ import annotations

import asyncio

import pytest

from trellis.engine.core.errors import FabricError
from trellis.engine.core.fabric import FabricSnapshot
from trellis.engine.service.fabric_report import Reads


class SlowFabric:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reads = 0
        self.fail = False

    async def snapshot(self, domain: str, *, fence: int | None = None) -> FabricSnapshot:
        self.reads += 1
        await asyncio.sleep(self.seconds)
        if self.fail:
            raise FabricError("the manager said no")
        return FabricSnapshot(circuits=[], bindings=[])


async def test_a_read_past_the_deadline_answers_the_next_caller_once() -> None:
    fabric = SlowFabric(0.3)
    reads = Reads()
    with pytest.raises(TimeoutError):
        await reads.read("hall", fabric, 0.1)  # type: ignore[arg-type]
    await asyncio.sleep(0.3)  # it ends, unclaimed
    snapshot = await asyncio.wait_for(reads.read("hall", fabric, 1.0), 0.05)  # type: ignore[arg-type]
    assert snapshot == FabricSnapshot(circuits=[], bindings=[])
    assert fabric.reads == 1
    # Taken once: the next caller reads again, and what a caller took is not kept.
    await reads.read("hall", fabric, 1.0)  # type: ignore[arg-type]
    await reads.read("hall", fabric, 1.0)  # type: ignore[arg-type]
    assert fabric.reads == 3


async def test_a_failed_read_is_its_callers_and_the_next_reads_again() -> None:
    fabric = SlowFabric(0.05)
    fabric.fail = True
    reads = Reads()
    with pytest.raises(FabricError):
        await reads.read("hall", fabric, 1.0)  # type: ignore[arg-type]
    fabric.fail = False
    await reads.read("hall", fabric, 1.0)  # type: ignore[arg-type]
    assert fabric.reads == 2
