"""The chaos run's checker (tests/chaos/checker.py) on hand-built logs: clean ones pass, and each
promise it checks, broken on purpose, is found and named.

The logs are built as the engine writes them: every payload must decode as the engine's own
event type (engine.core.events) and every hash is the engine's (engine.core.records.chain_hash), so
the checker, which imports neither, is held to the engine's real shapes and hashing.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import checker
from checker import Ack, LogRow, RequestRow, StreamMessage, check

from trellis.engine.core.records import GENESIS_HASH, chain_hash
from trellis.engine.core.upcast import upcast

DOMAIN = "hall"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

NODES = [
    {"id": "h1", "kind": "host"},
    {"id": "h2", "kind": "host"},
    {"id": "sw", "kind": "switch", "latency_ns": 150},
    {"id": "o1", "kind": "ocs", "ports": 4, "latency_ns": 30},
    {"id": "g1", "kind": "device", "device_kind": "gpu", "model": "H100"},
    {"id": "g2", "kind": "device", "device_kind": "gpu", "model": "H100"},
    {"id": "m1", "kind": "device", "device_kind": "memory", "capacity_gib": 512},
]
LINKS = [
    {"id": "l-h1", "a": "h1", "b": "sw", "capacity_gbps": 100},
    {"id": "l-h2", "a": "h2", "b": "sw", "capacity_gbps": 100},
    {"id": "l-up", "a": "sw", "b": "o1", "b_port": 0, "capacity_gbps": 100},
    {"id": "l-g1", "a": "g1", "b": "o1", "b_port": 1, "capacity_gbps": 64},
    {"id": "l-g2", "a": "sw", "b": "g2", "capacity_gbps": 64},
    {"id": "l-m1", "a": "sw", "b": "m1", "capacity_gbps": 64},
]
CIRCUIT = {"ocs": "o1", "a_port": 0, "b_port": 1}


def gpu1(host: str = "h1", gbps: float = 50) -> dict[str, Any]:
    """g1 over the OCS: host cable, uplink, circuit 0-1, g1's cable."""
    return binding("g1", [host, "sw", "o1", "g1"], [f"l-{host}", "l-up", "l-g1"], gbps, [CIRCUIT])


def gpu2(host: str = "h1", gbps: float = 50) -> dict[str, Any]:
    return binding("g2", [host, "sw", "g2"], [f"l-{host}", "l-g2"], gbps)


def memory(host: str, gib: float, gbps: float = 30) -> dict[str, Any]:
    return binding("m1", [host, "sw", "m1"], [f"l-{host}", "l-m1"], gbps, gib=gib)


def binding(
    device: str,
    path: list[str],
    links: list[str],
    gbps: float,
    circuits: list[dict[str, Any]] | None = None,
    gib: float | None = None,
) -> dict[str, Any]:
    return {
        "device": device,
        "kind": "memory" if gib is not None else "gpu",
        "path": path,
        "links": links,
        "circuits": circuits or [],
        "hops": len(links) + len(circuits or []),
        "latency_ns": 300,
        "bandwidth_gbps": gbps,
        "capacity_gib": gib,
        "entry": 0,
    }


