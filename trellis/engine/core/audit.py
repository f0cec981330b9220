"""What `trellis verify` checks in the log itself, purely: the hash chain and the invariants.

`ChainCheck` recomputes each domain's sha256 chain with `engine.core.records.hash_of` (the writer's
own definition of the hash) and reports every event whose version, link or hash is wrong, or
that goes back in time or in position;
`CheckpointCheck` recomputes the Merkle root of every stored checkpoint from the log, and checks
each stored signed note with the deployment's verifier keys (the old and the new after a key
rotation: any one of them may have signed it).

`InvariantAudit` is deliberately written apart from the engine: it folds the raw JSON objects of
the events (dicts, as `json.loads` gives them), not the msgspec Structs and not
`engine.core.state.evolve`, so a bug there (a release that forgets a reservation, a decoder that
drops a field) cannot hide itself by being used to check itself. It keeps only what the
invariants need (ARCHITECTURE §1, §5, §8):

- `device_double_allocation`: a whole device is held by at most one live composition or live
  reservation, and a memory device is either held whole by one or sliced, at most once per
  composition (a reservation's devices pass to the composition it is applied as);
- `memory_over_capacity`: the slices of a memory device, compositions' and reservations',
  never add up to more than its capacity_gib;
- `link_over_capacity`: the bandwidth live paths reserve on a link never exceeds its
  capacity_gbps;
- `ocs_port_reuse`: an OCS port is in at most one circuit;
- `exclusive_shared_switch`: no PCIe switch (node kind `switch`) on an exclusive
  composition's path carries another tenant's live path;
- `active_without_path`: a composition turns active only when every device it holds has a
  `PathEstablished` (or was put on its path by a repair: `PathRerouted`, `DeviceReplaced`).

A composition is live from `CompositionRequested` until `CompositionReleased` or
`CompositionFailed`, which return everything it held (`LeaseExpired` is followed by the
release). A reservation is live from `ReservationMade` until `ReservationApplied`,
`ReservationCancelled` or `ReservationExpired`. Each finding names the invariant, the domain
and the first position where it happens; one violation (the same device, link, port or
switch) is reported once.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec

from trellis.engine.core.checkpoints import NoteError, Verifier, open_checkpoint_by_any, origin_of
from trellis.engine.core.merkle import MerkleTree, leaf_hash
from trellis.engine.core.records import GENESIS_HASH, RecordedEvent, hash_of

# Sums of floats (GiB, Gbps) are compared with this slack, as the engine's own counts are.
_EPSILON = 1e-9


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One thing `trellis verify` found wrong: which check, where, and a sentence saying what.

    `position` and `version` name the first event where it shows (0 when it is about no event,
    e.g. a projection row); `key` names a projection row or KV key; `details` the rest. Every
    key is always present in the report (null, 0 or {} when it does not apply), so a script
    can read `f["position"]` of any finding."""

    check: str
    domain: str
    message: str
    position: int = 0
    version: int = 0
    table: str | None = None
    key: str | None = None
    details: dict[str, Any] = {}


# ---- the hash chain ----


