"""`program` for a fabric driver that makes one change per call: the changes one after
another, each awaited before the next (FabricDriver.program's contract, without batching)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from trellis.engine.core.fabric import FabricBinding, FabricChange, FabricCircuit


class OneChangeAtATime(Protocol):
    """The per-change half of the FabricDriver port."""

    def create_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> Awaitable[None]: ...

    def remove_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> Awaitable[None]: ...

    def bind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> Awaitable[None]: ...

    def unbind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> Awaitable[None]: ...


async def program_in_turn(
    driver: OneChangeAtATime,
    domain: str,
    changes: Sequence[FabricChange],
    *,
    fence: int | None = None,
    started: Callable[[FabricChange], None] | None = None,
) -> None:
    """Make each change with its own call, in order, stopping at the first that raises."""
    for change in changes:
        if started is not None:
            started(change)
        if change.circuit is not None:
            make = driver.create_circuit if change.op == "create_circuit" else driver.remove_circuit
            await make(domain, change.circuit, fence=fence)
        elif change.binding is not None:
            tie = driver.bind if change.op == "bind" else driver.unbind
            await tie(domain, change.binding, fence=fence)
