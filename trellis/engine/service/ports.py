"""Ports: the small Protocols the engine needs from the outside world (cosmicpython's style).

The core never imports an adapter; `adapters.bootstrap` wires concrete ones in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import Literal, Protocol

import msgspec

from trellis.engine.core import replies
from trellis.engine.core.fabric import FabricBinding, FabricChange, FabricCircuit, FabricSnapshot
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent
from trellis.engine.core.results import (
    CheckpointKeyResult,
    CheckpointResult,
    CompositionResult,
    Connection,
    ConsistencyResult,
    Interval,
    ProofResult,
    WhyResult,
)
from trellis.engine.service.follower import Failure


class StoredReply(msgspec.Struct, frozen=True, kw_only=True):
    """The committed answer to one request_id, kept to answer a resend."""

    actor: str
    request_id: str
    verb: str
    body_hash: str
    reply: bytes


class PendingReply(msgspec.Struct, frozen=True, kw_only=True):
    """An answer to store with a batch. For a success `body` is the encoded result object and the
    store wraps it with the position of batch event `event_index` (None: the position the domain
    had before the batch); for a recorded rejection `body` is the whole error reply."""

    actor: str
    request_id: str
    verb: str
    body_hash: str
    ok: bool
    body: bytes
    event_index: int | None = None


def reply_position(expected: Head, reply: PendingReply, positions: dict[int, int]) -> int:
    """The position a stored answer carries: its batch event's (`positions` maps the batch's
    versions to their positions), or the head's before the batch."""
    if reply.event_index is None:
        return expected.position
    return positions[expected.version + reply.event_index + 1]


def stored_replies(
    expected: Head, pending: Sequence[PendingReply], positions: dict[int, int]
) -> list[StoredReply]:
    """The answers an append stores, as every EventStore renders them: a success wrapped in
    its ok envelope with its position, a recorded rejection as it is."""
    return [
        StoredReply(
            actor=p.actor,
            request_id=p.request_id,
            verb=p.verb,
            body_hash=p.body_hash,
            reply=replies.ok(p.body, reply_position(expected, p, positions)) if p.ok else p.body,
        )
        for p in pending
    ]


class Appended(msgspec.Struct, frozen=True):
    events: list[RecordedEvent]
    replies: list[StoredReply]
    head: Head


class EventStore(Protocol):
    """The append-only log plus the request-id table, in one database."""

    async def domains(self) -> list[str]: ...

    async def head(self, domain: str) -> Head: ...

    async def last_position(self) -> int:
        """The highest position the log has given an event of any domain (0: none yet)."""
        ...

    async def locate(self, domain: str, at: datetime | int) -> tuple[Head, datetime] | None:
        """The domain's last event at or before `at` (a time, or a log position) and its time;
        None when the domain had no event yet then."""
        ...

    def read(
        self, domain: str, after_version: int = 0, limit: int | None = None
    ) -> AsyncIterator[RecordedEvent]: ...

    async def find_replies(
        self, domain: str, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], StoredReply]: ...

    async def append(
        self,
        domain: str,
        expected: Head,
        events: Sequence[PendingEvent],
        replies: Sequence[PendingReply],
        fence: int | None = None,
    ) -> Appended:
        """Append atomically after `expected`, under the writer epoch `fence`; raise
        ConcurrencyConflict, WriterFenced (another engine holds the domain's lease now),
        EventRefused (the log refuses an event's content) or StoreUnavailable."""
        ...

    async def barrier(self) -> None:
        """Return once everything committed before the call is as durable as an append: in
        PostgreSQL, a commit of our own that waits for the synchronous standby, as an append's
        does. A commit whose wait for the standby was cancelled stays on the primary alone;
        an answer read back from the log must not be given before this covers it.
        Raises StoreUnavailable."""
        ...


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A fold of one domain as of one event (engine/service/snapshots.py)."""

    domain: str
    kind: Literal["state", "read_models"]
    version: int
    position: int
    hash: str  # the chain hash of event `version`, which the log must still hold
    recorded_at: datetime  # of that event: the writer's clock never goes back before it
    format: str
    body: bytes

    @property
    def head(self) -> Head:
        return Head(self.version, self.position, self.hash)


class SnapshotStore(Protocol):
    """Snapshots of domains' folds (engine/service/snapshots.py), outside the log."""

    async def save(self, snapshot: Snapshot) -> None: ...

    def candidates(
        self, domain: str, kind: str, *, at_most_version: int | None = None
    ) -> AsyncIterator[Snapshot]:
        """The domain's snapshots of `kind` at or below `at_most_version`, newest first, each
        checked first: one whose event the log does not hold with that position and hash, or
        (in a store others can write, PostgreSQL) whose seal by the checkpoint key does not
        verify, is skipped, with a warning."""
        ...


