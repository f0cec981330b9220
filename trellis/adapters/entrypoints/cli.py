"""The `trellis` command: run the engine, and talk to a running one over NATS.

It lives in adapters/ (not engine/, as the first module map had it) because it wires concrete
adapters, and the engine core imports none.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import re
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import asyncpg
import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js.api import DeliverPolicy
from nats.js.errors import NoKeysError

from trellis import DISTRIBUTION
from trellis.adapters.bootstrap import (
    connect_nats,
    fabric_state_path,
    find_endpoint,
    redfish_password_file,
    running_engine,
    running_engine_pid,
    until_accepted,
)
from trellis.adapters.embedded.servers import DataDirVersionError, default_data_dir, reload_nats
from trellis.adapters.entrypoints import (
    audit_proofs,
    audit_verify,
    completion,
    export,
    redfish_import,
    render,
)
from trellis.adapters.entrypoints.economics import demo as economics
from trellis.adapters.entrypoints.economics.runs import Plan as EconomicsPlan
from trellis.adapters.nats.auth import (
    CredentialsError,
    NkeyCredentials,
    Principal,
    SecureDir,
    inbox_prefix,
    public_key,
)
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.contract import contract_files
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.jetstream import (
    StreamConfigError,
    bucket_name,
    stream_event,
    stream_name,
)
from trellis.adapters.nats.kv_state import bucket_entry
from trellis.adapters.postgres.export import ExportError
from trellis.adapters.postgres.migrations import SCHEMA_DIR, MigrationError
from trellis.adapters.postgres.privileges import PrivilegeError
from trellis.adapters.postgres.store import PostgresEventStore, connect_pool
from trellis.adapters.settings import Settings, SettingsError, metrics_port, redacted
from trellis.engine.core.errors import StoreUnavailable
from trellis.engine.core.ids import COMPONENT_REF_PATTERN, ID_PATTERN
from trellis.engine.core.intents import LEASE_SECONDS_RANGE
from trellis.engine.core.results import FabricReport
from trellis.projections import rebuild

DEFAULT_DOMAIN = "default"
DEFAULT_TENANT = "default"


# Exit codes (docs/operations.md): what a script can tell apart without reading the line.
EXIT_OK = 0
EXIT_FAILED = 1  # the engine refused, a check found a difference, or a local step failed
EXIT_USAGE = 2  # the command line is wrong (a flag, an id): nothing was sent
EXIT_UNAVAILABLE = 3  # NATS, the engine or Postgres could not be reached, or did not answer
EXIT_INTERNAL = 70  # a bug: the line says so, and -v shows the traceback
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # what a shell reports for a command killed by SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart from a bug
        return code
    except BrokenPipeError:
        # The reader went away (`trellis ... | head -1`): stop quietly, as a command killed by
        # SIGPIPE would, and keep the interpreter's last flush from complaining.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        _say("usage", str(exc), exc.hint)
        return EXIT_USAGE
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        raise  # not a bug, nor a database that is down: main stops quietly
    except CliError as exc:
        _say(exc.code, str(exc), exc.hint)
        return exc.exit
    except SettingsError as exc:
        _say("config", str(exc), "see docs/configuration.md")
        return EXIT_FAILED
    except (MigrationError, PrivilegeError, StreamConfigError, ExportError) as exc:
        _say("error", str(exc), None)
        return EXIT_FAILED
    except DataDirVersionError as exc:
        _say("incompatible", str(exc), exc.hint)
        return EXIT_FAILED
    except _POSTGRES_REFUSED as exc:  # configuration, not an outage: not waited out
        _say("refused", f"Postgres refused the connection: {exc}", "check TRELLIS_DATABASE_URL")
        return EXIT_FAILED
    except StoreUnavailable as exc:
        _say("unavailable", str(exc), "is Postgres running? see TRELLIS_DATABASE_URL")
        return EXIT_UNAVAILABLE
    except _POSTGRES_DOWN as exc:  # the local commands that read the database themselves
        _say(
            "unavailable",
            f"cannot reach Postgres: {exc or type(exc).__name__}",
            "is `trellis up` or Postgres running? see TRELLIS_DATABASE_URL",
        )
        return EXIT_UNAVAILABLE
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        _say("internal", f"{type(exc).__name__}: {exc}", "run with -v for the traceback")
        return EXIT_INTERNAL
    return code


def _say(code: str, message: str, hint: str | None) -> None:
    """One line on stderr: `trellis: <code>: <sentence> (hint: ...)`."""
    line = f"trellis: {code}: " + " ".join(message.split())
    if hint:
        line += f" (hint: {hint})"
    print(line, file=sys.stderr)


# A wrong role or password, or no such database.
_POSTGRES_REFUSED = (
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
)
# Nothing listens, or the server is starting or shutting down. (NATS commands report their
# own connection trouble in _on_nats, so what reaches main is a database connection's.)
_POSTGRES_DOWN = (ConnectionError, asyncpg.CannotConnectNowError)


class CliError(Exception):
    """A problem to report in one line, without a traceback: its code, the sentence, a hint
    and the exit code."""

    def __init__(
        self, message: str, *, code: str = "error", hint: str | None = None, exit: int = 1
    ) -> None:
        super().__init__(message)
        self.code, self.hint, self.exit = code, hint, exit


class _UsageError(Exception):
    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


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
        raise _UsageError(message, f"`{self.prog} --help`")


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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trellis",
        description=__doc__.splitlines()[0],
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
        "--redfish",
        type=_redfish_port,
        metavar="PORT",
        help="serve the Redfish service /redfish/v1 on PORT (0: a free one); "
        "default: off (env TRELLIS_REDFISH_PORT; docs/redfish.md)",
    )
    up.add_argument(
        "--redfish-host",
        metavar="ADDRESS",
        help="the address Redfish listens on; default 127.0.0.1 (env TRELLIS_REDFISH_HOST)",
    )
    up.add_argument("--redfish-cert", metavar="FILE", help="serve Redfish over TLS: certificate")
    up.add_argument("--redfish-key", metavar="FILE", help="serve Redfish over TLS: private key")
    up.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name (besides the bound address) the page and /metrics answer to in a request's "
        "Host, e.g. a proxy's; repeatable (env TRELLIS_ALLOWED_HOSTS, comma-separated)",
    )
    up.set_defaults(run=_up)

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
    econ.set_defaults(run=_demo_economics)

    follow = sub.add_parser(
        "follow", help="run the log followers alone (what TRELLIS_FOLLOWERS=process starts)"
    )
    follow.set_defaults(run=_follow)

    tenant = sub.add_parser("tenant", help="tenants' NATS identities (secure mode)")
    tenant_sub = tenant.add_subparsers(metavar="ACTION")
    tenant_add = tenant_sub.add_parser(
        "add", help="issue a tenant's credentials; a running embedded NATS takes them at once"
    )
    tenant_add.add_argument("name", type=_id("tenant"))
    tenant_add.set_defaults(run=_tenant_add)

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
    imp.set_defaults(run=_topology_import)
    show = topo_sub.add_parser("show", help="nodes and links with health and free capacity")
    _at_option(show)
    _client_options(show)
    show.set_defaults(run=_topology_show)

    replay = sub.add_parser(
        "replay", help="the fabric and its connections as they were at a past moment"
    )
    _at_option(replay, required=True)
    _client_options(replay)
    replay.set_defaults(run=_replay)

    _composition_commands(sub)
    _admin_commands(sub)
    _query_commands(sub)
    _quota_commands(sub)
    audit_proofs.register(sub, _request, _client_options)
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
    fabric_show.set_defaults(run=_fabric_show)
    fabric_check = fabric_sub.add_parser(
        "check",
        help="does the domain's hardware hold exactly what the log says? exit 1 when not",
    )
    _client_options(fabric_check)
    fabric_check.set_defaults(run=_fabric_check)

    proj = sub.add_parser("projections", help="the read models folded from the log")
    proj_sub = proj.add_subparsers(metavar="ACTION")
    rebuild = proj_sub.add_parser("rebuild", help="empty every projection and replay the log")
    rebuild.set_defaults(run=_projections_rebuild)

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
    schema_export.set_defaults(run=_schema_export)

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
    compose.set_defaults(run=_compose)

    release = sub.add_parser("release", help="release a composition")
    release.add_argument("composition_id", type=_id("composition id"))
    release.add_argument("--reason", default="")
    _intent_options(release)
    release.set_defaults(run=_release)

    comp = sub.add_parser("composition", help="one composition, or the live ones")
    comp_sub = comp.add_subparsers(metavar="ACTION")
    get = comp_sub.add_parser("get", help="a composition: host, devices, state and lease")
    get.add_argument("id", type=_id("composition id"))
    _query_options(get)
    get.set_defaults(run=_composition_get)
    listing = comp_sub.add_parser(
        "list",
        help="the live compositions, one a line, from the KV feed (TRELLIS_STATE), which "
        "follows the log a moment behind the replies",
    )
    listing.add_argument("--tenant", type=_id("tenant"), help="only this tenant's")
    listing.add_argument("--state", choices=["pending", "active", "impaired"])
    listing.add_argument("--host", type=_id("host id"), help="only those on this host")
    _client_options(listing)
    listing.set_defaults(run=_composition_list)

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
    watch.set_defaults(run=_watch)

    extend = sub.add_parser("extend", help="extend a composition's lease")
    extend.add_argument("composition_id", type=_id("composition id"))
    extend.add_argument("--lease", type=_lease, required=True, metavar="SECONDS")
    _intent_options(extend)
    extend.set_defaults(run=_extend)


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
        (drain, _drain),
        (undrain, _undrain),
        (fault, _report_fault),
        (add_node, _add_node),
        (add_link, _add_link),
        (remove, _remove),
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
    conn.set_defaults(run=_connections)

    why = sub.add_parser("why", help="why a device, host, composition or link is as it is")
    why.add_argument("id", type=_id("component or composition id", COMPONENT_REF_PATTERN))
    _query_options(why)
    why.set_defaults(run=_why)

    free = sub.add_parser("free", help="usable devices with capacity left")
    free.add_argument("--kind", choices=DEVICE_KINDS)
    _query_options(free)
    free.set_defaults(run=_free)

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
    history.set_defaults(run=_history)

    blast = sub.add_parser("blast-radius", help="what a failure of a component would hit")
    blast.add_argument("id", type=_id("component id", COMPONENT_REF_PATTERN))
    _query_options(blast)
    blast.set_defaults(run=_blast_radius)


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
    set_.set_defaults(run=_quota_set)
    clear = quota_sub.add_parser("clear", help="remove a tenant's quota for a kind")
    clear.add_argument("tenant", type=_id("tenant"))
    clear.add_argument("kind", choices=DEVICE_KINDS)
    clear.add_argument("--reason", default="")
    clear.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
    _client_options(clear)
    clear.set_defaults(run=_quota_clear)
    show = quota_sub.add_parser("show", help="quotas and holdings, by tenant and kind")
    show.add_argument("--tenant", type=_id("tenant"), help="only this tenant")
    show.add_argument("--kind", choices=DEVICE_KINDS)
    _query_options(show)
    show.set_defaults(run=_quota_show)


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


def _at(args: argparse.Namespace, body: dict[str, Any]) -> dict[str, Any]:
    return body if getattr(args, "at", None) is None else {**body, "at": args.at}


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


# ---- commands ----


def _follow(args: argparse.Namespace) -> int:
    from trellis.adapters.entrypoints.follow import main as follow_main

    return follow_main()


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


def _demo_economics(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    if args.http is not None:
        settings = msgspec.structs.replace(settings, http_port=args.http)
    _no_embedded_engine_running(settings)
    plan = EconomicsPlan(seconds=float(args.seconds), requests=int(args.requests))
    asyncio.run(economics.main(plan, settings, args.out, show="lines" if args.plain else "auto"))
    return EXIT_OK


def _no_embedded_engine_running(settings: Settings) -> None:
    """Embedded servers keep their files in the data dir: a second engine there would collide
    with the first's (postmaster.pid). Engines on shared servers may run side by side (a
    standby takes over a domain), so only the embedded case is refused."""
    if settings.nats_url and settings.database_url:
        return
    pid = running_engine_pid(settings)
    if pid is not None:
        raise CliError(
            f"an engine already runs on {settings.data_dir or default_data_dir()} (pid {pid})",
            code="running",
            hint="stop it first, or give this one its own TRELLIS_DATA_DIR",
        )


def _http_port(text: str) -> int | None:
    try:
        return metrics_port(text, "--http")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _redfish_port(text: str) -> int | None:
    try:
        return metrics_port(text, "--redfish")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _up(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    if args.redfish is not None:
        settings = msgspec.structs.replace(settings, redfish_port=args.redfish)
    if args.redfish_host:
        settings = msgspec.structs.replace(settings, redfish_host=args.redfish_host)
    if args.redfish_cert:
        settings = msgspec.structs.replace(settings, redfish_cert=Path(args.redfish_cert))
    if args.redfish_key:
        settings = msgspec.structs.replace(settings, redfish_key=Path(args.redfish_key))
    if args.http is not None:
        settings = msgspec.structs.replace(settings, http_port=args.http)
    if args.http_host:
        settings = msgspec.structs.replace(settings, http_host=args.http_host)
    if args.allow_host:
        allowed = [*settings.allowed_hosts, *args.allow_host]
        settings = msgspec.structs.replace(settings, allowed_hosts=allowed)
    if args.metrics_port is not None:
        settings = msgspec.structs.replace(settings, metrics_port=args.metrics_port)
    if args.metrics_host:
        settings = msgspec.structs.replace(settings, metrics_host=args.metrics_host)
    if args.secure:
        settings = msgspec.structs.replace(settings, secure=True)
    elif args.tenant:
        raise CliError("--tenant issues secure mode identities; add --secure")
    _no_embedded_engine_running(settings)

    async def serve() -> None:
        stop = asyncio.Event()
        starting = asyncio.current_task()
        serving = False

        def on_signal() -> None:
            # While starting (perhaps waiting for Postgres or NATS) a signal cancels the start,
            # which unwinds whatever had started; once serving, it stops the engine in order.
            if serving:
                stop.set()
            elif starting is not None:
                starting.cancel()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            async with running_engine(settings, tenants=args.tenant) as running:
                serving = True
                nats, postgres = redacted(running.nats_url), redacted(running.database_url)
                domains = ", ".join(running.engine.domains) or "none yet"
                print(f"trellis engine up: NATS {nats}, Postgres {postgres}")
                if running.nats_monitor_url:
                    print(f"NATS monitoring: {running.nats_monitor_url} (/varz, /jsz, /healthz)")
                if running.metrics_url:
                    url = running.metrics_url
                    print(f"metrics: {url}/metrics (Prometheus), health: {url}/healthz")
                if running.page_url:
                    token = f"?token={running.page_token}" if running.page_token else ""
                    print(f"fabric page: {running.page_url}/{token} (operators only)")
                if running.redfish_url:
                    print(f"Redfish: {running.redfish_url}/redfish/v1 (user admin)")
                    secret = redfish_password_file(settings)
                    if secret is not None:
                        print(f"Redfish admin password: in {secret} (mode 0600)")
                if settings.redfish_url and settings.fabric == "redfish":
                    print(f"fabric: Redfish at {redacted(settings.redfish_url)}")
                else:
                    print(f"fabric: simulated, its hardware state in {fabric_state_path(settings)}")
                if running.secure_dir is not None:
                    _print_secure(settings, SecureDir(running.secure_dir.parent))
                print(f"serving {running.subject_prefix}.* for domains: {domains}. Ctrl-C stops.")
                sys.stdout.flush()
                await stop.wait()
        except asyncio.CancelledError:
            if serving:
                raise
            print("trellis engine stopped before it served")
            return
        print("trellis engine stopped")

    asyncio.run(serve())
    return 0


def _print_secure(settings: Settings, secure: SecureDir) -> None:
    tenants = ", ".join(secure.tenants()) or "none yet (`trellis tenant add NAME`)"
    print(f"secure mode: NATS identities in {secure.root} (engine, operator, auditor; tenants:")
    print(f"  {tenants}); clients without one are refused")
    if settings.nats_url:
        print(_external_nats_note(secure))


def _external_nats_note(secure: SecureDir) -> str:
    # nats-server resolves an include relative to the including file, never as absolute.
    return (
        "NATS is external (TRELLIS_NATS_URL): link the users' file beside its configuration,\n"
        f"  `ln -s {secure.config_path} <config dir>/trellis-auth.conf`, include it there once\n"
        '  (`include "trellis-auth.conf"`), and reload the server after every change\n'
        "  (`nats-server --signal reload`, or SIGHUP); the file is the whole `authorization` block"
    )


def _tenant_add(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    data_dir = settings.data_dir or default_data_dir()
    secure = SecureDir(data_dir)
    # The permissions name the subject prefix the engine serves: the one written before, if any.
    prefix = secure.prefix() or settings.subject_prefix
    try:
        new = secure.ensure(prefix, [args.name])
        key = public_key(secure.credentials(Principal("tenant", args.name)).seed())
    except CredentialsError as exc:
        raise CliError(str(exc)) from None
    path = secure.seed_path(Principal("tenant", args.name))
    print(f"{'issued' if new else 'already issued'} tenant {args.name}'s identity: {path}")
    print(f"  public key {key}; connect with its seed and inbox prefix {inbox_prefix(key)}")
    print(f"  it may send {prefix}.intent.*.{args.name}.> and ask {prefix}.view.*.{args.name}.>")
    if settings.nats_url:
        print(_external_nats_note(secure))
    elif reload_nats(data_dir):
        url = find_endpoint(settings, "nats_url")
        if url is not None:
            creds = secure.credentials(Principal("tenant", args.name))
            try:
                asyncio.run(until_accepted(url, creds))
            except TimeoutError as exc:
                raise CliError(str(exc)) from None
        print("the running nats-server reloaded its users: the tenant can connect now")
    else:
        print(f"no embedded nats-server runs on {data_dir}: the next `trellis up` serves it")
    return 0


def _topology_import(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.from_redfish is None):
        raise CliError("give a topology file or --from-redfish URL (one of them)")
    if args.from_redfish is not None:
        try:
            body = redfish_import.read(args)
        except redfish_import.RedfishImportError as exc:
            raise CliError(str(exc), code="unavailable", exit=EXIT_UNAVAILABLE) from None
        if args.dry_run:
            print(redfish_import.show(body))
            return 0
    else:
        doc = _read_json(args.file)
        reason = args.reason or doc.get("reason", f"imported from {args.file.name}")
        body = {**doc, "reason": reason}
    # A fresh id per run: importing A, then B, then A again must import A, not replay its
    # first answer. Importing the same content twice is a no-op anyway (idempotent by content).
    request_id = args.request_id or str(uuid.uuid4())
    reply = _request(
        args,
        f"admin.{args.domain}.import-topology",
        body,
        send=lambda client: client.import_topology(args.domain, body, request_id),
    )
    return _print_reply(args, reply, render.import_summary)


def _composition_get(args: argparse.Namespace) -> int:
    reply = _request(args, _query_subject(args, "composition"), _at(args, {"id": args.id}))
    return _print_reply(args, reply, render.compose_summary)


def _composition_list(args: argparse.Namespace) -> int:
    async def read(nc: NATS, settings: Settings, url: str, *_: Any) -> list[dict[str, Any]]:
        kv = await nc.jetstream().key_value(bucket_name(settings.subject_prefix))
        try:
            keys = await kv.keys()
        except NoKeysError:
            return []
        rows = []
        prefix = f"{args.domain}.composition."
        foreign = ForeignMessages("composition list")
        for key in sorted(k for k in keys if k.startswith(prefix)):
            entry = await kv.get(key)
            if not entry.value:
                continue
            if bucket_entry(key, entry.value) is None:  # not the contract's: skipped, counted
                foreign.skipped(args.domain, f"key {key}")
                continue
            rows.append({"id": key.rsplit(".", 1)[1], **msgspec.json.decode(entry.value)})
        return rows

    rows = [
        r
        for r in _on_nats(args, f"query.{args.domain}.composition", read)
        if (args.tenant is None or r["tenant"] == args.tenant)
        and (args.state is None or r["state"] == args.state)
        and (args.host is None or r["host"] == args.host)
    ]
    if args.output == "json":
        print(as_json(rows))
    else:
        print(render.composition_rows(render.visible(rows), wide=args.output == "wide"))
    return 0


def _watch(args: argparse.Namespace) -> int:
    async def follow(nc: NATS, settings: Settings, *_: Any) -> int:
        domain = "*" if args.all_domains else args.domain
        subject = f"{settings.subject_prefix}.events.{domain}.*"
        policy = DeliverPolicy.ALL if args.from_start else DeliverPolicy.NEW
        js = nc.jetstream()
        sub = await js.subscribe(
            subject, stream=stream_name(settings.subject_prefix), ordered_consumer=True,
            deliver_policy=policy,
        )  # fmt: skip
        shown = 0
        owners: dict[str, str] = {}  # composition -> tenant, from the requests seen
        foreign = ForeignMessages("watch")
        try:
            async for msg in sub.messages:
                prefix = settings.subject_prefix
                if stream_event(prefix, msg.subject, msg.data, msg.headers) is None:
                    foreign.skipped(domain, f"seq {msg.metadata.sequence.stream}")
                    continue
                event = msgspec.json.decode(msg.data)
                if _watched(args, event, owners):
                    # json: each event as the stream carries it, one JSON document a line.
                    line = (
                        msg.data.decode()
                        if args.output == "json"
                        else render.event_line(render.visible(event))
                    )
                    print(line, flush=True)
                    shown += 1
                    if args.count is not None and shown >= args.count:
                        break
        finally:
            await sub.unsubscribe()
        return 0

    try:
        code: int = _on_nats(args, f"query.{args.domain}.topology", follow)
    except KeyboardInterrupt:
        return 0
    return code


def _watched(args: argparse.Namespace, event: dict[str, Any], owners: dict[str, str]) -> bool:
    """Whether `watch` shows `event`. A tenant's events are those it caused, those naming it,
    and the engine's on its compositions (settlements, repairs), known from their requests."""
    data = event.get("data") or {}
    if event.get("type") == "CompositionRequested" and "tenant" in data:
        owners[data["composition_id"]] = data["tenant"]
    if args.type and event.get("type") not in args.type:
        return False
    if args.tenant is None:
        return True
    return args.tenant in (
        event.get("actor"),
        data.get("tenant"),
        owners.get(data.get("composition_id", "")),
    )