class ChainCheck:
    """Feed one domain's events in version order; `findings` lists every event that breaks
    the chain. After a bad event the check goes on from its stored hash, so each tampered row
    is named on its own and not every event after it."""

    def __init__(self, domain: str):
        self.domain = domain
        self.findings: list[Finding] = []
        self.version = 0
        self.position = 0
        self.hash = GENESIS_HASH
        self.count = 0
        self._recorded_at: datetime | None = None

    def feed(self, event: RecordedEvent) -> None:
        self.count += 1
        problems: list[tuple[str, str]] = []
        if event.version != self.version + 1:
            problems.append(("version_gap", self._version_gap(event.version)))
        if event.prev_hash != self.hash:
            if self.version == 0:
                problems.append(("genesis", "the first event does not follow the genesis hash"))
            else:
                problems.append(
                    ("broken_link", f"prev_hash is not the hash of version {self.version}")
                )
        expected = hash_of(event, event.prev_hash, self.domain, event.version)
        if event.hash != expected:
            problems.append(("hash_mismatch", "its hash is not the sha256 of its contents"))
        if self._recorded_at is not None and event.recorded_at < self._recorded_at:
            problems.append(("time_order", "recorded_at is earlier than the event before"))
        # The hash does not cover the position (ARCHITECTURE §6), so only this order shows
        # rows whose positions were swapped.
        if event.position <= self.position:
            why = f"its position is not after position {self.position} of version {self.version}"
            problems.append(("position_order", why))
        for check, why in problems:
            self.findings.append(
                Finding(
                    check=check,
                    domain=self.domain,
                    position=event.position,
                    version=event.version,
                    message=f"event {event.version} (position {event.position}): {why}",
                )
            )
        self.version, self.position, self.hash = event.version, event.position, event.hash
        self._recorded_at = event.recorded_at

    def _version_gap(self, version: int) -> str:
        """Why `version` cannot follow the last version fed, naming the versions missing."""
        if version <= self.version:
            return f"version {version} repeats or goes back from version {self.version}"
        first, last = self.version + 1, version - 1
        missing = f"version {first} is" if first == last else f"versions {first}-{last} are"
        after = f"follows version {self.version}" if self.version else "is the first"
        return f"version {version} {after}: {missing} missing"

    def head_finding(self, version: int, position: int, hash_: str) -> Finding | None:
        """A finding when the stored stream head (trellis_streams) is not where the chain
        ends."""
        if (version, position, hash_) == (self.version, self.position, self.hash):
            return None
        return Finding(
            check="stream_head",
            domain=self.domain,
            position=self.position,
            version=self.version,
            message=(
                f"the stream head says version {version} at position {position}, the log ends "
                f"at version {self.version} (position {self.position})"
                + ("" if hash_ == self.hash else " with another hash")
            ),
        )


class StoredCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A row of `trellis_checkpoints` as stored: the tree size, the base64 root and the signed
    note the engine published (engine/core/checkpoints.py), and when it was recorded."""

    size: int
    root: str
    note: str
    recorded_at: datetime | None = None


class CheckpointCheck:
    """The domain's stored Merkle checkpoints against its log: feed the events in version
    order; each checkpoint's root must be the RFC 9162 root of the first `size` event hashes
    (engine/core/merkle.py, ARCHITECTURE §6), and no checkpoint may be of more events than the
    log holds. A stored checkpoint is a promise the engine made to the outside world, so a log
    that no longer keeps it was rewritten after it was made.

    The `root` column is no more than a copy, which whoever rewrites the log can rewrite too;
    what the engine promised is its signed note. Given the deployment's `verifiers`, each note
    must verify with one of them (`checkpoints.open_checkpoint_by_any`: a key rotation leaves
    notes of the old key before those of the new) and say the row's origin, size and root
    (`note_findings`), and the log must give the root the note signed."""

    def __init__(
        self,
        domain: str,
        checkpoints: Iterable[StoredCheckpoint],
        verifiers: Iterable[Verifier] = (),
    ):
        self.domain = domain
        self._stored = sorted(checkpoints, key=lambda c: c.size)
        self._notes: list[Finding] = []
        # The signed (size, base64 root) the log must give, where they are not the row's.
        self._signed: list[tuple[int, str]] = []
        self._verifiers = tuple(dict.fromkeys(verifiers))
        if self._verifiers:
            for stored in self._stored:
                self._open(stored)
        self._tree = MerkleTree()
        self._sizes = {c.size for c in self._stored} | {size for size, _ in self._signed}
        self._at: dict[int, int] = {}  # size -> position of the event that completes it

    def feed(self, event: RecordedEvent) -> None:
        try:
            leaf = bytes.fromhex(event.hash)
        except ValueError:
            leaf = b""
        self._tree.append(leaf_hash(leaf))
        if self._tree.size in self._sizes:
            self._at[self._tree.size] = event.position

    def findings(self) -> list[Finding]:
        """Each stored row whose root the log does not give."""
        return [
            finding
            for c in self._stored
            if (finding := self._against_log(c.size, c.root, "the checkpoint")) is not None
        ]

    def note_findings(self) -> list[Finding]:
        """Each note that does not verify or does not say what its row says, and each signed
        root the log does not give (empty without verifiers: nothing was checked)."""
        signed = [
            finding
            for size, root in self._signed
            if (finding := self._against_log(size, root, "the signed note")) is not None
        ]
        return [*self._notes, *signed]

    def _open(self, stored: StoredCheckpoint) -> None:
        where = f"the note of the checkpoint of {stored.size} events"
        try:
            signed, _ = open_checkpoint_by_any(stored.note, self._verifiers)
        except NoteError as exc:
            keys = " or ".join(verifier.key() for verifier in self._verifiers)
            self._note(stored, f"{where} does not verify with {keys}: {exc}")
            return
        said = {
            "origin": signed.origin,
            "size": str(signed.size),
            "root": base64.b64encode(signed.root).decode(),
        }
        row = {"origin": origin_of(self.domain), "size": str(stored.size), "root": stored.root}
        differ = [what for what in said if said[what] != row[what]]
        if differ:
            self._note(
                stored,
                f"{where} signed {', '.join(f'{w} {said[w]}' for w in differ)}; the row says "
                f"{', '.join(f'{w} {row[w]}' for w in differ)}",
                {"signed": said, "row": row},
            )
        # The engine's promise about this log, checked against the log whether or not the row
        # agrees: when both were kept and the log changed, the chain check names the row's
        # root and this check the signed one (both fail, each for its own reason).
        if signed.origin == row["origin"]:
            self._signed.append((signed.size, said["root"]))

    def _note(
        self, stored: StoredCheckpoint, message: str, more: dict[str, Any] | None = None
    ) -> None:
        self._notes.append(
            Finding(
                check="checkpoint_note",
                domain=self.domain,
                version=stored.size,
                message=message,
                details={"size": stored.size, "root": stored.root, **(more or {})},
            )
        )

    def _against_log(self, size: int, root: str, what: str) -> Finding | None:
        """A finding when the log's first `size` events do not give `root` (base64)."""
        if size > self._tree.size:
            return Finding(
                check="checkpoint",
                domain=self.domain,
                version=size,
                message=f"{what} of {size} events is stored, but the log holds {self._tree.size}",
                details={"size": size, "root": root},
            )
        computed = base64.b64encode(self._tree.root(size)).decode()
        if computed == root:
            return None
        return Finding(
            check="checkpoint",
            domain=self.domain,
            position=self._at[size],
            version=size,
            message=f"{what} of {size} events has root {root}; the log's first {size} events "
            f"give {computed}",
            details={"size": size, "root": root, "log_root": computed},
        )


