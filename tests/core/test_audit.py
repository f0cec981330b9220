"""The independent checks of `trellis verify` (engine/core/audit.py) on small hand-written logs.

Each invariant gets a log that breaks it, checked to be named with its first position, and the
same log made lawful (the release, the second circuit on other ports, ...) checked to be clean,
so a check that never fires, or fires on everything, fails here.
"""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime
from typing import Any

import msgspec

from trellis.engine.core.audit import (
    ChainCheck,
    CheckpointCheck,
    Finding,
    StoredCheckpoint,
    audit,
)
from trellis.engine.core.checkpoints import Checkpoint, Signer, Verifier, origin_of
from trellis.engine.core.merkle import MerkleTree, leaf_hash
from trellis.engine.core.records import GENESIS_HASH, RecordedEvent, chain_hash, hash_of

D = "hall-1"
Ev = tuple[str, dict[str, Any]]


def topology() -> Ev:
    nodes = [
        {"id": "host-01", "kind": "host"},
        {"id": "host-02", "kind": "host"},
        {"id": "sw-1", "kind": "switch"},
        {"id": "ocs-1", "kind": "ocs", "ports": 8},
        {"id": "gpu-01", "kind": "device", "device_kind": "gpu"},
        {"id": "gpu-02", "kind": "device", "device_kind": "gpu"},
        {"id": "mem-01", "kind": "device", "device_kind": "memory", "capacity_gib": 100},
    ]
    links = [
        {"id": "l-h1", "a": "host-01", "b": "sw-1", "capacity_gbps": 100},
        {"id": "l-h2", "a": "host-02", "b": "sw-1", "capacity_gbps": 100},
        {"id": "l-g1", "a": "sw-1", "b": "gpu-01", "capacity_gbps": 64},
        {"id": "l-g2", "a": "sw-1", "b": "gpu-02", "capacity_gbps": 64},
        {"id": "l-m", "a": "sw-1", "b": "mem-01", "capacity_gbps": 128},
    ]
    return "TopologyImported", {"type": "TopologyImported", "nodes": nodes, "links": links}


def requested(cid: str, tenant: str = "t1", isolation: str = "shared", host: str = "host-01") -> Ev:
    request = {"request_id": f"r-{cid}", "constraints": {"isolation": isolation}}
    return "CompositionRequested", {
        "composition_id": cid,
        "tenant": tenant,
        "host": host,
        "request": request,
        "requested_at": "2026-12-01T00:00:00Z",
    }


def binding(
    device: str, gbps: float = 10, gib: float | None = None, host: str = "host-01"
) -> dict[str, Any]:
    link = {"gpu-01": "l-g1", "gpu-02": "l-g2", "mem-01": "l-m"}[device]
    return {
        "device": device,
        "kind": "memory" if device.startswith("mem") else "gpu",
        "path": [host, "sw-1", device],
        "links": [f"l-h{host[-1]}", link],
        "circuits": [],
        "hops": 2,
        "latency_ns": 250,
        "bandwidth_gbps": gbps,
        "capacity_gib": gib,
    }


def reserved(cid: str, *bindings: dict[str, Any]) -> Ev:
    return "DevicesReserved", {"composition_id": cid, "devices": list(bindings)}


def established(cid: str, *devices: str) -> list[Ev]:
    return [
        *(("PathEstablished", {"composition_id": cid, "device": d, "path": []}) for d in devices),
        ("CompositionActivated", {"composition_id": cid}),
    ]


def released(cid: str) -> Ev:
    return "CompositionReleased", {"composition_id": cid}


def circuit(a: int, b: int, kind: str = "CircuitCreated") -> Ev:
    return kind, {"ocs": "ocs-1", "a_port": a, "b_port": b, "host": "host-01"}


def run(*events: Ev | list[Ev]) -> list[Finding]:
    flat: list[Ev] = []
    for e in events:
        flat += e if isinstance(e, list) else [e]
    # Positions are 10x the version, so a finding's position is visibly not its version.
    return audit(D, [(10 * v, v, t, d) for v, (t, d) in enumerate(flat, 1)])


