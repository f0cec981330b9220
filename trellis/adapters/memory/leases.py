"""engine.service.ports.LeaseStore in memory, with schema/008's rules: a lease is taken when free or
run out, each take draws the next epoch, renewals reach only leases still running.

Times come from one monotonic clock (injectable, so tests can run a lease out without
sleeping), as the PostgreSQL store uses only the database's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec

from trellis.engine.service.ports import Holder


class _Lease(msgspec.Struct):
    holder: str
    epoch: int
    expires_at: float


class _Engine(msgspec.Struct):
    serves_all: bool
    heartbeat_at: float


class MemoryLeases:
    """Writer leases and engine heartbeats; `epoch_of` is what a MemoryLog fences against."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._engines: dict[str, _Engine] = {}

    async def heartbeat(
        self, engine: str, name: str, ttl: float, *, serves_all: bool = True
    ) -> list[str]:
        now = self._clock()
        self._engines[engine] = _Engine(serves_all=serves_all, heartbeat_at=now)
        return sorted(
            e for e, row in self._engines.items() if row.serves_all and row.heartbeat_at > now - ttl
        )

    async def acquire(self, domain: str, engine: str, ttl: float, at_least: int = 0) -> int | None:
        now = self._clock()
        lease = self._leases.get(domain)
        if lease is not None and lease.expires_at > now:
            return None
        epoch = max(1 if lease is None else lease.epoch + 1, at_least)
        self._leases[domain] = _Lease(holder=engine, epoch=epoch, expires_at=now + ttl)
        return epoch

    async def renew(self, engine: str, domains: Sequence[str], ttl: float) -> dict[str, int]:
        now = self._clock()
        renewed = {}
        for domain in domains:
            lease = self._leases.get(domain)
            if lease is not None and lease.holder == engine and lease.expires_at > now:
                lease.expires_at = now + ttl
                renewed[domain] = lease.epoch
        return renewed

    async def release(self, domain: str, engine: str, epoch: int) -> None:
        lease = self._leases.get(domain)
        if lease is not None and (lease.holder, lease.epoch) == (engine, epoch):
            lease.expires_at = self._clock()

    async def holders(self) -> list[Holder]:
        now = self._clock()
        return [
            Holder(domain=d, engine=lease.holder, epoch=lease.epoch)
            for d, lease in sorted(self._leases.items())
            if lease.expires_at > now
        ]

    async def leave(self, engine: str) -> None:
        self._engines.pop(engine, None)

    def fence_refusal(self, domain: str, fence: int | None) -> str | None:
        """Why an append under `fence` must be refused (schema/008's trellis_check_fence), or
        None: a domain nobody leased yet takes any append."""
        lease = self._leases.get(domain)
        if lease is None:
            return None
        if fence != lease.epoch or lease.expires_at <= self._clock():
            return f"an append with writer epoch {fence} while epoch {lease.epoch} holds the lease"
        return None