def _admin(args: argparse.Namespace, verb: str, body: dict[str, Any]) -> int:
    body = {**body, "request_id": args.request_id or str(uuid.uuid4())}
    reply = _request(args, f"admin.{args.domain}.{verb}", body)
    return _print_reply(args, reply, render.component_summary)


def _drain(args: argparse.Namespace) -> int:
    return _admin(args, "drain", {"id": args.id, "reason": args.reason, "force": args.force})


def _undrain(args: argparse.Namespace) -> int:
    return _admin(args, "undrain", {"id": args.id, "reason": args.reason})


def _report_fault(args: argparse.Namespace) -> int:
    body = {"component": args.id, "state": args.state, "detail": args.detail}
    return _admin(args, "report-fault", body)


def _add_node(args: argparse.Namespace) -> int:
    return _admin(args, "add-node", {"node": _read_json(args.file), "reason": args.reason})


def _add_link(args: argparse.Namespace) -> int:
    return _admin(args, "add-link", {"link": _read_json(args.file), "reason": args.reason})


def _remove(args: argparse.Namespace) -> int:
    return _admin(args, "remove", {"id": args.id, "reason": args.reason})


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def _topology_show(args: argparse.Namespace) -> int:
    reply = _paged(args, f"query.{args.domain}.topology", _at(args, {}))
    return _print_reply(args, reply, render.topology_tables)


