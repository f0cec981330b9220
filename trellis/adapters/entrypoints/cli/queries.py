"""Queries: `composition get` / `list`, `connections`, `why`, `history`, `free`,
`blast-radius`."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
from nats.js.errors import NoKeysError

from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.talk import (
    as_json,
    at,
    on_nats,
    paged,
    print_reply,
    query_subject,
    request,
)
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.jetstream import (
    bucket_name,
)
from trellis.adapters.nats.kv_state import bucket_entry
from trellis.adapters.settings import Settings


def composition_get(args: argparse.Namespace) -> int:
    reply = request(args, query_subject(args, "composition"), at(args, {"id": args.id}))
    return print_reply(args, reply, render.compose_summary)


def composition_list(args: argparse.Namespace) -> int:
    async def read(client: TrellisClient, settings: Settings, *_: Any) -> list[dict[str, Any]]:
        kv = await client.nc.jetstream().key_value(bucket_name(settings.subject_prefix))
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
    filters = {k: getattr(args, k) for k in ("id", "tenant", "since", "until") if getattr(args, k)}
    reply = paged(args, query_subject(args, "history"), at(args, filters))
    return print_reply(args, reply, render.history_table)


def free(args: argparse.Namespace) -> int:
    body = {"kind": args.kind} if args.kind else {}
    reply = paged(args, query_subject(args, "free"), at(args, body))
    return print_reply(args, reply, render.free_table)


def blast_radius(args: argparse.Namespace) -> int:
    reply = request(args, query_subject(args, "blast-radius"), at(args, {"id": args.id}))
    return print_reply(args, reply, render.blast_radius_table)
