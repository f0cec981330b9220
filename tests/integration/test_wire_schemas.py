"""Real messages of a running engine validate against schema/json (issue 12 item 6).

A client in another language generates its types from schema/json and validates every
message with them. Here the engine serves on real NATS and Postgres and is asked over every
request-reply subject (each intent, admin verb, query and tenant view, with errors of several
codes); each request body is validated against its subject's request schema and each reply,
as the engine sent it, against its subject's reply schema, with `jsonschema` (draft 2020-12,
formats checked). Replies are also checked against the schemas closed (no field they do not
name), so a field the engine sends that the Structs do not describe fails too. Wrong bodies
and wrong replies must fail. Then every stream message the relay publishes and every KV
value it writes are validated likewise.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Any, NamedTuple, cast

import jsonschema
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric, gpu, link
from harness import Harness, ManualClock, serving
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.nats.jetstream import bucket_name, stream_name
from trellis.adapters.postgres.migrations import SCHEMA_DIR
from trellis.engine.core.intents import INTENTS
from trellis.engine.core.throttle import RateLimit

DOMAIN = "wire"
FILES = ("intents", "events", "replies", "stream", "kv")
DOCS = {n: json.loads((SCHEMA_DIR / "json" / f"{n}.schema.json").read_text()) for n in FILES}
# Every request-reply subject, as the schema files name them: `<family>.<verb>`.
SUBJECTS = {f"{family}.{verb}" for family, verb in INTENTS} | {
    f"view.{verb}" for family, verb in INTENTS if family == "query" and verb != "fabric"
}

FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _is_rfc3339(value: object) -> bool:
    """RFC 3339 with a zone (jsonschema checks date-time only with an extra package)."""
    if not isinstance(value, str):
        return True
    parsed = datetime.fromisoformat(value)
    return "T" in value and parsed.tzinfo is not None


def closed(node: Any) -> Any:
    """A schema with every object that lists its properties closed to any other field."""
    if isinstance(node, list):
        return [closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: closed(v) for k, v in node.items()}
    if isinstance(node.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


REGISTRY: Registry[Any] = Registry().with_resources(
    (d["$id"], Resource.from_contents(d, default_specification=DRAFT202012)) for d in DOCS.values()
)


@functools.cache
def document(name: str, *, strict: bool = False) -> tuple[dict[str, Any], Registry[Any]]:
    """A file, checked as a draft 2020-12 schema (closed, when `strict`), and the registry
    that resolves its `$ref`s."""
    doc = DOCS[name]
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert doc["$id"] == f"urn:trellis:contract:{name}"
    jsonschema.Draft202012Validator.check_schema(doc)
    if not strict:
        return doc, REGISTRY
    doc = closed(doc)
    # `#/$defs/...` resolves against the `$id`: the closed document must be the one found.
    return doc, REGISTRY.with_resource(doc["$id"], DRAFT202012.create_resource(doc))


@functools.cache
def validator(name: str, definition: str | None = None, *, strict: bool = False) -> Any:
    """A validator of a file's root or of one of its `$defs`, the other files beside it."""
    doc, registry = document(name, strict=strict)
    schema = doc
    if definition is not None:
        assert definition in doc["$defs"], definition
        root = ("anyOf", "oneOf", "discriminator", "$ref")
        schema = {k: v for k, v in doc.items() if k not in root}
        schema["$ref"] = f"#/$defs/{definition}"
    return jsonschema.Draft202012Validator(schema, registry=registry, format_checker=FORMATS)


def check(name: str, value: Any, definition: str | None = None, *, strict: bool = False) -> None:
    validator(name, definition, strict=strict).validate(value)


def invalid(name: str, value: Any, definition: str) -> bool:
    return not validator(name, definition).is_valid(value)


class Exchange(NamedTuple):
    subject: str  # `<family>.<verb>`
    request: bytes
    reply: bytes