def _replay(args: argparse.Namespace) -> int:
    """The fabric, then what was connected to what and why, both as of `--at`."""
    topology = _paged(args, f"query.{args.domain}.topology", _at(args, {}))
    if not topology.get("ok"):
        return _print_reply(args, topology, render.topology_tables)
    connections = _request(args, f"query.{args.domain}.connections", _at(args, {}))
    if not connections.get("ok"):
        return _print_reply(args, connections, render.connections_table)
    if args.output == "json":
        print(as_json({"topology": topology["result"], "connections": connections["result"]}))
        return 0
    wide = args.output == "wide"
    print(f"as of log position {topology['position']}")
    print(render.topology_tables(topology["result"], topology, wide=wide))
    print()
    print(render.connections_table(connections["result"], connections, wide=wide))
    return 0


def _compose(args: argparse.Namespace) -> int:
    body = _read_json(args.file) if args.file else _compose_body(args)
    return _send_intent(args, "compose", body, render.compose_summary)


def _compose_body(args: argparse.Namespace) -> dict[str, Any]:
    devices: list[dict[str, Any]] = []
    shared = {"bandwidth_gbps": args.bandwidth} if args.bandwidth else {}
    if args.gpu:
        gpu: dict[str, Any] = {"kind": "gpu", "count": args.gpu, **shared}
        if args.model:
            gpu["models"] = args.model
        if args.min_generation is not None:
            gpu["min_generation"] = args.min_generation
        devices.append(gpu)
    if args.memory:
        devices.append({"kind": "memory", "capacity_gib": args.memory, **shared})
    for kind in ("nic", "nvme"):
        if getattr(args, kind):
            devices.append({"kind": kind, "count": getattr(args, kind), **shared})
    constraints: dict[str, Any] = {"isolation": "exclusive" if args.exclusive else "shared"}
    if args.max_hops is not None:
        constraints["max_hops"] = args.max_hops
    if args.max_latency_ns is not None:
        constraints["max_latency_ns"] = args.max_latency_ns
    if args.label:
        constraints["labels"] = _pairs(args.label)
    body: dict[str, Any] = {"constraints": constraints, "reason": args.reason}
    if args.host:
        body["host"] = args.host
    else:
        body["host_selector"] = {"labels": _pairs(args.host_label)}
    if devices:
        body["devices"] = devices
    if args.device_id:
        body["device_ids"] = args.device_id
    if args.lease:
        body["lease_seconds"] = args.lease
    return body


