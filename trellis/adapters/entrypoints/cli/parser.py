"""The `trellis` command line: every command's arguments, and which function runs it."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
from pathlib import Path
from typing import Any, NoReturn

from trellis import DISTRIBUTION
from trellis.adapters.entrypoints import (
    audit_proofs,
    audit_verify,
    completion,
    export,
    redfish_import,
    render,
)
from trellis.adapters.entrypoints.cli import (
    admin,
    intents,
    local,
    queries,
    serve,
    topology,
    watching,
)
from trellis.adapters.entrypoints.cli.errors import UsageError
from trellis.adapters.entrypoints.cli.talk import request
from trellis.adapters.postgres.migrations import SCHEMA_DIR
from trellis.adapters.settings import SettingsError, metrics_port
from trellis.engine.core.ids import COMPONENT_REF_PATTERN, ID_PATTERN
from trellis.engine.core.intents import LEASE_SECONDS_RANGE

DESCRIPTION = "The `trellis` command: run the engine, and talk to a running one over NATS."
DEFAULT_DOMAIN = "default"
DEFAULT_TENANT = "default"


class _Help(argparse.HelpFormatter):
    """Help that names each option's default, when it has one worth naming."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or not action.option_strings
            or default in (None, False, [], argparse.SUPPRESS)
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported as one line (not the usage block) and exit code 2,
    and help that names defaults (every subcommand's parser is one of these)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"`{self.prog} --help`")


class _RawEpilog(_Help):
    """The root's help: its epilog's lines kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


ENVIRONMENT = """environment (docs/configuration.md has them all):
  TRELLIS_NATS_URL       the engine's NATS (unset: the local `trellis up`'s, or embedded)
  TRELLIS_DATABASE_URL   its PostgreSQL (unset: embedded)
  TRELLIS_DATA_DIR       embedded servers' data, endpoints.json, identities
  TRELLIS_SUBJECT_PREFIX subjects' first token (default trellis)
  TRELLIS_DOMAIN         --domain's default
  TRELLIS_TENANT         --tenant's default
  TRELLIS_NATS_CREDS     --creds' default
exit codes: 0 ok, 1 refused or failed, 2 usage, 3 unavailable, 70 internal (docs/operations.md)"""


def _id(what: str, pattern: str = ID_PATTERN) -> Any:
    """An argparse type: a value the contract takes as an id (checked here, before sending)."""
    compiled = re.compile(pattern)

    def check(text: str) -> str:
        if compiled.fullmatch(text) is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a valid {what}: 1-64 letters, digits, '_' or '-'"
            )
        return text

    check.__name__ = what  # argparse names the type in its message
    return check


def _lease(text: str) -> int:
    """--lease: whole seconds within the contract's LeaseSeconds bounds."""
    low, high = LEASE_SECONDS_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"a lease is {low} to {high} seconds, not {value}")
    return value


