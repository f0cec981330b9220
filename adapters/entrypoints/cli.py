"""The `trellis` command: run the engine, and talk to a running one over NATS.

It lives in adapters/ (not engine/, as the first module map had it) because it wires concrete
adapters, and the engine core imports none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from adapters.bootstrap import connect_nats, fabric_state_path, find_endpoint, running_engine
from adapters.entrypoints import render
from adapters.fabric.sim import read_state_file
from adapters.nats.client import TrellisClient
from adapters.nats.jetstream import StreamConfigError
from adapters.postgres.migrations import SCHEMA_DIR
from adapters.postgres.store import PostgresEventStore, connect_pool
from adapters.settings import Settings, SettingsError
from engine.contract import json_schemas
from engine.fabric_plan import reconcile
from engine.ports import FabricSnapshot
from engine.state import DomainState, evolve
from projections import ProjectionRunner

DEFAULT_DOMAIN = "default"
DEFAULT_TENANT = "default"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except (CliError, SettingsError, StreamConfigError) as exc:
        print(f"trellis: {exc}", file=sys.stderr)
        return 1
    return code


class CliError(Exception):
    """A problem to report in one line, without a traceback."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trellis", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(metavar="COMMAND")

    up = sub.add_parser("up", help="run the engine (embedded NATS/Postgres unless configured)")
    up.set_defaults(run=_up)

    topo = sub.add_parser("topology", help="import or show a domain's fabric")
    topo_sub = topo.add_subparsers(metavar="ACTION")
    imp = topo_sub.add_parser("import", help="import a topology document (JSON)")
    imp.add_argument("file", type=Path)
    imp.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
    imp.add_argument("--reason", default="")
    _client_options(imp)
    imp.set_defaults(run=_topology_import)
    show = topo_sub.add_parser("show", help="nodes and links with health and free capacity")
    _client_options(show)
    show.set_defaults(run=_topology_show)

    _composition_commands(sub)
    _query_commands(sub)

    fabric = sub.add_parser("fabric", help="the fabric as the driver sees it")
    fabric_sub = fabric.add_subparsers(metavar="ACTION")
    fabric_show = fabric_sub.add_parser(
        "show", help="circuits and bindings the simulated hardware holds (its state file)"
    )
    fabric_show.add_argument("--domain", help="only this domain (default: every domain)")
    fabric_show.add_argument("--json", action="store_true", help="print the state as JSON")
    fabric_show.set_defaults(run=_fabric_show)
    fabric_check = fabric_sub.add_parser(
        "check",
        help="compare the simulated hardware with the log; exit 1 when they differ",
    )
    fabric_check.add_argument("--domain", help="only this domain (default: every domain)")
    fabric_check.set_defaults(run=_fabric_check)

    proj = sub.add_parser("projections", help="the read models folded from the log")
    proj_sub = proj.add_subparsers(metavar="ACTION")
    rebuild = proj_sub.add_parser("rebuild", help="empty every projection and replay the log")
    rebuild.set_defaults(run=_projections_rebuild)

    schema = sub.add_parser("schema", help="the wire contract as JSON Schema")
    schema_sub = schema.add_subparsers(metavar="ACTION")
    export = schema_sub.add_parser("export", help="write schema/json/*.schema.json")
    export.add_argument("--dir", type=Path, default=SCHEMA_DIR / "json")
    export.set_defaults(run=_schema_export)
    return parser


def _composition_commands(sub: Any) -> None:
    compose = sub.add_parser("compose", help="compose a host and devices (flags or --file)")
    compose.add_argument("--file", type=Path, help="a compose body (JSON) instead of flags")
    compose.add_argument("--host", help="the host to compose on")
    compose.add_argument(
        "--host-label", action="append", default=[], metavar="K=V", help="pick a host by label"
    )
    compose.add_argument("--gpu", type=int, default=0, metavar="N", help="number of GPUs")
    compose.add_argument("--model", action="append", default=[], help="acceptable GPU model")
    compose.add_argument("--min-generation", type=int)
    compose.add_argument("--memory", type=float, metavar="GIB", help="a memory slice of GIB")
    compose.add_argument("--nic", type=int, default=0, metavar="N")
    compose.add_argument("--nvme", type=int, default=0, metavar="N")
    compose.add_argument("--device-id", action="append", default=[], help="a specific device")
    compose.add_argument("--bandwidth", type=float, default=0.0, metavar="GBPS", help="per device")
    compose.add_argument("--max-hops", type=int)
    compose.add_argument("--max-latency-ns", type=int)
    compose.add_argument("--exclusive", action="store_true", help="no switch shared with others")
    compose.add_argument(
        "--label", action="append", default=[], metavar="K=V", help="device label constraint"
    )
    compose.add_argument("--lease", type=int, metavar="SECONDS", help="lease length")
    compose.add_argument("--reason", default="")
    _intent_options(compose)
    compose.set_defaults(run=_compose)

    release = sub.add_parser("release", help="release a composition")
    release.add_argument("composition_id")
    release.add_argument("--reason", default="")
    _intent_options(release)
    release.set_defaults(run=_release)

    extend = sub.add_parser("extend", help="extend a composition's lease")
    extend.add_argument("composition_id")
    extend.add_argument("--lease", type=int, required=True, metavar="SECONDS")
    _intent_options(extend)
    extend.set_defaults(run=_extend)


