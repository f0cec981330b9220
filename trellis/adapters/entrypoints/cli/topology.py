"""A domain's fabric: `topology import` / `show`, `replay`, and `fabric show` / `check`."""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path
from typing import Any

import msgspec

from trellis.adapters.entrypoints import (
    redfish_import,
    render,
)
from trellis.adapters.entrypoints.cli.errors import (
    EXIT_FAILED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
)
from trellis.adapters.entrypoints.cli.options import (
    at_option,
    client_options,
    request_id_option,
)
from trellis.adapters.entrypoints.cli.talk import (
    as_json,
    at,
    may_have_been_committed,
    paged,
    print_reply,
    read_json,
    request,
)
from trellis.engine.core.results import FabricReport


def topology_import(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.from_redfish is None):
        raise CliError("give a topology file or --from-redfish URL (one of them)")
    if args.from_redfish is not None:
        try:
            body = redfish_import.read(args)
        except redfish_import.RedfishImportError as exc:
            raise _import_error(exc) from None
        if args.dry_run:
            print(redfish_import.show(body))
            return 0
    else:
        doc = read_json(args.file)
        reason = args.reason or doc.get("reason", f"imported from {args.file.name}")
        body = {**doc, "reason": reason}
    # A fresh id per run: importing A, then B, then A again must import A, not replay its
    # first answer. Importing the same content twice is a no-op anyway (idempotent by content).
    request_id = args.request_id or str(uuid.uuid4())
    reply = request(
        args,
        f"admin.{args.domain}.import-topology",
        body,
        send=lambda client: client.import_topology(args.domain, body, request_id),
        request_id=request_id,
    )
    code = print_reply(args, reply, render.import_summary)
    may_have_been_committed(args, reply, request_id)
    return code


def _import_error(exc: redfish_import.RedfishImportError) -> CliError:
    """The exit code of docs/operations.md for why the service could not be read: only a
    service that cannot be reached (or answers 503) is `unavailable`, 3; a URL that is no
    service URL is `usage`, 2; a refusal (401, 403, no such fabric, anything else) is 1."""
    kind = exc.kind
    if kind == "usage":
        return CliError(str(exc), code="usage", exit=EXIT_USAGE)
    if kind == "unavailable":
        return CliError(str(exc), code=kind, exit=EXIT_UNAVAILABLE)
    hint = (
        "give its account with --user and TRELLIS_REDFISH_PASSWORD" if kind == "refused" else None
    )
    return CliError(str(exc), code=kind, hint=hint, exit=EXIT_FAILED)


def topology_show(args: argparse.Namespace) -> int:
    reply = paged(args, f"query.{args.domain}.topology", at(args, {}))
    return print_reply(args, reply, render.topology_tables)


def replay(args: argparse.Namespace) -> int:
    """The fabric, then what was connected to what and why, both as of `--at`."""
    topology = paged(args, f"query.{args.domain}.topology", at(args, {}))
    if not topology.get("ok"):
        return print_reply(args, topology, render.topology_tables)
    connections = request(args, f"query.{args.domain}.connections", at(args, {}))
    if not connections.get("ok"):
        return print_reply(args, connections, render.connections_table)
    if args.output == "json":
        print(as_json({"topology": topology["result"], "connections": connections["result"]}))
        return 0
    wide = args.output == "wide"
    print(f"as of log position {topology['position']}")
    print(render.topology_tables(topology["result"], topology, wide=wide))
    print()
    print(render.connections_table(connections["result"], connections, wide=wide))
    return 0


def fabric_show(args: argparse.Namespace) -> int:
    reply = request(args, f"query.{args.domain}.fabric", {})
    return print_reply(args, reply, render.fabric_tables)


def fabric_check(args: argparse.Namespace) -> int:
    """What an auditor asks of the hardware: does it hold exactly what the log says? The
    engine that drives it answers (the `fabric` query); exit 1 when they differ."""
    reply = request(args, f"query.{args.domain}.fabric", {})
    code = print_reply(args, reply, render.fabric_check)
    if code == 0:
        report = msgspec.convert(reply["result"], FabricReport)
        code = 1 if render.fabric_differences(report.differences) else 0
    return code


def add_commands(sub: Any) -> None:
    """`topology import` / `show`, and `replay`."""
    topo = sub.add_parser("topology", help="import or show a domain's fabric")
    topo_sub = topo.add_subparsers(metavar="ACTION")
    imp = topo_sub.add_parser(
        "import", help="import a topology document (JSON), or one read from a Redfish service"
    )
    imp.add_argument(
        "file",
        type=Path,
        nargs="?",
        help="the topology document (nodes and links; `trellis schema export` writes its schema); "
        "none with --from-redfish",
    )
    request_id_option(imp)
    imp.add_argument(
        "--reason",
        default="",
        help="why, recorded with the import (else the document's reason, or where it came from)",
    )
    redfish_import.add_arguments(imp)
    client_options(imp)
    imp.set_defaults(run=topology_import)
    show = topo_sub.add_parser("show", help="nodes and links with health and free capacity")
    at_option(show)
    client_options(show)
    show.set_defaults(run=topology_show)

    replay_parser = sub.add_parser(
        "replay", help="the fabric and its connections as they were at a past moment"
    )
    at_option(replay_parser, required=True)
    client_options(replay_parser)
    replay_parser.set_defaults(run=replay)


def add_fabric(sub: Any) -> None:
    """`fabric show` / `check`."""
    fabric = sub.add_parser(
        "fabric", help="the hardware as the engine's fabric driver sees it (the `fabric` query)"
    )
    fabric_sub = fabric.add_subparsers(metavar="ACTION")
    fabric_show_parser = fabric_sub.add_parser(
        "show", help="the circuits and bindings the domain's hardware holds"
    )
    client_options(fabric_show_parser)
    fabric_show_parser.set_defaults(run=fabric_show)
    fabric_check_parser = fabric_sub.add_parser(
        "check",
        help="does the domain's hardware hold exactly what the log says? exit 1 when not",
    )
    client_options(fabric_check_parser)
    fabric_check_parser.set_defaults(run=fabric_check)