def _verbose_anywhere(parser: argparse.ArgumentParser) -> None:
    """`-v` after a subcommand too (`trellis compose -v ...`), as people type it: every
    subcommand takes it, without resetting one given before the subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                if not any("-v" in a.option_strings for a in sub._actions):
                    sub.add_argument(
                        "-v",
                        "--verbose",
                        action="store_true",
                        default=argparse.SUPPRESS,
                        help="log at INFO level",
                    )
                _verbose_anywhere(sub)


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trellis",
        description=DESCRIPTION,
        epilog=ENVIRONMENT,
        formatter_class=_RawEpilog,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"trellis {_version()}")
    sub = parser.add_subparsers(metavar="COMMAND")

    up = sub.add_parser("up", help="run the engine (embedded NATS/Postgres unless configured)")
    up.add_argument(
        "--secure",
        action="store_true",
        help="NATS users and permissions: an identity per tenant, operator, auditor, engine",
    )
    up.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME",
        help="(secure mode) issue this tenant an identity too; repeatable",
    )
    up.add_argument(
        "--metrics-port",
        type=_metrics_port,
        metavar="PORT",
        help="serve Prometheus /metrics and /healthz on PORT (0: a free one); "
        "default: off (env TRELLIS_METRICS_PORT)",
    )
    up.add_argument(
        "--metrics-host",
        metavar="ADDRESS",
        help="the address metrics listen on; default 127.0.0.1 (env TRELLIS_METRICS_HOST)",
    )
    up.add_argument(
        "--http",
        type=_http_port,
        metavar="PORT",
        help="serve the live fabric page (an operator's view) on PORT (0: a free one); "
        "default: off (env TRELLIS_HTTP_PORT)",
    )
    up.add_argument(
        "--http-host",
        metavar="ADDRESS",
        help="the address the page listens on; default 127.0.0.1 (env TRELLIS_HTTP_HOST)",
    )
    up.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name (besides the bound address) the page and /metrics answer to in a request's "
        "Host, e.g. a proxy's; repeatable (env TRELLIS_ALLOWED_HOSTS, comma-separated)",
    )
    up.set_defaults(run=serve.up)

    demo = sub.add_parser("demo", help="demonstrations on a fresh engine of their own")
    demo_sub = demo.add_subparsers(metavar="DEMO")
    econ = demo_sub.add_parser(
        "economics",
        help="Azure's LLM trace through pooled composition and fixed GPU boxes, compared",
    )
    econ.add_argument(
        "--seconds", type=_demo_number(5, 3600), default=45.0, help="compressed demand, seconds"
    )
    econ.add_argument(
        "--requests", type=_demo_number(1, 100_000), default=200, help="trace requests to replay"
    )
    econ.add_argument(
        "--out",
        type=Path,
        default=Path("trellis-economics"),
        metavar="DIR",
        help="where the report, figures.json and the plots go; default ./trellis-economics",
    )
    econ.add_argument(
        "--http",
        type=_http_port,
        metavar="PORT",
        help="serve the live fabric page on PORT while it runs, to watch it (0: a free one)",
    )
    econ.add_argument(
        "--plain",
        action="store_true",
        help="progress as lines, not the live table (the default off a terminal)",
    )
    econ.set_defaults(run=serve.demo_economics)

    follow = sub.add_parser(
        "follow", help="run the log followers alone (what TRELLIS_FOLLOWERS=process starts)"
    )
    follow.set_defaults(run=serve.follow)

    tenant = sub.add_parser("tenant", help="tenants' NATS identities (secure mode)")
    tenant_sub = tenant.add_subparsers(metavar="ACTION")
    tenant_add = tenant_sub.add_parser(
        "add", help="issue a tenant's credentials; a running embedded NATS takes them at once"
    )
    tenant_add.add_argument("name", type=_id("tenant"))
    tenant_add.set_defaults(run=serve.tenant_add)

    topo = sub.add_parser("topology", help="import or show a domain's fabric")
    topo_sub = topo.add_subparsers(metavar="ACTION")
    imp = topo_sub.add_parser(
        "import", help="import a topology document (JSON), or one read from a Redfish service"
    )
    imp.add_argument("file", type=Path, nargs="?")
    imp.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
    imp.add_argument("--reason", default="")
    redfish_import.add_arguments(imp)
    _client_options(imp)
    imp.set_defaults(run=topology.topology_import)
    show = topo_sub.add_parser("show", help="nodes and links with health and free capacity")
    _at_option(show)
    _client_options(show)
    show.set_defaults(run=topology.topology_show)

    replay = sub.add_parser(
        "replay", help="the fabric and its connections as they were at a past moment"
    )
    _at_option(replay, required=True)
    _client_options(replay)
    replay.set_defaults(run=topology.replay)

    _composition_commands(sub)
    _admin_commands(sub)
    _query_commands(sub)
    _quota_commands(sub)
    audit_proofs.register(sub, request, _client_options)
    # One `verify`, two modes: with --proof / --checkpoint the offline proof check
    # (audit_proofs), else the log against the database (audit_verify.run dispatches).
    verify = sub.add_parser(
        "verify",
        help="check the hash chain, the invariants, the projections and the KV bucket against "
        "the log (exit 1 on any finding, 2 when it cannot run); with --proof, check a proof "
        "offline against signed checkpoints",
    )
    audit_verify.add_arguments(verify)
    audit_proofs.add_offline_verify(verify)
    verify.set_defaults(run=audit_verify.run)

    fabric = sub.add_parser(
        "fabric", help="the hardware as the engine's fabric driver sees it (the `fabric` query)"
    )
    fabric_sub = fabric.add_subparsers(metavar="ACTION")
    fabric_show = fabric_sub.add_parser(
        "show", help="the circuits and bindings the domain's hardware holds"
    )
    _client_options(fabric_show)
    fabric_show.set_defaults(run=topology.fabric_show)
    fabric_check = fabric_sub.add_parser(
        "check",
        help="does the domain's hardware hold exactly what the log says? exit 1 when not",
    )
    _client_options(fabric_check)
    fabric_check.set_defaults(run=topology.fabric_check)

    proj = sub.add_parser("projections", help="the read models folded from the log")
    proj_sub = proj.add_subparsers(metavar="ACTION")
    rebuild = proj_sub.add_parser("rebuild", help="empty every projection and replay the log")
    rebuild.set_defaults(run=local.projections_rebuild)

    parquet = sub.add_parser(
        "export", help="append the log, connection history and compositions to Parquet files"
    )
    parquet.add_argument("--parquet", type=Path, required=True, metavar="DIR")
    parquet.add_argument(
        "--domain", type=_id("domain"), help="only this domain (default: every domain)"
    )
    parquet.add_argument("--since", metavar="TIME", help="skip events before this ISO time")
    parquet.add_argument("--until", metavar="TIME", help="stop at the last event at or before")
    parquet.set_defaults(run=export.run)

    schema = sub.add_parser("schema", help="the wire contract as JSON Schema")
    schema_sub = schema.add_subparsers(metavar="ACTION")
    schema_export = schema_sub.add_parser("export", help="write schema/json/*.schema.json")
    schema_export.add_argument("--dir", type=Path, default=SCHEMA_DIR / "json")
    schema_export.set_defaults(run=local.schema_export)

    complete = sub.add_parser(
        "completion",
        help="print a shell completion script (`source <(trellis completion bash)`)",
    )
    complete.add_argument("shell", choices=completion.SHELLS)
    complete.set_defaults(run=_completion)
    _verbose_anywhere(parser)
    return parser


def _composition_commands(sub: Any) -> None:
    compose = sub.add_parser("compose", help="compose a host and devices (flags or --file)")
    compose.add_argument("--file", type=Path, help="a compose body (JSON) instead of flags")
    compose.add_argument("--host", type=_id("host id"), help="the host to compose on")
    compose.add_argument(
        "--host-label", action="append", default=[], metavar="K=V", help="pick a host by label"
    )
    compose.add_argument("--gpu", type=int, default=0, metavar="N", help="number of GPUs")
    compose.add_argument("--model", action="append", default=[], help="acceptable GPU model")
    compose.add_argument("--min-generation", type=int)
    compose.add_argument("--memory", type=float, metavar="GIB", help="a memory slice of GIB")
    compose.add_argument("--nic", type=int, default=0, metavar="N")
    compose.add_argument("--nvme", type=int, default=0, metavar="N")
    compose.add_argument(
        "--device-id", action="append", default=[], type=_id("device id"), help="a device"
    )
    compose.add_argument("--bandwidth", type=float, default=0.0, metavar="GBPS", help="per device")
    compose.add_argument("--max-hops", type=int)
    compose.add_argument("--max-latency-ns", type=int)
    compose.add_argument("--exclusive", action="store_true", help="no switch shared with others")
    compose.add_argument(
        "--label", action="append", default=[], metavar="K=V", help="device label constraint"
    )
    compose.add_argument("--lease", type=_lease, metavar="SECONDS", help="lease length")
    compose.add_argument("--reason", default="")
    _intent_options(compose)
    compose.set_defaults(run=intents.compose)

    release = sub.add_parser("release", help="release a composition")
    release.add_argument("composition_id", type=_id("composition id"))
    release.add_argument("--reason", default="")
    _intent_options(release)
    release.set_defaults(run=intents.release)

    comp = sub.add_parser("composition", help="one composition, or the live ones")
    comp_sub = comp.add_subparsers(metavar="ACTION")
    get = comp_sub.add_parser("get", help="a composition: host, devices, state and lease")
    get.add_argument("id", type=_id("composition id"))
    _query_options(get)
    get.set_defaults(run=queries.composition_get)
    listing = comp_sub.add_parser(
        "list",
        help="the live compositions, one a line, from the KV feed (TRELLIS_STATE), which "
        "follows the log a moment behind the replies",
    )
    listing.add_argument("--tenant", type=_id("tenant"), help="only this tenant's")
    listing.add_argument("--state", choices=["pending", "active", "impaired"])
    listing.add_argument("--host", type=_id("host id"), help="only those on this host")
    _client_options(listing)
    listing.set_defaults(run=queries.composition_list)

    watch = sub.add_parser(
        "watch", help="live events from the stream (TRELLIS_EVENTS), one a line, until Ctrl-C"
    )
    watch.add_argument(
        "--type",
        action="append",
        default=[],
        metavar="EVENT",
        help="only this event type, e.g. CompositionActivated; repeatable",
    )
    watch.add_argument(
        "--tenant",
        type=_id("tenant"),
        help="only this tenant's: events it caused or that name it, and the engine's on "
        "compositions it requested while watching",
    )
    watch.add_argument("--all-domains", action="store_true", help="every domain, not --domain")
    watch.add_argument(
        "--from-start",
        action="store_true",
        help="replay the stream from its first event instead of new ones only",
    )
    watch.add_argument("--count", type=int, metavar="N", help="stop after N events")
    _client_options(watch)
    watch.set_defaults(run=watching.watch)

    extend = sub.add_parser("extend", help="extend a composition's lease")
    extend.add_argument("composition_id", type=_id("composition id"))
    extend.add_argument("--lease", type=_lease, required=True, metavar="SECONDS")
    _intent_options(extend)
    extend.set_defaults(run=intents.extend)


def _admin_commands(sub: Any) -> None:
    """The operator's verbs on one component (trellis.admin.<domain>.<verb>)."""
    component = _id("component id (a node, a link or <ocs>:<port>)", COMPONENT_REF_PATTERN)
    drain = sub.add_parser(
        "drain", help="take a component out of service for new paths (existing ones stay)"
    )
    drain.add_argument("id", type=component)
    drain.add_argument(
        "--force", action="store_true", help="also move (or impair) the live paths through it"
    )
    undrain = sub.add_parser("undrain", help="put a drained component back in service")
    undrain.add_argument("id", type=component)
    fault = sub.add_parser(
        "report-fault", help="record a component's health: failed, degraded or healthy again"
    )
    fault.add_argument("id", type=component)
    fault.add_argument("--state", choices=["failed", "degraded", "healthy"], default="failed")
    fault.add_argument("--detail", default="", help="what was seen (free text)")
    add_node = sub.add_parser("add-node", help="add one node (a JSON NodeSpec, see schema/json)")
    add_node.add_argument("file", type=Path, help="the node as JSON, or - for stdin")
    add_link = sub.add_parser("add-link", help="add one link (a JSON LinkSpec, see schema/json)")
    add_link.add_argument("file", type=Path, help="the link as JSON, or - for stdin")
    remove = sub.add_parser("remove", help="remove a node or link no live composition uses")
    remove.add_argument("id", type=_id("node or link id"))
    for p, run in (
        (drain, admin.drain),
        (undrain, admin.undrain),
        (fault, admin.report_fault),
        (add_node, admin.add_node),
        (add_link, admin.add_link),
        (remove, admin.remove),
    ):
        if p is not fault:
            p.add_argument("--reason", default="", help="why, recorded with the event")
        p.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
        _client_options(p)
        p.set_defaults(run=run)


