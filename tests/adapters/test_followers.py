"""Followers on the in-memory log: the rules CI's 65,536-device import broke.

A follower whose batch is too big for its sink's time limit takes it in smaller ones: a
65,536-device import is 35 events of about a megabyte each; projecting them in one batch can
outlast the database's command timeout on a busy machine, and retrying the same batch then
fails the same way for ever. After a failure the follower halves its batch (down to one
event) and grows it back as batches succeed. And a wait for a position outlives followers
replaced when an engine takes a domain up again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trellis.adapters.memory import MemoryLog
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent
from trellis.engine.service.follower import (
    BUSY_FOR_S,
    MAX_STRETCH,
    Follower,
    Followers,
    Progress,
    next_turn,
)

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


class Held(SlowForBigBatches):
    """A sink that applies nothing until `release` is set."""

    name = "held"

    def __init__(self) -> None:
        super().__init__(limit=1_000_000)
        self.release = asyncio.Event()

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        await self.release.wait()
        return await super().apply(domain, records)


def imported(i: int) -> PendingEvent:
    return PendingEvent(
        id=f"e-{i}",
        type="TopologyImported",
        schema_version=1,
        actor="admin",
        causation_id="import",
        correlation_id="import",
        recorded_at=datetime(2026, 1, 1, tzinfo=UTC),
        data=b"{}",
    )


async def logged(events: int) -> MemoryLog:
    log = MemoryLog()
    await log.append(DOMAIN, Head(), [imported(i) for i in range(events)], [])
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


async def test_a_wait_outlives_the_followers_an_engine_replaced_when_it_took_the_domain_again() -> (
    None
):
    # An engine that loses a domain's lease and takes it up again follows it anew; whoever
    # waited on the old followers (read-your-writes, a test's harness) must see the new ones.
    log, sink = await logged(3), Held()
    followers = Followers(log, [sink], max_backoff=0.01)
    followers.follow(DOMAIN)
    waiting = asyncio.create_task(followers.wait_for("held", DOMAIN, 3, timeout=10))
    await asyncio.sleep(0.1)
    await followers.unfollow(DOMAIN)  # lost...
    followers.follow(DOMAIN)  # ...and taken up again
    sink.release.set()
    try:
        assert await waiting
    finally:
        await followers.close(drain_timeout=0)


async def test_a_domain_not_followed_here_is_not_waited_for() -> None:
    followers = Followers(await logged(1), [Held()])
    assert await followers.wait_for("held", DOMAIN, 1, timeout=10) is False


async def grown(log: MemoryLog, by: int) -> None:
    """Append `by` events after the log's head, as one commit each."""
    for _ in range(by):
        head = await log.head(DOMAIN)
        await log.append(DOMAIN, head, [imported(head.version)], [])


async def committed(log: MemoryLog, follower: Follower) -> int:
    """One commit more and its notice to `follower`; the log's end position."""
    await grown(log, 1)
    follower.notify()
    return (await log.head(DOMAIN)).position


@pytest.mark.parametrize(
    ("options", "apart"),
    [
        # Gathering: an interval far longer than the test; commits 20 ms apart, time enough
        # for a pass of their own, were they not gathered.
        ({"pass_interval": 60.0}, 0.02),
        # Stretched: an interval of 10 ms, stretched far beyond the test's length; commits five
        # intervals apart.
        ({"pass_interval": 0.01, "stretch": lambda: 6000.0}, 0.05),
    ],
    ids=["gathered", "stretched"],
)
async def test_commits_close_together_are_taken_in_one_pass_and_a_waiter_cuts_the_wait(
    options: dict[str, Any], apart: float
) -> None:
    """A pass a commit asks for starts at most every `pass_interval` (times the follower's
    stretch): the commits that come meanwhile share one read and one sink transaction, and a
    wait for a position is not held up by the gathering."""
    log, sink = await logged(1), SlowForBigBatches(limit=100)
    follower = Follower(DOMAIN, log, sink, **options)
    follower.start()
    try:
        assert await follower.wait_for(1, timeout=5)
        for _ in range(3):
            await committed(log, follower)
            await asyncio.sleep(apart)
        assert sink.sizes == [1]
        assert await follower.wait_for((await log.head(DOMAIN)).position, timeout=5)
        assert sink.sizes == [1, 3]
    finally:
        await follower.stop()


