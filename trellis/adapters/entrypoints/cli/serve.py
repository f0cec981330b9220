"""Running things: `trellis up` (the engine), `trellis follow`, `trellis demo economics`, and
`trellis tenant add|list|revoke` (secure mode's identities)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import msgspec

from trellis.adapters import event_loop
from trellis.adapters.bootstrap import (
    checkpoint_key_path,
    fabric_state_path,
    redfish_password_file,
    running_engine,
)
from trellis.adapters.collector import settle_for_serving
from trellis.adapters.embedded.nats_server import reload_nats
from trellis.adapters.embedded.process import default_data_dir
from trellis.adapters.endpoints import find_endpoint, running_engine_pid
from trellis.adapters.entrypoints.cli.errors import EXIT_OK, CliError
from trellis.adapters.entrypoints.cli.options import (
    demo_number,
    http_port_arg,
    identifier,
    metrics_port_arg,
    redfish_port_arg,
)
from trellis.adapters.entrypoints.cli.talk import as_json
from trellis.adapters.entrypoints.economics import demo as economics
from trellis.adapters.entrypoints.economics.runs import Plan as EconomicsPlan
from trellis.adapters.entrypoints.render import add_output_options, table
from trellis.adapters.nats.auth import (
    CredentialsError,
    NkeyCredentials,
    Principal,
    SecureDir,
    UnknownTenant,
    inbox_prefix,
    public_key,
)
from trellis.adapters.nats.connect import accepts_anonymous, until_accepted, until_refused
from trellis.adapters.settings import Settings, redacted


def follow(args: argparse.Namespace) -> int:
    from trellis.adapters.entrypoints.follow import main as follow_main

    settings = Settings.from_env()
    if not (settings.nats_url and settings.database_url):
        # Said here as every command says a configuration mistake (it printed its own
        # "trellis follow: ..." and exited 2, a usage code, for a missing setting).
        raise CliError(
            "`trellis follow` needs TRELLIS_NATS_URL and TRELLIS_DATABASE_URL (the servers "
            "of the engine whose log it follows)",
            code="config",
            hint="`trellis up` starts its own followers; run this beside an engine on servers "
            "of your own",
        )
    return follow_main()


def demo_economics(args: argparse.Namespace) -> int:
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


def up(args: argparse.Namespace) -> int:
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
    if (settings.redfish_cert or settings.redfish_key) and settings.redfish_port is None:
        raise CliError(
            "a Redfish certificate or key is given but no Redfish port: nothing would serve it",
            code="config",
            hint="add --redfish PORT (or TRELLIS_REDFISH_PORT), or drop the certificate",
        )
    _no_embedded_engine_running(settings)
    key = checkpoint_key_path(settings)
    new_key = not key.exists()  # made by this start: said in the banner, as a plain line

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
                if running.secure_dir is not None and settings.nats_url:
                    await _refusing_anonymous(
                        running.nats_url, SecureDir(running.secure_dir.parent)
                    )
                settle_for_serving()
                nats, postgres = redacted(running.nats_url), redacted(running.database_url)
                # Every engine serves every domain it may (forwarding to the writer); it writes
                # those whose lease it holds, which a restart takes up over its first ticks.
                writing = ", ".join(running.engine.domains) or "none yet"
                domains = f"every domain (writing now: {writing})"
                if settings.domains:
                    limited = ", ".join(settings.domains)
                    domains = f"domains {limited} (TRELLIS_DOMAINS; writing now: {writing})"
                print(f"trellis engine up: NATS {nats}, Postgres {postgres}")
                print(f"event loop: {event_loop.running()} (TRELLIS_EVENT_LOOP)")
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
                    state = fabric_state_path(settings)
                    print(f"fabric: simulated, its hardware state in {state}.g<N> (newest N)")
                if running.secure_dir is not None:
                    _print_secure(settings, SecureDir(running.secure_dir.parent))
                if new_key and key.exists():
                    print(f"generated the checkpoint signing key {key} (verifier key: {key}.pub)")
                if running.checkpoint_key_warning:
                    print(f"WARNING: {running.checkpoint_key_warning}")
                print(f"serving {running.subject_prefix}.* for {domains}. Ctrl-C stops.")
                sys.stdout.flush()
                await stop.wait()
        except asyncio.CancelledError:
            if serving:
                raise
            print("trellis engine stopped before it served")
            return
        print("trellis engine stopped")

    event_loop.run(serve(), settings.event_loop)
    return 0


async def _refusing_anonymous(url: str, secure: SecureDir) -> None:
    """An external nats-server that secure mode's users are not included in yet accepts
    anyone: the engine said "clients without one are refused" while any client got in.

    Raises:
        CliError: it lets a client without credentials connect.
    """
    if await accepts_anonymous(url):
        raise CliError(
            f"secure mode, but the nats-server at {redacted(url)} lets clients without "
            "credentials in: its configuration does not include secure mode's users",
            hint=f"link {secure.config_path} beside its configuration as trellis-auth.conf, "
            'add `include "trellis-auth.conf"`, reload it, and start again',
        )


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


def _secured(settings: Settings, issuing: bool = False) -> SecureDir:
    """The data dir's identities.

    Raises:
        CliError: it is not in secure mode (`issuing`: nor asked to be, TRELLIS_SECURE).
    """
    data_dir = settings.data_dir or default_data_dir()
    secure = SecureDir(data_dir)
    if not (secure.exists() or (issuing and settings.secure)):
        # Issuing the first identity sets secure mode up in the data dir, and a data dir once
        # secured stays so: the next plain `trellis up` came up secure, unasked, while this
        # said the tenant could connect (the running server still let anyone in).
        raise CliError(
            f"{data_dir} is not in secure mode: a tenant's identity means nothing there",
            hint="start it with `trellis up --secure` first (or set TRELLIS_SECURE=1)",
        )
    return secure


def tenant_add(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    data_dir = settings.data_dir or default_data_dir()
    secure = _secured(settings, issuing=True)
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


def tenant_list(args: argparse.Namespace) -> int:
    """Every tenant with an identity, read from the data dir alone (no server asked)."""
    secure = _secured(Settings.from_env())
    try:
        rows = [
            {"tenant": name, "public_key": key, "identity": str(path)}
            for name, key, path in secure.identities()
        ]
    except CredentialsError as exc:
        raise CliError(str(exc)) from None
    if args.output == "json":
        print(as_json(rows))
    elif not rows:
        print(f"no tenant has an identity in {secure.tenants_dir} (`trellis tenant add NAME`)")
    else:
        print(table(["TENANT", "PUBLIC KEY", "IDENTITY"], [list(r.values()) for r in rows]))
    return 0


def tenant_revoke(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    data_dir = settings.data_dir or default_data_dir()
    secure = _secured(settings)
    try:
        aside = secure.revoke(args.name, secure.prefix() or settings.subject_prefix)
        key = public_key(NkeyCredentials(aside).seed())
    except UnknownTenant as exc:
        raise CliError(
            str(exc), code="not_found", hint="`trellis tenant list` names those there are"
        ) from None
    except (CredentialsError, OSError) as exc:
        raise CliError(str(exc)) from None
    print(f"revoked tenant {args.name}'s identity (public key {key}): its seed is now {aside}")
    print(
        f"  its compositions are not released: their devices stay held until their leases "
        f"end. To release them now, issue a new identity (`trellis tenant add {args.name}`), "
        f"`trellis release ID --tenant {args.name}` each, and revoke it again"
    )
    if settings.nats_url:
        print(_external_nats_note(secure))
        print(f"  until that reload, the nats-server still lets {key} in")
    elif reload_nats(data_dir):
        url = find_endpoint(settings, "nats_url")
        if url is not None:
            try:
                asyncio.run(until_refused(url, NkeyCredentials(aside)))
            except TimeoutError as exc:
                raise CliError(str(exc)) from None
        print("the running nats-server reloaded its users: it refuses that identity now, and")
        print("  closed the connections it had")
    else:
        print(f"no embedded nats-server runs on {data_dir}: the next `trellis up` refuses it")
    return 0


def add_commands(sub: Any) -> None:
    """`up`, `demo`, `follow` and `tenant`."""
    up_parser = sub.add_parser(
        "up", help="run the engine (embedded NATS/Postgres unless configured)"
    )
    up_parser.add_argument(
        "--secure",
        action="store_true",
        help="NATS users and permissions: an identity per tenant, operator, auditor, engine",
    )
    up_parser.add_argument(
        "--tenant",
        action="append",
        default=[],
        type=identifier("tenant"),
        metavar="NAME",
        help="(secure mode) issue this tenant an identity too; repeatable",
    )
    up_parser.add_argument(
        "--metrics-port",
        type=metrics_port_arg,
        metavar="PORT",
        help="serve Prometheus /metrics and /healthz on PORT (0: a free one); "
        "default: off (env TRELLIS_METRICS_PORT)",
    )
    up_parser.add_argument(
        "--metrics-host",
        metavar="ADDRESS",
        help="the address metrics listen on; default 127.0.0.1 (env TRELLIS_METRICS_HOST)",
    )
    up_parser.add_argument(
        "--http",
        type=http_port_arg,
        metavar="PORT",
        help="serve the live fabric page (an operator's view) on PORT (0: a free one); "
        "default: off (env TRELLIS_HTTP_PORT)",
    )
    up_parser.add_argument(
        "--http-host",
        metavar="ADDRESS",
        help="the address the page listens on; default 127.0.0.1 (env TRELLIS_HTTP_HOST)",
    )
    up_parser.add_argument(
        "--redfish",
        type=redfish_port_arg,
        metavar="PORT",
        help="serve the Redfish service /redfish/v1 on PORT (0: a free one); "
        "default: off (env TRELLIS_REDFISH_PORT; docs/redfish.md)",
    )
    up_parser.add_argument(
        "--redfish-host",
        metavar="ADDRESS",
        help="the address Redfish listens on; default 127.0.0.1 (env TRELLIS_REDFISH_HOST)",
    )
    up_parser.add_argument(
        "--redfish-cert", metavar="FILE", help="serve Redfish over TLS: certificate"
    )
    up_parser.add_argument(
        "--redfish-key", metavar="FILE", help="serve Redfish over TLS: private key"
    )
    up_parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name (besides the bound address) the page and /metrics answer to in a request's "
        "Host, e.g. a proxy's; repeatable (env TRELLIS_ALLOWED_HOSTS, comma-separated)",
    )
    up_parser.set_defaults(run=up)

    demo = sub.add_parser("demo", help="demonstrations on a fresh engine of their own")
    demo_sub = demo.add_subparsers(metavar="DEMO")
    econ = demo_sub.add_parser(
        "economics",
        help="Azure's LLM trace through pooled composition and fixed GPU boxes, compared",
    )
    econ.add_argument(
        "--seconds",
        type=demo_number(5, 3600),
        default=45.0,
        help="the demand's ten minutes compressed into this many seconds, 5 to 3,600",
    )
    econ.add_argument(
        "--requests",
        type=demo_number(1, 100_000, whole=True),
        default=200,
        help="trace requests to replay, 1 to 100,000 (at most what the trace's ten minutes hold)",
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
        type=http_port_arg,
        metavar="PORT",
        help="serve the live fabric page on PORT while it runs, to watch it (0: a free one)",
    )
    econ.add_argument(
        "--plain",
        action="store_true",
        help="progress as lines, not the live table (the default off a terminal)",
    )
    econ.set_defaults(run=demo_economics)

    follow_parser = sub.add_parser(
        "follow", help="run the log followers alone (what TRELLIS_FOLLOWERS=process starts)"
    )
    follow_parser.set_defaults(run=follow)

    tenant = sub.add_parser("tenant", help="tenants' NATS identities (secure mode)")
    tenant_sub = tenant.add_subparsers(metavar="ACTION")
    tenant_add_parser = tenant_sub.add_parser(
        "add", help="issue a tenant's credentials; a running embedded NATS takes them at once"
    )
    tenant_add_parser.add_argument("name", type=identifier("tenant"), help="the tenant's name")
    tenant_add_parser.set_defaults(run=tenant_add)
    tenant_list_parser = tenant_sub.add_parser(
        "list", help="the tenants with an identity: name, public key, seed file"
    )
    add_output_options(tenant_list_parser)
    tenant_list_parser.set_defaults(run=tenant_list)
    tenant_revoke_parser = tenant_sub.add_parser(
        "revoke",
        help="take a tenant's identity away; a running embedded NATS refuses it and cuts off "
        "its connections at once (its compositions stay held)",
    )
    tenant_revoke_parser.add_argument(
        "name", type=identifier("tenant"), help="the tenant whose identity is revoked"
    )
    tenant_revoke_parser.set_defaults(run=tenant_revoke)