def _query_commands(sub: Any) -> None:
    conn = sub.add_parser("connections", help="what is connected to what, and why")
    conn.add_argument("--host", type=_id("host id"))
    conn.add_argument("--tenant", type=_id("tenant"), help="only this tenant's connections")
    conn.add_argument("--device", type=_id("device id"))
    _query_options(conn)
    conn.set_defaults(run=queries.connections)

    why = sub.add_parser("why", help="why a device, host, composition or link is as it is")
    why.add_argument("id", type=_id("component or composition id", COMPONENT_REF_PATTERN))
    _query_options(why)
    why.set_defaults(run=queries.why)

    free = sub.add_parser("free", help="usable devices with capacity left")
    free.add_argument("--kind", choices=DEVICE_KINDS)
    _query_options(free)
    free.set_defaults(run=queries.free)

    history = sub.add_parser("history", help="who held which device when")
    history.add_argument(
        "--id",
        "--device",
        dest="id",
        type=_id("device, host or composition id"),
        help="a device, host or composition (default: all)",
    )
    history.add_argument("--tenant", type=_id("tenant"), help="only this tenant's intervals")
    history.add_argument("--since", metavar="TIME", help="ISO time with offset, e.g. ...Z")
    history.add_argument("--until", metavar="TIME", help="ISO time with offset")
    _query_options(history)
    history.set_defaults(run=queries.history)

    blast = sub.add_parser("blast-radius", help="what a failure of a component would hit")
    blast.add_argument("id", type=_id("component id", COMPONENT_REF_PATTERN))
    _query_options(blast)
    blast.set_defaults(run=queries.blast_radius)


