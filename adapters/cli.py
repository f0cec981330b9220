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
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from adapters.bootstrap import connect_nats, find_nats_url, running_engine
from adapters.client import TrellisClient
from adapters.migrations import SCHEMA_DIR
from adapters.render import import_summary, topology_tables
from adapters.settings import Settings
from engine.contract import json_schemas

DEFAULT_DOMAIN = "default"


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
    except CliError as exc:
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

    schema = sub.add_parser("schema", help="the wire contract as JSON Schema")
    schema_sub = schema.add_subparsers(metavar="ACTION")
    export = schema_sub.add_parser("export", help="write schema/json/*.schema.json")
    export.add_argument("--dir", type=Path, default=SCHEMA_DIR / "json")
    export.set_defaults(run=_schema_export)
    return parser


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
            print(f"serving {running.subject_prefix}.* for domains: {domains}. Ctrl-C stops.")
            await stop.wait()
        print("trellis engine stopped")

    asyncio.run(serve())
    return 0


def _topology_import(args: argparse.Namespace) -> int:
    try:
        doc = msgspec.json.decode(args.file.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise CliError(f"cannot read {args.file}: {exc}") from None
    if not isinstance(doc, dict):
        raise CliError(f"{args.file} must hold a JSON object with nodes and links")
    body = {**doc, "reason": args.reason or doc.get("reason", f"imported from {args.file.name}")}
    # A fresh id per run: importing A, then B, then A again must import A, not replay its
    # first answer. Importing the same content twice is a no-op anyway (idempotent by content).
    request_id = args.request_id or str(uuid.uuid4())
    reply = _request(
        args, f"admin.{args.domain}.import-topology", {**body, "request_id": request_id}
    )
    return _print_reply(args, reply, import_summary)


def _topology_show(args: argparse.Namespace) -> int:
    reply = _request(args, f"query.{args.domain}.topology", {})
    return _print_reply(args, reply, topology_tables)


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
    url = find_nats_url(settings)
    if url is None:
        raise CliError("no engine found: set TRELLIS_NATS_URL or start one with `trellis up`")
    try:
        nc = await asyncio.wait_for(connect_nats(url, name="trellis-cli"), timeout)
    except Exception as exc:
        raise CliError(f"cannot reach NATS at {url}: {exc}") from None
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


def _print_reply(args: argparse.Namespace, reply: dict[str, Any], render: Any) -> int:
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(reply), indent=2).decode())
    elif reply.get("ok"):
        print(render(reply["result"], reply))
    else:
        err = reply["error"]
        print(f"error [{err['code']}]: {err['message']}", file=sys.stderr)
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