# ---- the invariants, over raw event data ----


@dataclass
class _Composition:
    tenant: str
    exclusive: bool
    # device -> its binding as stored: {device, kind, path, links, bandwidth_gbps, capacity_gib}
    bindings: dict[str, dict[str, Any]] = field(default_factory=dict)
    established: set[str] = field(default_factory=set)
    activated: bool = False


@dataclass
class _Node:
    kind: str
    capacity_gib: float | None = None


class InvariantAudit:
    """One domain's independent invariant audit; `feed` each event in version order."""

    def __init__(self, domain: str, *, limit: int = 1000):
        self.domain = domain
        self.findings: list[Finding] = []
        self._limit = limit
        self._reported: set[tuple[str, str]] = set()
        self._nodes: dict[str, _Node] = {}
        self._links: dict[str, float] = {}  # link -> capacity_gbps
        # An import in parts: the first parts' nodes and links, until its last part.
        self._staged: tuple[dict[str, _Node], dict[str, float]] = ({}, {})
        self._compositions: dict[str, _Composition] = {}
        self._whole: dict[str, str] = {}  # device held whole -> composition
        self._slices: dict[str, dict[str, float]] = {}  # memory device -> composition -> GiB
        # Live reservations: their bindings, and what they hold (whole, and slices).
        self._reservations: dict[str, list[dict[str, Any]]] = {}
        self._reserved_whole: dict[str, str] = {}  # device -> reservation
        self._reserved_slices: dict[str, dict[str, float]] = {}  # device -> reservation -> GiB
        self._reserved: dict[str, float] = {}  # link -> Gbps reserved by live paths
        self._ports: dict[tuple[str, int], tuple[int, int]] = {}  # (ocs, port) -> its circuit
        self._switch_paths: dict[str, dict[str, int]] = {}  # switch -> tenant -> live paths
        self._exclusive_paths: dict[str, dict[str, int]] = {}  # same, exclusive ones only
        self._position = 0
        self._version = 0

    def feed(self, position: int, version: int, type_: str, data: dict[str, Any]) -> None:
        self._position, self._version = position, version
        handler = getattr(self, f"_on_{type_}", None)
        if handler is None:
            return
        try:
            handler(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # A payload without the fields its type has: damage, or a forger's mistake.
            self._report(
                "malformed_event",
                f"{position}",
                f"{type_} lacks what its type carries ({type(exc).__name__}: {exc})",
                {"type": type_},
            )

    # -- topology --

    def _on_TopologyImported(self, data: dict[str, Any]) -> None:
        nodes = {n["id"]: _node(n) for n in data.get("nodes", [])}
        links = {lk["id"]: float(lk["capacity_gbps"]) for lk in data.get("links", [])}
        part, parts = data.get("part", 1), data.get("parts", 1)
        if part > 1:  # a later part of one import: with the parts before it
            nodes, links = self._staged[0] | nodes, self._staged[1] | links
        if part < parts:
            self._staged = (nodes, links)
            return
        self._staged = ({}, {})
        self._nodes, self._links = nodes, links
        for link in self._links:
            self._check_link(link)

    def _on_NodeAdded(self, data: dict[str, Any]) -> None:
        node = data["node"]
        self._nodes[node["id"]] = _node(node)

    def _on_LinkAdded(self, data: dict[str, Any]) -> None:
        link = data["link"]
        self._links[link["id"]] = float(link["capacity_gbps"])
        self._check_link(link["id"])

    def _on_ComponentRemoved(self, data: dict[str, Any]) -> None:
        component = data["component"]
        if data.get("kind") == "node":
            self._nodes.pop(component, None)
            for link in data.get("links", []):
                self._links.pop(link, None)
        else:
            self._links.pop(component, None)

    # -- circuits --

    def _on_CircuitCreated(self, data: dict[str, Any]) -> None:
        ocs, a, b = data["ocs"], int(data["a_port"]), int(data["b_port"])
        for port in sorted({a, b}):
            taken = self._ports.get((ocs, port))
            if taken is not None:
                self._report(
                    "ocs_port_reuse",
                    f"{ocs}:{port}",
                    f"port {port} of {ocs} is put in circuit {a}-{b} while it is in circuit "
                    f"{taken[0]}-{taken[1]}",
                    {"ocs": ocs, "port": port, "circuit": [a, b], "held_by": list(taken)},
                )
        if a == b:
            self._report(
                "ocs_port_reuse",
                f"{ocs}:{a}",
                f"circuit {a}-{b} of {ocs} uses port {a} twice",
                {"ocs": ocs, "port": a, "circuit": [a, b]},
            )
        self._ports[(ocs, a)] = self._ports[(ocs, b)] = (a, b)

    def _on_CircuitRemoved(self, data: dict[str, Any]) -> None:
        ocs, a, b = data["ocs"], int(data["a_port"]), int(data["b_port"])
        for port in (a, b):
            if self._ports.get((ocs, port)) == (a, b):
                del self._ports[(ocs, port)]

    # -- compositions --

    def _on_CompositionRequested(self, data: dict[str, Any]) -> None:
        constraints = (data.get("request") or {}).get("constraints") or {}
        self._compositions[data["composition_id"]] = _Composition(
            tenant=data["tenant"], exclusive=constraints.get("isolation") == "exclusive"
        )

    def _on_DevicesReserved(self, data: dict[str, Any]) -> None:
        cid = data["composition_id"]
        for binding in data.get("devices", []):
            self._hold(cid, binding)

    def _on_PathEstablished(self, data: dict[str, Any]) -> None:
        composition = self._compositions.get(data["composition_id"])
        if composition is not None:
            composition.established.add(data["device"])

    def _on_PathRerouted(self, data: dict[str, Any]) -> None:
        self._swap(data["composition_id"], data["device"], data["binding"])

    def _on_DeviceReplaced(self, data: dict[str, Any]) -> None:
        self._swap(data["composition_id"], data["old_device"], data["binding"])

    def _on_CompositionActivated(self, data: dict[str, Any]) -> None:
        cid = data["composition_id"]
        composition = self._compositions.get(cid)
        if composition is None:
            return
        missing = sorted(set(composition.bindings) - composition.established)
        if missing:
            self._report(
                "active_without_path",
                cid,
                f"composition {cid} is activated without a PathEstablished for "
                f"{', '.join(missing)}",
                {"composition_id": cid, "devices": missing},
            )
        composition.activated = True

    def _on_CompositionReleased(self, data: dict[str, Any]) -> None:
        self._end(data["composition_id"])

    def _on_CompositionFailed(self, data: dict[str, Any]) -> None:
        self._end(data["composition_id"])

    # -- reservations --

    def _on_ReservationMade(self, data: dict[str, Any]) -> None:
        rid = data["reservation_id"]
        bindings = list(data.get("devices", []))
        for binding in bindings:
            device = binding["device"]
            gib = binding.get("capacity_gib")
            holders = self._holders(device, whole=gib is None)
            if holders:
                self._report(
                    "device_double_allocation",
                    device,
                    f"{device} is reserved by reservation {rid} while "
                    f"{', '.join(holders)} holds it",
                    {"device": device, "holders": [*holders, f"reservation {rid}"]},
                )
            if gib is None:
                self._reserved_whole[device] = rid
            else:
                pool = self._reserved_slices.setdefault(device, {})
                pool[rid] = pool.get(rid, 0.0) + float(gib)
                self._check_pool(device)
        self._reservations[rid] = bindings

    def _on_ReservationApplied(self, data: dict[str, Any]) -> None:
        self._unreserve(data["reservation_id"])

    def _on_ReservationCancelled(self, data: dict[str, Any]) -> None:
        self._unreserve(data["reservation_id"])

    def _on_ReservationExpired(self, data: dict[str, Any]) -> None:
        self._unreserve(data["reservation_id"])

    def _unreserve(self, rid: str) -> None:
        for binding in self._reservations.pop(rid, []):
            device = binding["device"]
            if binding.get("capacity_gib") is None:
                if self._reserved_whole.get(device) == rid:
                    del self._reserved_whole[device]
            else:
                pool = self._reserved_slices.get(device, {})
                pool.pop(rid, None)
                if not pool:
                    self._reserved_slices.pop(device, None)

    def _holders(self, device: str, *, whole: bool) -> list[str]:
        """Who holds `device` so that another may not take it (`whole`: at all; else a slice:
        whoever holds it whole)."""
        holders = []
        if (cid := self._whole.get(device)) is not None:
            holders.append(f"composition {cid}")
        if (rid := self._reserved_whole.get(device)) is not None:
            holders.append(f"reservation {rid}")
        if whole:
            holders += [f"composition {c}" for c in sorted(self._slices.get(device, {}))]
            holders += [f"reservation {r}" for r in sorted(self._reserved_slices.get(device, {}))]
        return holders

    # -- holding and returning --

    def _hold(self, cid: str, binding: dict[str, Any]) -> None:
        composition = self._compositions.get(cid)
        if composition is None:
            return
        device = binding["device"]
        gib = binding.get("capacity_gib")
        if device in composition.bindings:
            self._report(
                "device_double_allocation",
                f"{device}@{cid}",
                f"composition {cid} holds {device} twice",
                {"device": device, "compositions": [cid]},
            )
        whole_owner = self._whole.get(device)
        slicers = self._slices.get(device, {})
        others = sorted(
            ({whole_owner} if whole_owner and whole_owner != cid else set())
            | (set(slicers) - {cid} if gib is None else set())
        )
        if others:
            self._report(
                "device_double_allocation",
                device,
                f"{device} is given to composition {cid} while composition "
                f"{', '.join(others)} holds it",
                {"device": device, "compositions": [*others, cid]},
            )
        reserving = sorted(
            ({self._reserved_whole[device]} if device in self._reserved_whole else set())
            | (set(self._reserved_slices.get(device, {})) if gib is None else set())
        )
        if reserving:
            self._report(
                "device_double_allocation",
                device,
                f"{device} is given to composition {cid} while reservation "
                f"{', '.join(reserving)} holds it",
                {"device": device, "compositions": [cid], "reservations": reserving},
            )
        composition.bindings[device] = binding
        if gib is None:
            self._whole[device] = cid
        else:
            pool = self._slices.setdefault(device, {})
            pool[cid] = pool.get(cid, 0.0) + float(gib)
            self._check_pool(device)
        for link in binding.get("links", []):
            self._reserved[link] = self._reserved.get(link, 0.0) + _gbps(binding)
            self._check_link(link)
        for switch in self._switches(binding):
            self._check_switch(switch, cid, composition)
            _add(self._switch_paths, switch, composition.tenant, 1)
            if composition.exclusive:
                _add(self._exclusive_paths, switch, composition.tenant, 1)

    def _give_back(self, cid: str, composition: _Composition, binding: dict[str, Any]) -> None:
        device = binding["device"]
        gib = binding.get("capacity_gib")
        if gib is None:
            if self._whole.get(device) == cid:
                del self._whole[device]
        else:
            pool = self._slices.get(device, {})
            pool.pop(cid, None)
            if not pool:
                self._slices.pop(device, None)
        for link in binding.get("links", []):
            left = self._reserved.get(link, 0.0) - _gbps(binding)
            if left > _EPSILON:
                self._reserved[link] = left
            else:
                self._reserved.pop(link, None)
        for switch in self._switches(binding):
            _add(self._switch_paths, switch, composition.tenant, -1)
            if composition.exclusive:
                _add(self._exclusive_paths, switch, composition.tenant, -1)

    def _swap(self, cid: str, device: str, binding: dict[str, Any]) -> None:
        composition = self._compositions.get(cid)
        if composition is None:
            return
        old = composition.bindings.pop(device, None)
        composition.established.discard(device)
        if old is not None:
            self._give_back(cid, composition, old)
        self._hold(cid, binding)
        composition.established.add(binding["device"])  # a repair puts it on its path

    def _end(self, cid: str) -> None:
        composition = self._compositions.pop(cid, None)
        if composition is None:
            return
        for binding in composition.bindings.values():
            self._give_back(cid, composition, binding)

    # -- the checks --

    def _switches(self, binding: dict[str, Any]) -> list[str]:
        return [
            n
            for n in dict.fromkeys(binding.get("path", []))
            if (node := self._nodes.get(n)) is not None and node.kind == "switch"
        ]

    def _check_switch(self, switch: str, cid: str, composition: _Composition) -> None:
        tenant = composition.tenant
        others = sorted(
            t for t, n in self._switch_paths.get(switch, {}).items() if n and t != tenant
        )
        exclusive_others = sorted(
            t for t, n in self._exclusive_paths.get(switch, {}).items() if n and t != tenant
        )
        if composition.exclusive and others:
            self._report(
                "exclusive_shared_switch",
                switch,
                f"exclusive composition {cid} of tenant {tenant} is routed through {switch}, "
                f"which carries paths of tenant {', '.join(others)}",
                {"switch": switch, "composition_id": cid, "tenants": [tenant, *others]},
            )
        elif exclusive_others:
            self._report(
                "exclusive_shared_switch",
                switch,
                f"composition {cid} of tenant {tenant} is routed through {switch}, which an "
                f"exclusive composition of tenant {', '.join(exclusive_others)} holds",
                {"switch": switch, "composition_id": cid, "tenants": [tenant, *exclusive_others]},
            )

    def _check_link(self, link: str) -> None:
        reserved = self._reserved.get(link, 0.0)
        capacity = self._links.get(link)
        if capacity is not None and reserved > capacity + _EPSILON:
            self._report(
                "link_over_capacity",
                link,
                f"{link} carries {reserved:g} Gbps of reserved paths over its {capacity:g} Gbps",
                {"link": link, "reserved_gbps": reserved, "capacity_gbps": capacity},
            )

    def _check_pool(self, device: str) -> None:
        node = self._nodes.get(device)
        used = sum(self._slices.get(device, {}).values())
        used += sum(self._reserved_slices.get(device, {}).values())
        capacity = node.capacity_gib if node is not None else None
        if capacity is not None and used > capacity + _EPSILON:
            self._report(
                "memory_over_capacity",
                device,
                f"{device} has {used:g} GiB sliced out of its {capacity:g} GiB",
                {"device": device, "used_gib": used, "capacity_gib": capacity},
            )

    def _report(self, check: str, subject: str, message: str, details: dict[str, Any]) -> None:
        if (check, subject) in self._reported or len(self.findings) >= self._limit:
            return
        self._reported.add((check, subject))
        self.findings.append(
            Finding(
                check=check,
                domain=self.domain,
                position=self._position,
                version=self._version,
                message=f"position {self._position}: {message}",
                details=details,
            )
        )


def audit(domain: str, events: Iterable[tuple[int, int, str, dict[str, Any]]]) -> list[Finding]:
    """The invariant findings of one domain's `(position, version, type, data)` events."""
    checker = InvariantAudit(domain)
    for position, version, type_, data in events:
        checker.feed(position, version, type_, data)
    return checker.findings


def _node(spec: dict[str, Any]) -> _Node:
    gib = spec.get("capacity_gib")
    return _Node(kind=spec["kind"], capacity_gib=None if gib is None else float(gib))


def _gbps(binding: dict[str, Any]) -> float:
    return float(binding.get("bandwidth_gbps") or 0.0)


def _add(table: dict[str, dict[str, int]], switch: str, tenant: str, delta: int) -> None:
    counts = table.setdefault(switch, {})
    counts[tenant] = counts.get(tenant, 0) + delta
    if counts[tenant] <= 0:
        del counts[tenant]
    if not counts:
        del table[switch]
