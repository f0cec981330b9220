"""Hostile input on every subject: a typed refusal, nothing written, every domain still serving.

Issue 9 (items 1 and 10). Hypothesis builds requests that break the wire contract (ARCHITECTURE
§1, §3, §4) in one place, for every subject in SUBJECTS (intents, admin verbs, queries and the
tenant-scoped views; a test fails when a verb or view is missing), and derives them from the
request Structs themselves (msgspec.inspect), so every field of every body is a target:
- a field of the wrong JSON type, a required field missing, an unknown field (odd unicode keys
  included), 1,000-deep nesting in place of any value;
- integers beyond int64 or beyond the field's bound, negative ones where they are not allowed;
  numbers beyond a double (`1e400`), `NaN` and `Infinity` literals, and finite ones beyond the
  bound that keeps sums finite;
- ids with `.`, `*`, `>`, spaces, tabs, newlines (a trailing one too), NUL, right-to-left marks,
  zero-width spaces, lone surrogates (as JSON escapes), too long or empty; text with control
  characters or lone surrogates, or too long; lists and maps one entry over their bound;
- bodies that are not JSON, not an object, 1,000-deep, or over the body limit; the domain and
  tenant tokens of the subject as hostile ids;
- request ids reused with another body.

Each example sends one such request to every subject at once, over real NATS to the real engine
on real Postgres, and requires a typed refusal:
- `invalid` for whatever breaks the contract. Not `not_found`: a malformed id that is looked
  up at all (the "h01\\n" of issue 9) has got past validation, which is the bug;
- `conflict` for a request_id reused with another body;
- `not_found` for a well-formed request to a domain that does not exist (one per example).
Any other answer, an `unavailable` (internal error) above all, fails. Nothing may be written:
the log's events and stored request ids must stay as they were. Afterwards every domain must
still serve a valid compose. Where NATS cannot carry a request (a token with `.` or whitespace,
a body over max_payload) its client or server refuses it first; the same request is then handed
to Engine.handle, as the intake would, so the engine's own refusal is checked too.

Bounded and deterministic: a fixed number of examples from a derandomized Hypothesis, one
engine for the whole run. The zeros are printed as a table (tests/zeros.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec
import msgspec.inspect as mi
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from integration.fabrics import check_envelope, expect_ok, fabric, gpu
from integration.harness import Harness, serving
from isolation import (
    Database,
    create_schema,
    delete_relay_targets,
    drop_schema,
    unique_schema_name,
    unique_subject_prefix,
)
from nats.errors import BadSubjectError, MaxPayloadError, NoRespondersError
from zeros import ZeroTable, zeros

from trellis.engine.core.ids import COMPONENT_REF_PATTERN, ID_PATTERN
from trellis.engine.core.intents import INTENTS, MAX_BODY_BYTES
from trellis.engine.core.model import MAX_QUANTITY
from trellis.engine.core.throttle import RateLimit, ViewBudget
from trellis.engine.core.views import SCOPES

DOMAINS = ("hall-1", "hall-2")
HOME = DOMAINS[0]  # where the reused request ids were first committed
TENANT = "acme"
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
EXAMPLES = 120
UNTHROTTLED = RateLimit(per_second=100_000.0, burst=100_000)
UNMETERED = ViewBudget(share=0)  # views with no budget, for the same reason

# ---- the subjects, each with a valid body that sets every field it can ----


@dataclass(frozen=True)
class Subject:
    family: str  # intent | admin | query | view
    verb: str
    body: dict[str, Any]
    decodes_as: str | None = None  # the family whose Struct decodes the body, if not its own

    @property
    def name(self) -> str:
        return f"{self.family}.{self.verb}"

    @property
    def engine_family(self) -> str:
        """The family Engine.handle is given (a view is a query with a tenant)."""
        return self.decodes_as or self.family

    @property
    def struct(self) -> type[msgspec.Struct]:
        return INTENTS[(self.engine_family, self.verb)]  # type: ignore[index]

    @property
    def writes(self) -> bool:
        return self.family in ("intent", "admin")

    @property
    def tenant_scoped(self) -> bool:
        return self.family in ("intent", "view")


def link_doc(**fields: Any) -> dict[str, Any]:
    base = {"id": "l-9", "a": "ocs-1", "a_port": 5, "b": "host-01", "b_port": 6}
    return {**base, "capacity_gbps": 64.0, "latency_ns": 50, **fields}


COMPOSE = {
    "host": "host-01",
    "host_selector": {"labels": {"rack": "r1"}},
    "devices": [
        {
            "kind": "gpu",
            "count": 1,
            "models": ["H100"],
            "min_generation": 8,
            "min_memory_gib": 40.0,
            "capacity_gib": 1.0,
            "bandwidth_gbps": 8.0,
        },
    ],
    "device_ids": ["gpu-01"],
    "constraints": {
        "max_hops": 4,
        "max_latency_ns": 3000,
        "isolation": "shared",
        "labels": {"rack": "r3"},
    },
    "lease_seconds": 3600,
    "labels": {"workload": "decode"},
    "reason": "fuzz",
}

SOME_EVENT = "00000000-0000-4000-8000-000000000001"

SUBJECTS = [
    Subject("intent", "compose", COMPOSE),
    Subject("intent", "release", {"composition_id": "c-1", "reason": "fuzz"}),
    Subject("intent", "extend", {"composition_id": "c-1", "lease_seconds": 60}),
    Subject("intent", "reserve", {"manifest": COMPOSE, "duration_seconds": 300}),
    Subject("intent", "apply", {"reservation_id": "rsv-1"}),
    Subject("intent", "apply", {"manifest": COMPOSE}),
    Subject("intent", "cancel-reservation", {"reservation_id": "rsv-1", "reason": "fuzz"}),
    Subject("admin", "import-topology", {**fabric(), "reason": "fuzz"}),
    Subject(
        "admin",
        "add-node",
        {
            "node": gpu("gpu-09", labels={"rack": "r3"}, memory_gib=80.0, cost_per_hour=2.5),
            "reason": "fuzz",
        },
    ),
    Subject("admin", "add-link", {"link": link_doc(), "reason": "fuzz"}),
    Subject("admin", "remove", {"id": "l-nic", "reason": "fuzz"}),
    Subject("admin", "drain", {"id": "ocs-1:1", "reason": "fuzz", "force": True}),
    Subject("admin", "undrain", {"id": "sw-1", "reason": "fuzz"}),
    Subject(
        "admin", "report-fault", {"component": "gpu-02", "state": "degraded", "detail": "fuzz"}
    ),
    Subject(
        "admin",
        "set-quota",
        {"tenant": TENANT, "kind": "memory", "count": 4, "capacity_gib": 512.0, "reason": "fuzz"},
    ),
    Subject("admin", "clear-quota", {"tenant": TENANT, "kind": "gpu", "reason": "fuzz"}),
    Subject("query", "topology", {}),
    Subject("query", "composition", {"id": "c-1"}),
    Subject("query", "connections", {"host": "host-01", "tenant": TENANT, "device": "gpu-01"}),
    Subject("query", "why", {"id": "gpu-01", "at": 5}),
    Subject("query", "free", {"kind": "gpu"}),
    Subject("query", "blast-radius", {"id": "ocs-1:1"}),
    Subject("query", "quotas", {"tenant": TENANT, "kind": "gpu"}),
    Subject("query", "preview", {"manifest": COMPOSE, "tenant": TENANT}),
    Subject("query", "reservations", {"tenant": TENANT, "id": "rsv-1"}),
    Subject("admin", "checkpoint", {}),
    Subject("query", "proof", {"event_id": SOME_EVENT, "size": 3}),
    Subject("query", "consistency", {"from_size": 1, "to_size": 2}),
    Subject("query", "checkpoint-key", {}),
    Subject("query", "fabric", {"min_position": 1}),
    Subject(
        "query",
        "history",
        {
            "id": "gpu-01",
            "tenant": TENANT,
            "since": "2026-11-30T12:00:00Z",
            "until": "2026-12-01T12:00:00+01:00",
        },
    ),
    # The tenant-scoped views (engine/core/views.py), one line each.
    Subject("view", "topology", {}, decodes_as="query"),
    Subject("view", "composition", {"id": "c-1"}, decodes_as="query"),
    Subject("view", "connections", {"host": "host-01", "device": "gpu-01"}, decodes_as="query"),
    Subject("view", "why", {"id": "gpu-01", "at": 5}, decodes_as="query"),
    Subject("view", "free", {"kind": "gpu"}, decodes_as="query"),
    Subject("view", "blast-radius", {"id": "ocs-1:1"}, decodes_as="query"),
    Subject("view", "quotas", {"kind": "memory"}, decodes_as="query"),
    Subject("view", "preview", {"manifest": COMPOSE}, decodes_as="query"),
    Subject("view", "reservations", {"id": "rsv-1"}, decodes_as="query"),
    Subject("view", "proof", {"event_id": SOME_EVENT, "size": 3}, decodes_as="query"),
    Subject("view", "consistency", {"from_size": 1, "to_size": 2}, decodes_as="query"),
    Subject("view", "checkpoint-key", {}, decodes_as="query"),
    Subject(
        "view", "history", {"id": "host-01", "since": "2026-11-30T12:00:00Z"}, decodes_as="query"
    ),
]
WRITES = [s for s in SUBJECTS if s.writes]

# What setup commits in HOME under request ids `seed-<verb>`; resending one of those ids with
# another body (any base body above, none equal to these) must be `conflict`.
SEEDS: list[tuple[str, str, dict[str, Any]]] = [
    ("admin", "import-topology", {**fabric(), "reason": "seed"}),
    ("admin", "add-node", {"node": gpu("gpu-08"), "reason": "seed"}),
    ("admin", "add-link", {"link": link_doc(id="l-8", a_port=4, b="gpu-08", b_port=None)}),
    ("intent", "compose", {"host": "host-01", "devices": [{"kind": "nic"}], "reason": "seed"}),
    ("intent", "extend", {"composition_id": "@", "lease_seconds": 7200}),
    ("intent", "release", {"composition_id": "@", "reason": "seed"}),
    ("admin", "drain", {"id": "nic-01", "reason": "seed"}),
    ("admin", "undrain", {"id": "nic-01", "reason": "seed"}),
    ("admin", "report-fault", {"component": "nvme-01", "state": "degraded", "detail": "seed"}),
    ("admin", "remove", {"id": "l-8", "reason": "seed"}),
    ("admin", "set-quota", {"tenant": "globex", "kind": "nic", "count": 1, "reason": "seed"}),
    ("admin", "clear-quota", {"tenant": "globex", "kind": "nic", "reason": "seed"}),
    ("intent", "reserve", {"manifest": {"host": "host-01", "devices": [{"kind": "nic"}]}}),
    ("intent", "cancel-reservation", {"reservation_id": "@", "reason": "seed"}),
    ("intent", "apply", {"manifest": {"host": "host-01", "devices": [{"kind": "nic"}]}}),
]


def seed_id(verb: str) -> str:
    return f"seed-{verb}"


# ---- JSON with the parts json.dumps cannot write (1e400, 1,000-deep nesting) ----


@dataclass(frozen=True)
class Raw:
    text: str


def render(value: Any) -> str:
    """JSON text; Raw parts verbatim. Lone surrogates come out as `\\udXXX` escapes."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render(v) for v in value) + "]"
    return json.dumps(value)  # floats nan/inf become the NaN/Infinity literals JSON lacks