def named(findings: list[Finding]) -> list[tuple[str, int]]:
    return [(f.check, f.position) for f in findings]


# ---- no device in two live compositions ----


def test_a_device_given_to_a_second_live_composition_is_named_at_that_reservation() -> None:
    findings = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01")),
        requested("c2"),
        reserved("c2", binding("gpu-01")),  # version 5
    )
    assert named(findings) == [("device_double_allocation", 50)]
    assert findings[0].details["compositions"] == ["c1", "c2"]


def test_a_device_released_can_be_held_again() -> None:
    assert not run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01")),
        released("c1"),
        requested("c2"),
        reserved("c2", binding("gpu-01")),
    )


def test_a_failed_composition_gives_its_device_back_too() -> None:
    assert not run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01")),
        ("CompositionFailed", {"composition_id": "c1", "reason": "fabric"}),
        requested("c2"),
        reserved("c2", binding("gpu-01")),
    )


def test_a_replacement_onto_a_device_someone_holds_is_named() -> None:
    findings = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01")),
        requested("c2"),
        reserved("c2", binding("gpu-02")),
        (
            "DeviceReplaced",
            {"composition_id": "c2", "old_device": "gpu-02", "binding": binding("gpu-01")},
        ),
    )
    assert named(findings) == [("device_double_allocation", 60)]


def test_a_reroute_keeps_the_device_and_frees_the_old_path() -> None:
    rerouted = {**binding("gpu-01", gbps=64), "links": ["l-h2", "l-g1"]}
    assert not run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01", gbps=60)),
        (
            "PathRerouted",
            {"composition_id": "c1", "device": "gpu-01", "old_path": [], "binding": rerouted},
        ),
        # l-h1 is free again (the reroute left it), so 100 Gbps fit there now.
        requested("c2"),
        reserved("c2", binding("gpu-02", gbps=60)),
    )


# ---- memory pools ----


def test_memory_slices_share_a_pool_up_to_its_capacity() -> None:
    assert not run(
        topology(),
        requested("c1"),
        reserved("c1", binding("mem-01", gib=60)),
        requested("c2"),
        reserved("c2", binding("mem-01", gib=40)),
    )


def test_memory_sliced_beyond_its_capacity_is_named() -> None:
    findings = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("mem-01", gib=60)),
        requested("c2"),
        reserved("c2", binding("mem-01", gib=41)),
    )
    assert named(findings) == [("memory_over_capacity", 50)]


def test_two_slices_of_one_pool_in_one_composition_are_named() -> None:
    findings = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("mem-01", gib=10, gbps=1), binding("mem-01", gib=10, gbps=1)),
    )
    assert named(findings) == [("device_double_allocation", 30)]


def test_a_pool_held_whole_cannot_be_sliced_by_another() -> None:
    findings = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("mem-01")),  # asked for by id: the whole pool
        requested("c2"),
        reserved("c2", binding("mem-01", gib=10)),
    )
    assert named(findings) == [("device_double_allocation", 50)]


# ---- links ----


def test_a_link_reserved_over_its_capacity_is_named_at_the_reservation() -> None:
    ok = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01", gbps=50)),
        requested("c2"),
        reserved("c2", binding("gpu-02", gbps=50)),  # l-h1: 100 of 100
    )
    assert not ok
    findings = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01", gbps=50)),
        requested("c2"),
        reserved("c2", binding("gpu-02", gbps=51)),
    )
    assert named(findings) == [("link_over_capacity", 50)]
    assert findings[0].details["link"] == "l-h1"


