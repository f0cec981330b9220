"""Bad input gets `invalid` with a readable message, writes nothing, and the engine keeps serving.

ARCHITECTURE §3 and §10 (reliability): one case per kind of bad input, each with the words its
message must contain. Every request here travels as raw bytes over NATS, as a broken or hostile
client would send it. The fuzzing of every subject is tests/property/test_hostile_input.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from fabrics import check_envelope, expect_error, expect_ok, fabric, gpu, row_counts
from harness import Harness, serving

from trellis.engine.core.intents import MAX_BODY_BYTES

DOMAIN = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


async def imported(h: Harness) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))


def js(value: Any) -> bytes:
    return json.dumps(value).encode()


async def still_serving(h: Harness, cid: str = "gpu-01") -> None:
    """A valid intent right after the bad one is answered and committed."""
    reply = await h.client.admin(DOMAIN, "drain", {"id": cid})
    assert expect_ok(reply)["component"] == cid


LONG_ID = "x" * 65
CASES: list[tuple[str, str, bytes, str]] = [
    # (case id, subject tail, body, a word the message must contain)
    ("malformed-json", f"admin.{DOMAIN}.drain", b'{"request_id": "r-1", "id": ', "JSON"),
    ("not-utf8", f"admin.{DOMAIN}.drain", b"\xff\xfe{}", "JSON"),
    ("empty-body", f"admin.{DOMAIN}.drain", b"", "JSON"),
    ("json-array", f"admin.{DOMAIN}.drain", js(["r-1", "sw-1"]), "object"),
    ("json-string", f"admin.{DOMAIN}.drain", js("drain sw-1"), "object"),
    ("unknown-field", f"admin.{DOMAIN}.drain", js({"request_id": "r", "id": "sw-1", "x": 1}), "x"),
    ("wrong-type", f"admin.{DOMAIN}.drain", js({"request_id": "r-1", "id": 7}), "id"),
    ("bool-for-id", f"admin.{DOMAIN}.remove", js({"request_id": "r-1", "id": True}), "id"),
    ("id-with-dot", f"admin.{DOMAIN}.drain", js({"request_id": "r-1", "id": "sw.1"}), "id"),
    ("id-with-space", f"admin.{DOMAIN}.drain", js({"request_id": "r-1", "id": "sw 1"}), "id"),
    ("id-65-chars", f"admin.{DOMAIN}.drain", js({"request_id": "r-1", "id": LONG_ID}), "id"),
    ("empty-id", f"admin.{DOMAIN}.drain", js({"request_id": "r-1", "id": ""}), "id"),
    (
        "node-id-with-dot",
        f"admin.{DOMAIN}.add-node",
        js({"request_id": "r-1", "node": {"id": "gpu.9", "kind": "host"}}),
        "id",
    ),
    (
        "ocs-without-ports",
        f"admin.{DOMAIN}.add-node",
        js({"request_id": "r-1", "node": {"id": "ocs-9", "kind": "ocs"}}),
        "ports",
    ),
    (
        "bad-fault-state",
        f"admin.{DOMAIN}.report-fault",
        js({"request_id": "r-1", "component": "sw-1", "state": "on-fire"}),
        "state",
    ),
    ("missing-request-id", f"admin.{DOMAIN}.drain", js({"id": "sw-1"}), "request_id"),
    (
        "empty-request-id",
        f"admin.{DOMAIN}.drain",
        js({"request_id": "", "id": "sw-1"}),
        "request_id",
    ),
    (
        "null-request-id",
        f"admin.{DOMAIN}.drain",
        js({"request_id": None, "id": "sw-1"}),
        "request_id",
    ),
    (
        "domain-with-dollar",
        "admin.bad$dom.drain",
        js({"request_id": "r-1", "id": "sw-1"}),
        "bad$dom",
    ),
    (
        "domain-65-chars",
        f"admin.{LONG_ID}.drain",
        js({"request_id": "r-1", "id": "sw-1"}),
        "domain",
    ),
    ("unknown-verb", f"admin.{DOMAIN}.frobnicate", js({"request_id": "r-1", "id": "sw-1"}), "verb"),
    (
        "intent-verb-on-admin",
        f"admin.{DOMAIN}.compose",
        js({"request_id": "r-1", "host": "host-01"}),
        "verb",
    ),
    (
        "tenant-with-star-char",
        f"intent.{DOMAIN}.ten%ant.release",
        js({"request_id": "r-1", "composition_id": "c-1"}),
        "tenant",
    ),
    ("unknown-query", f"query.{DOMAIN}.everything", b"{}", "verb"),
    ("query-unknown-field", f"query.{DOMAIN}.topology", js({"verbose": True}), "verbose"),
]


@pytest.mark.parametrize(
    ("subject", "body", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_rejects_bad_input_as_invalid_and_writes_nothing(
    h: Harness, database_url: str, pg_schema: str, subject: str, body: bytes, says: str
) -> None:
    # Given: a domain in which the well-formed version of each request would write.
    await imported(h)
    before = await row_counts(database_url, pg_schema)

    reply = await h.client.raw(subject, body)

    check_envelope(reply)
    assert says in expect_error(reply, "invalid")["message"]
    assert await row_counts(database_url, pg_schema) == before
    await still_serving(h)


async def test_rejects_a_request_id_with_a_nul_character_as_invalid(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    await imported(h)
    before = await row_counts(database_url, pg_schema)

    reply = await h.client.raw(f"admin.{DOMAIN}.drain", b'{"request_id": "r\\u0000", "id": "sw-1"}')

    assert await row_counts(database_url, pg_schema) == before
    assert "request_id" in expect_error(reply, "invalid")["message"]


async def test_one_bad_request_does_not_spoil_the_intents_committed_with_it(h: Harness) -> None:
    # Given: many good intents in flight, with one whose request_id the database cannot store.
    await imported(h)
    good = [h.client.admin(DOMAIN, "add-node", {"node": gpu(f"gpu-g{i:02}")}) for i in range(40)]
    bad = h.client.raw(f"admin.{DOMAIN}.drain", b'{"request_id": "r\\u0000", "id": "sw-1"}')

    replies = await asyncio.gather(*good[:20], bad, *good[20:])

    # Then: the good ones are committed, whatever happens to the bad one.
    failed = [r for i, r in enumerate(replies) if i != 20 and not r["ok"]]
    assert failed == []


async def test_rejects_a_body_over_the_engine_limit_sent_over_nats(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    max_payload = h.client.nc.max_payload
    if max_payload <= MAX_BODY_BYTES:
        pytest.skip(
            f"the NATS server's max_payload is {max_payload} bytes, not above the engine's "
            f"{MAX_BODY_BYTES}-byte body limit, so an oversized body cannot reach the engine; "
            "the next two tests cover the limit from both sides"
        )
    await imported(h)
    before = await row_counts(database_url, pg_schema)

    reply = await h.client.raw(f"admin.{DOMAIN}.drain", padded_drain(MAX_BODY_BYTES + 1))

    assert "limit" in expect_error(reply, "invalid")["message"]
    assert await row_counts(database_url, pg_schema) == before
    await still_serving(h)


async def test_rejects_a_body_over_the_engine_limit_handed_to_the_engine(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    """The limit itself, without NATS in the way (its default max_payload equals the limit)."""
    await imported(h)
    before = await row_counts(database_url, pg_schema)

    raw = await h.engine.handle("admin", DOMAIN, None, "drain", padded_drain(MAX_BODY_BYTES + 1))

    reply = msgspec.json.decode(raw)
    check_envelope(reply)
    assert str(MAX_BODY_BYTES) in expect_error(reply, "invalid")["message"]
    assert await row_counts(database_url, pg_schema) == before
    await still_serving(h)


async def test_a_body_of_the_largest_size_nats_carries_gets_an_answer(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    await imported(h)
    before = await row_counts(database_url, pg_schema)
    size = min(h.client.nc.max_payload, MAX_BODY_BYTES)

    reply = await h.client.raw(f"admin.{DOMAIN}.drain", padded_drain(size))

    assert "reason" in expect_error(reply, "invalid")["message"]  # far over the 2048 limit
    assert await row_counts(database_url, pg_schema) == before
    await still_serving(h)


def padded_drain(size: int) -> bytes:
    """A drain of sw-1 whose `reason` pads the body to exactly `size` bytes."""
    shell = js({"request_id": "big-1", "id": "sw-1", "reason": ""})
    body = shell.replace(b'""', b'"' + b"r" * (size - len(shell)) + b'"')
    assert len(body) == size
    return body