def deep(kind: str, depth: int = 1000) -> Raw:
    if kind == "array":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


# ---- where a body can be broken: every value, key and object, typed by its Struct ----

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Slot:
    path: Path
    type: mi.Type
    is_key: bool = False  # path[-1] is a key of a map, and the key is the target


def kinds_of(t: mi.Type) -> set[str]:
    """The JSON kinds a type accepts."""
    match t:
        case mi.UnionType(types=types):
            return set().union(*(kinds_of(m) for m in types))
        case mi.StrType() | mi.LiteralType() | mi.UUIDType() | mi.DateTimeType():
            return {"string"}
        case mi.IntType():
            return {"integer"}
        case mi.FloatType():
            return {"integer", "float"}
        case mi.BoolType():
            return {"boolean"}
        case mi.NoneType():
            return {"null"}
        case mi.ListType():
            return {"array"}
        case mi.DictType() | mi.StructType():
            return {"object"}
    raise AssertionError(f"no JSON kind known for {t!r}")


def member(t: mi.Type, value: Any) -> mi.Type:
    """The member of a union that `value` decodes as."""
    if not isinstance(t, mi.UnionType):
        return t
    want = {dict: "object", list: "array"}.get(type(value))
    for m in t.types:
        if want is not None and want in kinds_of(m):
            return m
    return t