def _query_commands(sub: Any) -> None:
    conn = sub.add_parser("connections", help="what is connected to what, and why")
    conn.add_argument("--host")
    conn.add_argument("--tenant", help="only this tenant's connections")
    conn.add_argument("--device")
    _client_options(conn)
    conn.set_defaults(run=_connections)

    why = sub.add_parser("why", help="why a device, host, composition or link is as it is")
    why.add_argument("id")
    _client_options(why)
    why.set_defaults(run=_why)

    free = sub.add_parser("free", help="usable devices with capacity left")
    free.add_argument("--kind", choices=["gpu", "memory", "nic", "nvme", "accelerator"])
    _client_options(free)
    free.set_defaults(run=_free)

    blast = sub.add_parser("blast-radius", help="what a failure of a component would hit")
    blast.add_argument("id")
    _client_options(blast)
    blast.set_defaults(run=_blast_radius)


def _intent_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", default=os.environ.get("TRELLIS_TENANT", DEFAULT_TENANT))
    p.add_argument("--request-id", help="resend-safe id (default: a fresh one)")
    _client_options(p)


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--domain", default=os.environ.get("TRELLIS_DOMAIN", DEFAULT_DOMAIN))
    p.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a reply")


# ---- commands ----


def _up(args: argparse.Namespace) -> int:
    settings = Settings.from_env()

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with running_engine(settings) as running:
            domains = ", ".join(running.engine.domains) or "none yet"
            print(f"trellis engine up: NATS {running.nats_url}, Postgres {running.database_url}")
            print(f"fabric: simulated, its hardware state in {fabric_state_path(settings)}")
            print(f"serving {running.subject_prefix}.* for domains: {domains}. Ctrl-C stops.")
            await stop.wait()
        print("trellis engine stopped")

    asyncio.run(serve())
    return 0


def _topology_import(args: argparse.Namespace) -> int:
    doc = _read_json(args.file)
    body = {**doc, "reason": args.reason or doc.get("reason", f"imported from {args.file.name}")}
    # A fresh id per run: importing A, then B, then A again must import A, not replay its
    # first answer. Importing the same content twice is a no-op anyway (idempotent by content).
    request_id = args.request_id or str(uuid.uuid4())
    reply = _request(
        args, f"admin.{args.domain}.import-topology", {**body, "request_id": request_id}
    )
    return _print_reply(args, reply, render.import_summary)


def _topology_show(args: argparse.Namespace) -> int:
    reply = _request(args, f"query.{args.domain}.topology", {})
    return _print_reply(args, reply, render.topology_tables)


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
    reply = _request(args, f"query.{args.domain}.connections", filters)
    return _print_reply(args, reply, render.connections_table)


def _why(args: argparse.Namespace) -> int:
    reply = _request(args, f"query.{args.domain}.why", {"id": args.id})
    return _print_reply(args, reply, render.why_text)


def _free(args: argparse.Namespace) -> int:
    reply = _request(args, f"query.{args.domain}.free", {"kind": args.kind} if args.kind else {})
    return _print_reply(args, reply, render.free_table)


def _blast_radius(args: argparse.Namespace) -> int:
    reply = _request(args, f"query.{args.domain}.blast-radius", {"id": args.id})
    return _print_reply(args, reply, render.blast_radius_table)


