"""Queries: `composition get` / `list`, `connections`, `why`, `history`, `free`,
`blast-radius`, `engines`."""

from __future__ import annotations

import argparse
import re
from typing import Any

import msgspec
import nats.errors
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.errors import EXIT_UNAVAILABLE, CliError
from trellis.adapters.entrypoints.cli.options import (
    COMPONENT_HELP,
    DEVICE_KINDS,
    client_options,
    identifier,
    moment,
    positional_or_flag,
    query_options,
)
from trellis.adapters.entrypoints.cli.talk import (
    as_json,
    at,
    on_nats,
    paged,
    print_reply,
    query_subject,
    reading_jetstream,
    request,
)
from trellis.adapters.nats.client import NatsRefused, TrellisClient
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.jetstream import (
    bucket_name,
)
from trellis.adapters.nats.kv_state import CompositionEntry, bucket_entry
from trellis.adapters.settings import Settings, redacted
from trellis.engine.core.ids import COMPONENT_REF_PATTERN

_ANY_ID = identifier("component or composition id")
_PORT = re.compile(COMPONENT_REF_PATTERN)


def _why_id(text: str) -> str:
    """`why`'s id: the query takes a node, link or composition id, not an OCS port (which
    drain and blast-radius take); a port was refused by the engine, exit 1, as `Expected an
    id`."""
    if _PORT.fullmatch(text) and ":" in text:
        ocs = text.split(":", 1)[0]
        raise argparse.ArgumentTypeError(
            f"{text!r} is an OCS port: why takes a node, link or composition id "
            f"(ask `trellis why {ocs}` for the OCS)"
        )
    return str(_ANY_ID(text))


def composition_get(args: argparse.Namespace) -> int:
    """The composition query's answer; for people, with its conditions now, as the KV bucket
    holds them (kubectl describe's Conditions): a live composition's, not a past moment's nor
    a tenant's view (the query's JSON stays the reply's result)."""
    subject, body = query_subject(args, "composition"), at(args, {"id": args.id})
    conditions: list[dict[str, Any]] = []

    async def ask(client: TrellisClient) -> dict[str, Any]:
        reply = await client.raw(subject, msgspec.json.encode(body))
        live = args.output != "json" and args.at is None and args.view is None
        if reply.get("ok") and live:
            conditions[:] = await _conditions(client, args.domain, args.id)
        return reply

    reply = request(args, subject, body, send=ask)

    def show(result: dict[str, Any], seen: dict[str, Any], wide: bool = False) -> str:
        said = render.compose_summary(result, seen, wide=wide)
        if not conditions:
            return said
        return f"{said}\n{render.conditions_table(render.visible(conditions), wide)}"

    return print_reply(args, reply, show)


async def _conditions(client: TrellisClient, domain: str, cid: str) -> list[dict[str, Any]]:
    """The composition's conditions in the bucket; none when it holds no value for it (it
    ended) or may not be read (an identity without the bucket): they only add to the answer."""
    key = f"{domain}.composition.{cid}"
    try:
        kv = await client.nc.jetstream().key_value(bucket_name(client.prefix))
        value = (await kv.get(key)).value
    except (nats.errors.Error, TimeoutError):
        return []  # no such key or bucket, or a permission refused
    entry = bucket_entry(key, value) if value else None  # the contract's shape, or nothing
    if not isinstance(entry, CompositionEntry):
        return []
    conditions: list[dict[str, Any]] = msgspec.to_builtins(entry.conditions)
    return conditions


async def composition_rows(kv: KeyValue, domain: str) -> list[dict[str, Any]]:
    """The live compositions of `domain` in the state bucket, each its value with its `id`."""
    try:
        keys = await kv.keys()
    except NoKeysError:
        return []
    rows = []
    prefix = f"{domain}.composition."
    foreign = ForeignMessages("composition list")
    for key in sorted(k for k in keys if k.startswith(prefix)):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):  # released since the keys were listed
            continue
        if not entry.value:
            continue
        if bucket_entry(key, entry.value) is None:  # not the contract's: skipped, counted
            foreign.skipped(domain, f"key {key}")
            continue
        rows.append({"id": key.rsplit(".", 1)[1], **msgspec.json.decode(entry.value)})
    return rows


def composition_list(args: argparse.Namespace) -> int:
    async def read(
        client: TrellisClient, settings: Settings, url: str, who: str
    ) -> list[dict[str, Any]]:
        async def rows() -> list[dict[str, Any]]:
            kv = await client.nc.jetstream().key_value(bucket_name(settings.subject_prefix))
            return await composition_rows(kv, args.domain)

        return await reading_jetstream(client, rows(), who)

    rows = [
        r
        for r in on_nats(args, f"query.{args.domain}.composition", read)
        if (args.tenant is None or r["tenant"] == args.tenant)
        and (args.state is None or r["state"] == args.state)
        and (args.host is None or r["host"] == args.host)
    ]
    if args.output == "json":
        print(as_json(rows))
    else:
        print(render.composition_rows(render.visible(rows), wide=args.output == "wide"))
    return 0


def connections(args: argparse.Namespace) -> int:
    filters = {k: getattr(args, k) for k in ("host", "tenant", "device") if getattr(args, k)}
    reply = paged(args, query_subject(args, "connections"), at(args, filters))
    return print_reply(args, reply, render.connections_table)