def test_a_link_shrunk_below_what_it_carries_is_named_at_the_import() -> None:
    kind, doc = topology()
    smaller = {
        **doc,
        "links": [{**lk, "capacity_gbps": 8} if lk["id"] == "l-g1" else lk for lk in doc["links"]],
    }
    findings = run(
        (kind, doc), requested("c1"), reserved("c1", binding("gpu-01", gbps=10)), (kind, smaller)
    )
    assert named(findings) == [("link_over_capacity", 40)]


# ---- OCS ports ----


def test_an_ocs_port_in_two_circuits_is_named() -> None:
    findings = run(topology(), circuit(0, 1), circuit(1, 2))
    assert named(findings) == [("ocs_port_reuse", 30)]
    assert findings[0].details["port"] == 1


def test_a_removed_circuit_frees_its_ports() -> None:
    assert not run(topology(), circuit(0, 1), circuit(0, 1, "CircuitRemoved"), circuit(1, 2))


# ---- exclusive isolation ----


def test_an_exclusive_composition_on_a_switch_another_tenant_uses_is_named() -> None:
    findings = run(
        topology(),
        requested("c1", tenant="t1"),
        reserved("c1", binding("gpu-01")),
        requested("c2", tenant="t2", isolation="exclusive", host="host-02"),
        reserved("c2", binding("gpu-02", host="host-02")),
    )
    assert named(findings) == [("exclusive_shared_switch", 50)]


def test_another_tenant_routed_through_an_exclusive_switch_is_named() -> None:
    findings = run(
        topology(),
        requested("c1", tenant="t1", isolation="exclusive"),
        reserved("c1", binding("gpu-01")),
        requested("c2", tenant="t2", host="host-02"),
        reserved("c2", binding("gpu-02", host="host-02")),
    )
    assert named(findings) == [("exclusive_shared_switch", 50)]


def test_exclusive_allows_the_same_tenant_and_a_switch_others_have_left() -> None:
    assert not run(
        topology(),
        requested("c1", tenant="t1", isolation="exclusive"),
        reserved("c1", binding("gpu-01")),
        requested("c2", tenant="t1", host="host-02"),
        reserved("c2", binding("gpu-02", host="host-02")),
        released("c1"),
        released("c2"),
        requested("c3", tenant="t2", isolation="exclusive"),
        reserved("c3", binding("gpu-01")),
    )


# ---- activation ----


def test_activated_without_a_path_for_every_device_is_named() -> None:
    findings = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01"), binding("gpu-02")),
        established("c1", "gpu-01"),  # gpu-02's PathEstablished is missing
    )
    assert named(findings) == [("active_without_path", 50)]
    assert findings[0].details["devices"] == ["gpu-02"]


def test_activated_with_every_path_and_after_a_repair_is_clean() -> None:
    assert not run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01")),
        established("c1", "gpu-01"),
        ("CompositionImpaired", {"composition_id": "c1", "component": "gpu-01"}),
        (
            "DeviceReplaced",
            {"composition_id": "c1", "old_device": "gpu-01", "binding": binding("gpu-02")},
        ),
        ("CompositionActivated", {"composition_id": "c1"}),
    )


def test_one_violation_is_named_once_at_its_first_position() -> None:
    findings = run(
        topology(),
        circuit(0, 1),
        circuit(1, 2),
        circuit(1, 3),
    )
    assert named(findings) == [("ocs_port_reuse", 30)]


def test_a_payload_without_its_fields_is_named_and_the_audit_goes_on() -> None:
    findings = run(
        topology(),
        ("DevicesReserved", {"devices": [binding("gpu-01")]}),  # no composition_id
        circuit(0, 1),
        circuit(1, 2),
    )
    assert named(findings) == [("malformed_event", 20), ("ocs_port_reuse", 40)]


# ---- the hash chain ----