def _send_intent(args: argparse.Namespace, verb: str, body: dict[str, Any], show: Any) -> int:
    body = {**body, "request_id": args.request_id or body.get("request_id") or str(uuid.uuid4())}
    reply = _request(args, f"intent.{args.domain}.{args.tenant}.{verb}", body)
    return _print_reply(args, reply, show)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = msgspec.json.decode(path.read_bytes())
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
    path = fabric_state_path(Settings.from_env())
    try:
        held = read_state_file(path)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if held is None and not args.json:
        print(f"no simulated fabric state at {path}: nothing has been programmed there yet")
        return 0
    domains = {
        d: msgspec.to_builtins(snapshot)
        for d, snapshot in (held or {}).items()
        if args.domain in (None, d)
    }
    result = {"state_file": str(path), "domains": domains}
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(result), indent=2).decode())
    else:
        print(render.fabric_tables(result, args.domain))
    return 0


def _fabric_check(args: argparse.Namespace) -> int:
    """What an auditor asks of the hardware: does it hold exactly what the log says?"""
    settings = Settings.from_env()
    url = find_endpoint(settings, "database_url")
    if url is None:
        raise CliError("no database: set TRELLIS_DATABASE_URL or start one with `trellis up`")
    path = fabric_state_path(settings)
    try:
        held = read_state_file(path) or {}
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None

    async def folded() -> dict[str, DomainState]:
        store = await PostgresEventStore.open(url, schema=settings.db_schema)
        try:
            domains = [args.domain] if args.domain else await store.domains()
            states = {}
            for domain in domains:
                state = DomainState(domain=domain)
                async for recorded in store.read(domain):
                    state = evolve(state, recorded.event())
                states[domain] = state
            return states
        finally:
            await store.close()

    states = asyncio.run(folded())
    if args.domain and not states[args.domain].exists:
        raise CliError(f"the log has no domain {args.domain!r}")
    empty = FabricSnapshot(circuits=[], bindings=[])
    differ = False
    for domain, state in sorted(states.items()):
        plan = reconcile(held.get(domain, empty), state)
        lines = render.fabric_differences(plan)
        differ |= bool(lines)
        verdict = "hardware and log differ" if lines else "hardware holds what the log says"
        print(f"{domain}: {verdict}")
        for line in lines:
            print(f"  {line}")
    return 1 if differ else 0


def _projections_rebuild(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    url = find_endpoint(settings, "database_url")
    if url is None:
        raise CliError("no database: set TRELLIS_DATABASE_URL or start one with `trellis up`")

    async def go() -> tuple[int, float]:
        store = await PostgresEventStore.open(url, schema=settings.db_schema)
        pool = await connect_pool(url, schema=settings.db_schema, max_size=4)
        runner = ProjectionRunner(pool, store, owns_pool=True)
        try:
            started = time.perf_counter()
            applied = await runner.rebuild()
            return applied, time.perf_counter() - started
        finally:
            await runner.close()
            await store.close()

    applied, seconds = asyncio.run(go())
    rate = applied / seconds if seconds else 0.0
    print(f"rebuilt {', '.join(_TABLES)} from {applied} events in {seconds:.2f} s ({rate:,.0f}/s)")
    return 0


_TABLES = ("compositions", "connections", "devices")


def _schema_export(args: argparse.Namespace) -> int:
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, content in json_schemas().items():
        (args.dir / name).write_bytes(content)
        print(f"wrote {args.dir / name}")
    return 0


# ---- talking to a running engine ----


@contextlib.asynccontextmanager
async def _client(timeout: float) -> AsyncIterator[TrellisClient]:
    settings = Settings.from_env()
    url = find_endpoint(settings, "nats_url")
    if url is None:
        raise CliError("no engine found: set TRELLIS_NATS_URL or start one with `trellis up`")
    try:
        nc = await asyncio.wait_for(connect_nats(url, name="trellis-cli"), timeout)
    except Exception as exc:
        raise CliError(f"cannot reach NATS at {url}: {str(exc) or type(exc).__name__}") from None
    try:
        yield TrellisClient(nc, prefix=settings.subject_prefix, timeout=timeout)
    finally:
        await nc.close()


def _request(args: argparse.Namespace, subject_tail: str, body: dict[str, Any]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with _client(args.timeout) as client:
            try:
                return await client.raw(subject_tail, msgspec.json.encode(body))
            except TimeoutError:
                raise CliError(f"no reply within {args.timeout}s: is an engine running?") from None

    return asyncio.run(go())


def _print_reply(args: argparse.Namespace, reply: dict[str, Any], show: Any) -> int:
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(reply), indent=2).decode())
    elif reply.get("ok"):
        print(show(reply["result"], reply))
    else:
        print(render.error_text(reply["error"]), file=sys.stderr)
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