async def test_with_more_domains_busy_each_gathers_longer_up_to_a_bound() -> None:
    """A pass's cost before its events is paid per domain: with several domains busy, the
    process's followers of one sink pass between them about as often as two busy domains'
    would, so each gathers longer; never past MAX_STRETCH intervals, and as before once the
    other domains have been quiet for BUSY_FOR_S."""
    now = [1000.0]
    domains = [f"d{i}" for i in range(12)]
    followers = Followers(
        await logged(1), [Named("projections")], clock=lambda: now[0], pass_interval=3600.0
    )
    for domain in domains:
        followers.follow(domain)
    try:
        assert followers.stretch() == 1.0  # nothing busy
        followers.notify("d0")
        assert followers.stretch() == 1.0
        followers.notify("d1")
        followers.notify("d1")  # a domain counts once however many commits it makes
        assert followers.stretch() == 1.0
        for domain in domains[2:4]:
            followers.notify(domain)
        assert followers.stretch() == 2.0
        for domain in domains[4:]:
            followers.notify(domain)
        assert followers.stretch() == MAX_STRETCH
        followers.notify("not-followed")  # a domain this process does not follow: no say
        assert followers.stretch() == MAX_STRETCH
        now[0] += BUSY_FOR_S / 2
        followers.notify("d0")
        now[0] += BUSY_FOR_S / 2 + 0.001
        assert followers.stretch() == 1.0  # only d0 committed within the last BUSY_FOR_S
        for domain in domains[1:4]:
            followers.notify(domain)
        assert followers.stretch() == 2.0
        await followers.unfollow("d0")  # a domain no longer followed here counts no more
        assert followers.stretch() == 1.5
    finally:
        await followers.close(drain_timeout=0)


class CountedReads:
    """The log, counting its reads."""

    def __init__(self, log: MemoryLog):
        self.log = log
        self.reads = 0

    def read(self, domain: str, after_version: int = 0, limit: int | None = None) -> Any:
        self.reads += 1
        return self.log.read(domain, after_version, limit)


async def test_a_batch_shorter_than_asked_ends_a_catch_up_without_another_read() -> None:
    log = CountedReads(await logged(5))
    sink = SlowForBigBatches(limit=1_000)
    assert await Follower(DOMAIN, log, sink, batch_size=500).catch_up() == 5  # type: ignore[arg-type]
    assert log.reads == 1
    # Full batches read on until a short (or empty) one says where the log ends.
    log, sink = CountedReads(await logged(5)), SlowForBigBatches(limit=1_000)
    assert await Follower(DOMAIN, log, sink, batch_size=2).catch_up() == 5  # type: ignore[arg-type]
    assert sink.sizes == [2, 2, 1] and log.reads == 3
    log, sink = CountedReads(await logged(4)), SlowForBigBatches(limit=1_000)
    assert await Follower(DOMAIN, log, sink, batch_size=2).catch_up() == 4  # type: ignore[arg-type]
    assert sink.sizes == [2, 2] and log.reads == 3


class SwallowsCancel(SlowForBigBatches):
    """A sink whose batch finishes although its task was cancelled meanwhile, as Python 3.11's
    `asyncio.wait_for` can end when its inner call completes as the cancel arrives."""

    name = "swallows"

    def __init__(self) -> None:
        super().__init__(limit=1_000_000)
        self.applying = asyncio.Event()

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        self.applying.set()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed: the batch completes
            await asyncio.Event().wait()
        return await super().apply(domain, records)


async def test_a_stop_whose_cancel_a_batch_swallowed_does_not_wait_a_poll_interval() -> None:
    log, sink = await logged(3), SwallowsCancel()
    follower = Follower(DOMAIN, log, sink, poll_interval=3600)
    follower.start()
    await sink.applying.wait()
    stopping = asyncio.create_task(follower.stop())
    # The flag ends the loop at its next turn; without it, the stop waited for the next poll.
    done, _ = await asyncio.wait({stopping}, timeout=10)
    assert done, "the stop waited for the follower's next poll"
    assert sink.progress.version == 3


async def test_a_domain_woken_while_the_followers_close_gets_no_second_follower() -> None:
    """The follower process follows a domain when a commit signal comes (a timer callback);
    one that fired during close() started a second follower of each sink beside the one being
    drained. Two followers of one sink fold the same domain in the same sink at once (the
    relay's fold raised KeyError, or put values folded from half a log), and the new one
    outlived the close."""
    log, sink = await logged(3), Held()
    followers = Followers(log, [sink], max_backoff=0.01)
    followers.follow(DOMAIN)
    await asyncio.sleep(0.05)  # its batch is in the held sink
    closing = asyncio.create_task(followers.close(drain_timeout=10))
    await asyncio.sleep(0.05)  # stopped, and the last catch-up waits in the sink
    followers.follow(DOMAIN)  # a commit signal's wake-up, during the close
    sink.release.set()
    await closing
    assert followers.domains == []
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("follow-")]
    assert left == []


class Named(SlowForBigBatches):
    """A sink of a given name, noting when (on the event loop's clock) each pass reached it."""

    def __init__(self, name: str):
        super().__init__(limit=1_000_000)
        self.name = name
        self.passes: list[float] = []

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        self.passes.append(asyncio.get_running_loop().time())
        return await super().apply(domain, records)


