"""Plain-text rendering of replies for people (the CLI and the demo); scripts use `-o json`.

Every renderer of a result takes `(result, reply, wide=False)`: `wide` (the CLI's `-o wide`)
adds the columns a narrow terminal can do without (full times, request ids, positions, labels).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from trellis.engine.core.fabric import FabricBinding, FabricCircuit
from trellis.engine.core.fabric_plan import Reconciliation
from trellis.engine.core.results import FabricReport

Row = dict[str, Any]
# A column: its header, its cell, and whether only `-o wide` shows it.
Column = tuple[str, Callable[[Row], object], bool]


OUTPUTS = ("table", "json", "wide")
# What a terminal must not be handed raw: C0 and C1 controls and the bidirectional controls.
# Intents refuse them (engine/core/ids.py), but a log may hold older events, or a foreign message.
_HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(value: Any) -> Any:
    """`value` (a reply's result, an event: any JSON) with every control or bidirectional
    character in its strings written as an escape (`\\u202e`), so no text can reorder or forge
    what the terminal shows."""
    match value:
        case str():
            return _HIDDEN.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
        case dict():
            return {visible(k): visible(v) for k, v in value.items()}
        case list():
            return [visible(v) for v in value]
    return value


def add_output_options(p: argparse.ArgumentParser) -> None:
    """`-o table|json|wide`, and `--json` for `-o json`, on a command that prints results."""
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="table",
        help="table: for people; json: the reply's result as one JSON document (a refusal: "
        "the error reply); wide: the table with more columns",
    )
    p.add_argument(
        "--json", dest="output", action="store_const", const="json", help="the same as -o json"
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, a rule under the header, two spaces between columns."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    # Stripped too: a last column with an empty header and no cell ended it in spaces.
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


def columns(spec: Sequence[Column], rows: Sequence[Row], wide: bool) -> str:
    """`table` of `rows`, one column per entry of `spec` (wide-only ones with `wide`)."""
    shown = [c for c in spec if wide or not c[2]]
    return table([h for h, _, _ in shown], [[cell(r) for _, cell, _ in shown] for r in rows])


def _time(text: str | None, wide: bool) -> str:
    """An ISO time to the second; whole with `wide`."""
    return (text or "") if wide else (text or "")[:19]


def _labels(labels: dict[str, str] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))


def fabric_tables(result: Row, reply: Row, wide: bool = False) -> str:
    """`fabric show`: what the domain's hardware holds, as the engine's driver reports it;
    with `wide`, whether the log says so too, for each circuit and binding."""
    report = msgspec.convert(result, FabricReport)  # the result's shape, checked
    stray_circuits = {(c.ocs, c.a_port, c.b_port) for c in report.differences.remove}
    stray_bindings = {(b.device, b.composition_id) for b in report.differences.unbind}
    circuits = columns(
        [
            ("ocs", lambda c: c["ocs"], False),
            ("ports", lambda c: f"{c['a_port']}-{c['b_port']}", False),
            ("log", lambda c: _in_log((c["ocs"], c["a_port"], c["b_port"]), stray_circuits), True),
        ],
        result["circuits"],
        wide,
    )
    bindings = columns(
        [
            ("host", lambda b: b["host"], False),
            ("device", lambda b: b["device"] + _gib(b["capacity_gib"]), False),
            ("composition", lambda b: b["composition_id"], False),
            ("path", lambda b: " > ".join(b["path"]), False),
            ("log", lambda b: _in_log((b["device"], b["composition_id"]), stray_bindings), True),
        ],
        result["bindings"],
        wide,
    )
    held = (
        f"the hardware of domain {report.domain} holds {counted(report.circuits, 'circuit')}, "
        f"{counted(report.bindings, 'binding')}"
        if report.circuits or report.bindings
        else f"the hardware of domain {report.domain} holds nothing"
    )
    verdict = (
        "in step with the log"
        if report.in_step
        else "not in step with the log (`trellis fabric check`)"
    )
    parts = [
        circuits if report.circuits else "",
        bindings if report.bindings else "",
        f"{held}; {verdict}, at position {reply['position']}",
        "\n".join(_findings(report)),
    ]
    return "\n\n".join(part for part in parts if part)


def fabric_check(result: Row, reply: Row, wide: bool = False) -> str:
    """`fabric check`: whether the hardware holds exactly what the log says, and if not, what
    differs, one line each."""
    report = msgspec.convert(result, FabricReport)
    lines = fabric_differences(report.differences)
    verdict = "hardware and log differ" if lines else "hardware holds what the log says"
    if lines and report.settling:
        verdict += " (the engine is still programming the fabric: check again shortly)"
    return "\n".join(
        [f"{report.domain}: {verdict}", *(f"  {line}" for line in lines), *_findings(report)]
    )


def _findings(report: FabricReport) -> list[str]:
    """What the driver saw on the fabric and cannot explain; Trellis leaves it alone."""
    return [f"  found, not Trellis's to change: {finding}" for finding in report.findings]


def counted(items: Sequence[object], noun: str) -> str:
    """`1 circuit`, `3 circuits`: how many `items`, the noun in its number."""
    return f"{len(items)} {noun}" + ("" if len(items) == 1 else "s")


def _in_log(key: tuple[object, ...], strays: set[Any]) -> str:
    return "not in the log" if key in strays else "in the log"


def _gib(capacity: float | None) -> str:
    return f" {capacity:g} GiB" if capacity else ""


def import_summary(result: Row, reply: Row, wide: bool = False) -> str:
    if result["unchanged"]:
        size = f"{result['nodes']} nodes, {result['links']} links"
        return f"domain {result['domain']}: unchanged ({size})"
    lines = [
        f"domain {result['domain']}: imported {result['nodes']} nodes, {result['links']} links"
        f" at position {reply['position']}" + replayed(reply)
    ]
    for key in ("added", "updated", "removed"):
        ids, total = result[key], result.get(f"{key}_count") or len(result[key])
        if ids:
            named = ids if wide else ids[:12]
            shown = ", ".join(named)
            if total > len(named):
                shown += f", ... ({total} nodes and links in all)"
            lines.append(f"  {key}: {shown}")
    return "\n".join(lines)


_NODES: list[Column] = [
    ("node", lambda n: n["id"], False),
    ("kind", lambda n: n.get("device_kind") or n["kind"], False),
    ("model", lambda n: " ".join(str(n[k]) for k in ("vendor", "model") if k in n), False),
    ("gen", lambda n: n.get("generation", ""), True),
    ("capacity", lambda n: _capacity(n), False),
    ("ns", lambda n: n.get("latency_ns", ""), True),
    ("cost/h", lambda n: f"{n['cost_per_hour']:g}" if n.get("cost_per_hour") else "", True),
    ("state", lambda n: _condition(n), False),
    ("labels", lambda n: _labels(n.get("labels")), True),
]
_LINKS: list[Column] = [
    ("link", lambda lk: lk["id"], False),
    ("a", lambda lk: _end(lk["a"], lk.get("a_port")), False),
    ("b", lambda lk: _end(lk["b"], lk.get("b_port")), False),
    ("free/cap gbps", lambda lk: f"{lk['free_gbps']:g}/{lk['capacity_gbps']:g}", False),
    ("ns", lambda lk: str(lk.get("latency_ns", 0)), False),
    ("state", lambda lk: _condition(lk), False),
]
_CIRCUITS: list[Column] = [
    ("ocs", lambda c: c["ocs"], False),
    ("ports", lambda c: f"{c['a_port']}-{c['b_port']}", False),
    ("host", lambda c: c["host"], False),
]


def topology_tables(result: Row, reply: Row, wide: bool = False) -> str:
    """Nodes, then links; with `wide`, each circuit too, and more of each node."""
    parts = [columns(_NODES, result["nodes"], wide), columns(_LINKS, result["links"], wide)]
    if wide and result["circuits"]:
        parts.append(columns(_CIRCUITS, result["circuits"], wide))
    parts.append(f"{counted(result['circuits'], 'circuit')}; at position {reply['position']}")
    return "\n\n".join(parts)


def _capacity(node: Row) -> str:
    if "capacity_gib" in node:
        return f"{node['capacity_gib']:g} GiB pool"
    if "memory_gib" in node:
        return f"{node['memory_gib']:g} GiB"
    if "ports" in node:
        return f"{node['ports']} ports"
    return ""


def _condition(component: Row) -> str:
    state = component["health"] + (", drained" if component["drained"] else "")
    return state + (f" ({component['detail']})" if component.get("detail") else "")


def _end(node: str, port: int | None) -> str:
    return node if port is None else f"{node}:{port}"


def error_text(error: Row) -> str:
    """The error line, plus the why-not funnel when there is one."""
    lines = [f"error [{error['code']}]: {error['message']}"]
    if error.get("details", {}).get("replayed"):
        lines[0] += " (replayed: the answer this request_id got before; a new one tries again)"
    details = error.get("details") or {}
    # A refusal that counts what stands in the way (`in use by 1 live composition(s)`) names
    # them in its details: the line names them too, the ids the operator acts on next.
    for key in ("compositions", "reservations"):
        ids = details.get(key)
        if isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids):
            lines.append(f"{key}: {', '.join(ids)}")
    funnel = details.get("funnel")
    if funnel:
        rows = [[f["stage"], f["removed"], f["remaining"]] for f in funnel]
        lines.append(table(["constraint", "removed", "remaining"], rows))
    return "\n".join(lines)


#: What the verbs that add or remove a component did to it, as their summary says.
_COMPONENT_DONE = {"add-node": "added", "add-link": "added", "remove": "removed"}


def component_summary(result: Row, reply: Row, wide: bool = False, *, verb: str = "") -> str:
    """An admin verb's answer on one component: what it is now (added or removed, for those
    verbs: the answer's health is then only its default) and what it touched."""
    name = result["component"]
    if result.get("link") and result["link"] != name:
        name += f" (link {result['link']})"
    health = result.get("health", "healthy")
    if not result.get("changed"):
        line = f"{name}: already so, nothing changed"
    elif verb in _COMPONENT_DONE:
        line = f"{name}: {_COMPONENT_DONE[verb]}"
    else:
        line = f"{name}: {health}" + (", drained" if result.get("drained") else "")
    if verb == "undrain" and health != "healthy":
        # Undrained or never drained, it is still unusable: an undrain clears no fault report.
        ref = result["component"]
        line += f" (it is {health}: `trellis report-fault {ref} --state healthy` clears that)"
    parts = [line]
    if result.get("removed"):
        parts.append("removed with it: " + ", ".join(result["removed"]))
    if result.get("compositions"):
        parts.append("compositions touched: " + ", ".join(result["compositions"]))
    for move in result.get("moved") or []:
        how = "rerouted" if move["to"] == move["device"] else f"replaced by {move['to']}"
        path, links = " > ".join(move["path"]), ", ".join(move.get("links") or [])
        parts.append(
            f"  {move['composition_id']}: {move['device']} {how} (path {path}; links {links})"
        )
    # Touched and not left impaired: moved while active, or mended (an undrain's, a
    # recovery's): either way active now, which an operator reading an undrain asks first.
    if active := [
        c for c in result.get("compositions") or [] if c not in result.get("impaired", [])
    ]:
        parts.append("active now: " + ", ".join(active))
    if result.get("impaired"):
        parts.append("left impaired: " + ", ".join(result["impaired"]))
    return "\n".join(parts) + f"\nat position {reply.get('position')}{replayed(reply)}"


def impairments(items: list[Any]) -> str:
    """What impairs a composition, in either shape it comes in: the composition query's
    Impairment objects (`component (reason)`), or `composition list`'s component ids."""
    said = []
    for item in items:
        if isinstance(item, dict):
            reason = item.get("reason")
            said.append(f"{item['component']} ({reason})" if reason else str(item["component"]))
        else:
            said.append(str(item))
    return ", ".join(said)


_LIVE: list[Column] = [
    ("composition", lambda r: r["id"], False),
    ("tenant", lambda r: r["tenant"], False),
    ("host", lambda r: r["host"], False),
    ("state", lambda r: r["state"], False),
    ("devices", lambda r: ", ".join(d["id"] for d in r["devices"]), False),
    ("expires", lambda r: r.get("expires_at") or "no lease", False),
    ("impaired by", lambda r: impairments(r.get("impaired_by") or []), True),
    ("position", lambda r: r.get("position", ""), True),
]


def composition_rows(rows: list[Row], wide: bool = False) -> str:
    """`composition list`: one live composition a line (KV entries, adapters/nats/kv_state)."""
    if not rows:
        return "no live compositions"
    return columns(_LIVE, rows, wide)


def event_line(event: Row) -> str:
    """`watch`: an event of the stream as one line (ARCHITECTURE §6 envelope)."""
    data = event.get("data") or {}
    about = data.get("composition_id") or data.get("component") or data.get("id")
    parts = [event["recorded_at"], event["domain"], f"#{event['position']}", event["type"]]
    parts += [str(about)] if about else []
    return "  ".join([*parts, f"by {event['actor']}"])


_BOUND: list[Column] = [
    ("device", lambda d: d["id"], False),
    ("kind", lambda d: d["kind"] + _gib(d.get("capacity_gib")), False),
    ("path", lambda d: " > ".join(d["path"]), False),
    ("hops", lambda d: d["hops"], False),
    ("ns", lambda d: d["latency_ns"], False),
    ("gbps", lambda d: f"{d['bandwidth_gbps']:g}", False),
]


_CONDITIONS: list[Column] = [
    ("condition", lambda c: c["type"], False),
    ("status", lambda c: c["status"], False),
    ("reason", lambda c: c["reason"], False),
    ("since (position)", lambda c: f"{c['last_transition_time']} ({c['observed_position']})", True),
    ("message", lambda c: c["message"], False),
]


def conditions_table(conditions: Sequence[Row], wide: bool = False) -> str:
    """A composition's conditions (engine/core/conditions.py), as the KV bucket holds them."""
    return columns(_CONDITIONS, conditions, wide)


def compose_summary(result: Row, reply: Row, wide: bool = False) -> str:
    """A compose's answer, or `composition get`'s; with `wide`, who asked, why and when."""
    when = _ended(result) or f"expires: {result.get('expires_at') or 'no lease'}"
    head = (
        f"composition {result['composition_id']} on {result['host']}: {result['state']}"
        f" ({when}) at position {reply['position']}" + replayed(reply)
    )
    lines = [head]
    if wide:
        asked = [
            f"{key.replace('_', ' ')}: {result[key]}"
            for key in ("tenant", "created_at", "request_id", "reason")
            if result.get(key)
        ]
        if result.get("labels"):
            asked.append(f"labels: {_labels(result['labels'])}")
        if result.get("impaired_by"):
            asked.append(f"impaired by: {impairments(result['impaired_by'])}")
        lines += asked
    return "\n".join([*lines, columns(_BOUND, result["devices"], wide)])


#: The events that end a composition, as its chain (`composition get`) names them.
_ENDS = ("CompositionReleased", "CompositionFailed")


def _ended(result: Row) -> str:
    """When and where a released or failed composition ended, from its chain ("" while live
    or for a compose's answer, which has none): its devices are shown as they were held."""
    if result.get("state") not in ("released", "failed"):
        return ""
    ends = [e for e in result.get("chain") or [] if e.get("type") in _ENDS]
    if not ends:
        return ""
    end = ends[-1]
    return f"since {end['time']}, position {end['position']}; it held the devices below"


def reservation_summary(result: Row, reply: Row, wide: bool = False) -> str:
    """A reserve's answer: what is held, on which host, until when."""
    head = (
        f"reservation {result['reservation_id']} on {result['host']}: {result['state']} until "
        f"{result['expires_at']} at position {reply['position']}" + replayed(reply)
    )
    return "\n".join([head, columns(_BOUND, result["devices"], wide)])


def preview_summary(result: Row, reply: Row, wide: bool = False) -> str:
    """What a compose would take now (nothing held)."""
    circuits = ", ".join(result["circuits"]) or "none"
    head = f"a compose now would take, on {result['host']} (new circuits: {circuits}):"
    return "\n".join([head, columns(_BOUND, result["devices"], wide)])


def reservations_table(result: Row, reply: Row, wide: bool = False) -> str:
    spec: list[Column] = [
        ("reservation", lambda r: r["reservation_id"], False),
        ("tenant", lambda r: r["tenant"], False),
        ("host", lambda r: r["host"], False),
        ("devices", lambda r: ", ".join(d["id"] for d in r["devices"]), False),
        ("expires", lambda r: _time(r["expires_at"], wide), False),
        ("made", lambda r: _time(r["made_at"], wide), True),
        ("request", lambda r: r["request_id"], True),
        ("reason", lambda r: r["reason"], True),
    ]
    return columns(spec, result["reservations"], wide)


def cancel_summary(result: Row, reply: Row, wide: bool = False) -> str:
    return (
        f"reservation {result['reservation_id']} cancelled at position {reply['position']}; "
        f"returned {', '.join(result['devices'])}"
    )


def replayed(reply: Row) -> str:
    """What a summary adds for a stored answer to a request_id sent again: nothing was done
    twice."""
    return " (replayed)" if reply.get("replayed") else ""


def release_summary(result: Row, reply: Row, wide: bool = False) -> str:
    circuits = ", ".join(result["circuits_removed"]) or "none"
    return (
        f"composition {result['composition_id']} released at position {reply['position']}"
        f"{replayed(reply)}; returned {', '.join(result['devices'])}; circuits removed: {circuits}"
    )


def extend_summary(result: Row, reply: Row, wide: bool = False) -> str:
    return (
        f"composition {result['composition_id']} extended at position {reply['position']}"
        f"{replayed(reply)}: now expires at {result['expires_at']}"
    )


def _connection_columns(wide: bool) -> list[Column]:
    return [
        ("device", lambda c: c["device"], False),
        ("host", lambda c: c["host"], False),
        ("composition", lambda c: c["composition_id"], False),
        ("tenant", lambda c: c["tenant"], False),
        ("path", lambda c: " > ".join(c["path"]), False),
        ("gbps", lambda c: f"{c['bandwidth_gbps']:g}", False),
        ("since", lambda c: _time(c["since"], wide), False),
        ("why", lambda c: c["why"]["reason"] or c["why"]["request_id"], False),
        ("request", lambda c: c["why"]["request_id"], True),
        ("actor", lambda c: c["why"]["actor"], True),
        ("position", lambda c: c["why"]["position"], True),
        ("isolation", lambda c: (c["why"].get("constraints") or {}).get("isolation", ""), True),
        ("labels", lambda c: _labels(c["why"].get("labels")), True),
    ]


def connections_table(result: Row, reply: Row, wide: bool = False) -> str:
    rows = result["connections"]
    footer = f"\n{counted(rows, 'connection')} at position {reply['position']}"
    return columns(_connection_columns(wide), rows, wide) + footer


def _history_columns(wide: bool) -> list[Column]:
    return [
        ("device", lambda i: i["device"], False),
        ("model", lambda i: i["model"] or i["kind"], False),
        ("host", lambda i: i["host"], False),
        ("composition", lambda i: i["composition_id"], False),
        ("tenant", lambda i: i["tenant"], False),
        ("start", lambda i: _time(i["start"], wide), False),
        ("end", lambda i: _time(i["end"], wide) or "(held)", False),
        ("ended by", lambda i: i["end_reason"] or "", False),
        # The device's own price (a memory pool's whole, not a slice's share: a slice pays
        # its GiB's share of it, docs/demo.md), so named for what it is.
        (
            "device $/h",
            lambda i: f"{i['cost_per_hour']:g}" if i["cost_per_hour"] is not None else "",
            False,
        ),
        ("gbps", lambda i: f"{i['bandwidth_gbps']:g}", True),
        ("GiB", lambda i: f"{i['capacity_gib']:g}" if i.get("capacity_gib") else "", True),
        ("from", lambda i: i.get("start_position", ""), True),
        ("to", lambda i: i.get("end_position") or "", True),
    ]


def history_table(result: Row, reply: Row, wide: bool = False) -> str:
    rows = result["intervals"]
    footer = f"\n{counted(rows, 'interval')} at position {reply['position']}"
    return columns(_history_columns(wide), rows, wide) + footer


def why_text(result: Row, reply: Row, wide: bool = False) -> str:
    chain_columns: list[Column] = [
        ("position", lambda e: e["position"], False),
        ("event", lambda e: e["type"], False),
        ("time", lambda e: _time(str(e["time"]), wide), False),
        ("actor", lambda e: e["actor"], False),
        ("request_id", lambda e: e["request_id"], False),
    ]
    chain = result.get("chain", [])
    told = result["text"] + ("\n\n" + columns(chain_columns, chain, wide) if chain else "")
    return f"{told}\nat position {reply['position']}"  # the moment it answers for (--at)


_FREE: list[Column] = [
    ("device", lambda d: d["id"], False),
    ("kind", lambda d: d["device_kind"], False),
    ("model", lambda d: " ".join(str(d[k]) for k in ("vendor", "model") if k in d), False),
    ("gen", lambda d: d.get("generation", ""), False),
    (
        "capacity",
        lambda d: f"{d['free_gib']:g} GiB free" if "free_gib" in d else _capacity(d),
        False,
    ),
    ("pool GiB", lambda d: f"{d['capacity_gib']:g}" if "capacity_gib" in d else "", True),
    ("cost/h", lambda d: f"{d['cost_per_hour']:g}" if d.get("cost_per_hour") else "", True),
    ("labels", lambda d: _labels(d.get("labels")), False),
]


_ENGINES: list[Column] = [
    ("engine", lambda e: e["engine"], False),
    ("writes", lambda e: ", ".join(e["writes"]) or "-", False),  # the domains it writes now
    # The domains it may write (TRELLIS_DOMAINS; `*`: every one).
    ("serves", lambda e: ", ".join(e["serves"]), False),
]


def engines_table(engines: Sequence[Row], wide: bool = False) -> str:
    """`trellis engines`: each engine up, the domains it writes now and those it serves."""
    return columns(_ENGINES, engines, wide)


def free_table(result: Row, reply: Row, wide: bool = False) -> str:
    rows = result["devices"]
    free = counted(rows, "usable device")
    return columns(_FREE, rows, wide) + f"\n{free} free at position {reply['position']}"


_HIT: list[Column] = [
    ("composition", lambda c: c["composition_id"], False),
    ("tenant", lambda c: c["tenant"], False),
    ("host", lambda c: c["host"], False),
    ("state", lambda c: c["state"], False),
    ("devices on that path", lambda c: ", ".join(c["devices"]), False),
]


def blast_radius_table(result: Row, reply: Row, wide: bool = False) -> str:
    tenants = ", ".join(result["tenants"]) or "none"
    link = f" (on link {result['link']})" if wide and result.get("link") else ""
    affected = f"tenants affected: {tenants}{link}; at position {reply['position']}"
    return columns(_HIT, result["compositions"], wide) + "\n" + affected


def quota_summary(result: Row, reply: Row, wide: bool = False) -> str:
    """One line for set-quota / clear-quota: the quota now, what is held, and what it means."""
    what = f"quota of {result['tenant']} for {result['kind']}"
    now = _limit(result["kind"], result["limit"]) if result["limit"] else "none (no limit)"
    line = f"{what}: {now}; holds {_amount(result['kind'], result['held'])}"
    if not result["changed"]:
        line += " (unchanged, nothing recorded)"
    else:
        line += f", recorded at position {reply['position']}"
    if result["over"]:
        line += (
            f"\nover quota: nothing held is taken away; new composes of {result['kind']} are "
            "refused until it is under"
        )
    return line


_QUOTAS: list[Column] = [
    ("tenant", lambda r: r["tenant"], False),
    ("kind", lambda r: r["kind"], False),
    ("quota", lambda r: _limit(r["kind"], r["limit"]) if r["limit"] else "none", False),
    ("holds", lambda r: _amount(r["kind"], r["held"]), False),
    ("", lambda r: "over quota" if r["over"] else "", False),
]


def quota_table(result: Row, reply: Row, wide: bool = False) -> str:
    rows = result["quotas"]
    footer = f"\n{len(rows)} tenant and kind pairs at position {reply['position']}"
    return columns(_QUOTAS, rows, wide) + footer


def _limit(kind: str, limit: Row) -> str:
    parts = [] if limit["count"] is None else [_units(kind, limit["count"])]
    if limit["capacity_gib"] is not None:
        parts.append(f"{limit['capacity_gib']:g} GiB")
    return ", ".join(parts)


def _amount(kind: str, held: Row) -> str:
    text = _units(kind, held["count"])
    return text + (f", {held['capacity_gib']:g} GiB" if "capacity_gib" in held else "")


def _units(kind: str, count: int) -> str:
    """`1 device`, `3 devices`; memory counts slices."""
    unit = "slice" if kind == "memory" else "device"
    return f"{count} {unit}" + ("" if count == 1 else "s")


def fabric_differences(plan: Reconciliation) -> list[str]:
    """One line per difference between the hardware and the log; none when they agree."""
    lines = [f"holds {_binding(b)}, which the log does not" for b in plan.unbind]
    lines += [f"holds circuit {_circuit(c)}, which the log does not" for c in plan.remove]
    lines += [f"lacks circuit {_circuit(c)}, which the log holds" for c in plan.create]
    lines += [f"lacks {_binding(b)}, which the log holds" for b in plan.bind]
    lines += [
        f"composition {cid} is still pending (its saga has not settled)" for cid in plan.pending
    ]
    return lines


def _binding(b: FabricBinding) -> str:
    over = " > ".join(b.path) or "no path"  # a half-made slice reads back without one
    return f"{b.device} bound to {b.host} for {b.composition_id} over {over}"


def _circuit(c: FabricCircuit) -> str:
    return f"{c.ocs}:{c.a_port}-{c.b_port}"
