"""Test doubles of the engine's storage ports, in memory: the log, writer leases, snapshots.

They keep the rules the PostgreSQL schema enforces (expected version, hash chain, writer
fences, request ids once per domain, time that never goes back), checked by the same contract
suite as the PostgreSQL adapters (tests/store_contract.py), so the writer's and the engine's
behaviour can be tested in milliseconds. They are never a default and never the event store of
a running Trellis: nothing they hold survives the process.
"""

from trellis.adapters.memory.leases import MemoryLeases
from trellis.adapters.memory.log import MemoryLog
from trellis.adapters.memory.snapshots import MemorySnapshots

__all__ = ["MemoryLeases", "MemoryLog", "MemorySnapshots"]