def recorded(n: int, seconds: list[int] | None = None) -> list[RecordedEvent]:
    """A valid chain of `n` events, recorded at those seconds past noon (1, 2, 3... by
    default)."""
    events, prev = [], GENESIS_HASH
    for version in range(1, n + 1):
        second = seconds[version - 1] if seconds else version
        fields = dict(
            id=str(uuid.uuid4()),
            domain=D,
            version=version,
            type="ComponentDrained",
            schema_version=1,
            recorded_at=datetime(2026, 12, 1, 12, 0, second, tzinfo=UTC),
            actor="operator",
            causation_id=f"r{version}",
            correlation_id=f"r{version}",
            data=b'{"type":"ComponentDrained","component":"sw-1"}',
        )
        digest = chain_hash(prev, **fields)
        events.append(RecordedEvent(position=version * 10, prev_hash=prev, hash=digest, **fields))
        prev = digest
    return events


def chain_findings(events: list[RecordedEvent]) -> list[tuple[str, int, int]]:
    check = ChainCheck(D)
    for e in events:
        check.feed(e)
    return [(f.check, f.version, f.position) for f in check.findings]


def test_a_clean_chain_has_no_findings_and_ends_at_its_head() -> None:
    events = recorded(4)
    check = ChainCheck(D)
    for e in events:
        check.feed(e)
    assert check.findings == []
    assert check.head_finding(4, 40, events[-1].hash) is None
    assert check.head_finding(3, 30, events[-2].hash) is not None


def test_each_tampered_event_is_named_by_version_and_position() -> None:
    events = recorded(5)
    events[1] = msgspec.structs.replace(events[1], data=b'{"type":"ComponentDrained"}')
    events[3] = msgspec.structs.replace(events[3], actor="mallory")
    assert chain_findings(events) == [("hash_mismatch", 2, 20), ("hash_mismatch", 4, 40)]


def test_a_missing_event_and_a_forged_genesis_are_named() -> None:
    events = recorded(4)
    assert chain_findings(events[:1] + events[2:]) == [
        ("version_gap", 3, 30),
        ("broken_link", 3, 30),
    ]
    forged = msgspec.structs.replace(events[0], prev_hash="1" * 64)
    assert ("genesis", 1, 10) in chain_findings([forged, *events[1:]])


def test_a_recorded_at_that_goes_back_is_named() -> None:
    assert chain_findings(recorded(4, seconds=[1, 2, 2, 3])) == []  # equal times are fine
    assert chain_findings(recorded(4, seconds=[1, 5, 3, 6])) == [("time_order", 3, 30)]


def test_positions_that_do_not_increase_along_the_versions_are_named() -> None:
    events = recorded(4)
    swapped = [
        events[0],
        msgspec.structs.replace(events[1], position=events[2].position),
        msgspec.structs.replace(events[2], position=events[1].position),
        events[3],
    ]
    assert chain_findings(swapped) == [("position_order", 3, 20)]
    check = ChainCheck(D)
    for e in swapped:
        check.feed(e)
    assert check.findings[0].message == (
        "event 3 (position 20): its position is not after position 30 of version 2"
    )
    repeated = msgspec.structs.replace(events[2], position=events[1].position)
    assert chain_findings([*events[:2], repeated, events[3]]) == [("position_order", 3, 20)]


def test_stored_checkpoints_must_be_the_logs_merkle_roots() -> None:
    events = recorded(5)
    tree = MerkleTree(leaf_hash(bytes.fromhex(e.hash)) for e in events)
    root = {n: base64.b64encode(tree.root(n)).decode() for n in (2, 5)}

    def check(checkpoints: list[tuple[int, str]], log: list[RecordedEvent]) -> list[Any]:
        c = CheckpointCheck(D, [StoredCheckpoint(size=n, root=r, note="") for n, r in checkpoints])
        for e in log:
            c.feed(e)
        return [(f.check, f.version, f.position) for f in c.findings()]

    assert check([(2, root[2]), (5, root[5])], events) == []
    # The log was rewritten at version 2 after the checkpoint of 2 events was made.
    forked = [events[0], msgspec.structs.replace(events[1], hash="ab" * 32), *events[2:]]
    assert check([(2, root[2]), (5, root[5])], forked) == [
        ("checkpoint", 2, 20),
        ("checkpoint", 5, 50),
    ]
    # Events were cut off the end after a checkpoint of five was made.
    assert check([(5, root[5])], events[:4]) == [("checkpoint", 5, 0)]


