"""The wire's limits, checked once at the boundary (issue 9 item 1, ARCHITECTURE §1).

An id matches its pattern as a whole string (no trailing newline), every integer fits int64,
every number is finite and bounded so that the sums the engine forms stay finite and in range,
strings, lists and maps have bounded length, and nesting cannot go deeper than the Structs.
Anything else is `invalid` before decide sees it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from trellis.adapters.postgres.migrations import SCHEMA_DIR
from trellis.engine.core.ids import COMPONENT_REF_PATTERN, ID_PATTERN, is_valid_id
from trellis.engine.core.intents import (
    INTENTS,
    MAX_BODY_BYTES,
    MAX_TOPOLOGY_ITEMS,
    Family,
    ImportTopology,
    InvalidIntent,
    decode_intent,
)

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

NODE = {"id": "sw-1", "kind": "switch"}
OCS = {"id": "ocs-1", "kind": "ocs", "ports": 8}
GPU = {"id": "g-1", "kind": "device", "device_kind": "gpu", "generation": 9}
MEM = {"id": "m-1", "kind": "device", "device_kind": "memory", "capacity_gib": 512}
LINK = {"id": "l-1", "a": "h-1", "b": "ocs-1", "b_port": 3, "capacity_gbps": 64}
GPUS = {"kind": "gpu", "count": 1, "bandwidth_gbps": 8}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def decode(family: str, verb: str, body: bytes) -> msgspec.Struct:
    return decode_intent(family, verb, body)  # type: ignore[arg-type]


def refused(family: str, verb: str, body: bytes) -> str:
    """The reason `body` is refused; fails the test when it is accepted."""
    with pytest.raises(InvalidIntent) as err:
        decode(family, verb, body)
    return str(err.value)


# ---- ids: the whole string, in Python and in the JSON Schema's ECMA-262 regex ----

# (family, verb, body with "@" where the id goes): every place an id or a component ref appears.
ID_FIELDS = [
    ("admin", "remove", {"request_id": "r", "id": "@"}),
    ("admin", "drain", {"request_id": "r", "id": "@"}),
    ("admin", "undrain", {"request_id": "r", "id": "@"}),
    ("admin", "report-fault", {"request_id": "r", "component": "@", "state": "failed"}),
    ("admin", "add-node", {"request_id": "r", "node": {"id": "@", "kind": "host"}}),
    ("admin", "add-link", {"request_id": "r", "link": {**LINK, "id": "@"}}),
    ("admin", "add-link", {"request_id": "r", "link": {**LINK, "a": "@"}}),
    ("admin", "add-link", {"request_id": "r", "link": {**LINK, "b": "@"}}),
    ("admin", "import-topology", {"request_id": "r", "nodes": [{"id": "@", "kind": "host"}]}),
    ("admin", "import-topology", {"request_id": "r", "links": [{**LINK, "id": "@"}]}),
    ("admin", "set-quota", {"request_id": "r", "tenant": "@", "kind": "gpu", "count": 1}),
    ("admin", "clear-quota", {"request_id": "r", "tenant": "@", "kind": "gpu"}),
    ("intent", "compose", {"request_id": "r", "host": "@"}),
    ("intent", "compose", {"request_id": "r", "host": "h", "device_ids": ["@"]}),
    ("intent", "release", {"request_id": "r", "composition_id": "@"}),
    ("intent", "extend", {"request_id": "r", "composition_id": "@", "lease_seconds": 60}),
    ("query", "composition", {"id": "@"}),
    ("query", "connections", {"host": "@"}),
    ("query", "connections", {"tenant": "@"}),
    ("query", "connections", {"device": "@"}),
    ("query", "why", {"id": "@"}),
    ("query", "blast-radius", {"id": "@"}),
    ("query", "quotas", {"tenant": "@"}),
]

BAD_IDS = [
    "h01\n",
    "h01\r\n",
    "\nh01",
    "h01\n\n",
    "h.01",
    "h*",
    ">",
    "h 01",
    "h\t01",
    "h\x00",
    "h\u202e01",  # right-to-left override
    "h\u200b01",  # zero-width space
    "hé",
    "",
    "x" * 65,
]


def with_id(body: dict[str, Any], value: str) -> bytes:
    return encode(body).replace(b'"@"', json.dumps(value).encode())


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
@pytest.mark.parametrize(("family", "verb", "body"), ID_FIELDS, ids=lambda v: str(v)[:40])
def test_an_id_must_match_as_a_whole_string(
    family: str, verb: str, body: dict[str, Any], bad: str
) -> None:
    decode(family, verb, with_id(body, "h01"))  # the same body with a good id is accepted
    assert "Expected an id" in refused(family, verb, with_id(body, bad))


@pytest.mark.parametrize("bad", ["ocs-1:3\n", "ocs-1\n:3", "ocs-1:3 ", "ocs-1:65536\n"], ids=repr)
def test_a_component_ref_must_match_as_a_whole_string(bad: str) -> None:
    body = {"request_id": "r", "id": bad}
    assert "<ocs id>:<port>" in refused("admin", "drain", encode(body))


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_subject_tokens_are_checked_as_whole_strings(bad: str) -> None:
    assert is_valid_id("h01") and is_valid_id("A_z-9" * 12 + "abcd")
    assert not is_valid_id(bad)


def schema_patterns() -> Iterator[str]:
    """Every `pattern` in the committed JSON Schema of the request bodies."""

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    yield from walk(json.loads((SCHEMA_DIR / "json" / "intents.schema.json").read_text()))


def test_the_json_schema_carries_the_whole_string_id_patterns() -> None:
    patterns = set(schema_patterns())
    assert {ID_PATTERN, COMPONENT_REF_PATTERN} <= patterns
    # ECMA-262 `$` (no `m` flag) matches only at the very end, like Python's `\Z`: the pattern
    # must mean the same under both readings.
    for pattern in (ID_PATTERN, COMPONENT_REF_PATTERN):
        ecma = pattern.replace("$", r"\Z")
        for value in ("h01", "ocs-1:3", "h01\n", "ocs-1:3\n", "h01\n\n"):
            assert bool(re.search(pattern, value)) == bool(re.search(ecma, value)), value


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node for an ECMA-262 regex")
def test_the_json_schema_id_patterns_refuse_a_trailing_newline_in_ecma_262() -> None:
    script = (
        "const [p, q] = JSON.parse(process.argv[1]);"
        "const v = ['h01', 'h01\\n', 'ocs-1:3', 'ocs-1:3\\n'];"
        "console.log(JSON.stringify([v.map(s => new RegExp(p, 'u').test(s)),"
        " v.map(s => new RegExp(q, 'u').test(s))]))"
    )
    patterns = set(schema_patterns())
    assert {ID_PATTERN, COMPONENT_REF_PATTERN} <= patterns
    arg = json.dumps([ID_PATTERN, COMPONENT_REF_PATTERN])
    out = subprocess.run(
        ["node", "-e", script, arg], capture_output=True, text=True, check=True, timeout=30
    )
    assert json.loads(out.stdout) == [[True, False, False, False], [True, False, True, False]]


# ---- integers: int64, and bounds that keep the core's sums in range ----

# (family, verb, body with 0 where the integer goes, the largest value accepted there)
INT_FIELDS = [
    ("admin", "add-node", {"request_id": "r", "node": {**NODE, "latency_ns": 0}}, 10**9),
    ("admin", "add-node", {"request_id": "r", "node": {**OCS, "latency_ns": 0}}, 10**9),
    ("admin", "add-node", {"request_id": "r", "node": {**GPU, "generation": 0}}, INT64_MAX),
    ("admin", "add-link", {"request_id": "r", "link": {**LINK, "latency_ns": 0}}, 10**9),
    ("admin", "add-link", {"request_id": "r", "link": {**LINK, "b_port": 0}}, 65535),
    ("admin", "add-link", {"request_id": "r", "link": {**LINK, "a_port": 0}}, 65535),
    ("admin", "import-topology", {"request_id": "r", "links": [{**LINK, "latency_ns": 0}]}, 10**9),
    ("intent", "compose", {"request_id": "r", "constraints": {"max_hops": 0}}, INT64_MAX),
    ("intent", "compose", {"request_id": "r", "constraints": {"max_latency_ns": 0}}, INT64_MAX),
    (
        "intent",
        "compose",
        {"request_id": "r", "devices": [{**GPUS, "min_generation": 0}]},
        INT64_MAX,
    ),
    ("query", "why", {"id": "g-1", "at": 0}, INT64_MAX),
]


def with_int(body: dict[str, Any], value: int) -> bytes:
    text = encode(body).decode()
    assert text.count(": 0") == 1, text
    return text.replace(": 0", f": {value}").encode()


@pytest.mark.parametrize(
    ("family", "verb", "body", "largest"), INT_FIELDS, ids=lambda v: str(v)[:48]
)
def test_integers_beyond_their_bound_are_invalid(
    family: str, verb: str, body: dict[str, Any], largest: int
) -> None:
    decode(family, verb, with_int(body, largest))
    for value in (largest + 1, INT64_MAX + 1, 2**64, 10**30, -1, INT64_MIN - 1):
        assert "Expected `int`" in refused(family, verb, with_int(body, value)), value


def test_an_import_with_an_integer_beyond_int64_is_invalid() -> None:
    # The case of issue 9: accepted and committed, then every compose in the domain failed.
    body = {"request_id": "r", "nodes": [{**NODE, "latency_ns": 9223372036854775808}]}
    assert "latency_ns" in refused("admin", "import-topology", encode(body))


# ---- floats: finite, bounded so that sums stay finite ----

FLOAT_FIELDS = [
    ("admin", "add-link", {"request_id": "r", "link": {**LINK, "capacity_gbps": 0.5}}),
    ("admin", "add-node", {"request_id": "r", "node": {**GPU, "memory_gib": 0.5}}),
    ("admin", "add-node", {"request_id": "r", "node": {**GPU, "cost_per_hour": 0.5}}),
    ("admin", "add-node", {"request_id": "r", "node": {**MEM, "capacity_gib": 0.5}}),
    ("intent", "compose", {"request_id": "r", "devices": [{**GPUS, "bandwidth_gbps": 0.5}]}),
    ("intent", "compose", {"request_id": "r", "devices": [{**GPUS, "min_memory_gib": 0.5}]}),
    (
        "intent",
        "compose",
        {"request_id": "r", "devices": [{"kind": "memory", "capacity_gib": 0.5}]},
    ),
]


@pytest.mark.parametrize(
    "raw",
    ["1e400", "-1e400", "1.7e308", "1e13", "NaN", "Infinity", "-Infinity", "-1", "1" + "0" * 400],
)
@pytest.mark.parametrize(("family", "verb", "body"), FLOAT_FIELDS, ids=lambda v: str(v)[:48])
def test_numbers_must_be_finite_and_bounded(
    family: str, verb: str, body: dict[str, Any], raw: str
) -> None:
    text = encode(body).decode()
    decode(family, verb, text.encode())
    decode(family, verb, text.replace("0.5", "1e12").encode())
    refused(family, verb, text.replace("0.5", raw).encode())


# ---- strings ----


@pytest.mark.parametrize(
    "text",
    ['"\\ud800"', '"a\\udfffb"', '"\\u0000"', '"a\\u0007"', '"\\u007f"'],
)
@pytest.mark.parametrize(
    "body",
    [
        '{"request_id": "r", "id": "sw-1", "reason": @}',
        '{"request_id": @, "id": "sw-1"}',
        '{"request_id": "r", "id": "sw-1", "reason": "x", "force": false, "x": @}',
    ],
)
def test_text_without_lone_surrogates_or_control_characters(body: str, text: str) -> None:
    refused("admin", "drain", body.replace("@", text).encode())


@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("text", ['"\\ud800"', '"a\\u0000"'])
def test_label_keys_and_values_are_plain_text(where: str, text: str) -> None:
    label = f'{{{text}: "v"}}' if where == "key" else f'{{"k": {text}}}'
    body = f'{{"request_id": "r", "host": "h", "labels": {label}}}'
    refused("intent", "compose", body.encode())


# ---- lists and maps have bounded length ----


def test_lists_and_maps_are_bounded() -> None:
    labels = {f"k{i}": "v" for i in range(65)}
    cases = [
        ("intent", "compose", {"request_id": "r", "host": "h", "labels": labels}),
        ("intent", "compose", {"request_id": "r", "constraints": {"labels": labels}}),
        ("intent", "compose", {"request_id": "r", "host_selector": {"labels": labels}}),
        ("admin", "add-node", {"request_id": "r", "node": {**NODE, "labels": labels}}),
        ("intent", "compose", {"request_id": "r", "devices": [{**GPUS, "models": ["A"] * 65}]}),
        ("intent", "compose", {"request_id": "r", "devices": [GPUS] * 65}),
        ("intent", "compose", {"request_id": "r", "host": "h", "device_ids": ["g"] * 4097}),
    ]
    for family, verb, body in cases:
        message = refused(family, verb, encode(body))
        assert "length" in message, message


@pytest.mark.parametrize("field", ["nodes", "links"])
def test_topology_lists_are_bounded_beyond_the_body_limit(field: str) -> None:
    """No body within the limit holds that many, so the Struct is asked directly."""
    item = NODE if field == "nodes" else LINK
    body = encode({"request_id": "r", field: [item] * (MAX_TOPOLOGY_ITEMS + 1)})
    assert len(body) > MAX_BODY_BYTES
    with pytest.raises(msgspec.ValidationError, match="length"):
        msgspec.json.decode(body, type=ImportTopology)
    body = encode({"request_id": "r", field: [item] * MAX_TOPOLOGY_ITEMS})
    assert len(getattr(msgspec.json.decode(body, type=ImportTopology), field)) == MAX_TOPOLOGY_ITEMS


# ---- nesting cannot go deeper than the Structs ----


def nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "1" + "}" * depth


def every_field() -> Iterator[tuple[str, str, str]]:
    """(family, verb, field) for every top-level field of every request body."""
    for (family, verb), cls in INTENTS.items():
        for field in msgspec.structs.fields(cls):
            yield family, verb, field.name


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize(("family", "verb", "field"), list(every_field()), ids=str)
def test_thousand_deep_nesting_in_any_field_is_invalid(
    family: str, verb: str, field: str, kind: str
) -> None:
    body = f'{{"request_id": "r", "{field}": {nested(1000, kind)}}}'
    refused(family, verb, body.encode())


@pytest.mark.parametrize(
    "body",
    [
        nested(1000, "array"),
        nested(1000, "object"),
        '{"request_id": "r", "nodes": [{"id": "h", "kind": "host", "labels": '
        + nested(1000, "object")
        + "}]}",
        nested(MAX_BODY_BYTES // 2 - 1, "array"),
        '{"x":' * (MAX_BODY_BYTES // 6) + "}" * (MAX_BODY_BYTES // 6),
    ],
    ids=["array", "object", "in-labels", "deepest-array", "deepest-object"],
)
def test_deep_nesting_of_the_whole_body_is_invalid(body: str) -> None:
    assert len(body) <= MAX_BODY_BYTES
    for family, verb in INTENTS:
        refused(family, verb, body.encode())


# ---- every field of every request body is bounded ----


def leaves(t: mi.Type, where: str, seen: set[type]) -> Iterator[tuple[str, mi.Type]]:
    """Every scalar, list and map type reachable from `t`, with where it is."""
    match t:
        case mi.StructType(cls=cls, fields=fields):
            if cls in seen:
                return
            seen.add(cls)
            for f in fields:
                yield from leaves(f.type, f"{cls.__name__}.{f.name}", seen)
        case mi.UnionType(types=types):
            for member in types:
                yield from leaves(member, where, seen)
        case mi.ListType(item_type=item) | mi.SetType(item_type=item):
            yield where, t
            yield from leaves(item, f"{where}[]", seen)
        case mi.DictType(key_type=key, value_type=value):
            yield where, t
            yield from leaves(key, f"{where}{{key}}", seen)
            yield from leaves(value, f"{where}{{value}}", seen)
        case _:
            yield where, t


@pytest.mark.parametrize(("family", "verb"), sorted(INTENTS), ids=lambda v: str(v))
def test_every_number_string_list_and_map_of_a_body_is_bounded(family: Family, verb: str) -> None:
    unbounded = []
    for where, t in leaves(mi.type_info(INTENTS[(family, verb)]), verb, set()):
        match t:
            case mi.IntType(ge=ge, gt=gt, le=le, lt=lt):
                low = ge if ge is not None else (gt + 1 if gt is not None else None)
                high = le if le is not None else (lt - 1 if lt is not None else None)
                if low is None or high is None or low < INT64_MIN or high > INT64_MAX:
                    unbounded.append(f"{where}: int in [{low}, {high}]")
            case mi.FloatType(ge=ge, gt=gt, le=le, lt=lt):
                if (ge is None and gt is None) or (le is None and lt is None):
                    unbounded.append(f"{where}: float without both bounds")
            case mi.StrType(max_length=None, pattern=pattern):
                if pattern not in (ID_PATTERN, COMPONENT_REF_PATTERN):  # those bound the length
                    unbounded.append(f"{where}: str without max_length")
            case mi.ListType(max_length=None) | mi.DictType(max_length=None):
                unbounded.append(f"{where}: {type(t).__name__} without max_length")
            case mi.StrType() | mi.IntType() | mi.FloatType() | mi.ListType() | mi.DictType():
                pass
            case mi.BoolType() | mi.NoneType() | mi.LiteralType() | mi.DateTimeType():
                pass
            case mi.UUIDType():
                pass  # fixed length by its type
            case _:
                unbounded.append(f"{where}: {t!r} is not checked here")
    assert unbounded == []
