"""A domain's single writer: group commit, request ids, replies only after commit.

Everything that reaches a domain's log goes through its DomainWriter, which drains its queue in
batches: each batch is decided in arrival order on a scratch state and committed in one
transaction together with its request ids; only then does anyone hear back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

import msgspec

from trellis.engine.core import replies
from trellis.engine.core.actors import ENGINE
from trellis.engine.core.context import Context
from trellis.engine.core.decide import decide
from trellis.engine.core.errors import (
    ConcurrencyConflict,
    DomainUnreadable,
    EventRefused,
    IntentRejected,
    StoreUnavailable,
    WriterFenced,
)
from trellis.engine.core.events import MAX_EVENT_BYTES, Event
from trellis.engine.core.intents import ImportTopology, Intent
from trellis.engine.core.records import Head, PendingEvent
from trellis.engine.core.state import DomainState, evolve
from trellis.engine.service import snapshots
from trellis.engine.service.ports import (
    Clock,
    EventStore,
    NoTelemetry,
    PendingReply,
    SnapshotStore,
    StoredReply,
    Telemetry,
)
from trellis.engine.service.snapshots import STATE_FORMAT, state_of

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
# Told of each commit: the state before it, the state after it, and the events it appended.
OnCommit = Callable[[DomainState, DomainState, Sequence[Event]], None]
REMEMBERED = 10_000  # request keys a writer keeps of its own recent commits


class Request(msgspec.Struct, kw_only=True):
    actor: str
    verb: str
    intent: Intent
    body_hash: str
    reply: asyncio.Future[bytes]
    correlation_id: str | None = None  # default: the request id

    @property
    def key(self) -> tuple[str, str]:
        return (self.actor, self.intent.request_id)


class DomainWriter:
    """The single writer of one domain's stream, for one writer epoch.

    Args:
        fence: the writer epoch of this engine's lease on the domain; every append carries it,
            and the log refuses it once another engine has taken the lease over.
        holds: whether the lease is still ours by our own clock; checked before each batch, so
            an engine resumed after a pause stops before it even tries.
        reclaim: asked when `holds` says no: renew the lease now if the store still has it
            ours (the event loop was merely held up); True when it did.
        on_fenced: called once the lease is found lost (by `holds` or by the log).
        telemetry: told how long each decision and each group commit took, and its size.
    """

    def __init__(
        self,
        domain: str,
        store: EventStore,
        clock: Clock,
        max_batch: int,
        on_commit: OnCommit | None = None,
        *,
        fence: int | None = None,
        holds: Callable[[], bool] | None = None,
        reclaim: Callable[[], Awaitable[bool]] | None = None,
        on_fenced: Callable[[], None] | None = None,
        snapshots: SnapshotStore | None = None,
        snapshot_every: int = 0,
        telemetry: Telemetry | None = None,
    ):
        self.domain = domain
        self._telemetry = telemetry or NoTelemetry()
        self.fence = fence
        self._holds = holds
        self._reclaim = reclaim
        self._on_fenced = on_fenced
        self._on_commit = on_commit
        self.state = DomainState(domain=domain)
        self.head = Head()
        self._store = store
        self._clock = clock
        self._max_batch = max_batch
        self._queue: asyncio.Queue[Request] = asyncio.Queue()
        self._stale = True  # must catch up from the log before the next decision
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        # The time of the last event: the next is never recorded before it, even when this
        # engine's clock is behind the previous writer's (ARCHITECTURE §6).
        self._last_time: datetime | None = None
        self._snapshots = snapshots
        self._snapshot_every = snapshot_every
        self._saving: set[asyncio.Task[None]] = set()
        # The request keys this writer committed lately: a request among them is a resend,
        # looked up before anything is decided (see _commit_batch).
        self._answered: OrderedDict[tuple[str, str], None] = OrderedDict()
        # The events of the append in flight, until it ends: the fabric saga holds back what
        # it would let go while a reservation is on its way to carry it (FabricSync).
        self.appending: Sequence[Event] = ()

    async def catch_up(self) -> None:
        """Fold every event after our head into the state (start, or after a lost race); at
        start, from the newest usable snapshot."""
        state, head, last_time = self.state, self.head, self._last_time
        if head.version and not await self._log_holds(head):
            # The log lost what we folded last: a promoted standby never had the commits
            # whose wait for it was given up. Fold the log as it stands, from the start.
            log.warning(
                "domain %s: the log no longer holds version %d that this writer folded (a "
                "failover to a standby without it?); reading the domain again",
                self.domain,
                head.version,
            )
            state, head, last_time = DomainState(domain=self.domain), Head(), None
        if head.version == 0 and self._snapshots is not None:
            candidates = self._snapshots.candidates(self.domain, "state")
            found = await snapshots.first_usable(candidates, STATE_FORMAT, state_of)
            if found is not None:
                taken, state = found
                head, last_time = taken.head, taken.recorded_at
        async for recorded in self._store.read(self.domain, after_version=head.version):
            try:
                event = recorded.event()
            except Exception as exc:  # written by a newer engine, or damaged
                raise DomainUnreadable(
                    self.domain, recorded.position, f"{recorded.type}: {exc}"
                ) from exc
            state = evolve(state, event)
            head = Head(recorded.version, recorded.position, recorded.hash)
            last_time = recorded.recorded_at
        self.state, self.head, self._last_time, self._stale = state, head, last_time, False

    async def _log_holds(self, head: Head) -> bool:
        """Whether the log's event at `head.version` is the one we folded there."""
        async for recorded in self._store.read(self.domain, head.version - 1, limit=1):
            return recorded.hash == head.hash
        return False

    async def request(
        self,
        actor: str,
        verb: str,
        intent: Intent,
        family: str,
        correlation_id: str | None = None,
    ) -> bytes:
        """Queue one intent for the next batch; the reply, once its batch has committed.
        Closed (a router that found this writer just before its domain was dropped), it
        answers `unavailable` at once: nothing would ever take the request off the queue."""
        if self._closing:
            return self._stopped()
        request = Request(
            actor=actor,
            verb=verb,
            intent=intent,
            body_hash=body_hash(family, verb, intent),
            reply=asyncio.get_running_loop().create_future(),
            correlation_id=correlation_id,
        )
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"writer-{self.domain}")
        self._queue.put_nowait(request)
        return await request.reply

    async def close(self) -> None:
        """Stop writing; whoever still waits hears `unavailable` (and resends elsewhere)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._saving, return_exceptions=True)
        stopped = self._stopped()
        while not self._queue.empty():
            _answer(self._queue.get_nowait(), stopped)

    def _stopped(self) -> bytes:
        return replies.error(
            "unavailable",
            f"this engine stopped writing domain {self.domain!r}; resend with the same request_id",
            {"domain": self.domain},
        )

    async def _run(self) -> None:
        # Stopping is read from our own flag: a cancellation that surfaced as a store error
        # was answered as `unavailable`, and `cancelling()` cannot be trusted on Python 3.11.
        while not self._closing:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._commit_isolating_failures(batch)

    async def _commit_isolating_failures(self, batch: list[Request]) -> None:
        """Commit the batch; if it fails unexpectedly, retry its requests one by one so a
        single poisonous request cannot take the others down with it."""
        try:
            await self._commit_batch(batch)
            return
        except DomainUnreadable as exc:
            # The log holds an event this code cannot fold: nothing can be decided here until
            # the code can read it, and every client hears why.
            log.warning("domain %s cannot be served: %s", self.domain, exc)
            self._stale = True
            details = {"domain": self.domain, "position": exc.position, "cause": exc.cause}
            _answer_all(batch, replies.error("unavailable", str(exc), details))
            return
        except Exception as exc:  # a bug must not kill the writer; the clients get an answer
            if self._closing:
                # asyncpg may surface a cancellation inside a dying transaction as another
                # error; swallowing it would make close() wait forever.
                raise
            incident = secrets.token_hex(4)
            log.exception(
                "domain %s: batch of %d failed (incident %s)", self.domain, len(batch), incident
            )
            self._stale = True
            failure = exc
        if len(batch) == 1:
            _answer_all(batch, self._failed(failure, incident))
            return
        for request in batch:
            await self._commit_isolating_failures([request])

    def _failed(self, exc: Exception, incident: str) -> bytes:
        """The answer to a lone request whose commit failed unexpectedly."""
        if isinstance(exc, EventRefused):
            # Validation let through what the log refuses: the request itself is at fault, and
            # a resend would be refused again.
            return replies.error("invalid", f"the event log refused this request's events: {exc}")
        what = f"domain {self.domain!r} could not commit this request"
        return replies.internal_failure(what, exc, incident)

    async def _commit_batch(self, batch: list[Request]) -> None:
        for attempt in range(3):
            try:
                if not await self._still_ours():
                    raise WriterFenced(self.domain, "its lease ran out")
                if self._stale:
                    await self.catch_up()
                # A batch of new requests is decided without looking up stored answers: the
                # log's unique request ids catch a resend of one answered by another writer (a
                # conflict: nothing is written) and the retry looks up. Most commits save the
                # look-up's round trip. A resend of what this writer committed, and an import
                # (deciding one again costs as much as its size), are looked up first.
                look_up = attempt > 0 or any(
                    r.key in self._answered or isinstance(r.intent, ImportTopology) for r in batch
                )
                await self._decide_and_append(batch, look_up=look_up)
                return
            except WriterFenced as exc:
                # Another engine writes the domain now: nothing of this batch was committed,
                # and a resend reaches the new writer.
                log.warning("%s", exc)
                _answer_all(
                    batch,
                    replies.error(
                        "unavailable",
                        f"this engine no longer writes domain {self.domain!r}; resend with the "
                        "same request_id",
                        {"domain": self.domain},
                    ),
                )
                if self._on_fenced is not None:
                    self._on_fenced()
                return
            except ConcurrencyConflict as exc:
                # Another engine wrote to this domain: re-read the log and decide again.
                log.info("domain %s: %s; catching up", self.domain, exc)
                self._stale = True
            except StoreUnavailable as exc:
                # The commit may or may not have happened; the log is the truth, so re-read it
                # before deciding anything else. Clients retry with the same request_id.
                self._stale = True
                _answer_all(batch, replies.error("unavailable", f"event store unavailable: {exc}"))
                return
        _answer_all(batch, replies.error("unavailable", "too much write contention; retry"))

    async def _still_ours(self) -> bool:
        """Whether the lease is ours: by our own count, or else by a renewal out of turn."""
        if self._holds is None or self._holds():
            return True
        return self._reclaim is not None and await self._reclaim()

    async def _decide_and_append(self, batch: list[Request], *, look_up: bool) -> None:
        stored = (
            await self._store.find_replies(self.domain, [r.key for r in batch]) if look_up else {}
        )
        state = self.state
        events: list[PendingEvent] = []
        typed: list[Event] = []  # the same events, for whoever is told of the commit
        pending: list[PendingReply] = []
        # Per request: the final reply now, or ("first" | "resend", index into `pending`).
        answers: list[bytes | tuple[str, int]] = []
        first_in_batch: dict[tuple[str, str], int] = {}
        now = self._clock.now()
        if self._last_time is not None and now < self._last_time:
            now = self._last_time
        for req in batch:
            earlier = stored.get(req.key)
            index = first_in_batch.get(req.key)
            if earlier is not None:
                answers.append(_resend(earlier.body_hash, earlier.reply, req))
                continue
            if index is not None:
                same = pending[index].body_hash == req.body_hash
                answers.append(("resend", index) if same else _conflict(req))
                continue
            ctx = Context(domain=self.domain, actor=req.actor, verb=req.verb, now=now)
            started = time.perf_counter()
            try:
                decision = decide(state, req.intent, ctx)
            except IntentRejected as exc:
                answers.append(replies.rejection(exc))
                continue
            finally:
                self._telemetry.decided(req.verb, time.perf_counter() - started)
            cause = req.intent.request_id
            follow_up = decision.engine_from
            own_events = decision.events if follow_up is None else decision.events[:follow_up]
            decided = [
                PendingEvent.of(
                    event,
                    actor=req.actor,
                    causation_id=cause,
                    correlation_id=req.correlation_id or cause,
                    at=now,
                )
                for event in own_events
            ]
            if follow_up is not None:
                # The engine's follow-up, with no trace of the intent that allowed it: not its
                # actor, and not its request id, nor one derived from it (a hash can be
                # reversed by guessing). The log's next versions, in the same commit, are
                # where an operator finds it.
                freed = f"freed-{secrets.token_hex(12)}"
                decided += [
                    PendingEvent.of(
                        event, actor=ENGINE, causation_id=freed, correlation_id=freed, at=now
                    )
                    for event in decision.events[follow_up:]
                ]
            largest = max((len(e.data) for e in decided), default=0)
            if largest > MAX_EVENT_BYTES:  # the stream could never carry it: record nothing
                answers.append(replies.rejection(_too_large(req.verb, largest)))
                continue
            for event in decision.events:
                state = evolve(state, event)
            # The reply's position is its own last event's, not the engine's follow-up after
            # it: a release's reply names its CompositionReleased as `composition` does, and
            # tells the releasing tenant nothing of another's repair.
            own = len(events) + len(own_events)
            events.extend(decided)
            typed.extend(decision.events)
            first_in_batch[req.key] = len(pending)
            answers.append(("first", len(pending)))
            pending.append(
                PendingReply(
                    actor=req.actor,
                    request_id=req.intent.request_id,
                    verb=req.verb,
                    body_hash=req.body_hash,
                    # A recorded rejection (no_capacity, no_path) is stored like any answer.
                    ok=decision.error is None,
                    body=(
                        _encode(decision.result)
                        if decision.error is None
                        else replies.rejection(decision.error)
                    ),
                    event_index=own - 1 if own else None,
                )
            )
        if not look_up and any(isinstance(answer, bytes) for answer in answers):
            # An answer that writes nothing (a refusal) cannot let the log catch a resend: a
            # request already answered must get its first answer, not one decided on a state
            # that holds its own effects. Decide the batch again, answers looked up first.
            await self._decide_and_append(batch, look_up=True)
            return
        committed: list[StoredReply] = []
        if not pending and any(r.key in stored for r in batch):
            # Answers read back from the log, and nothing to commit that would cover them: the
            # first time they were committed, the wait for the standby may have been cancelled.
            await self._store.barrier()
        if pending:
            started = time.perf_counter()
            self.appending = typed
            try:
                appended = await self._store.append(
                    self.domain, self.head, events, pending, fence=self.fence
                )
            finally:
                self.appending = ()
            self._telemetry.committed(self.domain, len(batch), time.perf_counter() - started)
            before, version = self.state, self.head.version
            self.state, self.head, committed = state, appended.head, appended.replies
            self._remember([(p.actor, p.request_id) for p in pending])
            if events:
                self._last_time = now
                self._snapshot(version)
                if self._on_commit is not None:
                    self._on_commit(before, state, typed)  # e.g. wake the projection runner
        # Only now, after the commit, does anyone hear back.
        for req, ans in zip(batch, answers, strict=True):
            if isinstance(ans, bytes):
                _answer(req, ans)
            else:
                kind, index = ans
                reply = committed[index].reply
                _answer(req, replies.as_replayed(reply) if kind == "resend" else reply)

    def _remember(self, keys: list[tuple[str, str]]) -> None:
        """Note request keys just committed, forgetting the oldest past REMEMBERED."""
        for key in keys:
            self._answered[key] = None
        while len(self._answered) > REMEMBERED:
            self._answered.popitem(last=False)

    def _snapshot(self, before: int) -> None:
        """Save a snapshot of the state in the background when this commit reached a multiple
        of `snapshot_every` versions (a failed save costs only a longer fold later)."""
        every, store = self._snapshot_every, self._snapshots
        if store is None or not every or self.head.version // every == before // every:
            return
        state, head, at = self.state, self.head, self._last_time
        assert at is not None

        async def save() -> None:
            try:
                # The state is immutable: encoding it in a thread cannot race the writer.
                taken = await asyncio.to_thread(snapshots.of_state, state, head, at)
                await store.save(taken)
            except Exception as exc:
                log.warning(
                    "domain %s: snapshot at version %d not saved: %s",
                    self.domain,
                    head.version,
                    exc,
                )

        task = asyncio.create_task(save(), name=f"snapshot-{self.domain}")
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)


def body_hash(family: str, verb: str, intent: Intent) -> str:
    """Hash of the decoded body, so key order and whitespace do not make a resend 'different'."""
    return hashlib.sha256(f"{family}.{verb}\n".encode() + _encode(intent)).hexdigest()


def _resend(first_hash: str, first_reply: bytes, req: Request) -> bytes:
    return replies.as_replayed(first_reply) if first_hash == req.body_hash else _conflict(req)


def _too_large(verb: str, size: int) -> IntentRejected:
    return IntentRejected(
        "invalid",
        f"this {verb} would record an event of {size:,} bytes; an event must fit one message of "
        f"the event stream (at most {MAX_EVENT_BYTES:,} bytes): ask for less at once",
        {"event_bytes": size, "limit": MAX_EVENT_BYTES},
    )


def _conflict(req: Request) -> bytes:
    rid = req.intent.request_id
    return replies.error(
        "conflict",
        f"request_id {rid!r} was already used with a different body",
        {"request_id": rid},
    )


def _answer(req: Request, reply: bytes) -> None:
    if not req.reply.done():
        req.reply.set_result(reply)


def _answer_all(batch: list[Request], reply: bytes) -> None:
    for req in batch:
        _answer(req, reply)