def _release(args: argparse.Namespace) -> int:
    body = {"composition_id": args.composition_id, "reason": args.reason}
    return _send_intent(args, "release", body, render.release_summary)


def _extend(args: argparse.Namespace) -> int:
    body = {"composition_id": args.composition_id, "lease_seconds": args.lease}
    return _send_intent(args, "extend", body, render.extend_summary)


def _connections(args: argparse.Namespace) -> int:
    filters = {k: getattr(args, k) for k in ("host", "tenant", "device") if getattr(args, k)}
    reply = _paged(args, _query_subject(args, "connections"), _at(args, filters))
    return _print_reply(args, reply, render.connections_table)


def _why(args: argparse.Namespace) -> int:
    reply = _request(args, _query_subject(args, "why"), _at(args, {"id": args.id}))
    return _print_reply(args, reply, render.why_text)


def _history(args: argparse.Namespace) -> int:
    filters = {k: getattr(args, k) for k in ("id", "tenant", "since", "until") if getattr(args, k)}
    reply = _paged(args, _query_subject(args, "history"), _at(args, filters))
    return _print_reply(args, reply, render.history_table)


def _free(args: argparse.Namespace) -> int:
    body = {"kind": args.kind} if args.kind else {}
    reply = _paged(args, _query_subject(args, "free"), _at(args, body))
    return _print_reply(args, reply, render.free_table)