class Wire:
    """Asks the engine as any client would and keeps every exchange, byte for byte."""

    def __init__(self, h: Harness, prefix: str):
        self.h = h
        self.prefix = prefix
        self.exchanges: list[Exchange] = []

    async def ask(self, tail: str, body: dict[str, Any]) -> dict[str, Any]:
        family, rest = tail.split(".", 1)
        request = json.dumps(body).encode()
        msg = await self.h.client.nc.request(f"{self.prefix}.{tail}", request, timeout=10)
        self.exchanges.append(Exchange(f"{family}.{rest.rsplit('.', 1)[-1]}", request, msg.data))
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    async def admin(self, verb: str, request_id: str, **body: Any) -> dict[str, Any]:
        return await self.ask(f"admin.{DOMAIN}.{verb}", {"request_id": request_id, **body})

    async def intent(self, tenant: str, verb: str, request_id: str, **body: Any) -> dict[str, Any]:
        tail = f"intent.{DOMAIN}.{tenant}.{verb}"
        return await self.ask(tail, {"request_id": request_id, **body})

    async def query(self, what: str, body: dict[str, Any], view: str | None = None) -> Any:
        tail = f"view.{DOMAIN}.{view}.{what}" if view else f"query.{DOMAIN}.{what}"
        return await self.ask(tail, body)

    def replies(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for exchange in self.exchanges:
            yield exchange.subject, json.loads(exchange.reply)


async def every_subject(h: Harness, w: Wire) -> None:
    """Each intent, admin verb, query and view at least once with success, and errors of
    several codes, on the standard little hall."""
    expect_ok(await w.admin("import-topology", "topo", **fabric()))
    assert expect_ok(await w.admin("import-topology", "t2", **fabric()))["unchanged"] is True
    expect_ok(await w.admin("set-quota", "q1", tenant="acme", kind="gpu", count=1))
    expect_ok(await w.admin("set-quota", "q2", tenant="acme", kind="memory", capacity_gib=1024))

    compose = {
        "host": "host-01",
        "devices": [{"kind": "gpu", "bandwidth_gbps": 16}],
        "constraints": {"max_hops": 4, "labels": {}},
        "lease_seconds": 600,
        "labels": {"workload": "decode"},
        "reason": "wire test",
    }
    composed = expect_ok(await w.intent("acme", "compose", "c1", **compose))
    cid, gpu_id = composed["composition_id"], composed["devices"][0]["id"]
    assert (await w.intent("acme", "compose", "c1", **compose))["replayed"] is True
    slice_ = [{"kind": "memory", "capacity_gib": 256}]
    expect_ok(await w.intent("acme", "compose", "c2", host="host-01", devices=slice_))
    one_gpu = {"host": "host-01", "devices": [{"kind": "gpu"}]}
    expect_error(await w.intent("acme", "compose", "c3", **one_gpu), "quota")
    expect_ok(await w.admin("clear-quota", "q3", tenant="acme", kind="gpu"))
    b200 = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["B200"]}]}
    expect_error(await w.intent("globex", "compose", "c4", **b200), "no_capacity")
    cast(SimulatedFabric, h.fabric).fail_next("bind")
    nic = [{"kind": "nic"}]
    expect_error(await w.intent("globex", "compose", "c5", host="host-01", devices=nic), "failed")
    expect_error(await w.intent("globex", "release", "r0", composition_id=cid), "not_found")
    expect_error(await w.intent("acme", "release", "c1", composition_id=cid), "conflict")
    expect_error(await w.intent("acme", "release", "r1", composition_id="c-none"), "not_found")
    expect_error(await w.intent("acme", "compose", "c6", **one_gpu, colour="red"), "invalid")
    expect_error(await w.intent("engine", "compose", "c7", **one_gpu), "forbidden")
    # A tenant past its burst (the clock stands still here: no token comes back).
    burst = RateLimit().burst
    for i in range(burst):
        await h.client.intent(DOMAIN, "flooder", "release", {"composition_id": f"c-{i}"})
    throttled = await w.intent("flooder", "release", "f1", composition_id="c-none")
    assert expect_error(throttled, "throttled")["details"]["retry_after_ms"] > 0
    extended = await w.intent("acme", "extend", "e1", composition_id=cid, lease_seconds=1200)
    expect_ok(extended)
    # Reservations: reserve, apply one, cancel another, leave a third held (the queries below
    # and the KV bucket show it); preview as the operator and as a tenant.
    memory = {"host": "host-01", "devices": [{"kind": "memory", "capacity_gib": 128}]}
    made = expect_ok(
        await w.intent("globex", "reserve", "v1", manifest=memory, duration_seconds=600)
    )
    expect_ok(await w.intent("globex", "apply", "v2", reservation_id=made["reservation_id"]))
    nic_id = {"host": "host-01", "device_ids": ["nic-01"]}
    again = expect_ok(await w.intent("globex", "reserve", "v3", manifest=nic_id))
    rid = again["reservation_id"]
    expect_ok(await w.intent("globex", "cancel-reservation", "v4", reservation_id=rid))
    expect_error(await w.intent("globex", "apply", "v5", reservation_id=rid), "conflict")
    expect_ok(await w.intent("acme", "reserve", "v6", manifest=nic_id))
    expect_error(await w.intent("globex", "reserve", "v7", manifest=nic_id), "no_capacity")
    slice_64 = {
        "manifest": {"host": "host-01", "devices": [{"kind": "memory", "capacity_gib": 64}]}
    }
    expect_ok(await w.query("preview", slice_64))
    expect_ok(await w.query("preview", slice_64, view="acme"))

    expect_ok(await w.admin("add-node", "n1", node=gpu("gpu-03")))
    cable = link("l-gpu-03", "gpu-03", "ocs-1", b_port=4, capacity_gbps=64)
    expect_ok(await w.admin("add-link", "n2", link=cable))
    spare = {"id": "nvme-02", "kind": "device", "device_kind": "nvme", "capacity_gib": 1024}
    expect_ok(await w.admin("add-node", "n3", node=spare))
    expect_ok(await w.admin("remove", "n4", id="nvme-02"))
    expect_error(await w.admin("remove", "n5", id="nvme-99"), "not_found")
    expect_ok(await w.admin("drain", "m1", id="nic-01", reason="rma"))
    expect_ok(await w.admin("undrain", "m2", id="nic-01"))
    port = {"gpu-01": 1, "gpu-02": 2}[gpu_id]  # the OCS port the composed GPU is cabled to
    fault = {"component": f"ocs-1:{port}", "state": "degraded", "detail": "flaky"}
    assert expect_ok(await w.admin("report-fault", "f1", **fault))["link"] is not None
    # A host that is down impairs what it holds, with nothing to repair it with.
    down = {"component": "host-01", "state": "failed", "detail": "psu"}
    expect_ok(await w.admin("report-fault", "f2", **down))
    expect_ok(await w.admin("checkpoint", "k1"))

    await h.projected(DOMAIN)
    logged = [r async for r in h.store.read(DOMAIN)]
    head = logged[-1].version
    impaired = expect_ok(await w.query("composition", {"id": cid}))
    assert impaired["state"] == "impaired" and impaired["impaired_by"], impaired
    held = impaired["devices"][0]["id"]  # a repair may have replaced the first one
    for what, body in [
        ("topology", {}),
        ("free", {}),
        ("free", {"kind": "memory"}),
        ("blast-radius", {"id": "sw-1"}),
        ("blast-radius", {"id": "ocs-1:1"}),
        ("connections", {}),
        ("why", {"id": held}),
        ("why", {"id": "host-01"}),
        ("why", {"id": "l-host"}),
        ("why", {"id": cid}),
        ("quotas", {}),
        ("reservations", {}),
        ("proof", {"event_id": logged[0].id}),
        ("consistency", {"from_size": 1, "to_size": head}),
        ("checkpoint-key", {}),
    ]:
        expect_ok(await w.query(what, body))
        expect_ok(await w.query(what, body, view="acme"))
    expect_ok(await w.query("fabric", {}))  # the operator's; a tenant's view has no fabric
    expect_ok(await w.query("composition", {"id": cid, "at": extended["position"]}))
    expect_error(await w.query("free", {"kind": "quantum"}), "invalid")
    expect_error(await w.query("consistency", {"from_size": 1, "to_size": head + 9}), "invalid")
    expect_error(await w.ask("query.nowhere.topology", {}), "not_found")
    expect_error(await w.query("composition", {"id": cid}, view="globex"), "not_found")
    expect_error(await w.query("free", {}, view="engine"), "forbidden")

    expect_ok(await w.admin("report-fault", "f3", component="host-01", state="healthy"))
    expect_ok(await w.intent("acme", "release", "r2", composition_id=cid))
    await h.projected(DOMAIN)
    for what, body in (("history", {}), ("composition", {"id": cid}), ("why", {"id": held})):
        expect_ok(await w.query(what, body))
        expect_ok(await w.query(what, body, view="acme"))


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, clock=ManualClock()
    ) as harness:
        yield harness