def notes_checked(
    stored: list[StoredCheckpoint], log: list[RecordedEvent], *verifiers: Verifier
) -> tuple[list[Finding], list[Finding]]:
    """(the rows' findings, the notes' findings) of `stored` against `log`."""
    c = CheckpointCheck(D, stored, verifiers)
    for e in log:
        c.feed(e)
    return c.findings(), c.note_findings()


def signed_rows(
    signer: Signer, log: list[RecordedEvent], sizes: list[int]
) -> list[StoredCheckpoint]:
    """The rows the engine stores for checkpoints of `log` at `sizes`: root and signed note."""
    tree = MerkleTree(leaf_hash(bytes.fromhex(e.hash)) for e in log)
    rows = []
    for size in sizes:
        note = signer.checkpoint(Checkpoint(origin=origin_of(D), size=size, root=tree.root(size)))
        rows.append(
            StoredCheckpoint(size=size, root=base64.b64encode(tree.root(size)).decode(), note=note)
        )
    return rows


def rewritten(log: list[RecordedEvent], at: int) -> list[RecordedEvent]:
    """`log` with event `at` (a version) changed and every hash after it recomputed."""
    out, prev = list(log[: at - 1]), log[at - 2].hash if at > 1 else GENESIS_HASH
    for e in log[at - 1 :]:
        if e.version == at:
            e = msgspec.structs.replace(e, actor="mallory")
        e = msgspec.structs.replace(e, prev_hash=prev, hash=hash_of(e, prev, D, e.version))
        out.append(e)
        prev = e.hash
    return out


def test_stored_notes_must_verify_and_say_what_their_rows_say() -> None:
    signer = Signer.generate()
    log = recorded(6)
    rows = signed_rows(signer, log, [3, 6])
    assert notes_checked(rows, log, signer.verifier) == ([], [])

    # A signature line changed: the note does not verify.
    text, _, signature = rows[1].note.rpartition(" ")
    broken = f"{text} {signature[:8]}{'A' if signature[8] != 'A' else 'B'}{signature[9:]}"
    found = notes_checked(
        [rows[0], msgspec.structs.replace(rows[1], note=broken)], log, signer.verifier
    )
    assert [(f.check, f.version) for f in found[1]] == [("checkpoint_note", 6)]
    assert "does not verify" in found[1][0].message and found[0] == []

    # A note of another size (signed, but of 3 events) in the row of 6.
    found = notes_checked(
        [msgspec.structs.replace(rows[1], note=rows[0].note)], log, signer.verifier
    )
    assert [(f.check, f.version) for f in found[1]] == [("checkpoint_note", 6)]
    assert found[1][0].message.startswith(
        f"the note of the checkpoint of 6 events signed size 3, root {rows[0].root}; "
        f"the row says size 6, root {rows[1].root}"
    )

    # Another key's notes are not the deployment's.
    found = notes_checked(rows, log, Signer.generate().verifier)
    assert [(f.check, f.version) for f in found[1]] == [
        ("checkpoint_note", 3),
        ("checkpoint_note", 6),
    ]

    # Without a key, nothing is said about the notes (the caller reports that as skipped).
    assert notes_checked([msgspec.structs.replace(rows[1], note="forged")], log) == ([], [])


