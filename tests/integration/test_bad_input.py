"""Bad input gets `invalid` with a readable message, writes nothing, and the engine keeps serving.

ARCHITECTURE §3 and §10 (reliability): fuzzed intents get `invalid`, write nothing, and the
engine keeps serving. Every request here travels as raw bytes over NATS, as a broken or hostile
client would send it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric, gpu, link, row_counts
from harness import Harness, serving
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.errors import ERROR_CODES
from engine.intents import MAX_BODY_BYTES

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


def check_envelope(reply: dict[str, Any]) -> None:
    """Exactly one of the two reply shapes of ARCHITECTURE §3."""
    if reply.get("ok") is True:
        assert set(reply) == {"ok", "result", "position", "replayed"}, reply
        assert isinstance(reply["position"], int) and reply["position"] >= 0, reply
        assert isinstance(reply["replayed"], bool), reply
    else:
        assert reply.get("ok") is False and set(reply) == {"ok", "error"}, reply
        error = reply["error"]
        assert set(error) == {"code", "message", "details"}, reply
        assert error["code"] in ERROR_CODES, reply
        assert isinstance(error["message"], str) and error["message"], reply
        assert isinstance(error["details"], dict), reply


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


# ---- fuzzing: random JSON-ish bodies at random admin verbs ----

ADMIN_VERBS = ["import-topology", "add-node", "add-link", "remove", "drain", "undrain",
               "report-fault", "compose", "nope"]  # fmt: skip
KNOWN_IDS = ["sw-1", "gpu-01", "l-host", "ocs-1", "host-01", "ghost", "a.b", "", "x" * 65]
FIELDS = [
    *("request_id", "id", "component", "state", "reason", "detail", "force", "node", "link"),
    *("nodes", "links", "kind", "a", "b", "ports", "b_port", "capacity_gbps"),
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.sampled_from([*KNOWN_IDS, "failed", "degraded", "healthy", "ocs", "host", "device"])
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=12,
)


def valid_bodies() -> dict[str, dict[str, Any]]:
    """A well-formed body for each admin verb against the standard fabric."""
    return {
        "import-topology": fabric(),
        "add-node": {"node": gpu("gpu-09")},
        "add-link": {"link": link("l-9", "host-01", "ocs-1", b_port=5)},
        "remove": {"id": "l-nic"},
        "drain": {"id": "sw-1"},
        "undrain": {"id": "sw-1"},
        "report-fault": {"component": "gpu-02", "state": "degraded"},
    }


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body for a random verb with at most one field dropped, replaced or added; request
    ids come from a small pool, so resends and conflicting reuses happen too."""
    verb = draw(st.sampled_from(sorted(valid_bodies())))
    body = {"request_id": draw(st.sampled_from(["fz-1", "fz-2", "fz-3"])), **valid_bodies()[verb]}
    key = draw(st.sampled_from(sorted(body)) | st.sampled_from(FIELDS))
    match draw(st.sampled_from(["keep", "keep", "drop", "replace"])):
        case "drop":
            body.pop(key, None)
        case "replace":
            body[key] = draw(json_values)
    return verb, js(body)


# Intent-shaped bodies (many get past the decoder), random JSON and random bytes, at any verb.
anything = st.tuples(
    st.sampled_from(ADMIN_VERBS),
    st.fixed_dictionaries({}, optional={f: json_values for f in FIELDS}).map(js)
    | json_values.map(js)
    | st.binary(max_size=64),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=near_valid() | near_valid() | anything)
async def test_fuzzed_admin_bodies_get_valid_envelopes_and_invalid_ones_write_nothing(
    h: Harness, database_url: str, pg_schema: str, request: tuple[str, bytes]
) -> None:
    verb, body = request
    if h.engine.state(DOMAIN) is None or not h.engine.state(DOMAIN).exists:  # type: ignore[union-attr]
        await imported(h)  # a fuzzed import may have emptied the domain; start over
    conn = await asyncpg.connect(database_url, server_settings={"search_path": pg_schema})
    try:
        count = (
            "SELECT (SELECT count(*) FROM trellis_events), (SELECT count(*) FROM trellis_requests)"
        )
        before = tuple(await conn.fetchrow(count))

        reply = await h.client.raw(f"admin.{DOMAIN}.{verb}", body)

        check_envelope(reply)
        event(f"{verb}: {reply['error']['code'] if not reply['ok'] else 'ok'}")
        if not reply["ok"]:
            assert reply["error"]["code"] != "unavailable", reply  # nothing here may crash it
            assert tuple(await conn.fetchrow(count)) == before, reply
        answer = await h.client.query(DOMAIN, "topology")
        check_envelope(answer)
    finally:
        await conn.close()