async def test_every_subject_replies_as_its_schema_says(h: Harness, subject_prefix: str) -> None:
    w = Wire(h, subject_prefix)
    await every_subject(h, w)

    succeeded, codes = set(), set()
    for exchange in w.exchanges:
        reply = json.loads(exchange.reply)
        if reply["ok"] or reply["error"]["code"] != "invalid":
            check("intents", json.loads(exchange.request), exchange.subject)
        check("replies", reply, exchange.subject)
        check("replies", reply, exchange.subject, strict=True)
        check("replies", reply)  # the root admits the reply of any subject
        if reply["ok"]:
            succeeded.add(exchange.subject)
        else:
            check("replies", reply, "ErrorReply", strict=True)
            codes.add(reply["error"]["code"])
    assert succeeded == SUBJECTS, SUBJECTS - succeeded
    assert codes >= {
        "invalid", "not_found", "forbidden", "conflict", "quota", "no_capacity", "throttled"
    }  # fmt: skip
    assert "failed" in codes

    # A body is checked against its own subject's schema, not any.
    compose = json.loads(next(e.request for e in w.exchanges if e.subject == "intent.compose"))
    assert invalid("intents", compose, "intent.release")
    assert invalid("intents", {**compose, "colour": "red"}, "intent.compose")
    assert invalid("intents", {"request_id": "x", "composition_id": "a.b"}, "intent.release")