class Log:
    """A log built event by event, with its request rows and what its clients were told."""

    def __init__(self) -> None:
        self.rows: list[LogRow] = []
        self.requests: list[RequestRow] = []
        self.acks: list[Ack] = []

    def event(
        self, type: str, data: dict[str, Any], actor: str, cause: str, domain: str = DOMAIN
    ) -> LogRow:
        text = json.dumps({"type": type, **data})
        upcast(type, 1, text.encode())  # the engine's own shape (as of v1), or this raises
        mine = [r for r in self.rows if r.domain == domain]
        version = len(mine) + 1
        prev = mine[-1].hash if mine else GENESIS_HASH
        at = T0 + timedelta(milliseconds=len(self.rows))
        fields: dict[str, Any] = {
            "id": f"00000000-0000-4000-8000-{len(self.rows):012d}",
            "domain": domain,
            "version": version,
            "type": type,
            "schema_version": 1,
            "actor": actor,
            "causation_id": cause,
            "correlation_id": cause,
        }
        digest = chain_hash(prev, **fields, recorded_at=at, data=text.encode())
        row = LogRow(
            position=len(self.rows) + 1,
            recorded_at=checker.canonical_time(at),
            data=text,
            prev_hash=prev,
            hash=digest,
            **fields,
        )
        self.rows.append(row)
        return row

    def answer(
        self,
        actor: str,
        rid: str,
        verb: str,
        reply: dict[str, Any],
        *,
        told: bool = True,
        domain: str = DOMAIN,
    ) -> None:
        """Store `reply` for the request id; the client is told it too, unless `told` is False."""
        self.requests.append(
            RequestRow(domain, actor, rid, verb, json.dumps(reply), len(self.rows))
        )
        if told:
            self.acks.append(Ack(domain, actor, verb, rid, reply))

    def ok(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "result": result, "position": len(self.rows), "replayed": False}

    # the engine's decisions, as docs/architecture.md §11 records them

    def imported(self) -> None:
        self.event("TopologyImported", {"nodes": NODES, "links": LINKS}, "operator", "import")
        self.answer("operator", "import", "import-topology", self.ok({"changed": True}))

    def composed(
        self, tenant: str, rid: str, host: str, *bindings: dict[str, Any], new_circuits: int = 0
    ) -> str:
        cid = f"c-{rid}"
        request = {"request_id": rid, "host": host, "devices": [{"kind": "gpu"}]}
        self.event(
            "CompositionRequested",
            {
                "composition_id": cid,
                "tenant": tenant,
                "host": host,
                "request": request,
                "requested_at": "2026-12-01T12:00:00Z",
            },
            tenant,
            rid,
        )
        for _ in range(new_circuits):
            self.event("CircuitCreated", {**CIRCUIT, "host": host}, tenant, rid)
        self.event(
            "DevicesReserved", {"composition_id": cid, "devices": list(bindings)}, tenant, rid
        )
        result = {"composition_id": cid, "host": host, "expires_at": None}
        pending = self.ok({**result, "state": "pending"})
        self.answer(tenant, rid, "compose", pending, told=False)
        settle = f"settle-{cid}"
        for b in bindings:
            path = {"composition_id": cid, "device": b["device"], "path": b["path"]}
            self.event("PathEstablished", path, "engine", settle)
        self.event("CompositionActivated", {"composition_id": cid}, "engine", settle)
        devices = [
            {k: b[k] for k in ("path", "hops", "latency_ns", "bandwidth_gbps")}
            | {"id": b["device"]}
            for b in bindings
        ]
        active = self.ok({**result, "state": "active", "devices": devices})
        self.answer("engine", settle, "establish", active, told=False)
        self.acks.append(Ack(DOMAIN, tenant, "compose", rid, active))
        return cid

    def rejected(self, tenant: str, rid: str) -> None:
        error = {"code": "no_capacity", "message": "no GPU is free", "details": {}}
        self.event(
            "CompositionRejected",
            {"tenant": tenant, "code": error["code"], "message": error["message"]},
            tenant,
            rid,
        )
        self.answer(tenant, rid, "compose", {"ok": False, "error": error})

    def released(self, tenant: str, rid: str, cid: str, *, circuits: int = 0) -> None:
        self.event("CompositionReleased", {"composition_id": cid}, tenant, rid)
        for _ in range(circuits):
            gone = {**CIRCUIT, "host": "h1", "composition_id": cid}
            self.event("CircuitRemoved", gone, tenant, rid)
        self.answer(tenant, rid, "release", self.ok({"composition_id": cid, "state": "released"}))

    def stream(self) -> list[StreamMessage]:
        """The stream as the relay publishes it: every event once, in log order."""
        return [message(i + 1, row) for i, row in enumerate(self.rows)]

    def findings(self, stream: list[StreamMessage] | None = None) -> checker.Findings:
        return check(
            self.rows, self.requests, self.acks, self.stream() if stream is None else stream
        )


def message(sequence: int, row: LogRow, **changes: Any) -> StreamMessage:
    body = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    body["data"] = json.loads(row.data)
    return StreamMessage(sequence, row.id, json.dumps({**body, **changes}))