DEVICE_KINDS = ["gpu", "memory", "nic", "nvme", "accelerator"]


def _quota_commands(sub: Any) -> None:
    quota = sub.add_parser("quota", help="tenants' quotas per device kind, and what they hold")
    quota_sub = quota.add_subparsers(metavar="ACTION")
    set_ = quota_sub.add_parser(
        "set", help="set a tenant's whole quota for a kind (a limit left out: no limit)"
    )
    set_.add_argument("tenant", type=_id("tenant"))
    set_.add_argument("kind", choices=DEVICE_KINDS)
    set_.add_argument(
        "--count", type=int, metavar="N", help="devices held at once (memory: slices)"
    )
    set_.add_argument("--gib", type=float, metavar="GIB", help="memory only: GiB held at once")
    set_.add_argument("--reason", default="")
    set_.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
    _client_options(set_)
    set_.set_defaults(run=admin.quota_set)
    clear = quota_sub.add_parser("clear", help="remove a tenant's quota for a kind")
    clear.add_argument("tenant", type=_id("tenant"))
    clear.add_argument("kind", choices=DEVICE_KINDS)
    clear.add_argument("--reason", default="")
    clear.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
    _client_options(clear)
    clear.set_defaults(run=admin.quota_clear)
    show = quota_sub.add_parser("show", help="quotas and holdings, by tenant and kind")
    show.add_argument("--tenant", type=_id("tenant"), help="only this tenant")
    show.add_argument("--kind", choices=DEVICE_KINDS)
    _query_options(show)
    show.set_defaults(run=admin.quota_show)


