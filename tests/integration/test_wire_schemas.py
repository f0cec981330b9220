"""Real messages of a running engine validate against schema/json (issue 12 item 6).

A client in another language generates its types from schema/json and validates every
message with them. Here the engine serves on real NATS and Postgres; the requests it is sent,
the replies it gives (successes and errors), the stream messages the relay publishes and the
KV values it writes are each validated with `jsonschema` (draft 2020-12) against the committed
files, and wrong bodies must fail against their subject's schema.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest_asyncio
from fabrics import fabric
from harness import Harness, serving

from trellis.adapters.nats.jetstream import bucket_name, stream_name
from trellis.adapters.postgres.migrations import SCHEMA_DIR

DOMAIN = "wire"
FILES = ("intents", "events", "replies", "stream", "kv")
DOCS = {n: json.loads((SCHEMA_DIR / "json" / f"{n}.schema.json").read_text()) for n in FILES}


def check(name: str, value: Any, definition: str | None = None) -> None:
    """Validate `value` against a file's root, or against one of its `$defs`."""
    doc = DOCS[name]
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert doc["$id"] == f"urn:trellis:contract:{name}"
    schema = doc if definition is None else {**doc, "anyOf": [{"$ref": f"#/$defs/{definition}"}]}
    schema = {k: v for k, v in schema.items() if k not in ("$ref", "oneOf")}
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(value)


def invalid(name: str, value: Any, definition: str) -> bool:
    try:
        check(name, value, definition)
    except jsonschema.ValidationError:
        return True
    return False


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


async def test_requests_replies_events_and_kv_values_match_the_committed_schemas(
    h: Harness, subject_prefix: str
) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    replies: list[dict[str, Any]] = []

    async def ask(subject: str, body: dict[str, Any]) -> dict[str, Any]:
        family, rest = subject.split(".", 1)
        verb = rest.rsplit(".", 1)[-1]
        sent.append((f"{family}.{verb}", body))
        reply = await h.client.raw(subject, json.dumps(body).encode())
        replies.append(reply)
        return reply

    await ask(f"admin.{DOMAIN}.import-topology", {**fabric(), "request_id": "topo"})
    compose = {"request_id": "c1", "host": "host-01", "devices": [{"kind": "gpu"}]}
    composed = await ask(f"intent.{DOMAIN}.acme.compose", {**compose, "lease_seconds": 600})
    assert composed["ok"], composed
    cid = composed["result"]["composition_id"]
    await ask(f"admin.{DOMAIN}.drain", {"request_id": "d1", "id": "nic-01", "reason": "rma"})
    await ask(f"query.{DOMAIN}.free", {"kind": "gpu"})
    await ask(f"query.{DOMAIN}.composition", {"id": cid})
    await ask(f"view.{DOMAIN}.acme.connections", {})
    refused = await ask(
        f"intent.{DOMAIN}.acme.release", {"request_id": "r0", "composition_id": "c-none"}
    )
    assert not refused["ok"] and refused["error"]["code"] == "not_found", refused
    await ask(f"intent.{DOMAIN}.acme.release", {"request_id": "r1", "composition_id": cid})

    for subject, body in sent:
        check("intents", body, subject)
        check("intents", body)  # the root admits a body of any subject
    for reply in replies:
        check("replies", reply)
    check("replies", refused, "ErrorReply")
    # A body is checked against its own subject's schema, not any.
    assert invalid("intents", compose, "intent.release")
    assert invalid("intents", {**compose, "colour": "red"}, "intent.compose")
    assert invalid("intents", {"request_id": "x", "composition_id": "a.b"}, "intent.release")

    # The feed: every stream message and KV value the relay wrote for this domain.
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
        check("stream", envelope)
        check("events", envelope["data"])
        types.add(envelope["type"])
        if envelope["position"] >= head:
            break
    await sub.unsubscribe()
    assert {"TopologyImported", "CompositionActivated", "CompositionReleased"} <= types, types

    kv = await js.key_value(bucket_name(subject_prefix))
    kinds = {"device": "DeviceEntry", "composition": "CompositionEntry", "host": "HostEntry"}
    seen = set()
    for key in await kv.keys():
        domain, kind, _ = key.split(".", 2)
        entry = await kv.get(key)
        if domain != DOMAIN or not entry.value:
            continue
        value = json.loads(entry.value)
        check("kv", value)
        check("kv", value, kinds[kind])
        seen.add(kind)
    assert seen >= {"device", "host"}, seen