def slots(value: Any, t: mi.Type, path: Path = ()) -> Iterator[Slot]:
    """Every place in `value` (decoded as `t`) that a hostile edit can target; absent optional
    fields too, which an edit adds."""
    yield Slot(path, t)
    match member(t, value):
        case mi.StructType(fields=fields):
            for f in fields:
                if f.encode_name in value:
                    yield from slots(value[f.encode_name], f.type, (*path, f.encode_name))
                else:
                    yield Slot((*path, f.encode_name), f.type)
        case mi.ListType(item_type=item):
            for i, x in enumerate(value):
                yield from slots(x, item, (*path, i))
        case mi.DictType(key_type=key_type, value_type=value_type):
            for key, x in value.items():
                yield Slot((*path, key), key_type, is_key=True)
                yield from slots(x, value_type, (*path, key))


def at(doc: Any, path: Path) -> Any:
    for step in path:
        doc = doc[step]
    return doc


# ---- hostile values, by type ----

ID_CHARS = string.ascii_letters + string.digits + "_-"
# Subject-token separators and wildcards, whitespace, NUL and DEL, right-to-left and zero-width
# marks, a byte-order mark, a non-ASCII letter, other punctuation, lone surrogates.
BAD_ID_CHARS = list(".*> \n\r\t\x00\x7f\u202e\u200f\u200b\ufeffé/:$\ud800\udfff")
# Control characters (C0 with tab, newline and return, DEL and C1), the bidi marks, embeddings,
# overrides and isolates that reorder what a terminal shows (ids.PLAIN_TEXT), lone surrogates.
BAD_TEXT_CHARS = list(
    "\x00\x01\x08\t\n\r\x0b\x0c\x1b\x1f\x7f\x80\x85\x9f"
    "\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    "\ud800\udbff\udc00"
)
# Text around a bad character: anything but surrogates and control characters (those are bad
# themselves, and would only make the case less clear).
PLAIN = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=8)


