"""What a fabric holds, in the engine's words: bindings, circuits and a snapshot of both, and
the changes a driver makes to them.

The FabricDriver port (engine/service/ports.py) speaks them; the pure plan
(engine.core.fabric_plan) compares them with the log.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class FabricBinding(msgspec.Struct, frozen=True, kw_only=True):
    """A device bound to a host over a path, as the hardware holds it."""

    host: str
    device: str
    path: list[str]
    composition_id: str
    capacity_gib: float | None = None  # a slice of a memory pool, which other hosts share


class FabricCircuit(msgspec.Struct, frozen=True, kw_only=True):
    """A cross-connect programmed inside an OCS (a_port < b_port)."""

    ocs: str
    a_port: int
    b_port: int


class FabricSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What the hardware of one domain holds now; compared with the log by tests and audits.
    `findings`: what the driver saw on the fabric and cannot explain (a resource of another
    client holding one of this domain's devices, a tagged resource it cannot map), one
    sentence each; it never touches those."""

    circuits: list[FabricCircuit]
    bindings: list[FabricBinding]
    findings: list[str] = []


FabricOp = Literal["create_circuit", "remove_circuit", "bind", "unbind"]


class FabricChange(msgspec.Struct, frozen=True, kw_only=True):
    """One change to the hardware, as `FabricDriver.program` takes a list of them: a circuit
    made or taken away, or a binding made or taken away."""

    op: FabricOp
    circuit: FabricCircuit | None = None
    binding: FabricBinding | None = None

    @property
    def target(self) -> str:
        """What the change is made on, as a failure report names it."""
        if self.circuit is not None:
            return f"{self.circuit.ocs}:{self.circuit.a_port}-{self.circuit.b_port}"
        return self.binding.device if self.binding is not None else ""