def _blast_radius(args: argparse.Namespace) -> int:
    reply = _request(args, _query_subject(args, "blast-radius"), _at(args, {"id": args.id}))
    return _print_reply(args, reply, render.blast_radius_table)


def _quota_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"tenant": args.tenant, "kind": args.kind, "reason": args.reason}
    if args.count is not None:
        body["count"] = args.count
    if args.gib is not None:
        body["capacity_gib"] = args.gib
    return _send_admin(args, "set-quota", body, render.quota_summary)


def _quota_clear(args: argparse.Namespace) -> int:
    body = {"tenant": args.tenant, "kind": args.kind, "reason": args.reason}
    return _send_admin(args, "clear-quota", body, render.quota_summary)


def _quota_show(args: argparse.Namespace) -> int:
    filters = {k: getattr(args, k) for k in ("tenant", "kind") if getattr(args, k)}
    reply = _request(args, _query_subject(args, "quotas"), filters)
    return _print_reply(args, reply, render.quota_table)


def _send_admin(args: argparse.Namespace, verb: str, body: dict[str, Any], show: Any) -> int:
    body = {**body, "request_id": args.request_id or str(uuid.uuid4())}
    reply = _request(args, f"admin.{args.domain}.{verb}", body)
    return _print_reply(args, reply, show)