def _at_option(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument(
        "--at",
        type=_point_in_time,
        required=required,
        metavar="TIME|POSITION",
        help="answer as of a past moment: an ISO time with its zone (2026-12-01T10:00:00Z) "
        "or a log position" + ("" if required else " (default: now)"),
    )


def _point_in_time(text: str) -> int | str:
    """A log position (digits) or an ISO time, as the `at` field takes them."""
    return int(text) if text.isdigit() else text


def _query_options(p: argparse.ArgumentParser) -> None:
    _at_option(p)
    p.add_argument(
        "--view",
        type=_id("tenant"),
        metavar="TENANT",
        help="ask as TENANT's view (<prefix>.view.<domain>.<tenant>.*): only its own data",
    )
    _client_options(p)


def _intent_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tenant",
        type=_id("tenant"),
        default=os.environ.get("TRELLIS_TENANT", DEFAULT_TENANT),
        help="who asks (default: $TRELLIS_TENANT or %(default)s)",
    )
    p.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
    _client_options(p)


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--domain",
        type=_id("domain"),
        default=os.environ.get("TRELLIS_DOMAIN", DEFAULT_DOMAIN),
        help="the fabric domain (default: $TRELLIS_DOMAIN or %(default)s)",
    )
    render.add_output_options(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a reply")
    p.add_argument(
        "--creds",
        type=Path,
        default=os.environ.get("TRELLIS_NATS_CREDS") or None,
        metavar="FILE",
        help="NATS identity (an nkey seed file) to connect as; default in secure mode: the "
        "tenant's own for intents and views, else the operator's, from the data dir",
    )


def _metrics_port(text: str) -> int | None:
    try:
        return metrics_port(text, "--metrics-port")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _demo_number(low: float, high: float) -> Any:
    """An argparse type: a number from `low` to `high` (whole when `low` is an int)."""
    kind = int if isinstance(low, int) else float

    def number(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not between {low} and {high}")
        return value

    return number


def _http_port(text: str) -> int | None:
    try:
        return metrics_port(text, "--http")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def _completion(args: argparse.Namespace) -> int:
    print(completion.script(make_parser(), args.shell), end="")
    return 0
