"""`trellis topology import --from-redfish URL`: the topology document from a fabric manager's
Redfish service (adapters/fabric/redfish/discovery.py), imported through the normal
`import-topology` intent, so a second run says `unchanged` or shows what differs.

Credentials come from `--user` (default TRELLIS_REDFISH_USER) and TRELLIS_REDFISH_PASSWORD
(never a flag: arguments show in `ps`). Latency has no Redfish source: `--latency KIND=NS`
(`switch`, `ocs`, `link`, or a node or link id) overrides the defaults, as often as needed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import msgspec

from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.discovery import (
    DEFAULT_LATENCY_NS,
    DiscoveryError,
    FabricMap,
    discover,
)


class RedfishImportError(Exception):
    """The service could not be read as a fabric; the message says why, and `kind` what sort
    of why: `usage` (no service URL), or a DiscoveryError's kind (`unavailable`, `refused`,
    `forbidden`, `not_found`, `error`)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def add_arguments(imp: argparse.ArgumentParser) -> None:
    imp.add_argument(
        "--from-redfish",
        metavar="URL",
        help="read the topology from a Redfish fabric manager (base URL, with or without "
        "/redfish/v1) instead of a file",
    )
    imp.add_argument(
        "--fabric",
        metavar="ID",
        help="with --from-redfish: the fabric to read (default: the only one)",
    )
    imp.add_argument(
        "--user",
        default=os.environ.get("TRELLIS_REDFISH_USER") or None,
        help="with --from-redfish: the account (default $TRELLIS_REDFISH_USER; the password "
        "is $TRELLIS_REDFISH_PASSWORD)",
    )
    imp.add_argument(
        "--auth",
        choices=("basic", "session"),
        default=os.environ.get("TRELLIS_REDFISH_AUTH") or "basic",
        help="with --from-redfish: send the credentials with every request (basic) or log "
        "in once and send the session's token (session) (default $TRELLIS_REDFISH_AUTH, "
        "else basic)",
    )
    imp.add_argument(
        "--latency",
        action="append",
        default=[],
        metavar="KIND=NS",
        type=_latency,
        help="with --from-redfish: latency in ns where Redfish has none: switch, ocs, link "
        "(default "
        + ", ".join(f"{k}={v}" for k, v in DEFAULT_LATENCY_NS.items())
        + "), or one node or link by id; repeatable",
    )
    imp.add_argument(
        "--dry-run",
        action="store_true",
        help="with --from-redfish: print the topology document instead of importing it",
    )


def _latency(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not key or not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected KIND=NS (e.g. switch=120), got {text!r}")
    return key, int(value)


def read(args: argparse.Namespace) -> dict[str, Any]:
    """The topology document the service describes, with a `reason` naming where it came
    from; what discovery skipped or guessed goes to stderr.

    Raises:
        RedfishImportError: The service could not be read.
    """
    fmap = asyncio.run(_discover(args))
    for note in fmap.notes:
        print(f"note: {note}", file=sys.stderr)
    fabric = fmap.fabric.rstrip("/").rsplit("/", 1)[-1]
    reason = args.reason or f"imported from Redfish {args.from_redfish} fabric {fabric}"
    return {**fmap.document, "reason": reason}


def show(doc: dict[str, Any]) -> str:
    return msgspec.json.format(msgspec.json.encode(doc), indent=2).decode()


async def _discover(args: argparse.Namespace) -> FabricMap:
    try:
        client = RedfishClient(
            args.from_redfish,
            args.user,
            os.environ.get("TRELLIS_REDFISH_PASSWORD"),
            auth=args.auth,
        )
    except ValueError as exc:
        raise RedfishImportError(str(exc), "usage") from None
    try:
        return await discover(client, fabric=args.fabric, latency=dict(args.latency))
    except DiscoveryError as exc:
        raise RedfishImportError(str(exc), exc.kind) from None
    finally:
        await client.close()