def _paged(args: argparse.Namespace, subject_tail: str, body: dict[str, Any]) -> dict[str, Any]:
    """A query whose answer may come in pages: all of them, as one reply."""
    return _request(args, subject_tail, body, send=lambda c: c.all_pages(subject_tail, body))


def _query_subject(args: argparse.Namespace, what: str) -> str:
    """The operator's query, or with --view the tenant's own view of it."""
    if args.view:
        return f"view.{args.domain}.{args.view}.{what}"
    return f"query.{args.domain}.{what}"


def _send_intent(args: argparse.Namespace, verb: str, body: dict[str, Any], show: Any) -> int:
    body = {**body, "request_id": args.request_id or body.get("request_id") or str(uuid.uuid4())}
    reply = _request(args, f"intent.{args.domain}.{args.tenant}.{verb}", body)
    return _print_reply(args, reply, show)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, or from stdin for `-`."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        doc = msgspec.json.decode(data)
    except (OSError, msgspec.DecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise CliError(f"{path} must hold a JSON object")
    return doc


def _pairs(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"expected K=V, got {item!r}")
        pairs[key] = value
    return pairs


def _fabric_show(args: argparse.Namespace) -> int:
    reply = _request(args, f"query.{args.domain}.fabric", {})
    return _print_reply(args, reply, render.fabric_tables)


def _fabric_check(args: argparse.Namespace) -> int:
    """What an auditor asks of the hardware: does it hold exactly what the log says? The
    engine that drives it answers (the `fabric` query); exit 1 when they differ."""
    reply = _request(args, f"query.{args.domain}.fabric", {})
    code = _print_reply(args, reply, render.fabric_check)
    if code == 0:
        report = msgspec.convert(reply["result"], FabricReport)
        code = 1 if render.fabric_differences(report.differences) else 0
    return code


def _projections_rebuild(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    url = find_endpoint(settings, "database_url")
    if url is None:
        raise CliError("no database: set TRELLIS_DATABASE_URL or start one with `trellis up`")

    async def go() -> tuple[int, float]:
        store = await PostgresEventStore.open(url, schema=settings.db_schema)
        pool = await connect_pool(url, schema=settings.db_schema, max_size=4)
        try:
            started = time.perf_counter()
            applied = await rebuild(pool, store, await store.domains())
            return applied, time.perf_counter() - started
        finally:
            await pool.close()
            await store.close()

    applied, seconds = asyncio.run(go())
    rate = applied / seconds if seconds else 0.0
    print(f"rebuilt {', '.join(_TABLES)} from {applied} events in {seconds:.2f} s ({rate:,.0f}/s)")
    return 0


_TABLES = ("compositions", "connections", "devices", "history")


def _completion(args: argparse.Namespace) -> int:
    print(completion.script(_parser(), args.shell), end="")
    return 0


def _schema_export(args: argparse.Namespace) -> int:
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, content in contract_files().items():
        (args.dir / name).write_bytes(content)
        print(f"wrote {args.dir / name}")
    return 0


# ---- talking to a running engine ----


def _credentials(
    settings: Settings, creds: Path | None, subject_tail: str
) -> NkeyCredentials | None:
    """Who to connect as: --creds / TRELLIS_NATS_CREDS; else, where the data dir holds secure
    mode's identities, the tenant's own for an intent or a view and the operator's for the
    rest; else nobody (a server without users)."""
    if creds is not None:
        return NkeyCredentials(creds)
    secure = SecureDir(settings.data_dir or default_data_dir())
    if not secure.exists():
        return None
    family, _, rest = subject_tail.partition(".")
    if family in ("intent", "view"):
        tenant = Principal("tenant", rest.split(".")[1])
        if not secure.seed_path(tenant).is_file():
            raise CliError(
                f"secure mode: no identity for tenant {tenant.name!r} in {secure.tenants_dir}; "
                f"`trellis tenant add {tenant.name}` issues one (or give --creds FILE)"
            )
        return secure.credentials(tenant)
    return secure.credentials(Principal("operator", "operator"))


class _Refusals:
    """What the server refused on this connection (credentials, or a publish its permissions
    deny): nats-py reports those only to the error callback, and a request would just time
    out. `first(...)` gives up on the awaited step as soon as one arrives."""

    def __init__(self) -> None:
        self.refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_error(self, exc: Exception) -> None:
        text = str(exc)
        if "violation" in text.lower() and not self.refused.done():
            self.refused.set_result(text.removeprefix("nats: ").strip("'"))

    async def first(self, step: Any, timeout: float | None) -> Any:
        task = asyncio.ensure_future(step)
        done, _ = await asyncio.wait(
            {task, self.refused}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self.refused.done():
            raise CliError(f"NATS refused it: {self.refused.result()}")
        raise TimeoutError


def _request(
    args: argparse.Namespace,
    subject_tail: str,
    body: dict[str, Any],
    send: Callable[[TrellisClient], Awaitable[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Send `body` on `subject_tail` (or have `send` talk to the engine, e.g. an import in
    parts) and return the reply, every failure turned into one CliError line. `--timeout` is
    each request's: `send` may make many (pages, parts)."""

    async def ask(nc: NATS, settings: Settings, url: str, refusals: _Refusals, who: str) -> Any:
        client = TrellisClient(nc, prefix=settings.subject_prefix, timeout=args.timeout)
        asked = send(client) if send else client.raw(subject_tail, msgspec.json.encode(body))
        try:  # the client's own timeout bounds each request
            return await refusals.first(asked, None if send else args.timeout)
        except CliError as exc:
            raise CliError(f"{exc} ({who} may not send that)", code="forbidden") from None
        except NoRespondersError:
            raise CliError(
                f"no engine serves {settings.subject_prefix}.* on {url}",
                code="unavailable",
                hint="start one with `trellis up`; check TRELLIS_SUBJECT_PREFIX",
                exit=EXIT_UNAVAILABLE,
            ) from None
        except TimeoutError:
            raise CliError(
                f"no reply within {args.timeout}s from {url}",
                code="unavailable",
                hint="is the engine busy or stopped? try a longer --timeout",
                exit=EXIT_UNAVAILABLE,
            ) from None

    reply: dict[str, Any] = _on_nats(args, subject_tail, ask)
    return reply


def _on_nats(args: argparse.Namespace, subject_tail: str, work: Any) -> Any:
    """Connect as the CLI does (the engine's NATS, the identity for `subject_tail`), run
    `await work(nc, settings, url, refusals, who)`, and close; connection trouble is one
    line."""
    settings = Settings.from_env()
    url = find_endpoint(settings, "nats_url")
    if url is None:
        raise CliError(
            "no engine found",
            code="unavailable",
            hint="start one with `trellis up`, or set TRELLIS_NATS_URL",
            exit=EXIT_UNAVAILABLE,
        )
    creds = _credentials(settings, args.creds, subject_tail)
    who = f"the identity in {creds.path}" if creds else "no credentials (see --creds)"

    async def go() -> Any:
        refusals = _Refusals()
        connecting = connect_nats(
            url, name="trellis-cli", credentials=creds, on_error=refusals.on_error
        )
        try:
            nc = await refusals.first(connecting, args.timeout)
        except (CliError, CredentialsError) as exc:
            raise CliError(
                f"{exc} (connecting to {url} with {who})", code="refused", hint="see --creds"
            ) from None
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            raise CliError(
                f"cannot reach NATS at {redacted(url)}: {reason}",
                code="unavailable",
                hint="is `trellis up` running? see TRELLIS_NATS_URL",
                exit=EXIT_UNAVAILABLE,
            ) from None
        try:
            return await work(nc, settings, url, refusals, who)
        finally:
            await nc.close()

    return asyncio.run(go())


def _print_reply(args: argparse.Namespace, reply: dict[str, Any], show: Any) -> int:
    """Print a reply as `-o` asks: `show(result, reply, wide=...)` for people, or (json) the
    result as it came; a refusal is the error and its funnel on stderr, or (json) the error
    reply on stdout. Exit 1 on a refusal."""
    ok = bool(reply.get("ok"))
    if args.output == "json":
        print(as_json(reply["result"] if ok else reply))
    elif ok:
        seen = render.visible(reply)  # text for a terminal: no control or bidi character raw
        print(show(seen["result"], seen, wide=args.output == "wide"))
    else:
        print(render.error_text(render.visible(reply["error"])), file=sys.stderr)
    return 0 if ok else 1


def as_json(value: Any) -> str:
    """One JSON document, indented."""
    return msgspec.json.format(msgspec.json.encode(value), indent=2).decode()


if __name__ == "__main__":
    raise SystemExit(main())
