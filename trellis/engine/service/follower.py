"""Checkpointed followers of the log: the one loop the projections and the event relay share.

A Follower reads one domain's events in version order from where its Sink stands and hands
them over in batches. The sink applies a batch and moves its checkpoint in one step (one
transaction), so after a crash sink and checkpoint agree and the follower resumes where the
last step ended, with nothing applied twice. A sink may skip what another follower of the same
checkpoint applied first, and says so by the progress it returns.

There is one follower per (sink, domain), so a domain whose events a sink cannot take (an event
this code cannot decode, a value the stream or the bucket refuses, a server that is away) holds
up its own follower only: every other domain's feed, read models and queries go on. A failure
is logged with the position it stopped at and retried with backoff, for as long as it lasts;
`failure` says what holds the follower up, so a query can name the cause.

Stopping is explicit: `stop()` raises a flag before it cancels, and the loop reads that flag,
never the task's `cancelling()` count. (On Python 3.11 a TaskGroup whose child failed leaves
its parent's count at 1; the relay once read that as a stop and ended without a word.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Protocol

import msgspec

from trellis.engine.core.records import RecordedEvent

log = logging.getLogger("trellis.follow")

# Passes asked for by commits start at most this often (at most 20 a second): under a steady
# stream of commits each pass takes several of them in one read and one sink transaction. A
# pass costs a sink about a millisecond and a half of CPU before its events (docs/
# benchmarks.md), and a reader that waits for a position (`wait_for`) never waits it out.
PASS_INTERVAL_S = 0.05

# A pass's cost before its events is paid per domain, so a process following several busy
# domains pays it several times an interval. Its followers of one sink pass, between them,
# about as often as those of this many busy domains would at the pass interval: each gathers
# for (busy domains / this) intervals, never less than one. Four busy domains gathering 100 ms
# took the follower process's CPU per pair down by a fifth (docs/benchmarks.md)...
BUSY_DOMAINS_PER_INTERVAL = 2
# ...up to this many intervals: what bounds how far the stream and the read models trail.
MAX_STRETCH = 4.0
# A domain counts as busy this long after a commit of it asked for a pass.
BUSY_FOR_S = 1.0


class Progress(msgspec.Struct, frozen=True):
    """How far a sink has applied a domain: the version and log position of its last event."""

    version: int = 0
    position: int = 0


class Rewound(Exception):
    """The sink's checkpoint is behind what it was handed (someone rebuilt it): resume."""


class Stalled(Exception):
    """The sink applied what came before `position` and cannot take the event there."""

    def __init__(self, progress: Progress, position: int, cause: str):
        super().__init__(f"cannot take the event at position {position}: {cause}")
        self.progress = progress
        self.position = position
        self.cause = cause


class Failure(msgspec.Struct, frozen=True, kw_only=True):
    """What holds a follower up: where it stopped, why, and since when (monotonic seconds)."""

    sink: str
    domain: str
    after: int  # the position of the last event applied
    position: int | None  # the event it cannot take, when that is known
    cause: str
    attempts: int
    since: float


class DomainLog(Protocol):
    """One domain's events in version order (engine.service.ports.EventStore is one)."""

    def read(
        self, domain: str, after_version: int = 0, limit: int | None = None
    ) -> AsyncIterator[RecordedEvent]: ...


class Sink(Protocol):
    """Where a follower takes a domain's events."""

    name: str

    async def resume(self, domain: str) -> tuple[int, Progress]:
        """Where to start: the version after which the sink needs the domain's events (it may
        want events it applied before, to rebuild a fold) and its checkpoint."""
        ...

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        """Take the next events (consecutive versions) and move the checkpoint with them, at
        once; the checkpoint now.

        Raises:
            Rewound: the stored checkpoint moved back; nothing was applied.
            Stalled: an event cannot be taken; everything before it was.
        """
        ...

    async def refresh(self, domain: str) -> None:
        """The log is quiet: notice what changed outside (a rebuild, a bucket removed).

        Raises:
            Rewound: the stored checkpoint moved back.
        """
        ...


