"""Strict decoding of request bodies into intents: every bad input is `invalid` with a reason."""

from __future__ import annotations

import pytest

from trellis.engine.core.intents import (
    MAX_BODY_BYTES,
    BlastRadiusQuery,
    Drain,
    Family,
    ImportTopology,
    InvalidIntent,
    decode_intent,
)


def test_decodes_a_valid_import() -> None:
    body = b'{"request_id": "r1", "nodes": [{"id": "h", "kind": "host"}], "links": []}'
    intent = decode_intent("admin", "import-topology", body)
    assert isinstance(intent, ImportTopology) and intent.nodes[0].id == "h"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"request_id": "r", "id": "sw-1", "extra": 1}', "unknown field `extra`"),
        (b'{"request_id": "r", "id": 5}', "Expected `str`"),
        (b'{"request_id": "r", "id": "a.b"}', "Expected an id"),
        (b'{"request_id": "r", "id": "' + b"x" * 65 + b'"}', "Expected an id"),
        (b'{"id": "sw-1"}', "missing required field `request_id`"),
        (b'{"request_id": "", "id": "sw-1"}', "length"),
        (b"[1, 2]", "Expected `object`"),
        (b"{nope", "not valid JSON"),
        (b'{"request_id": "r", "id": "sw-1"', "not valid JSON: Input data was truncated"),
        (b'{"request_id": "r\\ud800", "id": "sw-1"}', "lone surrogate"),
        (b'{"request_id": "\\ud800", "id": "sw-1"}', "lone surrogate"),
        (b'{"request_id": "r\\ud800", "id": NaN}', "not valid JSON: JSON is malformed"),
        (b'{"request_id": "r", "id": "sw-1", "id": "sw-2"}', "'id' is named twice"),
    ],
)
def test_rejects_bad_drain_bodies_with_a_readable_reason(body: bytes, reason: str) -> None:
    with pytest.raises(InvalidIntent, match=reason):
        decode_intent("admin", "drain", body)


def test_rejects_unknown_verbs_and_names_the_known_ones() -> None:
    with pytest.raises(InvalidIntent, match=r"expected one of .*drain"):
        decode_intent("admin", "explode", b"{}")


def test_rejects_bodies_over_one_mebibyte_before_parsing() -> None:
    with pytest.raises(InvalidIntent, match="limit"):
        decode_intent("admin", "drain", b" " * (MAX_BODY_BYTES + 1))


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        ('{"id": "o", "kind": "ocs"}', "needs `ports`"),
        ('{"id": "s", "kind": "switch", "ports": 4}', "only valid on an ocs"),
        ('{"id": "d", "kind": "device"}', "needs `device_kind`"),
        ('{"id": "m", "kind": "device", "device_kind": "memory"}', "needs `capacity_gib`"),
        ('{"id": "h", "kind": "host", "model": "x"}', "only valid on a device"),
        ('{"id": "h", "kind": "host", "latency_ns": 5}', "only valid on a switch or ocs"),
        ('{"id": "g", "kind": "device", "device_kind": "tpu"}', "Invalid enum value"),
    ],
)
def test_rejects_nodes_whose_fields_do_not_fit_their_kind(node: str, reason: str) -> None:
    with pytest.raises(InvalidIntent, match=reason):
        decode_intent("admin", "add-node", f'{{"request_id": "r", "node": {node}}}'.encode())


def test_an_empty_query_body_means_no_filters() -> None:
    assert decode_intent("query", "topology", b"") is not None


def test_drain_defaults() -> None:
    assert decode_intent("admin", "drain", b'{"request_id": "r", "id": "x"}') == Drain(
        request_id="r", id="x"
    )


@pytest.mark.parametrize(
    ("verb", "field"),
    [("report-fault", "component"), ("drain", "id"), ("undrain", "id")],
)
def test_admin_marks_accept_an_ocs_port_as_ocs_colon_port(verb: str, field: str) -> None:
    extra = ', "state": "failed"' if verb == "report-fault" else ""
    body = f'{{"request_id": "r", "{field}": "ocs-1:3"{extra}}}'.encode()
    assert getattr(decode_intent("admin", verb, body), field) == "ocs-1:3"
    assert decode_intent("query", "blast-radius", b'{"id": "ocs-1:0"}') == BlastRadiusQuery(
        id="ocs-1:0"
    )


@pytest.mark.parametrize("ref", ["ocs-1:x", "ocs-1:", ":3", "ocs-1:03", "ocs-1:3:4", "ocs-1:-1"])
def test_rejects_malformed_port_references_with_a_readable_reason(ref: str) -> None:
    body = f'{{"request_id": "r", "component": "{ref}", "state": "failed"}}'.encode()
    with pytest.raises(InvalidIntent, match="or `<ocs id>:<port>`"):
        decode_intent("admin", "report-fault", body)
    with pytest.raises(InvalidIntent, match="or `<ocs id>:<port>`"):
        decode_intent("query", "blast-radius", f'{{"id": "{ref}"}}'.encode())


@pytest.mark.parametrize(
    ("family", "verb", "body"),
    [
        ("admin", "remove", b'{"request_id": "r", "id": "ocs-1:3"}'),
        ("query", "why", b'{"id": "ocs-1:3"}'),
    ],
)
def test_remove_and_why_still_take_plain_ids_only(family: Family, verb: str, body: bytes) -> None:
    with pytest.raises(InvalidIntent, match="Expected an id") as err:
        decode_intent(family, verb, body)
    assert "<ocs id>" not in str(err.value)