def test_after_a_key_rotation_each_note_holds_with_the_key_that_signed_it() -> None:
    """A rotation (`TRELLIS_NEW_CHECKPOINT_KEY=1`) leaves the old key's notes before the new
    key's: given both keys every note holds; given one, exactly the other's notes are named."""
    old, new = Signer.generate(), Signer.generate()
    log = recorded(6)
    rows = [*signed_rows(old, log, [2, 4]), *signed_rows(new, log, [6])]

    assert notes_checked(rows, log, old.verifier, new.verifier) == ([], [])
    # The order the keys are given in, and a key given twice, change nothing.
    assert notes_checked(rows, log, new.verifier, old.verifier, new.verifier) == ([], [])

    _, found = notes_checked(rows, log, new.verifier)
    assert [(f.check, f.version) for f in found] == [("checkpoint_note", 2), ("checkpoint_note", 4)]
    key = new.verifier.key()
    assert found[0].message == (
        f"the note of the checkpoint of 2 events does not verify with {key}: the note carries "
        f"no signature by {key}"
    )
    _, found = notes_checked(rows, log, old.verifier)
    assert [(f.check, f.version) for f in found] == [("checkpoint_note", 6)]

    # A third key's note is named with every key given.
    stranger = signed_rows(Signer.generate(), log, [6])
    _, found = notes_checked([*rows[:2], *stranger], log, old.verifier, new.verifier)
    assert [(f.check, f.version) for f in found] == [("checkpoint_note", 6)]
    assert found[0].message.startswith(
        f"the note of the checkpoint of 6 events does not verify with {old.verifier.key()} or "
        f"{new.verifier.key()}: "
    )


def test_a_bad_signature_by_a_key_given_fails_its_note_beside_a_good_one() -> None:
    """As C2SP note verifiers treat their known keys (Go's note.Open): a note the engine
    co-signed with both keys holds with either, but a broken signature by a key given is a
    finding even where the other key's holds."""
    old, new = Signer.generate(), Signer.generate()
    log = recorded(3)
    (row,) = signed_rows(old, log, [3])
    (by_new,) = signed_rows(new, log, [3])
    new_line = by_new.note.rpartition("\n\n")[2]
    cosigned = msgspec.structs.replace(row, note=row.note + new_line)
    for keys in ([old.verifier], [new.verifier], [old.verifier, new.verifier]):
        assert notes_checked([cosigned], log, *keys) == ([], [])

    head, _, signature = new_line.rstrip("\n").rpartition(" ")
    flipped = "B" if signature[8] == "A" else "A"  # in the signature, past the key hash
    broken = f"{head} {signature[:8]}{flipped}{signature[9:]}\n"
    _, found = notes_checked(
        [msgspec.structs.replace(row, note=row.note + broken)], log, old.verifier, new.verifier
    )
    assert [(f.check, f.version) for f in found] == [("checkpoint_note", 3)]
    assert f"the signature by {new.verifier.key_id} does not verify" in found[0].message


def test_a_consistent_forgery_is_caught_by_the_signed_roots() -> None:
    """The log rewritten at version 2 with every hash after it recomputed, and each row's root
    set to the new log's: the rows agree with the log, the notes the engine signed do not."""
    signer = Signer.generate()
    log = recorded(6)
    signed = signed_rows(signer, log, [3, 6])
    forged = rewritten(log, 2)
    assert chain_findings(forged) == []
    recomputed = signed_rows(Signer.generate(), forged, [3, 6])
    rows = [
        msgspec.structs.replace(s, root=r.root) for s, r in zip(signed, recomputed, strict=True)
    ]

    found = notes_checked(rows, forged, signer.verifier)

    assert found[0] == []  # the rows' roots are the forged log's
    assert [(f.check, f.version, f.position) for f in found[1]] == [
        ("checkpoint_note", 3, 0),
        ("checkpoint_note", 6, 0),
        ("checkpoint", 3, 30),
        ("checkpoint", 6, 60),
    ]
    assert found[1][2].message == (
        f"the signed note of 3 events has root {signed[0].root}; the log's first 3 events give "
        f"{rows[0].root}"
    )