def renumbered(stream: list[StreamMessage]) -> list[StreamMessage]:
    """The messages with stream sequences 1, 2, 3... in the order listed."""
    return [dataclasses.replace(m, sequence=i + 1) for i, m in enumerate(stream)]


def busy_day() -> Log:
    """A valid log: two tenants share a memory pool to the last GiB and a host cable to the last
    Gbps, a GPU passes from one to the other, its OCS circuit is removed and created again, a
    compose is rejected, and everything is released in the end."""
    log = Log()
    log.imported()
    first = log.composed("t1", "t1-c1", "h1", gpu1(), new_circuits=1)
    slice_a = log.composed("t2", "t2-c1", "h2", memory("h2", 256))
    slice_b = log.composed("t1", "t1-c2", "h1", memory("h1", 256))
    log.rejected("t2", "t2-c2")
    log.released("t1", "t1-r1", first, circuits=1)
    second = log.composed("t2", "t2-c3", "h1", gpu1(gbps=40), gpu2(gbps=30), new_circuits=1)
    for tenant, rid, cid, circuits in [
        ("t2", "t2-r1", slice_a, 0),
        ("t1", "t1-r2", slice_b, 0),
        ("t2", "t2-r3", second, 1),
    ]:
        log.released(tenant, rid, cid, circuits=circuits)
    return log


def broken(findings: checker.Findings) -> set[str]:
    return {promise for promise, n in findings.broken.items() if n}


# ---- clean logs pass ----


def test_a_valid_log_with_reuse_after_release_breaks_no_promise() -> None:
    findings = busy_day().findings()
    assert findings.clean(), findings.report()
    assert findings.live_at_end == [] and findings.circuits_at_end == []
    assert set(findings.broken) == set(checker.PROMISES)


def test_the_checker_hashes_as_the_engine_does() -> None:
    log = busy_day()
    assert all(checker.event_hash(row) == row.hash for row in log.rows)


def test_what_is_still_held_at_the_end_is_listed() -> None:
    log = Log()
    log.imported()
    cid = log.composed("t1", "t1-c1", "h1", gpu1(), new_circuits=1)
    findings = log.findings()
    assert findings.clean(), findings.report()
    assert findings.live_at_end == [f"{DOMAIN}/{cid}"]
    assert findings.circuits_at_end == [f"{DOMAIN}/o1:0-1"]


def test_two_domains_interleaved_in_the_stream_are_in_order() -> None:
    log = busy_day()
    log.event("TopologyImported", {"nodes": NODES, "links": LINKS}, "operator", "import", "other")
    log.answer("operator", "import", "import-topology", log.ok({"changed": True}), domain="other")
    stream = log.stream()
    findings = log.findings(renumbered([stream[-1], *stream[:-1]]))
    assert findings.clean(), findings.report()


# ---- each promise, broken on purpose ----


def test_an_acknowledged_intent_missing_from_the_log_is_lost() -> None:
    log = busy_day()
    told = log.ok({"composition_id": "c-x", "state": "released"})
    log.acks.append(Ack(DOMAIN, "t1", "release", "t1-r9", told))
    assert broken(log.findings()) == {checker.LOST}


def test_a_stored_request_id_without_its_event_is_lost() -> None:
    log = busy_day()
    log.rows = [r for r in log.rows if r.causation_id != "t1-r2"]
    log.rows = rechain(log.rows)
    findings = log.findings()
    assert checker.LOST in broken(findings)
    assert findings.live_at_end  # the slice that release would have ended is still held


def rechain(rows: list[LogRow]) -> list[LogRow]:
    """`rows` renumbered and rehashed, as a log that never held the dropped events would be."""
    out: list[LogRow] = []
    for row in rows:
        prev = out[-1] if out else None
        version = prev.version + 1 if prev else 1
        position = prev.position + 1 if prev else 1
        prev_hash = prev.hash if prev else GENESIS_HASH
        row = dataclasses.replace(row, version=version, position=position, prev_hash=prev_hash)
        out.append(dataclasses.replace(row, hash=checker.event_hash(row)))
    return out