async def test_a_wrong_reply_fails_its_subjects_schema(h: Harness, subject_prefix: str) -> None:
    """The reply schemas can fail: a real reply, changed in one place, no longer validates."""
    w = Wire(h, subject_prefix)
    await every_subject(h, w)
    first = {subject: reply for subject, reply in reversed(list(w.replies())) if reply["ok"]}

    def changed(subject: str, edit: Any) -> dict[str, Any]:
        reply = copy.deepcopy(first[subject])
        edit(reply["result"])
        check("replies", first[subject], subject)  # the real one passes
        return reply

    wrong = {
        "intent.compose": changed("intent.compose", lambda r: r["devices"][0].update(hops="2")),
        "intent.extend": changed("intent.extend", lambda r: r.update(expires_at="tomorrow")),
        "admin.drain": changed("admin.drain", lambda r: r.update(health="purple")),
        "query.topology": changed("query.topology", lambda r: r.pop("circuits")),
        "query.why": changed("query.why", lambda r: r["connected_to"][0].update(path="p")),
        "view.history": changed("view.history", lambda r: r["intervals"][0].update(end=3)),
        "query.proof": changed("query.proof", lambda r: r.update(leaf_index=-0.5)),
    }
    for subject, reply in wrong.items():
        assert invalid("replies", reply, subject), subject
    # Another subject's answer is not this one's, and an error needs its code.
    assert invalid("replies", first["query.free"], "query.topology")
    error = next(r for _, r in w.replies() if not r["ok"])
    assert invalid("replies", {**error, "error": {"message": "no code"}}, "intent.compose")