class Unhurried(Named):
    poll_every = 30.0


@pytest.mark.parametrize(
    ("started", "now", "interval", "turn", "expected"),
    [
        (100.02, 100.03, 0.05, 0.02, 100.07),  # passing on its turns: one interval on
        (0.0, 100.01, 0.05, 0.02, 100.02),  # a poke after a quiet spell waits for the turn
        (100.02, 100.09, 0.05, 0.02, 100.12),  # a pass that overran: the turn after it ended
        (100.0, 100.001, 0.05, 0.03, 100.08),  # the last pass off its turn: the next turn on
        (100.0, 100.01, 0.0, 0.0, 100.01),  # no gathering: at once
    ],
)
def test_a_pass_starts_on_its_turn(
    started: float, now: float, interval: float, turn: float, expected: float
) -> None:
    assert next_turn(started, now, interval, turn) == pytest.approx(expected)


@given(
    started=st.floats(0, 1e6),
    waited=st.floats(0, 10),
    interval=st.floats(0.001, 1),
    turn=st.floats(0, 1),
)
def test_a_turn_is_never_early_and_never_more_than_an_interval_late(
    started: float, waited: float, interval: float, turn: float
) -> None:
    turn *= interval
    now = started + waited
    start = next_turn(started, now, interval, turn)
    earliest = max(started + interval, now)
    assert earliest - 1e-6 <= start < earliest + interval + 1e-6
    offset = (start - turn) % interval
    assert min(offset, interval - offset) < 1e-7


async def test_the_followers_of_a_process_take_turns_spread_over_the_interval() -> None:
    """Left to start when poked, the relay's and the projections' passes of a domain started
    together, and their bursts held up the intents committed meanwhile (the serial tail)."""
    interval = 0.05
    sinks = [Named("projections"), Named("relay"), Unhurried("audit")]
    followers = Followers(await logged(1), sinks, pass_interval=interval)
    domains = ["a", "b", "c", "d"]
    for domain in domains:
        followers.follow(domain)
    try:
        turns = sorted(
            follower.turn
            for domain in domains
            for name in ("projections", "relay")
            if (follower := followers.of(name, domain)) is not None
        )
        assert len(turns) == 8
        gaps = [b - a for a, b in zip(turns, [*turns[1:], turns[0] + interval], strict=True)]
        assert min(gaps) >= interval / 16, turns
        # One domain's two sinks are far apart, not next to each other.
        relay, projections = followers.of("relay", "a"), followers.of("projections", "a")
        assert relay is not None and projections is not None
        apart = abs(relay.turn - projections.turn) % interval
        assert min(apart, interval - apart) >= interval / 3
    finally:
        await followers.close(drain_timeout=0)


async def test_passes_asked_for_by_commits_start_on_the_followers_turn() -> None:
    """The first pass starts at once; each later one waits for the follower's turn, not only
    for an interval since the last: so passes started half an interval off the turn land on
    it. (Scheduling may start a pass late, never early; the bound allows a slow machine.)"""
    interval, turn = 0.4, 0.25
    log, sink = await logged(1), Named("relay")
    follower = Follower(DOMAIN, log, sink, pass_interval=interval, turn=turn)
    loop = asyncio.get_running_loop()
    # Start half an interval off the turn: a follower that counted the interval from its
    # last pass alone would keep passing there.
    await asyncio.sleep((turn + interval / 2 - loop.time()) % interval)
    follower.start()
    try:
        assert await follower.wait_for(1, timeout=5)
        for _ in range(3):
            position = await committed(log, follower)
            while sink.progress.position < position:
                await asyncio.sleep(0.01)
    finally:
        await follower.stop()
    assert len(sink.passes) == 4
    for started in sink.passes[1:]:
        late = (started - turn) % interval
        assert late < interval / 4, (sink.passes, late)


class Unreachable(SlowForBigBatches):
    """A sink whose database is away: every batch fails to connect."""

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        raise ConnectionRefusedError(111, "Connect call failed")


async def test_a_failure_of_one_kind_is_traced_once_for_all_the_followers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A primary lost under several domains: each follower says it failed, in a line, and the
    traceback of that failure is said once, not by each of them."""
    log = await logged(3)
    followers = [Follower(DOMAIN, log, Unreachable(limit=10), max_backoff=0.01) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="trellis.follow"):
        for follower in followers:
            follower.start()
        try:
            while not all(f.failure and f.failure.attempts >= 2 for f in followers):
                await asyncio.sleep(0.01)
        finally:
            for follower in followers:
                await follower.stop()
    failed = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert {r.getMessage().split(":")[0] for r in failed} == {
        f"slow of domain {DOMAIN} stopped after position 0"
    }
    assert len(failed) >= 8
    assert sum(bool(r.exc_info) for r in failed) <= 1
