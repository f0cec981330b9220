"""What the hardware of a domain should hold, and what to change so it does (pure).

The log is the truth and the fabric follows it. `reconcile(snapshot, state)` compares what the
hardware holds with what the state says and lists the operations that close the gap. Pending
compositions are the compose saga's business (engine.service.saga): reconciling neither programs nor
removes anything that belongs to them, so the saga can undo exactly what it did.
"""

from __future__ import annotations

import msgspec

from trellis.engine.core.fabric import FabricBinding, FabricCircuit, FabricSnapshot
from trellis.engine.core.state import Composition, DomainState

BindingKey = tuple[str, str]  # (device, composition_id): a memory pool holds one slice each


class Reconciliation(msgspec.Struct, frozen=True, kw_only=True):
    """Operations in the order they must run: removals free ports and devices first."""

    unbind: list[FabricBinding] = []
    remove: list[FabricCircuit] = []
    create: list[FabricCircuit] = []
    bind: list[FabricBinding] = []
    pending: list[str] = []  # compositions waiting for their saga, oldest id first

    @property
    def in_step(self) -> bool:
        """True when the hardware already holds what the settled compositions need."""
        return not (self.unbind or self.remove or self.create or self.bind)


def circuits_of(composition: Composition) -> list[FabricCircuit]:
    """Every cross-connect the composition's paths pass, each once, in a stable order."""
    keys = {(c.ocs, c.a_port, c.b_port) for b in composition.bindings for c in b.circuits}
    return [FabricCircuit(ocs=o, a_port=a, b_port=b) for o, a, b in sorted(keys)]


def bindings_of(composition: Composition) -> list[FabricBinding]:
    return [
        FabricBinding(
            host=composition.host,
            device=b.device,
            path=list(b.path),
            composition_id=composition.id,
            capacity_gib=b.capacity_gib,
        )
        for b in composition.bindings
    ]


def reconcile(snapshot: FabricSnapshot, state: DomainState) -> Reconciliation:
    """The operations that make `snapshot` hold what `state` says, pending compositions aside.

    Read the snapshot before the state: the fabric only ever follows committed events, so the
    state is then at least as new as anything the snapshot shows.
    """
    pending = sorted(cid for cid, c in state.compositions.items() if c.state == "pending")
    settled = [c for c in state.compositions.values() if c.state != "pending"]
    wanted_bindings = {(b.device, b.composition_id): b for c in settled for b in bindings_of(c)}
    known_keys = {
        (b.device, cid) for cid, c in state.compositions.items() for b in c.bindings
    }  # pending ones included: those stay as the saga left them
    wanted_circuits = {c for comp in settled for c in circuits_of(comp)}
    known_circuits = {
        FabricCircuit(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port) for c in state.circuits.values()
    }
    held_bindings = {(b.device, b.composition_id): b for b in snapshot.bindings}
    held_circuits = set(snapshot.circuits)

    stale = {
        key
        for key, held in held_bindings.items()
        if key not in known_keys or (key in wanted_bindings and wanted_bindings[key] != held)
    }
    still_bound = held_bindings.keys() - stale
    return Reconciliation(
        unbind=[held_bindings[key] for key in sorted(stale)],
        remove=_ordered(held_circuits - known_circuits),
        create=_ordered(wanted_circuits - held_circuits),
        bind=[b for key, b in sorted(wanted_bindings.items()) if key not in still_bound],
        pending=pending,
    )


def _ordered(circuits: set[FabricCircuit]) -> list[FabricCircuit]:
    return sorted(circuits, key=lambda c: (c.ocs, c.a_port, c.b_port))
