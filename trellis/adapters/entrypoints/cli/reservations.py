"""Reservations (docs/architecture.md, "Reservations"): `preview`, `reserve`, `apply` and
`reservation list` / `reservation cancel`."""

from __future__ import annotations

import argparse
from typing import Any

from trellis.adapters.entrypoints import render
from trellis.adapters.entrypoints.cli.intents import manifest, manifest_options
from trellis.adapters.entrypoints.cli.options import (
    identifier,
    intent_options,
    lease_seconds,
    query_options,
)
from trellis.adapters.entrypoints.cli.talk import (
    at,
    print_reply,
    query_subject,
    request,
    send_intent,
)

_MANIFEST = "a manifest (a compose body without request_id, JSON) instead of flags"


def reserve(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"manifest": manifest(args, "reserve")}
    if args.duration is not None:
        body["duration_seconds"] = args.duration
    return send_intent(args, "reserve", body, render.reservation_summary)


def preview(args: argparse.Namespace) -> int:
    reply = request(
        args, query_subject(args, "preview"), at(args, {"manifest": manifest(args, "preview")})
    )
    return print_reply(args, reply, render.preview_summary)


def apply(args: argparse.Namespace) -> int:
    body = {"reservation_id": args.reservation_id}
    return send_intent(args, "apply", body, render.compose_summary)


def listing(args: argparse.Namespace) -> int:
    body = {"tenant": args.of} if args.of else {}
    reply = request(args, query_subject(args, "reservations"), at(args, body))
    return print_reply(args, reply, render.reservations_table)


def cancel(args: argparse.Namespace) -> int:
    body = {"reservation_id": args.reservation_id, "reason": args.reason}
    return send_intent(args, "cancel-reservation", body, render.cancel_summary)


def add_commands(sub: Any) -> None:
    """`preview`, `reserve`, `apply` and `reservation`."""
    preview_parser = sub.add_parser("preview", help="what a compose would take now; holds nothing")
    manifest_options(preview_parser, _MANIFEST)
    query_options(preview_parser)
    preview_parser.set_defaults(run=preview)

    reserve_parser = sub.add_parser(
        "reserve",
        help="hold the devices a compose would take, for a while, to apply later (flags or --file)",
    )
    manifest_options(reserve_parser, _MANIFEST)
    reserve_parser.add_argument(
        "--duration",
        type=lease_seconds,
        metavar="SECONDS",
        help="how long it holds them (default 300)",
    )
    intent_options(reserve_parser)
    reserve_parser.set_defaults(run=reserve)

    apply_parser = sub.add_parser("apply", help="compose the devices of a reservation")
    apply_parser.add_argument(
        "reservation_id", type=identifier("reservation id"), help="the reservation to compose"
    )
    intent_options(apply_parser)
    apply_parser.set_defaults(run=apply)

    resv = sub.add_parser("reservation", help="the live reservations; cancel one")
    resv_sub = resv.add_subparsers(metavar="ACTION")
    list_parser = resv_sub.add_parser("list", help="the live reservations, by id")
    list_parser.add_argument(
        "--of", type=identifier("tenant"), metavar="TENANT", help="only this tenant's"
    )
    query_options(list_parser)
    list_parser.set_defaults(run=listing)
    cancel_parser = resv_sub.add_parser("cancel", help="give a reservation's devices back")
    cancel_parser.add_argument(
        "reservation_id", type=identifier("reservation id"), help="the reservation to cancel"
    )
    cancel_parser.add_argument("--reason", default="", help="why, recorded with the event")
    intent_options(cancel_parser)
    cancel_parser.set_defaults(run=cancel)