class Follower:
    """Keeps one sink up to date with one domain's log, in the background once started.

    Args:
        domain: the domain to follow.
        log: reads its events.
        sink: takes them.
        batch_size: events per `apply` at most; after a failure, batches are halved (down to
            one event) and grow back as they succeed, so a batch too big for the sink's time
            limit (a 65,536-device import, on a busy machine) is taken in smaller ones.
        poll_interval: seconds between looks when nobody calls `notify()`.
        max_backoff: the longest wait between retries of a failure.
        pass_interval: the least seconds between the starts of two passes that `notify()`
            asks for: commits closer together than that are taken in one pass (one read, one
            transaction of the sink) instead of one pass each. Someone waiting in `wait_for`
            cuts the wait short.
        turn: where in each pass_interval this follower's passes start (seconds after each
            multiple of it on the event loop's clock; see `next_turn`). Followers gives the
            followers of a process turns spread over the interval.
        stretch: how many pass intervals to gather for now (the interval and the turn are
            multiplied by it); Followers stretches them while several domains are busy.
    """

    def __init__(
        self,
        domain: str,
        log: DomainLog,
        sink: Sink,
        *,
        batch_size: int = 500,
        poll_interval: float = 5.0,
        max_backoff: float = 30.0,
        pass_interval: float = PASS_INTERVAL_S,
        turn: float = 0.0,
        stretch: Callable[[], float] | None = None,
    ):
        self.domain = domain
        self.sink = sink
        self._log = log
        self._batch_size = batch_size
        self._batch = batch_size  # what the next read asks for
        self._poll_interval = poll_interval
        self._max_backoff = max_backoff
        self._pass_interval = pass_interval
        self._turn = turn
        self._stretch = stretch
        self._hurry = asyncio.Event()  # someone waits in wait_for: no gathering
        self.progress = Progress()
        self.failure: Failure | None = None
        self._read = 0  # the last version handed to the sink
        self._resumed = False
        self._lock = asyncio.Lock()  # one catch-up at a time
        self._poke = asyncio.Event()
        self._advanced = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    @property
    def turn(self) -> float:
        """Where in each pass interval this follower's passes start (seconds)."""
        return self._turn

    @property
    def position(self) -> int:
        """The log position of the last event the sink has applied."""
        return self.progress.position

    def notify(self) -> None:
        """The domain's log has grown."""
        self._poke.set()

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(
                self._run(), name=f"follow-{self.sink.name}-{self.domain}"
            )

    async def stop(self) -> None:
        """Stop following; a batch in flight is not applied (its sink rolls back)."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_for(self, position: int, timeout: float = 5.0) -> bool:
        """True once the sink has applied the domain's events up to `position`; False if that
        took over `timeout`. Without a background task the caller's own task catches up."""
        if self.position >= position:
            return True
        if self._task is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.catch_up(), timeout)
            return self.position >= position
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.position < position:
            self._hurry.set()
            self.notify()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), remaining)
        return True

    async def catch_up(self) -> int:
        """Apply the domain's log up to its end; return how many events were handed over.

        Raises:
            Stalled: an event cannot be taken (everything before it was applied).
            Exception: whatever the sink or the log raised; nothing of that batch was applied.
        """
        async with self._lock:
            handed = 0
            while True:
                if not self._resumed:
                    self._read, progress = await self.sink.resume(self.domain)
                    self._advance(progress)
                    self._resumed = True
                asked = self._batch
                batch = [r async for r in self._log.read(self.domain, self._read, asked)]
                if not batch:
                    return handed
                try:
                    progress = await self.sink.apply(self.domain, batch)
                except Rewound:
                    log.info(
                        "%s moved back (a rebuild, or a log that lost its tail); reading again",
                        self._name,
                    )
                    self._resumed = False
                    continue
                except Stalled as exc:
                    self._read = max(self._read, exc.progress.version)
                    self._advance(exc.progress)
                    raise
                self._read = batch[-1].version
                self._advance(progress)
                self._recovered()
                self._batch = min(self._batch_size, self._batch * 2)
                handed += len(batch)
                if len(batch) < asked:
                    # The log ended there when read: no second read to find it empty. What
                    # commits after that read notifies this follower again.
                    return handed

    async def refresh(self) -> None:
        """Ask the sink to look for outside changes (done on every quiet poll)."""
        async with self._lock:
            if self._resumed:
                try:
                    await self.sink.refresh(self.domain)
                except Rewound:
                    self._resumed = False

    # ---- internals ----

    @property
    def _name(self) -> str:
        return f"{self.sink.name} of domain {self.domain}"

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._poke.clear()
            self._hurry.clear()
            started = loop.time()
            try:
                await self.catch_up()
                self._recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping:
                    raise asyncio.CancelledError from exc  # a stop the driver reported as an error
                await asyncio.sleep(self._failed(exc))
                continue
            if self._stopping:
                # A cancel the pass swallowed (Python 3.11's wait_for can, when its call ends
                # as the cancel comes): without this, stop() waited out a poll interval.
                return
            try:
                await asyncio.wait_for(self._poke.wait(), self._poll_interval)
            except TimeoutError:
                with contextlib.suppress(Exception):  # a failure here shows on the next pass
                    await self.refresh()
                continue
            now = loop.time()
            stretch = self._stretch() if self._stretch is not None else 1.0
            interval, turn = self._pass_interval * stretch, self._turn * stretch
            gather = next_turn(started, now, interval, turn) - now
            if gather > 0 and not self._hurry.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), gather)

    def _failed(self, exc: Exception) -> float:
        """Record and log a failure; the seconds to wait before the next attempt."""
        attempts = 1 if self.failure is None else self.failure.attempts + 1
        if not isinstance(exc, Stalled):  # the batch may be what failed: try a smaller one
            self._batch = max(1, self._batch // 2)
        delay = min(self._max_backoff, 0.05 * 2**attempts)
        stalled = exc if isinstance(exc, Stalled) else None
        self.failure = Failure(
            sink=self.sink.name,
            domain=self.domain,
            after=self.position,
            position=stalled.position if stalled else None,
            cause=stalled.cause if stalled else f"{type(exc).__name__}: {exc}",
            attempts=attempts,
            since=time.monotonic() if self.failure is None else self.failure.since,
        )
        where = f"at position {stalled.position}" if stalled else f"after position {self.position}"
        log.warning(
            "%s stopped %s: %s (attempt %d; retrying in %.2f s)",
            self._name,
            where,
            self.failure.cause,
            attempts,
            delay,
            exc_info=attempts == 1 and _first_of_its_kind(exc),
        )
        return delay

    def _recovered(self) -> None:
        if self.failure is not None:
            log.warning("%s is moving again after %d failures", self._name, self.failure.attempts)
            self.failure = None

    def _advance(self, progress: Progress) -> None:
        if progress == self.progress:
            return
        self.progress = progress
        # Wake every wait_for; each re-checks the position against its own target.
        advanced, self._advanced = self._advanced, asyncio.Event()
        advanced.set()


#: The kinds of failure a traceback was logged for, in this process.
_TRACED: set[tuple[str, str]] = set()


def _first_of_its_kind(exc: Exception) -> bool:
    """Whether `exc` is the first failure of its kind (type, and cause for a Stalled) in this
    process: its traceback is said once, then a line per follower and attempt. A Postgres
    primary lost under four domains logged the same traceback for each of their dozen
    followers."""
    kind = (type(exc).__qualname__, type(exc.__cause__).__qualname__)
    if kind in _TRACED:
        return False
    _TRACED.add(kind)
    return True


def next_turn(started: float, now: float, interval: float, turn: float) -> float:
    """When a follower's next pass starts: on its turn (an instant `turn` seconds after a
    multiple of `interval`), no sooner than `interval` after its last pass `started`, nor
    before `now`.

    The passes of a process's followers all follow the same commits. Left to start when
    poked, the relay's and the projections' passes started together, and each such burst
    (two sinks' work and their Postgres sessions at once, on a machine of two cores) held
    up the intents committed meanwhile: the serial compose's tail. On turns spread over the
    interval they take the cores one after the other. A follower still passes at most once
    an interval, and a poke waits at most an interval for its pass (two, once, after a pass
    that `wait_for` started off its turn)."""
    earliest = max(started + interval, now)
    if interval <= 0:
        return earliest
    return earliest + (turn - earliest) % interval


# Each new follower's turn is the last one's plus this fraction of the interval (the golden
# ratio's): it lands in the largest gap the turns so far leave, so any number of followers
# stays spread over the interval without knowing how many will come.
_TURN_STEP = (5**0.5 - 1) / 2


def _unhurried(sink: Sink) -> float | None:
    """A sink with `poll_every` (seconds) is not woken by each commit but looks at its log
    that often: one that acts only every so many events (the checkpoints) then costs no read
    per commit."""
    every: float | None = getattr(sink, "poll_every", None)
    return every


class Followers:
    """Every follower of every domain an engine serves: one per (sink, domain).

    Args:
        log: reads each domain's events.
        sinks: what to keep up to date (the projections, the event relay).
        clock: seconds, for how long ago each domain was busy (monotonic).
        **options: passed to each Follower (batch_size, poll_interval, max_backoff,
            pass_interval).
    """

    def __init__(
        self,
        log: DomainLog,
        sinks: Sequence[Sink],
        *,
        clock: Callable[[], float] = time.monotonic,
        **options: float,
    ):
        self.sinks = {sink.name: sink for sink in sinks}
        self._log = log
        self._options = options
        self._clock = clock
        self._followers: dict[str, dict[str, Follower]] = {}
        self._asked: dict[str, float] = {}  # domain -> when a commit last asked for a pass
        self._stretched = 1.0  # as last counted
        self._recount_at = -math.inf  # when a busy domain counted then stops being busy
        self._turns = 0  # followers given a turn so far
        self._closed = False

    @property
    def domains(self) -> list[str]:
        return sorted(self._followers)

    def follow(self, domain: str) -> None:
        """Start following `domain` with every sink (nothing happens if already, or once closing:
        a second follower would fold the domain into the same sink beside the one draining)."""
        if domain in self._followers or self._closed:
            return
        followers = {
            name: Follower(
                domain,
                self._log,
                sink,
                stretch=self.stretch,
                **self._options_for(sink),  # type: ignore[arg-type]
            )
            for name, sink in self.sinks.items()
        }
        self._followers[domain] = followers
        for follower in followers.values():
            follower.start()

    async def unfollow(self, domain: str) -> None:
        if self._asked.pop(domain, None) is not None:
            self._recount_at = -math.inf
        for follower in self._followers.pop(domain, {}).values():
            await follower.stop()

    def notify(self, domain: str) -> None:
        """A commit: wake the domain's followers, except those of unhurried sinks."""
        followers = self._followers.get(domain)
        if followers is None:
            return
        now = self._clock()
        if self._asked.get(domain, -math.inf) <= now - BUSY_FOR_S:
            self._recount_at = now  # one busy domain more: count again
        self._asked[domain] = now
        for follower in followers.values():
            if _unhurried(follower.sink) is None:
                follower.notify()

    def stretch(self) -> float:
        """How many pass intervals a poked follower gathers for now: one per
        BUSY_DOMAINS_PER_INTERVAL domains a commit asked a pass of in the last BUSY_FOR_S,
        at least one and at most MAX_STRETCH."""
        now = self._clock()
        # Every follower asks at every pass: counted again only when the count may have
        # changed, so it costs nothing per pass however many domains there are.
        if now >= self._recount_at:
            since = now - BUSY_FOR_S
            self._asked = {d: at for d, at in self._asked.items() if at > since}
            busy = len(self._asked)
            self._stretched = min(MAX_STRETCH, max(1.0, busy / BUSY_DOMAINS_PER_INTERVAL))
            self._recount_at = min(self._asked.values(), default=math.inf) + BUSY_FOR_S
        return self._stretched

    def _options_for(self, sink: Sink) -> dict[str, float]:
        """A poked sink's follower gets the next turn; an unhurried one polls at its pace."""
        every = _unhurried(sink)
        if every is not None:
            return {**self._options, "poll_interval": every}
        interval = self._options.get("pass_interval", PASS_INTERVAL_S)
        turn = (self._turns * _TURN_STEP) % 1.0 * interval
        self._turns += 1
        return {**self._options, "turn": turn}

    def of(self, sink: str, domain: str) -> Follower | None:
        return self._followers.get(domain, {}).get(sink)

    async def wait_for(self, sink: str, domain: str, position: int, timeout: float = 5.0) -> bool:
        """True once `sink` has applied `domain` up to `position`; False after `timeout`, or at
        once when the domain is not followed here.

        The follower is looked up again every second: an engine that lost the domain and took
        it up again follows it with new followers, and the old ones never move."""
        if self.of(sink, domain) is None:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            follower = self.of(sink, domain)
            if follower is None:  # dropped; perhaps taken up again in a moment
                await asyncio.sleep(min(max(remaining, 0), 0.05))
            elif await follower.wait_for(position, min(max(remaining, 0), 1.0)):
                return True
            if loop.time() >= deadline:
                return False

    def failures(self) -> list[Failure]:
        """What holds any follower up now, by domain and sink."""
        return [
            f.failure
            for _, by_sink in sorted(self._followers.items())
            for _, f in sorted(by_sink.items())
            if f.failure is not None
        ]

    async def close(self, drain_timeout: float = 2.0) -> None:
        """Stop every follower, then give each a last catch-up (a clean exit leaves the stream
        complete); that gives up after `drain_timeout` seconds in all (NATS may be away)."""
        self._closed = True
        followers = [f for by_sink in self._followers.values() for f in by_sink.values()]
        self._followers.clear()
        for follower in followers:
            await follower.stop()
        if drain_timeout > 0 and followers:
            try:
                await asyncio.wait_for(_drain(followers), drain_timeout)
            except Exception as exc:
                log.warning("followers stopped before the end of the log: %r", exc)


async def _drain(followers: Iterable[Follower]) -> None:
    for follower in followers:
        await follower.catch_up()