class Holder(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds a domain's writer lease now."""

    domain: str
    engine: str  # the holding engine's id
    epoch: int


class LeaseStore(Protocol):
    """Writer leases, one per domain, each with an epoch that every append is checked against
    (the store refuses an append under a stale epoch). Times are the store's own clock."""

    async def heartbeat(
        self, engine: str, name: str, ttl: float, *, serves_all: bool = True
    ) -> list[str]:
        """Say `engine` is alive; the ids of every engine alive now (heartbeat within `ttl`)
        that serves every domain. An engine limited to some domains says `serves_all=False`:
        it takes no part in spreading the others."""
        ...

    async def acquire(self, domain: str, engine: str, ttl: float, at_least: int = 0) -> int | None:
        """Take the domain's lease for `ttl` seconds if nobody holds it (or its holder's lease
        ran out): the new epoch, the next one and at least `at_least`; None if another engine
        holds it."""
        ...

    async def renew(self, engine: str, domains: Sequence[str], ttl: float) -> dict[str, int]:
        """Extend `engine`'s leases on `domains` that it still holds: domain -> epoch."""
        ...

    async def release(self, domain: str, engine: str, epoch: int) -> None:
        """Give the lease up at once (a clean stop, a hand-over)."""
        ...

    async def holders(self) -> list[Holder]:
        """Every lease held now (not run out)."""
        ...

    async def leave(self, engine: str) -> None:
        """`engine` stops: its heartbeat goes."""
        ...


class Clock(Protocol):
    def now(self) -> datetime: ...


class Reserved(msgspec.Struct, frozen=True, kw_only=True):
    """The live reservation holding a device whole, as the engine's state has it: what `why`
    says of a device that holds nothing and yet is not free (the projections keep no
    reservations)."""

    reservation_id: str
    tenant: str
    expires_at: datetime


class PastModels(Protocol):
    """The answers of the history-bearing queries (`composition`, `connections`, `why`,
    `history`), live or as of one past event.

    Rows are the Structs of engine/core/results.py (the shapes of ARCHITECTURE section 4).
    """

    async def composition(self, domain: str, composition_id: str) -> CompositionResult | None: ...

    async def connections(
        self,
        domain: str,
        *,
        host: str | None = None,
        tenant: str | None = None,
        device: str | None = None,
    ) -> list[Connection]: ...

    async def why(
        self,
        domain: str,
        target: str,
        *,
        viewer: str | None = None,
        reserved: Reserved | None = None,
    ) -> WhyResult | None:
        """What `target` (device, host, composition or link) is connected to, the chain of
        events that made it so, and one plain sentence; None if the id is unknown. With
        `viewer`, as that tenant's view tells it (engine/core/views.py): only its own connections
        and their events, and another tenant's composition is unknown. `reserved`: the
        reservation holding the device target at that moment, if one does."""
        ...

    async def history(
        self,
        domain: str,
        *,
        id: str | None = None,
        tenant: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> list[Interval]:
        """The connection history (section 4's `history`): one row per interval a device was
        bound to a composition, of `id` (device, host or composition) and `tenant`, that
        overlaps [since, until]; in the order they began."""
        ...


class ReadModels(PastModels, Protocol):
    """Projections the queries `composition`, `connections`, `why` and `history` answer
    from, now and (`past`) as of any earlier event."""

    async def past(self, domain: str, head: Head) -> PastModels:
        """The answers right after the domain's event `head`, exactly as they were then."""
        ...

    async def wait_for(self, domain: str, position: int, timeout: float = 5.0) -> bool:
        """Block until the domain's projections include `position`; False if that took too
        long."""
        ...

    def holdup(self, domain: str) -> Failure | None:
        """What keeps the domain's projections from following its log, if anything."""
        ...


class AuditTrail(Protocol):
    """The log's signed Merkle checkpoints and their proofs (engine/core/merkle.py,
    engine/core/checkpoints.py; ARCHITECTURE §6 "Tamper evidence")."""

    async def answer(
        self, domain: str, query: msgspec.Struct, *, head: int, viewer: str | None = None
    ) -> ProofResult | ConsistencyResult | CheckpointKeyResult:
        """Answer a `proof`, `consistency` or `checkpoint-key` query over the domain's first
        `head` events; with `viewer`, as that tenant's view.

        Raises:
            IntentRejected: bad input (an unknown event, a size beyond the log, ...).
            StoreUnavailable: the store cannot be read now.
        """
        ...

    async def checkpoint(self, domain: str, size: int) -> CheckpointResult:
        """Record and publish the signed checkpoint of the domain's first `size` events (or
        the one recorded before).

        Raises:
            IntentRejected: `unavailable` when it was recorded but could not be published.
            StoreUnavailable: the store cannot be written now.
        """
        ...


class FabricDriver(Protocol):
    """Programs the physical fabric. Every operation is idempotent (doing it twice is doing it
    once), so a saga interrupted by a crash can simply be driven again. Failures raise
    `FabricError`; a call that does not finish within the engine's deadline is abandoned and
    compensated.

    `fence` is the caller's writer epoch for the domain (engine.service.ports.LeaseStore): the
    driver refuses, with WriterFenced, a call whose fence is below the highest it has seen for that
    domain, so an engine that lost its lease (paused past it, say) can no longer program the
    hardware. A real driver checks it at the resource (a controller-side token, or a
    compare-and-set on the device's state). None: a tool's call, not fenced."""

    async def create_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None: ...

    async def remove_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None: ...

    async def bind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> None: ...

    async def unbind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> None: ...

    async def snapshot(self, domain: str, *, fence: int | None = None) -> FabricSnapshot: ...

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        """Make `changes` in their order; return once all of them hold. Raise `FabricError` at
        the first that fails (those before it may hold; nothing after it is tried).

        `started` is told each change as the driver begins it, so a caller that stops
        waiting knows where the driver was; when `program` raises, the last change told is
        the one that failed. A driver that can make several changes in one request or one
        durable write does (the simulated fabric writes them once); one that cannot makes
        them one after another (adapters.fabric.in_turn)."""
        ...


SagaOutcome = Literal["established", "failed"]
#: Why an engine stopped writing a domain: its own stop, a lease renewal refused, a hand-over
#: to the engine the placement prefers, a lease that ran out while it was paused, or a refusal
#: by the log or the fabric of an epoch another writer superseded.
DropReason = Literal["stopping", "lease_lost", "handed_over", "lease_ran_out", "fenced"]


class Telemetry(Protocol):
    """What the engine reports about its own work, as plain numbers; an adapter turns them
    into metrics (adapters/instruments.py). Called on the event loop, so it must not block."""

    def decided(self, verb: str, seconds: float) -> None:
        """One intent was decided (engine.core.decide), taking `seconds`."""
        ...

    def committed(self, domain: str, requests: int, seconds: float) -> None:
        """One group commit: `requests` requests in one transaction that took `seconds`."""
        ...

    def settled(self, domain: str, outcome: SagaOutcome) -> None:
        """A compose saga's outcome was recorded."""
        ...

    def began_writing(self, domain: str, epoch: int) -> None:
        """This engine began writing `domain` under writer lease `epoch`."""
        ...

    def stopped_writing(self, domain: str, reason: DropReason) -> None:
        """This engine stopped writing `domain`."""
        ...


class NoTelemetry:
    """Telemetry that goes nowhere (an engine without metrics)."""

    def decided(self, verb: str, seconds: float) -> None:
        pass

    def committed(self, domain: str, requests: int, seconds: float) -> None:
        pass

    def settled(self, domain: str, outcome: SagaOutcome) -> None:
        pass

    def began_writing(self, domain: str, epoch: int) -> None:
        pass

    def stopped_writing(self, domain: str, reason: DropReason) -> None:
        pass
