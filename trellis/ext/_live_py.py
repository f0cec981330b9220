"""Pure-Python twins of the compiled core's incremental surface, on top of the reference.

``LiveConditions`` holds the reference's ``Conditions`` mappings and changes them in place,
so ``_paths_py.best_paths`` reads it as it reads a ``Conditions``; ``best_devices`` is the
device choice spelt with ``best_paths`` and a sort. ``_live_c`` has the same names, methods
and errors; tests/property runs every test on both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._paths_py import Conditions, Fabric, Path, PathRequest, Selector, best_paths, selected

_NO_CHANGE = object()
_NO_CONDITIONS = Conditions()


class LiveConditions:
    """Conditions of one fabric, changed in place; see ``_live_c.LiveConditions``."""

    def __init__(self, fabric: Fabric, conditions: Conditions = _NO_CONDITIONS) -> None:
        self.fabric = fabric
        self._links = {key for _, _, key in fabric.graph.edges(keys=True)}
        self.unusable: set[str] = set(conditions.unusable)
        self.reserved_gbps: dict[str, float] = dict(conditions.reserved_gbps)
        self.circuits: dict[str, tuple[int, str]] = dict(conditions.circuits)
        self.switch_tenants: dict[str, dict[str, int]] = {
            k: dict(v) for k, v in conditions.switch_tenants.items()
        }
        self.exclusive_tenants: dict[str, dict[str, int]] = {
            k: dict(v) for k, v in conditions.exclusive_tenants.items()
        }
        self.taken: set[str] = set(conditions.taken)
        self.sliced_gib: dict[str, float] = dict(conditions.sliced_gib)
        self._tracked: dict[str, list[str]] = {}
        self._through: dict[str, dict[str, int]] = {}
        self._journal: list[tuple[Any, ...]] | None = None
        self._depth = 0

    # ---- the journal ----

    def checkpoint(self) -> int:
        """Start recording changes; ``rollback(mark)`` undoes every change since. Nestable."""
        if self._journal is None:
            self._journal = []
        self._depth += 1
        return len(self._journal)

    def rollback(self, mark: int) -> None:
        """Undo every change since ``checkpoint()`` returned ``mark``, and end that checkpoint."""
        if self._journal is None or self._depth == 0:
            raise ValueError("rollback without a checkpoint")
        journal = self._journal
        try:
            while len(journal) > mark:
                table, key, old = journal.pop()
                if table is self._tracked:
                    self._untrack(key)
                    if old is not _NO_CHANGE:
                        self._track(key, old)
                elif table is self.unusable or table is self.taken:
                    (table.add if old else table.discard)(key)
                elif old is _NO_CHANGE:
                    table.pop(key, None)
                else:
                    table[key] = old
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._journal = None

    def _record(self, table: Any, key: str) -> None:
        if self._journal is not None:
            if table is self.unusable or table is self.taken:
                self._journal.append((table, key, key in table))
            else:
                self._journal.append((table, key, table.get(key, _NO_CHANGE)))

    # ---- changes ----

    def set_usable(self, component: str, usable: bool) -> None:
        """Mark a node or link usable (healthy, undrained) or not.

        Raises:
            KeyError: no node or link of the fabric has that id.
        """
        if component not in self.fabric.graph and component not in self._links:
            raise KeyError(component)
        if (component in self.unusable) == bool(usable):
            self._record(self.unusable, component)
            (self.unusable.discard if usable else self.unusable.add)(component)

    def set_reserved(self, link: str, gbps: float) -> None:
        """Set the bandwidth reserved on a link (the reference's ``reserved_gbps[link]``)."""
        if link not in self._links:
            raise KeyError(link)
        self._record(self.reserved_gbps, link)
        self.reserved_gbps[link] = gbps

    def reserve(self, link: str, gbps: float) -> None:
        """Add to the bandwidth reserved on a link."""
        self.set_reserved(link, self.reserved(link) + gbps)

    def reserved(self, link: str) -> float:
        """The bandwidth reserved on a link."""
        if link not in self._links:
            raise KeyError(link)
        return self.reserved_gbps.get(link, 0.0)

    def set_taken(self, device: str, taken: bool) -> None:
        """Mark a device taken (held whole; no selector chooses it) or not.

        Raises:
            KeyError: no node of the fabric has that id.
        """
        if device not in self.fabric.graph:
            raise KeyError(device)
        if (device in self.taken) != bool(taken):
            self._record(self.taken, device)
            (self.taken.add if taken else self.taken.discard)(device)

    def set_sliced(self, device: str, gib: float) -> None:
        """Set the GiB sliced out of a memory device (0: none).

        Raises:
            KeyError: no node of the fabric has that id.
        """
        if device not in self.fabric.graph:
            raise KeyError(device)
        self._record(self.sliced_gib, device)
        if gib:
            self.sliced_gib[device] = gib
        else:
            self.sliced_gib.pop(device, None)

    def set_circuit(self, ocs: str, port: int, other: int, owner: str) -> None:
        """``circuits["<ocs>:<port>"] = (other, owner)``."""
        key = f"{ocs}:{port}"
        self._record(self.circuits, key)
        self.circuits[key] = (other, owner)

    def clear_circuit(self, ocs: str, port: int) -> None:
        """``<ocs>:<port>`` is in no circuit any more."""
        key = f"{ocs}:{port}"
        if key in self.circuits:
            self._record(self.circuits, key)
            del self.circuits[key]

    def add_circuit(self, ocs: str, a_port: int, b_port: int, owner: str) -> None:
        """A circuit a_port <-> b_port owned by ``owner``: both ports' entries."""
        self.set_circuit(ocs, a_port, b_port, owner)
        self.set_circuit(ocs, b_port, a_port, owner)

    def _set_tenants(self, table: dict[str, dict[str, int]], switch: str, tenants: Any) -> None:
        self._record(table, switch)
        if tenants:
            table[switch] = dict(tenants)
        else:
            table.pop(switch, None)

    def set_switch_tenants(self, switch: str, tenants: Mapping[str, int]) -> None:
        """Tenants with live paths through ``switch`` (the reference's ``switch_tenants``)."""
        self._set_tenants(self.switch_tenants, switch, tenants)

    def set_exclusive_tenants(self, switch: str, tenants: Mapping[str, int]) -> None:
        """Tenants holding ``switch`` exclusively (the reference's ``exclusive_tenants``)."""
        self._set_tenants(self.exclusive_tenants, switch, tenants)

    def hold_switch(self, switch: str, tenant: str, exclusive: bool) -> None:
        """One more path of ``tenant`` through ``switch``; held exclusively if ``exclusive``."""
        for table, applies in ((self.switch_tenants, True), (self.exclusive_tenants, exclusive)):
            if applies:
                counts = dict(table.get(switch, {}))
                counts[tenant] = counts.get(tenant, 0) + 1
                self._set_tenants(table, switch, counts)

    # ---- blast radius: which tracked paths pass a component ----

    def _known(self, component: str) -> str:
        if component not in self.fabric.graph and component not in self._links:
            raise KeyError(component)
        return component

    def _track(self, key: str, components: list[str]) -> None:
        self._tracked[key] = components
        for c in components:
            keys = self._through.setdefault(c, {})
            keys[key] = keys.get(key, 0) + 1

    def _untrack(self, key: str) -> None:
        for c in self._tracked.pop(key, []):
            keys = self._through[c]
            keys[key] -= 1
            if not keys[key]:
                del keys[key]
                if not keys:
                    del self._through[c]

    def track(self, key: str, nodes: Sequence[str], links: Sequence[str]) -> None:
        """Record that ``key`` (a composition, say) has a path over ``nodes`` and ``links``;
        tracking a key again adds to what it passes.

        Raises:
            KeyError: a node or link the fabric lacks.
        """
        added = [self._known(c) for c in [*nodes, *links]]
        old = self._tracked.get(key)
        if self._journal is not None:
            self._journal.append((self._tracked, key, _NO_CHANGE if old is None else list(old)))
        self._untrack(key)
        self._track(key, (old or []) + added)

    def untrack(self, key: str) -> None:
        """``key`` has no paths any more."""
        old = self._tracked.get(key)
        if old is not None:
            if self._journal is not None:
                self._journal.append((self._tracked, key, list(old)))
            self._untrack(key)

    def through(self, component: str) -> list[str]:
        """The tracked keys whose paths pass ``component`` (its blast radius), sorted.

        Raises:
            KeyError: no node or link of the fabric has that id.
        """
        return sorted(self._through.get(self._known(component), ()))


def best_devices(
    fabric: Fabric,
    conditions: Conditions | LiveConditions,
    request: PathRequest,
    ranked: Mapping[str, int] | Selector,
    n: int = 1,
) -> list[Path]:
    """The best ``n`` target devices by (hops, latency, rank, id) of their best paths.

    ``ranked`` maps each candidate device to its policy rank (section 5: device choice), or
    is a ``Selector``: the candidates are then the fabric's devices it admits under these
    conditions, each with its ``DeviceInfo.rank``.

    Raises:
        PathError: the host is unknown, not a host, or unusable.
    """
    if isinstance(ranked, Selector):
        ranked = selected(fabric.devices, conditions.taken, conditions.sliced_gib, ranked)
    if n <= 0:
        best_paths(fabric, conditions, request, set())  # type: ignore[arg-type]  # host checks
        return []
    paths = best_paths(fabric, conditions, request, set(ranked))  # type: ignore[arg-type]
    order = sorted(paths.values(), key=lambda p: (p.hops, p.latency_ns, ranked[p.device], p.device))
    return order[:n]
