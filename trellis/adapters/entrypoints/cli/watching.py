"""`trellis watch`: live events from the stream, one a line."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import msgspec
import nats.errors
from nats.js.api import DeliverPolicy

from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.options import (
    client_options,
    identifier,
    positive_count,
)
from trellis.adapters.entrypoints.cli.talk import on_nats, reading_jetstream
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.jetstream import (
    stream_event,
    stream_name,
)
from trellis.adapters.settings import Settings
from trellis.engine.core.events import EVENT_TYPES


def watch(args: argparse.Namespace) -> int:
    async def follow(client: TrellisClient, settings: Settings, url: str, who: str) -> int:
        return await reading_jetstream(client, events(client, settings), who)

    async def events(client: TrellisClient, settings: Settings) -> int:
        domain = "*" if args.all_domains else args.domain
        subject = f"{settings.subject_prefix}.events.{domain}.*"
        policy = DeliverPolicy.ALL if args.from_start else DeliverPolicy.NEW
        js = client.nc.jetstream(timeout=args.timeout)
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
            # A Ctrl-C closes the connection first: unsubscribing from it then only raised
            # (logged as a task's unretrieved exception, with its traceback).
            with contextlib.suppress(nats.errors.ConnectionClosedError):
                await sub.unsubscribe()
        return 0

    # Ctrl-C, the way a watch ends, is exit 130 as for every command (the dispatcher's).
    code: int = on_nats(args, f"query.{args.domain}.topology", follow)
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


def add_commands(sub: Any) -> None:
    """`watch`."""
    watch_parser = sub.add_parser(
        "watch", help="live events from the stream (TRELLIS_EVENTS), one a line, until Ctrl-C"
    )
    watch_parser.add_argument(
        "--type",
        action="append",
        default=[],
        # Only the contract's types: another could never match, and the watch waited forever.
        choices=sorted(EVENT_TYPES),
        metavar="EVENT",
        help="only this event type, e.g. CompositionActivated; repeatable",
    )
    watch_parser.add_argument(
        "--tenant",
        type=identifier("tenant"),
        help="only this tenant's: events it caused or that name it, and the engine's on "
        "compositions it requested while watching",
    )
    watch_parser.add_argument(
        "--all-domains", action="store_true", help="every domain, not --domain"
    )
    watch_parser.add_argument(
        "--from-start",
        action="store_true",
        help="replay the stream from its first event instead of new ones only",
    )
    watch_parser.add_argument(
        "--count", type=positive_count, metavar="N", help="stop after N events"
    )
    # No reply to wait for: the watch runs until Ctrl-C or --count; --timeout bounds its start.
    client_options(
        watch_parser,
        timeout_help="seconds to wait for NATS to connect and the stream to start the watch",
    )
    watch_parser.set_defaults(run=watch)
