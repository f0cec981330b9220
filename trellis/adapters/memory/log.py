"""engine.service.ports.EventStore in memory, keeping the rules the PostgreSQL log enforces:

- an append follows the head it expected (version and hash), else ConcurrencyConflict;
- a request id is stored once per domain and actor, else ConcurrencyConflict;
- under a writer lease, the append's epoch must be the lease's and the lease running
  (MemoryLeases.fence_refusal), else WriterFenced, for events and stored answers alike;
- `recorded_at` never goes back along a domain, else EventRefused;
- an append is all or nothing, and positions are global and gap-free.

Each call yields to the event loop once, as a round trip to a database would, so intents that
arrive together still meet in the writer's queue and commit as one batch. `available = False`
makes every call raise StoreUnavailable (an outage).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import datetime

from trellis.adapters.memory.leases import MemoryLeases
from trellis.engine.core.errors import (
    ConcurrencyConflict,
    EventRefused,
    StoreUnavailable,
    WriterFenced,
)
from trellis.engine.core.ids import is_valid_id
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent, hash_of
from trellis.engine.service.ports import Appended, PendingReply, StoredReply, stored_replies


class MemoryLog:
    """The append-only log and the request-id table of one process."""

    def __init__(self, leases: MemoryLeases | None = None):
        self._leases = leases
        self._log: list[RecordedEvent] = []  # every domain's events, in position order
        self._domains: dict[str, list[RecordedEvent]] = {}
        self._replies: dict[str, dict[tuple[str, str], StoredReply]] = {}
        self.available = True

    async def _round_trip(self) -> None:
        await asyncio.sleep(0)
        if not self.available:
            raise StoreUnavailable("the in-memory store is switched off")

    async def domains(self) -> list[str]:
        await self._round_trip()
        return sorted(self._domains)

    async def head(self, domain: str) -> Head:
        await self._round_trip()
        return self._head(domain)

    def _head(self, domain: str) -> Head:
        events = self._domains.get(domain)
        if not events:
            return Head()
        last = events[-1]
        return Head(last.version, last.position, last.hash)

    def event(self, domain: str, version: int) -> RecordedEvent | None:
        """The domain's event at `version`, if the log holds one."""
        events = self._domains.get(domain, [])
        return events[version - 1] if 0 < version <= len(events) else None

    async def last_position(self) -> int:
        await self._round_trip()
        return self._log[-1].position if self._log else 0

    async def locate(self, domain: str, at: datetime | int) -> tuple[Head, datetime] | None:
        await self._round_trip()
        found = None
        for event in self._domains.get(domain, []):
            moment = event.position if isinstance(at, int) else event.recorded_at
            if moment > at:  # type: ignore[operator]  # int with int, datetime with datetime
                break
            found = event
        if found is None:
            return None
        return Head(found.version, found.position, found.hash), found.recorded_at

    async def read(
        self, domain: str, after_version: int = 0, limit: int | None = None
    ) -> AsyncIterator[RecordedEvent]:
        await self._round_trip()
        events = self._domains.get(domain, [])[after_version:]
        for event in events if limit is None else events[:limit]:
            yield event

    async def read_all(self, after_position: int = 0) -> AsyncIterator[RecordedEvent]:
        await self._round_trip()
        for event in self._log[after_position:]:
            yield event

    async def find_replies(
        self, domain: str, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], StoredReply]:
        await self._round_trip()
        held = self._replies.get(domain, {})
        return {key: held[key] for key in keys if key in held}

    async def barrier(self) -> None:
        await self._round_trip()  # memory has no standby: everything is as durable as it gets

    async def append(
        self,
        domain: str,
        expected: Head,
        events: Sequence[PendingEvent],
        replies: Sequence[PendingReply],
        fence: int | None = None,
    ) -> Appended:
        await self._round_trip()
        # Every check before anything changes: the append is all or nothing.
        if not is_valid_id(domain):
            raise EventRefused(f"domain {domain!r} is not an id")
        if self._leases is not None and (why := self._leases.fence_refusal(domain, fence)):
            raise WriterFenced(domain, why)
        head = self._head(domain)
        if head != expected:
            raise ConcurrencyConflict(domain, expected.version, head.version)
        held = self._replies.get(domain, {})
        keys = [(r.actor, r.request_id) for r in replies]
        if len(set(keys)) != len(keys) or any(key in held for key in keys):
            raise ConcurrencyConflict(domain, expected.version, head.version)
        previous = self._domains[domain][-1].recorded_at if head.version else None
        recorded: list[RecordedEvent] = []
        prev_hash, version, position = head.hash, head.version, len(self._log)
        for pending in events:
            if previous is not None and pending.recorded_at < previous:
                raise EventRefused(
                    f"event {version + 1} of {domain} is recorded at {pending.recorded_at}, "
                    f"before its predecessor ({previous})"
                )
            previous = pending.recorded_at
            version, position = version + 1, position + 1
            digest = hash_of(pending, prev_hash, domain, version)
            recorded.append(
                RecordedEvent(
                    id=pending.id,
                    domain=domain,
                    version=version,
                    position=position,
                    type=pending.type,
                    schema_version=pending.schema_version,
                    recorded_at=pending.recorded_at,
                    actor=pending.actor,
                    causation_id=pending.causation_id,
                    correlation_id=pending.correlation_id,
                    data=pending.data,
                    prev_hash=prev_hash,
                    hash=digest,
                )
            )
            prev_hash = digest
        positions = {e.version: e.position for e in recorded}
        answers = stored_replies(expected, replies, positions)
        self._log.extend(recorded)
        self._domains.setdefault(domain, []).extend(recorded)
        self._replies.setdefault(domain, {}).update({(a.actor, a.request_id): a for a in answers})
        new_head = Head(version, position, prev_hash) if recorded else expected
        return Appended(recorded, answers, new_head)
