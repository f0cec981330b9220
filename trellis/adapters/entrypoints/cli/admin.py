"""The operator's verbs: `drain`, `undrain`, `report-fault`, `add-node`, `add-link`, `remove`,
and `quota set` / `clear` / `show`."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.talk import (
    print_reply,
    query_subject,
    read_json,
    request,
    send_admin,
)


def _admin(args: argparse.Namespace, verb: str, body: dict[str, Any]) -> int:
    body = {**body, "request_id": args.request_id or str(uuid.uuid4())}
    reply = request(args, f"admin.{args.domain}.{verb}", body)
    return print_reply(args, reply, render.component_summary)


def drain(args: argparse.Namespace) -> int:
    return _admin(args, "drain", {"id": args.id, "reason": args.reason, "force": args.force})


def undrain(args: argparse.Namespace) -> int:
    return _admin(args, "undrain", {"id": args.id, "reason": args.reason})


def report_fault(args: argparse.Namespace) -> int:
    body = {"component": args.id, "state": args.state, "detail": args.detail}
    return _admin(args, "report-fault", body)


def add_node(args: argparse.Namespace) -> int:
    return _admin(args, "add-node", {"node": read_json(args.file), "reason": args.reason})


def add_link(args: argparse.Namespace) -> int:
    return _admin(args, "add-link", {"link": read_json(args.file), "reason": args.reason})


def remove(args: argparse.Namespace) -> int:
    return _admin(args, "remove", {"id": args.id, "reason": args.reason})


def quota_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"tenant": args.tenant, "kind": args.kind, "reason": args.reason}
    if args.count is not None:
        body["count"] = args.count
    if args.gib is not None:
        body["capacity_gib"] = args.gib
    return send_admin(args, "set-quota", body, render.quota_summary)


def quota_clear(args: argparse.Namespace) -> int:
    body = {"tenant": args.tenant, "kind": args.kind, "reason": args.reason}
    return send_admin(args, "clear-quota", body, render.quota_summary)


def quota_show(args: argparse.Namespace) -> int:
    filters = {k: getattr(args, k) for k in ("tenant", "kind") if getattr(args, k)}
    reply = request(args, query_subject(args, "quotas"), filters)
    return print_reply(args, reply, render.quota_table)