def around(bad: list[str], chars: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A string with one bad character somewhere in it."""
    return st.builds(lambda a, c, b: a + c + b, chars, st.sampled_from(bad), chars)


def hostile_ids(ref: bool = False) -> st.SearchStrategy[str]:
    """Not an id (nor, with `ref`, `<ocs id>:<port>`): a bad character anywhere, a trailing
    newline, too long, empty."""
    bad = [c for c in BAD_ID_CHARS if not (ref and c == ":")]
    fixed = ["h01\n", "gpu-01\n", "\nh01", "h01\r\n", "x" * 65, ""]
    if ref:
        fixed += ["ocs-1:1\n", "ocs-1:01", "ocs-1:-1", "ocs-1:", ":3", "ocs-1:1:2", "ocs-1:100000"]
    return st.one_of(
        around(bad, st.text(ID_CHARS, max_size=12)),
        st.text(ID_CHARS, min_size=65, max_size=90),
        st.sampled_from(fixed),
    )


def hostile_text(t: mi.StrType) -> st.SearchStrategy[str]:
    longest = t.max_length or 2048
    choices = [around(BAD_TEXT_CHARS, PLAIN), st.just("x" * (longest + 1))]
    if t.min_length:
        choices.append(st.just(""))
    return st.one_of(*choices)


def hostile_ints(t: mi.IntType) -> st.SearchStrategy[int]:
    """Beyond int64 whatever the field says, and beyond the field's own bounds."""
    choices = [
        st.sampled_from([INT64_MAX + 1, INT64_MIN - 1, 2**64, 10**30, -(10**30)]),
        st.integers(min_value=INT64_MAX + 1, max_value=2**80),
    ]
    low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
    high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
    if low is not None:
        choices.append(st.integers(min_value=low - 2**40, max_value=low - 1))
    if high is not None:
        choices.append(st.integers(min_value=high + 1, max_value=high + 2**40))
    return st.one_of(*choices)


def hostile_floats(t: mi.FloatType) -> st.SearchStrategy[Any]:
    """Not finite, beyond a double, or beyond the bound that keeps sums finite; negative."""
    high = t.le if t.le is not None else MAX_QUANTITY
    fixed: list[Any] = [
        Raw("1e400"),
        Raw("-1e400"),
        Raw("1" + "0" * 400),
        float("nan"),
        float("inf"),
        float("-inf"),
        1.7e308,
        -1.0,
        -1e-300,
    ]
    if t.gt is not None:
        fixed.append(t.gt)
    return st.one_of(
        st.sampled_from(fixed),
        st.floats(min_value=high, exclude_min=True, allow_infinity=False),
    )


WRONG_KIND = {
    "string": "7",
    "integer": 7,
    "float": 1.5,
    "boolean": True,
    "null": None,
    "array": [],
    "object": {},
}


def hostile_values(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values no field of type `t` accepts."""
    wrong = [v for kind, v in WRONG_KIND.items() if kind not in kinds_of(t)]
    choices: list[st.SearchStrategy[Any]] = [st.sampled_from([deep("array"), deep("object")])]
    if wrong:
        choices.append(st.sampled_from(wrong))
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    for m in members:
        match m:
            case mi.StrType(pattern=pattern) if pattern in (ID_PATTERN, COMPONENT_REF_PATTERN):
                choices.append(hostile_ids(ref=pattern == COMPONENT_REF_PATTERN))
            case mi.StrType():
                choices.append(hostile_text(m))
            case mi.LiteralType(values=values):
                others = {"nope", ""} | {v.upper() for v in values} | {f" {v}" for v in values}
                choices.append(st.sampled_from(sorted(others - set(values))))
            case mi.UUIDType():
                not_uuids = ["", "gpu-01", SOME_EVENT[:-1], SOME_EVENT + "0", SOME_EVENT[:-1] + "g"]
                choices.append(st.sampled_from(not_uuids))
            case mi.DateTimeType():  # a time without its zone, or no time at all
                choices.append(
                    st.sampled_from(["", "yesterday", "2026-12-01T10:00:00", "2026-13-01T00:00Z"])
                )
            case mi.IntType():
                choices.append(hostile_ints(m))
            case mi.FloatType():
                choices.append(hostile_floats(m))
    return st.one_of(*choices)


# ---- edits ----


@dataclass(frozen=True)
class Case:
    subject: Subject
    what: str  # the kind of hostility, for the table
    body: bytes
    expect: str  # the typed refusal it must get
    domain: str = HOME
    tenant: str | None = TENANT

    @property
    def tail(self) -> str:
        s = self.subject
        middle = f"{self.domain}.{self.tenant}" if s.tenant_scoped else self.domain
        return f"{s.family}.{middle}.{s.verb}"

    @property
    def tokens(self) -> list[str]:
        scoped = self.tenant is not None and self.subject.tenant_scoped
        return [self.domain, *([self.tenant] if scoped else [])]  # type: ignore[list-item]

    def __repr__(self) -> str:  # what a failing example shows
        body = self.body if len(self.body) < 300 else self.body[:300] + b"..."
        return f"<{self.what} on {self.tail!r}, expect {self.expect}: {body!r}>"

    def carried_by_nats(self, max_payload: int) -> bool:
        """Is each id one NATS subject token, and the body one message?"""
        for token in self.tokens:
            if not token or any(c in token for c in ". \t\r\n") or not encodable(token):
                return False
        return len(self.body) <= max_payload


def encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


Edit = Callable[[Any], Any]  # a copy of the body in, the broken body out


def replaced(path: Path, value: Any) -> Edit:
    def edit(doc: Any) -> Any:
        if not path:
            return value
        at(doc, path[:-1])[path[-1]] = value
        return doc

    return edit


def rekeyed(path: Path, key: str) -> Edit:
    def edit(doc: Any) -> Any:
        parent = at(doc, path[:-1])
        items = [(key if k == path[-1] else k, v) for k, v in parent.items()]
        parent.clear()
        parent.update(items)
        return doc

    return edit


def removed(path: Path) -> Edit:
    def edit(doc: Any) -> Any:
        del at(doc, path[:-1])[path[-1]]
        return doc

    return edit


@st.composite
def field_case(draw: st.DrawFn, subject: Subject, base: dict[str, Any]) -> Case:
    """One place in the body broken: a hostile value, key, unknown field or missing field."""
    slot = draw(st.sampled_from(list(slots(base, mi.type_info(subject.struct)))))
    t, path = slot.type, slot.path
    shape = member(t, at(base, path) if path_exists(base, path) else None)
    options = ["value"]
    if slot.is_key:
        options = ["key"]
    elif isinstance(shape, mi.StructType) and path_exists(base, path):
        options += ["unknown field", "unknown field"]
        if any(f.required for f in shape.fields):
            options.append("missing field")
    elif (
        isinstance(shape, mi.ListType | mi.DictType) and path_exists(base, path) and at(base, path)
    ):
        # A list too long to fit a body (nodes, links) is left to
        # tests/adapters/test_wire_limits.py.
        options += ["too many"] * 2 if (shape.max_length or MAX_BODY_BYTES) < 10_000 else []
    what = draw(st.sampled_from(options))
    match what:
        case "key":
            edit = rekeyed(path, draw(hostile_text(t)))  # type: ignore[arg-type]
        case "unknown field":
            names = {f.encode_name for f in shape.fields}  # type: ignore[union-attr]
            key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in names))
            value = draw(st.one_of(st.integers(), st.text(max_size=8), st.just(deep("array"))))
            edit = replaced((*path, key), value)
        case "missing field":
            required = sorted(f.encode_name for f in shape.fields if f.required)  # type: ignore[union-attr]
            edit = removed((*path, draw(st.sampled_from(required))))
        case "too many":
            value = at(base, path)
            bound = shape.max_length  # type: ignore[union-attr]
            if isinstance(value, list):
                edit = replaced(path, [value[0]] * (bound + 1))
            else:
                edit = replaced(path, {f"k{i}": "v" for i in range(bound + 1)})
        case _:
            edit = replaced(path, draw(hostile_values(t)))
    body = edit(copy.deepcopy(base))
    where = ".".join(map(str, path)) or "body"
    return Case(subject, f"{what} at {where}", render(body).encode(), "invalid")


def path_exists(doc: Any, path: Path) -> bool:
    try:
        at(doc, path)
    except (KeyError, IndexError, TypeError):
        return False
    return True


@st.composite
def body_case(draw: st.DrawFn, subject: Subject, base: dict[str, Any]) -> Case:
    """The whole body broken: not JSON, not an object, nested 1,000 deep, too big."""
    text = render(base)
    what = draw(
        st.sampled_from(
            [
                "bytes",
                "truncated",
                "trailing",
                "not an object",
                "deep",
                "deep",
                "oversized",
                "largest NATS carries",
            ]
        )
    )
    match what:
        case "bytes":  # a leading 0xff is never UTF-8, so never JSON
            raw = b"\xff" + draw(st.binary(max_size=32))
        case "truncated":
            raw = text[: draw(st.integers(1, len(text) - 1))].encode()
        case "trailing":
            raw = (text + draw(st.sampled_from(["x", "{}", ",", "]", "\x00"]))).encode()
        case "not an object":
            raw = render(draw(st.sampled_from([[], [base], 7, "x", None, True, 1.5]))).encode()
        case "deep":
            raw = render(draw(st.sampled_from([deep("array"), deep("object")]))).encode()
        case "oversized" | "largest NATS carries":
            size = MAX_BODY_BYTES + 1 if what == "oversized" else MAX_BODY_BYTES
            raw = padded(base, size)
    return Case(subject, f"body: {what}", raw, "invalid")


def padded(base: dict[str, Any], size: int) -> bytes:
    """`base` with an unknown field that pads it to exactly `size` bytes."""
    shell = render({**base, "padding": ""}).encode()
    body = shell[:-2] + b"p" * (size - len(shell)) + b'"}'
    assert len(body) == size
    return body


@st.composite
def token_case(draw: st.DrawFn, subject: Subject, base: dict[str, Any]) -> Case:
    """A valid body on a subject whose domain (or tenant) token is not an id."""
    bad = draw(hostile_ids())
    domain, tenant = (bad, TENANT)
    if subject.tenant_scoped and draw(st.booleans()):
        domain, tenant = HOME, bad
    what = "tenant token" if tenant == bad else "domain token"
    return Case(subject, what, render(base).encode(), "invalid", domain, tenant)


def hostile_case(subject: Subject) -> st.SearchStrategy[Case]:
    def build(request_id: str) -> st.SearchStrategy[Case]:
        base = {"request_id": request_id, **subject.body} if subject.writes else subject.body
        return st.one_of(
            field_case(subject, base),
            field_case(subject, base),
            field_case(subject, base),
            body_case(subject, base),
            token_case(subject, base),
        )

    # A hostile body under a request id already committed is refused for itself, first.
    return st.sampled_from(["fuzz-1", seed_id(subject.verb)]).flatmap(build)


@st.composite
def conflict_case(draw: st.DrawFn) -> Case:
    """A committed request id, resent with another valid body (same actor, any verb)."""
    family, verb, _ = draw(st.sampled_from(SEEDS))
    subject = draw(st.sampled_from([s for s in WRITES if s.family == family]))
    body = {**subject.body, "request_id": seed_id(verb)}
    if "reason" in body:
        body["reason"] = draw(st.text(string.ascii_letters, min_size=1, max_size=12))
    return Case(subject, "reused request_id", render(body).encode(), "conflict")


@st.composite
def unknown_domain_case(draw: st.DrawFn) -> Case:
    """Well formed, to a domain that does not exist: `not_found` (an import would create it)."""
    subject = draw(st.sampled_from([s for s in SUBJECTS if s.verb != "import-topology"]))
    domain = "no-" + draw(st.text(ID_CHARS, min_size=1, max_size=20))
    base = {"request_id": "fuzz-1", **subject.body} if subject.writes else subject.body
    return Case(subject, "unknown domain", render(base).encode(), "not_found", domain)


EXAMPLE = st.tuples(
    st.tuples(*(hostile_case(s) for s in SUBJECTS)),
    st.lists(conflict_case(), min_size=1, max_size=2),
    unknown_domain_case(),
)


# ---- sending and judging ----


@dataclass
class Run:
    h: Harness
    database_url: str
    schema: str
    table: ZeroTable
    failures: list[str] = field(default_factory=list)

    async def counts(self) -> tuple[int, int]:
        conn = await asyncpg.connect(
            self.database_url, server_settings={"search_path": self.schema}
        )
        try:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM trellis_events),"
                " (SELECT count(*) FROM trellis_requests)"
            )
        finally:
            await conn.close()
        return row[0], row[1]

    async def answer(self, case: Case) -> dict[str, Any] | None:
        """The reply, over NATS when it can carry the request, else from Engine.handle."""
        s, client = case.subject, self.h.client
        if case.carried_by_nats(client.nc.max_payload):
            self.table.tried("answered over NATS")
            try:
                return await client.raw(case.tail, case.body)
            except NoRespondersError:
                return None
        if all(map(encodable, case.tokens)):
            with contextlib.suppress(BadSubjectError, MaxPayloadError, NoRespondersError):
                reply = await client.raw(case.tail, case.body)  # if NATS delivers it, judge it
                if reply.get("ok") is not False or reply["error"]["code"] != case.expect:
                    return reply
        self.table.tried("refused by NATS, then handed to the engine")
        raw = await self.h.engine.handle(
            s.engine_family,  # type: ignore[arg-type]
            case.domain,
            case.tenant if s.tenant_scoped else None,
            s.verb,
            case.body,
        )
        decoded: dict[str, Any] = msgspec.json.decode(raw)
        return decoded

    def judge(self, case: Case, reply: dict[str, Any] | None) -> None:
        self.table.tried(f"bodies fuzzed: {case.subject.name}")
        self.table.tried(f"cases: {case.what.split(' at ')[0]}")
        problem = None
        if reply is None:
            problem = "unanswered"
        else:
            try:
                check_envelope(reply)
            except AssertionError:
                problem = "malformed replies"
            else:
                if reply["ok"]:
                    problem = "accepted"
                elif reply["error"]["code"] == "unavailable":
                    problem = "internal errors (unavailable)"
                elif reply["error"]["code"] != case.expect:
                    problem = "untyped or wrong answers"
        if problem is not None:
            self.table.add(problem)
            self.failures.append(
                f"{problem}: {case.tail} {case.what} {case.body[:300]!r} -> {reply}"
            )

    async def example(self, cases: list[Case]) -> None:
        before = await self.counts()
        replies = await asyncio.gather(*(self.answer(c) for c in cases))
        for case, reply in zip(cases, replies, strict=True):
            self.judge(case, reply)
        after = await self.counts()
        self.table.add("events written", after[0] - before[0])
        self.table.add("request ids written", after[1] - before[1])
        assert after == before, f"written: {before} -> {after}"
        assert not self.failures, "\n".join(self.failures)


async def seed(h: Harness) -> None:
    """Every domain imported; in HOME, one committed request under `seed-<verb>` per verb."""
    for domain in DOMAINS[1:]:
        expect_ok(await h.client.admin(domain, "import-topology", fabric()))
    cid = rid = None
    for family, verb, body in SEEDS:
        body = {**body, "request_id": seed_id(verb)}
        if body.get("composition_id") == "@":
            body["composition_id"] = cid
        if body.get("reservation_id") == "@":
            body["reservation_id"] = rid
        if family == "intent":
            result = expect_ok(await h.client.intent(HOME, TENANT, verb, body))
            cid = result.get("composition_id", cid)
            rid = result.get("reservation_id", rid)
        else:
            expect_ok(await h.client.admin(HOME, verb, body))


async def serves_a_compose(h: Harness, domain: str) -> bool:
    reply = await h.client.intent(
        domain,
        TENANT,
        "compose",
        {"host": "host-01", "devices": [{"kind": "gpu", "bandwidth_gbps": 8}]},
    )
    if not reply.get("ok") or reply["result"]["state"] != "active":
        return False
    cid = reply["result"]["composition_id"]
    released = await h.client.intent(domain, TENANT, "release", {"composition_id": cid})
    return bool(released.get("ok"))


def test_every_subject_and_every_field_is_fuzzed() -> None:
    covered = {(s.engine_family, s.verb) for s in SUBJECTS}
    assert covered >= set(INTENTS), f"not fuzzed: {sorted(set(INTENTS) - covered)}"
    viewed = {s.verb for s in SUBJECTS if s.family == "view"}
    assert viewed >= set(SCOPES), f"views not fuzzed: {sorted(set(SCOPES) - viewed)}"
    for s in SUBJECTS:  # the valid bodies are valid, so each edit is what breaks them
        msgspec.json.decode(
            render({"request_id": "r", **s.body} if s.writes else s.body), type=s.struct
        )


def test_hostile_input_on_every_subject_gets_a_typed_refusal_and_writes_nothing(
    nats_url: str, database: Database
) -> None:
    database_url = database.url
    table = zeros("hostile input (tests/property/test_hostile_input.py)")
    table.promise(
        "events written",
        "request ids written",
        "accepted",
        "unanswered",
        "malformed replies",
        "internal errors (unavailable)",
        "untyped or wrong answers",
        "domains not serving",
    )
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    schema, prefix = unique_schema_name(), unique_subject_prefix()
    try:
        loop.run_until_complete(create_schema(database, schema))
        h = loop.run_until_complete(
            # Every subject at once, 120 times: one tenant's intents would outrun its rate,
            # and its views their time (throttled is another test's business:
            # tests/integration/test_throttle.py).
            stack.enter_async_context(
                serving(
                    nats_url,
                    database_url,
                    schema,
                    prefix,
                    rate_limit=UNTHROTTLED,
                    view_budget=UNMETERED,
                )
            )
        )
        loop.run_until_complete(seed(h))
        run = Run(h, database_url, schema, table)

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            # No shrinking: each case breaks one thing already, and every problem of the
            # failing example is listed; shrinking against the real servers takes minutes.
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
                HealthCheck.filter_too_much,
            ],
        )
        @given(EXAMPLE)
        def fuzz(example: tuple[tuple[Case, ...], list[Case], Case]) -> None:
            hostile, conflicts, unknown = example
            run.failures.clear()
            loop.run_until_complete(run.example([*hostile, *conflicts, unknown]))

        fuzz()

        for domain in DOMAINS:
            if not loop.run_until_complete(serves_a_compose(h, domain)):
                table.add("domains not serving")
        assert table.must_be_zero["domains not serving"] == 0
    finally:
        loop.run_until_complete(stack.aclose())
        loop.run_until_complete(drop_schema(database, schema))
        loop.run_until_complete(delete_relay_targets(nats_url, prefix))
        loop.close()
