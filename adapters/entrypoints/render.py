"""Plain-text rendering of replies for people (the CLI and the demo); scripts use --json."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trellis.engine.fabric_plan import Reconciliation
from trellis.engine.ports import FabricBinding, FabricCircuit


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, a rule under the header, two spaces between columns."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fabric_tables(result: dict[str, Any], domain: str | None = None) -> str:
    """What the simulated hardware holds: circuits, then bindings, by domain."""
    domains = result["domains"]
    circuits = [
        [d, c["ocs"], f"{c['a_port']}-{c['b_port']}"]
        for d, held in domains.items()
        for c in held["circuits"]
    ]
    bindings = [
        [
            d,
            b["host"],
            b["device"] + (f" {b['capacity_gib']:g} GiB" if b.get("capacity_gib") else ""),
            b["composition_id"],
            " > ".join(b["path"]),
        ]
        for d, held in domains.items()
        for b in held["bindings"]
    ]
    where = f"domain {domain}" if domain else f"{len(domains)} domains"
    held = f"{len(circuits)} circuits, {len(bindings)} bindings in {where}"
    if not (circuits or bindings):
        held = f"the simulated hardware holds nothing in {domain or 'any domain'}"
    parts = [
        table(["domain", "ocs", "ports"], circuits) if circuits else "",
        table(["domain", "host", "device", "composition", "path"], bindings) if bindings else "",
        f"{held}; from {result['state_file']}",
    ]
    return "\n\n".join(part for part in parts if part)


def import_summary(result: dict[str, Any], reply: dict[str, Any]) -> str:
    if result["unchanged"]:
        size = f"{result['nodes']} nodes, {result['links']} links"
        return f"domain {result['domain']}: unchanged ({size})"
    lines = [
        f"domain {result['domain']}: imported {result['nodes']} nodes, {result['links']} links"
        f" at position {reply['position']}" + (" (replayed)" if reply.get("replayed") else "")
    ]
    for key in ("added", "updated", "removed"):
        ids = result[key]
        if ids:
            shown = ", ".join(ids[:12]) + (f", ... ({len(ids)} in all)" if len(ids) > 12 else "")
            lines.append(f"  {key}: {shown}")
    return "\n".join(lines)


def topology_tables(result: dict[str, Any], reply: dict[str, Any]) -> str:
    nodes = [
        [
            n["id"],
            n.get("device_kind") or n["kind"],
            " ".join(str(n[k]) for k in ("vendor", "model") if k in n),
            _capacity(n),
            _condition(n),
        ]
        for n in result["nodes"]
    ]
    links = [
        [
            lk["id"],
            _end(lk["a"], lk.get("a_port")),
            _end(lk["b"], lk.get("b_port")),
            f"{lk['free_gbps']:g}/{lk['capacity_gbps']:g}",
            str(lk.get("latency_ns", 0)),
            _condition(lk),
        ]
        for lk in result["links"]
    ]
    return "\n\n".join(
        [
            table(["node", "kind", "model", "capacity", "state"], nodes),
            table(["link", "a", "b", "free/cap gbps", "ns", "state"], links),
            f"{len(result['circuits'])} circuits; at position {reply['position']}",
        ]
    )


def _capacity(node: dict[str, Any]) -> str:
    if "capacity_gib" in node:
        return f"{node['capacity_gib']:g} GiB pool"
    if "memory_gib" in node:
        return f"{node['memory_gib']:g} GiB"
    if "ports" in node:
        return f"{node['ports']} ports"
    return ""


def _condition(component: dict[str, Any]) -> str:
    state = component["health"] + (", drained" if component["drained"] else "")
    return state + (f" ({component['detail']})" if component.get("detail") else "")


def _end(node: str, port: int | None) -> str:
    return node if port is None else f"{node}:{port}"


def error_text(error: dict[str, Any]) -> str:
    """The error line, plus the why-not funnel when there is one."""
    lines = [f"error [{error['code']}]: {error['message']}"]
    funnel = error.get("details", {}).get("funnel")
    if funnel:
        rows = [[f["stage"], f["removed"], f["remaining"]] for f in funnel]
        lines.append(table(["constraint", "removed", "remaining"], rows))
    return "\n".join(lines)


def component_summary(result: dict[str, Any], reply: dict[str, Any]) -> str:
    """An admin verb's answer on one component: what it is now and what it touched."""
    name = result["component"]
    if result.get("link") and result["link"] != name:
        name += f" (link {result['link']})"
    if not result.get("changed"):
        line = f"{name}: already so, nothing changed"
    else:
        state = result.get("health", "healthy") + (", drained" if result.get("drained") else "")
        line = f"{name}: {state}"
    parts = [line]
    if result.get("removed"):
        parts.append("removed: " + ", ".join(result["removed"]))
    if result.get("compositions"):
        parts.append("compositions touched: " + ", ".join(result["compositions"]))
    if result.get("impaired"):
        parts.append("left impaired: " + ", ".join(result["impaired"]))
    replayed = " (replayed)" if reply.get("replayed") else ""
    return "\n".join(parts) + f"\nat position {reply.get('position')}{replayed}"


def composition_rows(rows: list[dict[str, Any]]) -> str:
    """`composition list`: one live composition a line (KV entries, adapters/nats/kv_state)."""
    if not rows:
        return "no live compositions"
    body = [
        [
            r["id"],
            r["tenant"],
            r["host"],
            r["state"],
            ", ".join(d["id"] for d in r["devices"]),
            r.get("expires_at") or "no lease",
        ]
        for r in rows
    ]
    return table(["composition", "tenant", "host", "state", "devices", "expires"], body)