def test_an_intent_recorded_twice_is_duplicated() -> None:
    log = busy_day()
    again = [r for r in log.rows if r.causation_id == "t2-c2"]
    for row in again:
        log.event(row.type, drop_type(row), row.actor, row.causation_id)
    assert broken(log.findings()) == {checker.DUPLICATED}


def drop_type(row: LogRow) -> dict[str, Any]:
    data = row.payload()
    del data["type"]
    return data


def test_a_composition_settled_twice_is_duplicated() -> None:
    log = busy_day()
    cid = log.acks[1].reply["result"]["composition_id"]
    log.event("CompositionActivated", {"composition_id": cid}, "engine", f"settle-{cid}")
    assert broken(log.findings()) == {checker.DUPLICATED}


def test_a_reply_other_than_the_stored_one_is_found() -> None:
    log = busy_day()
    ack = log.acks[-1]
    log.acks[-1] = dataclasses.replace(ack, reply={**ack.reply, "position": 1})
    assert broken(log.findings()) == {checker.REPLY_DIFFERS}


def test_a_resent_refusal_marked_replayed_is_the_stored_one() -> None:
    log = busy_day()
    ack = next(a for a in log.acks if a.request_id == "t2-c2")
    error = ack.reply["error"]
    again = {**ack.reply, "error": {**error, "details": {**error["details"], "replayed": True}}}
    log.acks.append(dataclasses.replace(ack, reply=again))  # the client's resend, told again
    assert broken(log.findings()) == set()


def test_a_compose_reply_naming_other_devices_than_the_log_is_found() -> None:
    log = busy_day()
    index, ack = next((i, a) for i, a in enumerate(log.acks) if a.request_id == "t1-c1")
    result = ack.reply["result"]
    told = {**ack.reply, "result": {**result, "devices": [{**result["devices"][0], "id": "g2"}]}}
    log.acks[index] = dataclasses.replace(ack, reply=told)
    # Told g2 while the log reserved g1; the stored settlement differs from it as well.
    assert broken(log.findings()) == {checker.REPLY_DIFFERS}
    assert log.findings().broken[checker.REPLY_DIFFERS] == 2


def test_a_write_no_client_was_told_of_is_found() -> None:
    log = busy_day()
    log.acks = [a for a in log.acks if a.request_id != "t2-c2"]
    assert broken(log.findings()) == {checker.UNTOLD}


def test_a_device_reserved_while_another_composition_holds_it_is_a_double_allocation() -> None:
    log = Log()
    log.imported()
    log.composed("t1", "t1-c1", "h1", gpu2(gbps=10))
    log.composed("t2", "t2-c1", "h2", gpu2(host="h2", gbps=10))
    assert broken(log.findings()) == {checker.DOUBLE_ALLOCATION}


def test_memory_slices_beyond_the_pool_are_a_double_allocation() -> None:
    log = Log()
    log.imported()
    log.composed("t1", "t1-c1", "h1", memory("h1", 256, gbps=10))
    log.composed("t2", "t2-c1", "h2", memory("h2", 256, gbps=10))
    assert log.findings().clean()  # 512 GiB of 512
    log.composed("t2", "t2-c2", "h2", memory("h2", 1, gbps=10))
    assert broken(log.findings()) == {checker.DOUBLE_ALLOCATION}


def test_bandwidth_beyond_a_link_is_found_at_the_reservation_that_overfills_it() -> None:
    log = Log()
    log.imported()
    log.composed("t1", "t1-c1", "h1", gpu2(gbps=60))
    log.composed("t1", "t1-c2", "h1", memory("h1", 64, gbps=40))
    assert log.findings().clean()  # 100 Gbps of 100 on l-h1
    log.composed("t1", "t1-c3", "h1", gpu1(gbps=1), new_circuits=1)
    findings = log.findings()
    assert broken(findings) == {checker.LINK_OVER}
    assert findings.examples[checker.LINK_OVER] == [
        f"{DOMAIN} v12 DevicesReserved: l-h1 reserved 101 of 100 Gbps"
    ]


