"""The options commands share, and the argparse types that check values before anything is
sent."""

from __future__ import annotations

import argparse
import math
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from trellis.adapters.entrypoints import render
from trellis.adapters.entrypoints.cli.errors import EXIT_USAGE, CliError
from trellis.adapters.settings import SettingsError, metrics_port
from trellis.engine.core.ids import ID_PATTERN, RequestId
from trellis.engine.core.intents import LEASE_SECONDS_RANGE

DEFAULT_DOMAIN = "default"
DEFAULT_TENANT = "default"


#: What an admin verb's or blast-radius's component argument may be.
COMPONENT_HELP = "a node or link id, or an OCS port as <ocs>:<port> (ocs-1:3: the cable on it)"


def identifier(what: str, pattern: str = ID_PATTERN) -> Any:
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


def lease_seconds(text: str) -> int:
    """--lease: whole seconds within the contract's LeaseSeconds bounds."""
    low, high = LEASE_SECONDS_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"a lease is {low} to {high} seconds, not {value}")
    return value


def request_id(text: str) -> str:
    """--request-id: what the contract takes as a request id. An empty one was replaced by a
    fresh id without a word, so a resend with it was not the resend it meant to be."""
    try:
        return msgspec.convert(text, RequestId)
    except msgspec.ValidationError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a request id: 1 to 128 characters, no control or bidi character"
        ) from None


def request_id_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-id", type=request_id, help="resend-safe id (default: a fresh one)")


def _count(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"a count is {least} or more, not {value}")
    return value


def positive_count(text: str) -> int:
    """An argparse type: a whole number, 1 or more (a count of 0 would never be reached)."""
    return _count(text, 1)


def non_negative_count(text: str) -> int:
    """An argparse type: a whole number, 0 or more (a quota's --count: 0 holds none)."""
    return _count(text, 0)


def key_value(text: str) -> tuple[str, str]:
    """An argparse type: a label as K=V (V may be empty; K may not)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected K=V, got {text!r}")
    return key, value


def finite_number(text: str) -> float:
    """An argparse type: a finite number (JSON has no nan or inf; sent, they became null)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (an amount such as --memory's GiB)."""
    value = finite_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"an amount is above 0, not {text}")
    return value


def non_negative_number(text: str) -> float:
    """An argparse type: a finite number, 0 or more (a quota's --gib)."""
    value = finite_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"an amount is 0 or more, not {text}")
    return value


def timeout_seconds(text: str) -> float:
    """--timeout: a positive, finite number of seconds (0 or less would time out before any
    reply could come, and then read as an unreachable NATS)."""
    value = finite_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a timeout is a positive number of seconds, not {text}")
    return value


DEVICE_KINDS = ["gpu", "memory", "nic", "nvme", "accelerator"]


def at_option(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument(
        "--at",
        type=_point_in_time,
        required=required,
        metavar="TIME|POSITION",
        help="answer as of a past moment: an ISO time with its zone (2026-12-01T10:00:00Z) "
        "or a log position" + ("" if required else " (default: now)"),
    )


def _point_in_time(text: str) -> int | str:
    """A log position (digits) or an ISO time, as the `at` field takes them (RFC 3339)."""
    if text.isdigit():
        return int(text)
    try:
        return moment(text).isoformat()
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or a log position") from None


def moment(text: str) -> datetime:
    """An argparse type: an ISO time with its zone. Without a zone it names no one moment, and
    the engine would have refused it only after the round trip, as an invalid body."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO time (2026-12-01T10:00:00Z)"
        ) from None
    if at.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} names no moment: add its zone, e.g. Z")
    return at


def query_options(p: argparse.ArgumentParser) -> None:
    at_option(p)
    p.add_argument(
        "--view",
        type=identifier("tenant"),
        metavar="TENANT",
        help="ask as TENANT's view (<prefix>.view.<domain>.<tenant>.*): only its own data",
    )
    client_options(p)


def intent_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tenant",
        type=identifier("tenant"),
        default=os.environ.get("TRELLIS_TENANT", DEFAULT_TENANT),
        help="who asks (default: $TRELLIS_TENANT or %(default)s)",
    )
    request_id_option(p)
    client_options(p)


def client_options(
    p: argparse.ArgumentParser, timeout_help: str = "seconds to wait for a reply"
) -> None:
    p.add_argument(
        "--domain",
        type=identifier("domain"),
        default=os.environ.get("TRELLIS_DOMAIN", DEFAULT_DOMAIN),
        help="the fabric domain (default: $TRELLIS_DOMAIN or %(default)s)",
    )
    render.add_output_options(p)
    p.add_argument("--timeout", type=timeout_seconds, default=10.0, help=timeout_help)
    p.add_argument(
        "--creds",
        type=Path,
        default=os.environ.get("TRELLIS_NATS_CREDS") or None,
        metavar="FILE",
        help="NATS identity (an nkey seed file) to connect as; default in secure mode: the "
        "tenant's own for intents and views, else the operator's, from the data dir",
    )


def metrics_port_arg(text: str) -> int | None:
    try:
        return metrics_port(text, "--metrics-port")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def demo_number(low: float, high: float, *, whole: bool = False) -> Any:
    """An argparse type: a finite number from `low` to `high` (a whole one when `whole`); its
    error says the bounds."""
    wanted = f"{'a whole number' if whole else 'a number'} from {low:,g} to {high:,g}"

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (low <= value <= high and (value.is_integer() or not whole)):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return int(value) if whole else value

    return number


def http_port_arg(text: str) -> int | None:
    try:
        return metrics_port(text, "--http")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def redfish_port_arg(text: str) -> int | None:
    try:
        return metrics_port(text, "--redfish")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positional_or_flag(args: argparse.Namespace, positional: str, flag: str) -> None:
    """Take a value given as a positional argument or as its `--flag` (kubectl's habit, and
    the tour's), into the flag's attribute; both, naming different values, is a usage error."""
    given, named = getattr(args, positional), getattr(args, flag)
    if given is not None and named is not None and given != named:
        raise CliError(
            f"two values, {given} and --{flag.replace('_', '-')} {named}",
            code="usage",
            hint="see the command's --help",
            exit=EXIT_USAGE,
        )
    setattr(args, flag, named if named is not None else given)