def event_line(event: dict[str, Any]) -> str:
    """`watch`: an event of the stream as one line (ARCHITECTURE §6 envelope)."""
    data = event.get("data") or {}
    about = data.get("composition_id") or data.get("component") or data.get("id")
    parts = [event["recorded_at"], event["domain"], f"#{event['position']}", event["type"]]
    parts += [str(about)] if about else []
    return "  ".join([*parts, f"by {event['actor']}"])


def compose_summary(result: dict[str, Any], reply: dict[str, Any]) -> str:
    expires = result.get("expires_at") or "no lease"
    head = (
        f"composition {result['composition_id']} on {result['host']}: {result['state']}"
        f" (expires: {expires}) at position {reply['position']}"
        + (" (replayed)" if reply.get("replayed") else "")
    )
    rows = [
        [
            d["id"],
            d["kind"] + (f" {d['capacity_gib']:g} GiB" if d.get("capacity_gib") else ""),
            " > ".join(d["path"]),
            d["hops"],
            d["latency_ns"],
            f"{d['bandwidth_gbps']:g}",
        ]
        for d in result["devices"]
    ]
    return head + "\n" + table(["device", "kind", "path", "hops", "ns", "gbps"], rows)


def release_summary(result: dict[str, Any], reply: dict[str, Any]) -> str:
    circuits = ", ".join(result["circuits_removed"]) or "none"
    return (
        f"composition {result['composition_id']} released at position {reply['position']}; "
        f"returned {', '.join(result['devices'])}; circuits removed: {circuits}"
    )


def extend_summary(result: dict[str, Any], reply: dict[str, Any]) -> str:
    return f"composition {result['composition_id']} now expires at {result['expires_at']}"


def connections_table(result: dict[str, Any], reply: dict[str, Any]) -> str:
    rows = [
        [
            c["device"],
            c["host"],
            c["composition_id"],
            c["tenant"],
            " > ".join(c["path"]),
            f"{c['bandwidth_gbps']:g}",
            c["since"][:19],
            c["why"]["reason"] or c["why"]["request_id"],
        ]
        for c in result["connections"]
    ]
    headers = ["device", "host", "composition", "tenant", "path", "gbps", "since", "why"]
    return table(headers, rows) + f"\n{len(rows)} connections at position {reply['position']}"


def history_table(result: dict[str, Any], reply: dict[str, Any]) -> str:
    rows = [
        [
            i["device"],
            i["model"] or i["kind"],
            i["host"],
            i["composition_id"],
            i["tenant"],
            i["start"][:19],
            (i["end"] or "")[:19] or "(held)",
            i["end_reason"] or "",
            f"{i['cost_per_hour']:g}" if i["cost_per_hour"] is not None else "",
        ]
        for i in result["intervals"]
    ]
    headers = ["device", "model", "host", "composition", "tenant", "start", "end", "ended by"]
    footer = f"\n{len(rows)} intervals at position {reply['position']}"
    return table([*headers, "cost/h"], rows) + footer


def why_text(result: dict[str, Any], reply: dict[str, Any]) -> str:
    rows = [
        [e["position"], e["type"], str(e["time"])[:19], e["actor"], e["request_id"]]
        for e in result.get("chain", [])
    ]
    chain = table(["position", "event", "time", "actor", "request_id"], rows) if rows else ""
    return result["text"] + ("\n\n" + chain if chain else "")


def free_table(result: dict[str, Any], reply: dict[str, Any]) -> str:
    rows = [
        [
            d["id"],
            d["device_kind"],
            " ".join(str(d[k]) for k in ("vendor", "model") if k in d),
            d.get("generation", ""),
            f"{d['free_gib']:g} GiB free" if "free_gib" in d else _capacity(d),
            ", ".join(f"{k}={v}" for k, v in sorted(d.get("labels", {}).items())),
        ]
        for d in result["devices"]
    ]
    headers = ["device", "kind", "model", "gen", "capacity", "labels"]
    return table(headers, rows) + f"\n{len(rows)} usable devices free"


def blast_radius_table(result: dict[str, Any], reply: dict[str, Any]) -> str:
    rows = [
        [c["composition_id"], c["tenant"], c["host"], c["state"], ", ".join(c["devices"])]
        for c in result["compositions"]
    ]
    tenants = ", ".join(result["tenants"]) or "none"
    headers = ["composition", "tenant", "host", "state", "devices on that path"]
    return table(headers, rows) + f"\ntenants affected: {tenants}"


def quota_summary(result: dict[str, Any], reply: dict[str, Any]) -> str:
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


def quota_table(result: dict[str, Any], reply: dict[str, Any]) -> str:
    rows = [
        [
            r["tenant"],
            r["kind"],
            _limit(r["kind"], r["limit"]) if r["limit"] else "none",
            _amount(r["kind"], r["held"]),
            "over quota" if r["over"] else "",
        ]
        for r in result["quotas"]
    ]
    return table(["tenant", "kind", "quota", "holds", ""], rows) + (
        f"\n{len(rows)} tenant and kind pairs at position {reply['position']}"
    )


def _limit(kind: str, limit: dict[str, Any]) -> str:
    parts = [] if limit["count"] is None else [_units(kind, limit["count"])]
    if limit["capacity_gib"] is not None:
        parts.append(f"{limit['capacity_gib']:g} GiB")
    return ", ".join(parts)


def _amount(kind: str, held: dict[str, Any]) -> str:
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
    return f"{b.device} bound to {b.host} for {b.composition_id} over {' > '.join(b.path)}"


def _circuit(c: FabricCircuit) -> str:
    return f"{c.ocs}:{c.a_port}-{c.b_port}"