def test_a_reroute_moves_the_bandwidth_off_the_old_path() -> None:
    log = Log()
    log.imported()
    cid = log.composed("t1", "t1-c1", "h1", gpu2(gbps=60))
    moved = binding("g2", ["h2", "sw", "g2"], ["l-h2", "l-g2"], 60)
    data = {"composition_id": cid, "device": "g2", "old_path": ["h1", "sw", "g2"], "binding": moved}
    log.event("PathRerouted", data, "engine", "repair")
    log.composed("t2", "t2-c1", "h1", gpu1(gbps=64), new_circuits=1)  # l-h1 holds 64 of 100
    assert log.findings().clean(), log.findings().report()
    log.composed("t2", "t2-c2", "h2", memory("h2", 64, gbps=41))  # l-h2: 60 + 41
    assert broken(log.findings()) == {checker.LINK_OVER}


def test_an_ocs_port_in_two_circuits_is_found() -> None:
    log = Log()
    log.imported()
    log.event("CircuitCreated", {**CIRCUIT, "host": "h1"}, "t1", "t1-x")
    log.event("CircuitCreated", {"ocs": "o1", "a_port": 0, "b_port": 2, "host": "h2"}, "t2", "t2-x")
    log.event("CircuitCreated", {"ocs": "o1", "a_port": 2, "b_port": 3, "host": "h2"}, "t2", "t2-y")
    findings = check(log.rows, log.requests, log.acks)
    assert broken(findings) == {checker.PORT_TWICE}
    assert findings.broken[checker.PORT_TWICE] == 2  # port 0, then port 2


def test_reservations_and_releases_of_a_composition_that_is_not_live_are_found() -> None:
    log = busy_day()
    log.event("DevicesReserved", {"composition_id": "c-t1-c1", "devices": [gpu2()]}, "t1", "x")
    log.event("CompositionReleased", {"composition_id": "c-t1-c1"}, "t1", "y")
    findings = check(log.rows, log.requests, log.acks)
    assert broken(findings) == {checker.NOT_LIVE}
    assert findings.broken[checker.NOT_LIVE] == 2


def test_a_missing_version_is_a_gap() -> None:
    log = busy_day()
    del log.rows[5]
    findings = check(log.rows, log.requests, log.acks)
    assert checker.VERSION_GAP in broken(findings)
    assert findings.examples[checker.VERSION_GAP] == [f"{DOMAIN}: version 7 where 6 was due"]


def test_an_edited_event_breaks_the_hash_chain() -> None:
    log = busy_day()
    row = log.rows[1]  # t1's CompositionRequested: its host, changed afterwards
    log.rows[1] = dataclasses.replace(row, data=row.data.replace('"h1"', '"h2"', 1))
    findings = log.findings()
    assert broken(findings) == {checker.CHAIN_BREAK}
    assert findings.examples[checker.CHAIN_BREAK] == [f"{DOMAIN} v2: hash does not match"]


def test_an_event_missing_from_the_stream_is_a_gap() -> None:
    log = busy_day()
    stream = log.stream()
    del stream[4]
    assert broken(log.findings(stream)) == {checker.STREAM_GAP}


def test_an_event_twice_in_the_stream_is_a_duplicate() -> None:
    log = busy_day()
    stream = log.stream()
    stream.append(message(len(stream) + 1, log.rows[2]))
    assert broken(log.findings(stream)) == {checker.STREAM_DUPLICATE}


def test_a_domain_s_events_out_of_version_order_in_the_stream_are_found() -> None:
    log = busy_day()
    stream = log.stream()
    stream[3], stream[4] = stream[4], stream[3]
    assert broken(log.findings(renumbered(stream))) == {checker.STREAM_ORDER}


def test_a_stream_copy_unlike_its_event_is_found() -> None:
    log = busy_day()
    stream = log.stream()
    stream[2] = message(3, log.rows[2], hash="f" * 64)
    stream[3] = message(4, log.rows[3], data={"type": "CompositionReleased"})
    stream.append(StreamMessage(len(stream) + 1, "nobody", json.dumps({"id": "nobody"})))
    findings = log.findings(stream)
    assert broken(findings) == {checker.STREAM_UNLIKE}
    assert findings.broken[checker.STREAM_UNLIKE] == 3