def why(args: argparse.Namespace) -> int:
    reply = request(args, query_subject(args, "why"), at(args, {"id": args.id}))
    return print_reply(args, reply, render.why_text)


def history(args: argparse.Namespace) -> int:
    positional_or_flag(args, "target", "id")
    filters = {k: getattr(args, k) for k in ("id", "tenant") if getattr(args, k)}
    filters |= {k: getattr(args, k).isoformat() for k in ("since", "until") if getattr(args, k)}
    reply = paged(args, query_subject(args, "history"), at(args, filters))
    return print_reply(args, reply, render.history_table)


def free(args: argparse.Namespace) -> int:
    body = {"kind": args.kind} if args.kind else {}
    reply = paged(args, query_subject(args, "free"), at(args, body))
    return print_reply(args, reply, render.free_table)


def engines(args: argparse.Namespace) -> int:
    """Who writes which domain: every engine's answer to `$SRV.STATS.trellis-engine`."""

    async def ask(client: TrellisClient, settings: Any, url: str, who: str) -> list[dict[str, Any]]:
        try:
            # A refused question (a tenant may not ask the micro service) is said as such, not
            # taken for no engine at all: its answers simply never come.
            return await client.unrefused(client.engines())
        except NatsRefused as exc:
            raise CliError(
                f"{exc} ({who} may not ask the engines' micro service)",
                code="forbidden",
                hint="the operator's or the auditor's identity may (--creds)",
            ) from None
        except TimeoutError:
            raise CliError(
                f"the NATS server at {redacted(url)} did not answer within {args.timeout}s",
                code="unavailable",
                hint="is it stalled? try a longer --timeout",
                exit=EXIT_UNAVAILABLE,
            ) from None

    rows = on_nats(args, "query.engines", ask)
    if args.output == "json":
        print(as_json(rows))
        return 0
    print(render.engines_table(render.visible(rows), wide=args.output == "wide"))
    return 0


def blast_radius(args: argparse.Namespace) -> int:
    reply = request(args, query_subject(args, "blast-radius"), at(args, {"id": args.id}))
    return print_reply(args, reply, render.blast_radius_table)


def add_composition(sub: Any) -> None:
    """`composition get` / `list`."""
    comp = sub.add_parser("composition", help="one composition, or the live ones")
    comp_sub = comp.add_subparsers(metavar="ACTION")
    get = comp_sub.add_parser("get", help="a composition: host, devices, state and lease")
    get.add_argument("id", type=identifier("composition id"), help="a composition id (c-...)")
    query_options(get)
    get.set_defaults(run=composition_get)
    listing = comp_sub.add_parser(
        "list",
        help="the live compositions, one a line, from the KV feed (TRELLIS_STATE), which "
        "follows the log a moment behind the replies",
    )
    listing.add_argument("--tenant", type=identifier("tenant"), help="only this tenant's")
    listing.add_argument(
        "--state", choices=["pending", "active", "impaired"], help="only those in this state"
    )
    listing.add_argument("--host", type=identifier("host id"), help="only those on this host")
    client_options(listing)
    listing.set_defaults(run=composition_list)


def add_commands(sub: Any) -> None:
    """`connections`, `why`, `free`, `history`, `blast-radius`."""
    conn = sub.add_parser("connections", help="what is connected to what, and why")
    conn.add_argument("--host", type=identifier("host id"), help="only this host's connections")
    conn.add_argument("--tenant", type=identifier("tenant"), help="only this tenant's connections")
    conn.add_argument(
        "--device", type=identifier("device id"), help="only this device's connection"
    )
    query_options(conn)
    conn.set_defaults(run=connections)

    why_parser = sub.add_parser("why", help="why a device, host, composition or link is as it is")
    why_parser.add_argument(
        "id", type=_why_id, help="a node, a link or a composition (not an OCS port)"
    )
    query_options(why_parser)
    why_parser.set_defaults(run=why)

    free_parser = sub.add_parser("free", help="usable devices with capacity left")
    free_parser.add_argument("--kind", choices=DEVICE_KINDS, help="only this kind of device")
    query_options(free_parser)
    free_parser.set_defaults(run=free)

    history_parser = sub.add_parser("history", help="who held which device when")
    history_parser.add_argument(
        "target",
        nargs="?",
        metavar="ID",
        type=identifier("device, host or composition id"),
        help="a device, host or composition, as `why` takes it (or --id)",
    )
    history_parser.add_argument(
        "--id",
        "--device",
        dest="id",
        type=identifier("device, host or composition id"),
        help="a device, host or composition (default: all)",
    )
    history_parser.add_argument(
        "--tenant", type=identifier("tenant"), help="only this tenant's intervals"
    )
    history_parser.add_argument(
        "--since", type=moment, metavar="TIME", help="ISO time with offset, e.g. ...Z"
    )
    history_parser.add_argument("--until", type=moment, metavar="TIME", help="ISO time with offset")
    query_options(history_parser)
    history_parser.set_defaults(run=history)

    engines_parser = sub.add_parser("engines", help="the engines up, and which domains each writes")
    client_options(engines_parser)
    engines_parser.set_defaults(run=engines)

    blast = sub.add_parser("blast-radius", help="what a failure of a component would hit")
    blast.add_argument(
        "id", type=identifier("component id", COMPONENT_REF_PATTERN), help=COMPONENT_HELP
    )
    query_options(blast)
    blast.set_defaults(run=blast_radius)
