"""A follower whose batch is too big for its sink's time limit takes it in smaller ones.

A 65,536-device import is 35 events of about a megabyte each; projecting them in one batch can
outlast the database's command timeout on a busy machine, and retrying the same batch then
fails the same way for ever. After a failure the follower halves its batch (down to one event)
and grows it back as batches succeed."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from trellis.adapters.memory import MemoryLog
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent
from trellis.engine.service.follower import Follower, Progress

DOMAIN = "hall"


class SlowForBigBatches:
    """A sink that times out on any batch of more than `limit` events, as a statement does."""

    name = "slow"

    def __init__(self, limit: int):
        self.limit = limit
        self.progress = Progress()
        self.sizes: list[int] = []

    async def resume(self, domain: str) -> tuple[int, Progress]:
        return self.progress.version, self.progress

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        self.sizes.append(len(records))
        if len(records) > self.limit:
            raise TimeoutError("canceling statement due to statement timeout")
        self.progress = Progress(records[-1].version, records[-1].position)
        return self.progress

    async def refresh(self, domain: str) -> None:
        return None


async def logged(events: int) -> MemoryLog:
    log = MemoryLog()
    at = datetime(2026, 1, 1, tzinfo=UTC)
    pending = [
        PendingEvent(
            id=f"e-{i}",
            type="TopologyImported",
            schema_version=1,
            actor="admin",
            causation_id="import",
            correlation_id="import",
            recorded_at=at,
            data=b"{}",
        )
        for i in range(events)
    ]
    await log.append(DOMAIN, Head(), pending, [])
    return log


async def test_a_batch_past_the_sinks_time_limit_is_taken_in_smaller_ones() -> None:
    log, sink = await logged(35), SlowForBigBatches(limit=4)
    follower = Follower(DOMAIN, log, sink, batch_size=32, max_backoff=0.01)
    follower.start()
    try:
        assert await follower.wait_for(35, timeout=10)
    finally:
        await follower.stop()
    assert sink.progress.version == 35
    # 32 failed, then 16 and 8; 4 went through, and the batch grew back after it.
    assert sink.sizes[:4] == [32, 16, 8, 4]
    assert max(sink.sizes[4:]) > 4
