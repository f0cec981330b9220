"""The operator's verbs: `drain`, `undrain`, `report-fault`, `add-node`, `add-link`, `remove`,
and `quota set` / `clear` / `show`."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.errors import EXIT_USAGE, CliError
from trellis.adapters.entrypoints.cli.options import (
    COMPONENT_HELP,
    DEVICE_KINDS,
    client_options,
    identifier,
    non_negative_count,
    non_negative_number,
    positional_or_flag,
    query_options,
    request_id_option,
)
from trellis.adapters.entrypoints.cli.talk import (
    print_reply,
    query_subject,
    read_json,
    request,
    send_admin,
)
from trellis.engine.core.ids import COMPONENT_REF_PATTERN


def _admin(args: argparse.Namespace, verb: str, body: dict[str, Any]) -> int:
    return send_admin(args, verb, body, functools.partial(render.component_summary, verb=verb))


def drain(args: argparse.Namespace) -> int:
    return _admin(args, "drain", {"id": args.id, "reason": args.reason, "force": args.force})


def undrain(args: argparse.Namespace) -> int:
    return _admin(args, "undrain", {"id": args.id, "reason": args.reason})


def report_fault(args: argparse.Namespace) -> int:
    positional_or_flag(args, "state_given", "state")
    state = args.state or "failed"
    body = {"component": args.id, "state": state, "detail": args.detail}
    return _admin(args, "report-fault", body)


def add_node(args: argparse.Namespace) -> int:
    return _admin(args, "add-node", {"node": read_json(args.file), "reason": args.reason})


def add_link(args: argparse.Namespace) -> int:
    return _admin(args, "add-link", {"link": read_json(args.file), "reason": args.reason})


def remove(args: argparse.Namespace) -> int:
    return _admin(args, "remove", {"id": args.id, "reason": args.reason})


def quota_set(args: argparse.Namespace) -> int:
    if args.count is None and args.gib is None:
        raise CliError(
            "give --count, --gib or both",
            code="usage",
            hint=f"`trellis quota clear {args.tenant} {args.kind}` removes the quota",
            exit=EXIT_USAGE,
        )
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
    positional_or_flag(args, "tenant_given", "tenant")
    filters = {k: getattr(args, k) for k in ("tenant", "kind") if getattr(args, k)}
    reply = request(args, query_subject(args, "quotas"), filters)
    return print_reply(args, reply, render.quota_table)


_DRAIN = (
    "take a component out of service: new paths avoid it, and the live compositions through "
    "it are moved off (rerouted, or given another device); one that cannot be moved is impaired"
)
_SPEC_FILE = "a file holding the {} as a JSON object, or - to read it from stdin"


def add_commands(sub: Any) -> None:
    """The operator's verbs on one component (trellis.admin.<domain>.<verb>)."""
    component = identifier("component id (a node, a link or <ocs>:<port>)", COMPONENT_REF_PATTERN)
    # What the engine does (engine/core/topology.py, drain): live compositions are moved off.
    drain_parser = sub.add_parser("drain", help=_DRAIN, description=_DRAIN)
    drain_parser.add_argument("id", type=component, help=COMPONENT_HELP)
    drain_parser.add_argument(
        "--force",
        action="store_true",
        help="drain even if an exclusive composition that cannot be moved is impaired by it "
        "(without: the drain is refused, `conflict`)",
    )
    undrain_parser = sub.add_parser("undrain", help="put a drained component back in service")
    undrain_parser.add_argument("id", type=component, help=COMPONENT_HELP)
    fault = sub.add_parser(
        "report-fault", help="record a component's health: failed, degraded or healthy again"
    )
    fault.add_argument("id", type=component, help=COMPONENT_HELP)
    states = ["failed", "degraded", "healthy"]
    fault.add_argument("state_given", nargs="?", choices=states, metavar="STATE", help="as --state")
    fault.add_argument(
        "--state", choices=states, help="what the component is now (default: failed)"
    )
    fault.add_argument("--detail", default="", help="what was seen (free text)")
    add_node_parser = sub.add_parser(
        "add-node", help="add one node (a JSON NodeSpec; `trellis schema export` writes its schema)"
    )
    add_node_parser.add_argument("file", type=Path, help=_SPEC_FILE.format("node"))
    add_link_parser = sub.add_parser(
        "add-link", help="add one link (a JSON LinkSpec; `trellis schema export` writes its schema)"
    )
    add_link_parser.add_argument("file", type=Path, help=_SPEC_FILE.format("link"))
    remove_parser = sub.add_parser("remove", help="remove a node or link no live composition uses")
    remove_parser.add_argument("id", type=identifier("node or link id"), help="a node or link id")
    for p, run in (
        (drain_parser, drain),
        (undrain_parser, undrain),
        (fault, report_fault),
        (add_node_parser, add_node),
        (add_link_parser, add_link),
        (remove_parser, remove),
    ):
        if p is not fault:
            p.add_argument("--reason", default="", help="why, recorded with the event")
        request_id_option(p)
        client_options(p)
        p.set_defaults(run=run)


def add_quota(sub: Any) -> None:
    """`quota set` / `clear` / `show`."""
    quota = sub.add_parser("quota", help="tenants' quotas per device kind, and what they hold")
    quota_sub = quota.add_subparsers(metavar="ACTION")
    set_ = quota_sub.add_parser(
        "set",
        help="set a tenant's whole quota for a kind: --count, --gib or both (the one left out:"
        " no limit on it)",
    )
    set_.add_argument("tenant", type=identifier("tenant"), help="the tenant the quota is for")
    set_.add_argument("kind", choices=DEVICE_KINDS, help="the device kind it limits")
    set_.add_argument(
        "--count",
        type=non_negative_count,
        metavar="N",
        help="devices held at once (memory: slices)",
    )
    set_.add_argument(
        "--gib", type=non_negative_number, metavar="GIB", help="memory only: GiB held at once"
    )
    set_.add_argument("--reason", default="", help="why, recorded with the event")
    request_id_option(set_)
    client_options(set_)
    set_.set_defaults(run=quota_set)
    clear = quota_sub.add_parser("clear", help="remove a tenant's quota for a kind")
    clear.add_argument("tenant", type=identifier("tenant"), help="the tenant whose quota goes")
    clear.add_argument("kind", choices=DEVICE_KINDS, help="the device kind it limited")
    clear.add_argument("--reason", default="", help="why, recorded with the event")
    request_id_option(clear)
    client_options(clear)
    clear.set_defaults(run=quota_clear)
    show = quota_sub.add_parser("show", help="quotas and holdings, by tenant and kind")
    show.add_argument(
        "tenant_given", nargs="?", type=identifier("tenant"), metavar="TENANT", help="as --tenant"
    )
    show.add_argument("--tenant", type=identifier("tenant"), help="only this tenant")
    show.add_argument("--kind", choices=DEVICE_KINDS, help="only this kind of device")
    query_options(show)
    show.set_defaults(run=quota_show)