def test_a_log_that_changed_under_honest_rows_fails_the_notes_check_too() -> None:
    """Row and note agree, and the log no longer gives their root: the chain check names the
    row's root and the notes check the signed one (it once passed, counting on the chain's)."""
    signer = Signer.generate()
    log = recorded(6)
    rows = signed_rows(signer, log, [3, 6])

    from_rows, from_notes = notes_checked(rows, rewritten(log, 2), signer.verifier)

    assert [(f.check, f.version) for f in from_rows] == [("checkpoint", 3), ("checkpoint", 6)]
    assert [(f.check, f.version) for f in from_notes] == [("checkpoint", 3), ("checkpoint", 6)]
    assert from_notes[0].message.startswith("the signed note of 3 events has root")


# ---- reservations hold devices too ----


def reservation(rid: str, *bindings: dict[str, Any]) -> Ev:
    return "ReservationMade", {
        "reservation_id": rid,
        "tenant": "t2",
        "host": "host-02",
        "request": {"request_id": f"r-{rid}"},
        "devices": list(bindings),
        "made_at": "2026-12-01T00:00:00Z",
        "expires_at": "2026-12-01T00:05:00Z",
    }


def test_a_reserved_device_given_to_a_composition_is_named() -> None:
    findings = run(
        topology(),
        reservation("rsv-1", binding("gpu-01", host="host-02")),
        requested("c1"),
        reserved("c1", binding("gpu-01")),  # version 4
    )
    assert named(findings) == [("device_double_allocation", 40)]
    assert findings[0].details["reservations"] == ["rsv-1"]


def test_a_device_reserved_while_composed_or_reserved_is_named() -> None:
    composed = run(
        topology(),
        requested("c1"),
        reserved("c1", binding("gpu-01")),
        reservation("rsv-1", binding("gpu-01")),
    )
    twice = run(
        topology(), reservation("rsv-1", binding("gpu-01")), reservation("rsv-2", binding("gpu-01"))
    )
    assert named(composed) == [("device_double_allocation", 40)]
    assert named(twice) == [("device_double_allocation", 30)]


def test_reserved_slices_count_against_the_pool() -> None:
    findings = run(
        topology(),
        reservation("rsv-1", binding("mem-01", gib=60)),
        requested("c1"),
        reserved("c1", binding("mem-01", gib=50)),
    )
    assert named(findings) == [("memory_over_capacity", 40)]


def test_an_applied_cancelled_or_expired_reservation_lets_its_device_go() -> None:
    for end in ("ReservationApplied", "ReservationCancelled", "ReservationExpired"):
        data = {"reservation_id": "rsv-1", "composition_id": "c1"}
        if end != "ReservationApplied":
            data.pop("composition_id")
        assert not run(
            topology(),
            reservation("rsv-1", binding("gpu-01"), binding("mem-01", gib=60)),
            (end, data),
            requested("c1"),
            reserved("c1", binding("gpu-01"), binding("mem-01", gib=60)),
        ), end


# ---- a version gap names what is missing ----


def version_gaps(events: list[RecordedEvent]) -> list[str]:
    check = ChainCheck(D)
    for event in events:
        check.feed(event)
    return [f.message for f in check.findings if f.check == "version_gap"]


def test_one_missing_version_is_named() -> None:
    events = recorded(12)
    assert version_gaps(events[:9] + events[10:]) == [
        "event 11 (position 110): version 11 follows version 9: version 10 is missing"
    ]


def test_a_run_of_missing_versions_is_named_as_a_range() -> None:
    events = recorded(14)
    assert version_gaps(events[:9] + events[12:]) == [
        "event 13 (position 130): version 13 follows version 9: versions 10-12 are missing"
    ]


def test_missing_first_versions_are_named() -> None:
    events = recorded(4)
    assert version_gaps(events[2:]) == [
        "event 3 (position 30): version 3 is the first: versions 1-2 are missing"
    ]


def test_a_version_that_goes_back_is_still_named_so() -> None:
    events = recorded(3)
    assert version_gaps([events[0], events[1], events[1]]) == [
        "event 2 (position 20): version 2 repeats or goes back from version 2"
    ]
