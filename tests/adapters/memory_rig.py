"""An engine on the in-memory stores (adapters/memory), asked in-process: the writer's and the
engine's behaviour (group commit, request ids, read-your-writes, lease loss) in milliseconds.

The stores keep the rules the PostgreSQL schema enforces (tests/store_contract.py runs both);
`InProcessClient` speaks the subjects of ARCHITECTURE §3 straight to `Engine.handle`, as the
NATS intake does. No read models here: queries answered from state, the audit trail aside.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from trellis.adapters.clock import SystemClock
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.memory import MemoryLeases, MemoryLog, MemorySnapshots
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent
from trellis.engine.service.ports import Appended, Clock, PendingReply, StoredReply
from trellis.engine.service.router import Engine


class CountingLog(MemoryLog):
    """A MemoryLog that counts its appends (one per group commit) and its look-ups."""

    def __init__(self, leases: MemoryLeases | None = None):
        super().__init__(leases)
        self.appends = 0
        self.look_ups = 0  # find_replies calls: the writer's look-ups of stored answers

    async def find_replies(
        self, domain: str, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], StoredReply]:
        self.look_ups += 1
        return await super().find_replies(domain, keys)

    async def append(
        self,
        domain: str,
        expected: Head,
        events: Sequence[PendingEvent],
        replies: Sequence[PendingReply],
        fence: int | None = None,
    ) -> Appended:
        appended = await super().append(domain, expected, events, replies, fence)
        self.appends += 1
        return appended

    def counts(self) -> tuple[int, int]:
        """(events, stored request ids), as the PostgreSQL tests count rows."""
        return len(self._log), sum(len(held) for held in self._replies.values())

    def all_events(self) -> list[RecordedEvent]:
        return list(self._log)

    def event_types(self, domain: str) -> list[str]:
        return [e.type for e in self._domains.get(domain, [])]


class InProcessClient:
    """TrellisClient's calls (raw, admin, intent, query), answered by `Engine.handle`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._ids = 0

    async def raw(self, subject_tail: str, body: bytes) -> dict[str, Any]:
        match subject_tail.split("."):
            case ["intent", domain, tenant, verb]:
                answer = await self.engine.handle("intent", domain, tenant, verb, body)
            case ["admin", domain, verb]:
                answer = await self.engine.handle("admin", domain, None, verb, body)
            case ["query", domain, verb]:
                answer = await self.engine.handle("query", domain, None, verb, body)
            case ["view", domain, tenant, verb]:
                answer = await self.engine.handle("query", domain, tenant, verb, body)
            case _:
                raise AssertionError(f"not a subject of the contract: {subject_tail}")
        reply: dict[str, Any] = msgspec.json.decode(answer)
        return reply

    async def admin(self, domain: str, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.raw(f"admin.{domain}.{verb}", self._with_request_id(body))

    async def intent(
        self, domain: str, tenant: str, verb: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        return await self.raw(f"intent.{domain}.{tenant}.{verb}", self._with_request_id(body))

    async def query(
        self, domain: str, what: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return await self.raw(f"query.{domain}.{what}", msgspec.json.encode(body or {}))

    def _with_request_id(self, body: dict[str, Any]) -> bytes:
        if "request_id" not in body:
            self._ids += 1
            body = {"request_id": f"r-{self._ids}", **body}
        return msgspec.json.encode(body)


class Rig(msgspec.Struct, kw_only=True):
    engine: Engine
    log: CountingLog
    leases: MemoryLeases
    fabric: SimulatedFabric
    client: InProcessClient


@contextlib.asynccontextmanager
async def in_memory(
    *,
    log: CountingLog | None = None,
    leases: MemoryLeases | None = None,
    fabric: SimulatedFabric | None = None,
    clock: Clock | None = None,
    with_leases: bool = False,
    **engine_options: Any,
) -> AsyncIterator[Rig]:
    """An engine on memory stores (shared with another rig when given), started, then closed.
    `with_leases`: it writes a domain only under a writer lease, fenced by the log."""
    leases = leases or MemoryLeases()
    log = log or CountingLog(leases)
    fabric = fabric or SimulatedFabric()
    engine = Engine(
        log,
        clock or SystemClock(),
        fabric,
        leases=leases if with_leases else None,
        snapshots=MemorySnapshots(log),
        **engine_options,
    )
    await engine.start(lease_tick_seconds=None)
    try:
        yield Rig(
            engine=engine, log=log, leases=leases, fabric=fabric, client=InProcessClient(engine)
        )
    finally:
        await engine.close()