async def test_stream_messages_and_kv_values_match_the_committed_schemas(
    h: Harness, subject_prefix: str
) -> None:
    await every_subject(h, Wire(h, subject_prefix))

    await h.relayed(DOMAIN)
    js = h.client.nc.jetstream()
    sub = await js.subscribe(
        f"{subject_prefix}.events.{DOMAIN}.*", stream=stream_name(subject_prefix),
        ordered_consumer=True,
    )  # fmt: skip
    head = (await h.store.head(DOMAIN)).position
    types = set()
    async for msg in sub.messages:
        envelope = json.loads(msg.data)
        check("stream", envelope, strict=True)
        check("events", envelope["data"])
        check("events", envelope["data"], envelope["type"], strict=True)
        types.add(envelope["type"])
        if envelope["position"] >= head:
            break
    await sub.unsubscribe()
    assert {"TopologyImported", "CompositionActivated", "CompositionImpaired"} <= types, types
    assert invalid("stream", {**envelope, "data": {"type": "CompositionReleased"}}, "Envelope")

    kv = await js.key_value(bucket_name(subject_prefix))
    kinds = {
        "device": "DeviceEntry",
        "composition": "CompositionEntry",
        "host": "HostEntry",
        "reservation": "ReservationEntry",
    }
    seen = set()
    for key in await kv.keys():
        domain, kind, _ = key.split(".", 2)
        entry = await kv.get(key)
        if domain != DOMAIN or not entry.value:
            continue
        value = json.loads(entry.value)
        check("kv", value)
        check("kv", value, kinds[kind], strict=True)
        seen.add(kind)
    assert seen >= {"device", "host", "reservation"}, seen


async def test_composition_conditions_in_kv_match_the_schema_in_every_state(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    """Every value the relay puts for a composition, pending, active, failed and impaired,
    validates (closed) against kv.schema.json, and its conditions say that state."""
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, clock=ManualClock(), saga_deadline=3.0
    ) as h:
        w = Wire(h, subject_prefix)
        puts: list[dict[str, Any]] = []

        async def kept(msg: Any) -> None:
            if msg.data:  # a delete or purge marker has none
                puts.append(json.loads(msg.data))

        bucket = bucket_name(subject_prefix)
        sub = await h.client.nc.subscribe(f"$KV.{bucket}.{DOMAIN}.composition.>", cb=kept)
        sim = cast(SimulatedFabric, h.fabric)
        expect_ok(await w.admin("import-topology", "topo", **fabric()))
        one_gpu = {"host": "host-01", "devices": [{"kind": "gpu"}]}

        sim.hang_next("bind")  # pending until the saga's deadline, then failed
        hung = asyncio.create_task(w.intent("acme", "compose", "c-hung", **one_gpu))
        await until(lambda: any(p["state"] == "pending" for p in puts))
        expect_error(await hung, "failed")
        cid = expect_ok(await w.intent("acme", "compose", "c-ok", **one_gpu))["composition_id"]
        await h.relayed(DOMAIN)  # put active before the fault, not coalesced with it
        down = {"component": "host-01", "state": "failed", "detail": "psu"}
        expect_ok(await w.admin("report-fault", "f1", **down))
        await h.relayed(DOMAIN)
        await h.client.nc.flush()  # every put the server passed on has arrived
        await sub.unsubscribe()

    by_state: dict[str, dict[str, Any]] = {}
    for value in puts:
        check("kv", value, "CompositionEntry", strict=True)
        by_state[value["state"]] = {c["type"]: c for c in value["conditions"]}
    assert set(by_state) >= {"pending", "active", "failed", "impaired"}, set(by_state)
    status = {s: {t: c["status"] for t, c in conds.items()} for s, conds in by_state.items()}
    assert status["pending"] == {
        "Bound": "True", "PathEstablished": "False", "Ready": "False", "Impaired": "False",
        "Failed": "False",
    }  # fmt: skip
    assert status["active"]["Ready"] == "True" and status["active"]["PathEstablished"] == "True"
    failed = by_state["failed"]["Failed"]
    assert failed["status"] == "True" and failed["reason"] == "CompositionFailed"
    assert "bind" in failed["message"] and failed["components"]
    impaired = by_state["impaired"]
    assert status["impaired"]["Impaired"] == "True" and status["impaired"]["Ready"] == "False"
    last = next(p for p in reversed(puts) if p["state"] == "impaired")
    assert impaired["Impaired"]["components"] == last["impaired_by"] and cid
    # A condition is stamped with the log position of the event that moved it, never later.
    assert all(c["observed_position"] <= last["position"] for c in impaired.values())


async def until(ready: Any, timeout: float = 10.0) -> None:
    """Wait, bounded, for `ready()` to be true (what the relay puts arrives asynchronously)."""
    async with asyncio.timeout(timeout):
        while not ready():
            await asyncio.sleep(0.02)
