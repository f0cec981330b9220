"""Plain-text rendering of replies for people (the CLI and the demo); scripts use --json."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, a rule under the header, two spaces between columns."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
