"""The in-memory doubles of the storage ports (adapters/memory) against the ports' contract
(tests/store_contract.py), the same suite PostgreSQL passes."""

from __future__ import annotations

import pytest
from store_contract import EventStoreContract, LeaseStoreContract, SnapshotStoreContract, Stores

from trellis.adapters.memory import MemoryLeases, MemoryLog, MemorySnapshots


@pytest.fixture
def stores() -> Stores:
    leases = MemoryLeases()
    log = MemoryLog(leases)
    return Stores(log=log, leases=leases, snapshots=MemorySnapshots(log))


class TestMemoryEventStore(EventStoreContract):
    pass


class TestMemoryLeaseStore(LeaseStoreContract):
    pass


class TestMemorySnapshotStore(SnapshotStoreContract):
    pass
