"""A tenant's intents: `compose`, `release`, `extend`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.errors import EXIT_USAGE, CliError
from trellis.adapters.entrypoints.cli.options import (
    finite_number,
    identifier,
    intent_options,
    key_value,
    lease_seconds,
    positive_count,
    positive_number,
)
from trellis.adapters.entrypoints.cli.talk import read_json, send_intent


def compose(args: argparse.Namespace) -> int:
    body = manifest(args)
    return send_intent(args, "compose", body, render.compose_summary)


def _compose_body(args: argparse.Namespace) -> dict[str, Any]:
    devices: list[dict[str, Any]] = []
    shared = {"bandwidth_gbps": args.bandwidth} if args.bandwidth else {}
    if args.gpu is not None:
        gpu: dict[str, Any] = {"kind": "gpu", "count": args.gpu, **shared}
        if args.model:
            gpu["models"] = args.model
        if args.min_generation is not None:
            gpu["min_generation"] = args.min_generation
        devices.append(gpu)
    if args.memory is not None:
        devices.append({"kind": "memory", "capacity_gib": args.memory, **shared})
    for kind in ("nic", "nvme"):
        if getattr(args, kind) is not None:
            devices.append({"kind": kind, "count": getattr(args, kind), **shared})
    constraints: dict[str, Any] = {"isolation": "exclusive" if args.exclusive else "shared"}
    if args.max_hops is not None:
        constraints["max_hops"] = args.max_hops
    if args.max_latency_ns is not None:
        constraints["max_latency_ns"] = args.max_latency_ns
    if args.label:
        constraints["labels"] = dict(args.label)
    body: dict[str, Any] = {"constraints": constraints, "reason": args.reason}
    if args.host:
        body["host"] = args.host
    else:
        body["host_selector"] = {"labels": dict(args.host_label)}
    if devices:
        body["devices"] = devices
    if args.device_id:
        body["device_ids"] = args.device_id
    if args.lease:
        body["lease_seconds"] = args.lease
    if args.composition_label:
        body["labels"] = dict(args.composition_label)
    return body


def release(args: argparse.Namespace) -> int:
    body = {"composition_id": args.composition_id, "reason": args.reason}
    return send_intent(args, "release", body, render.release_summary)


def extend(args: argparse.Namespace) -> int:
    body = {"composition_id": args.composition_id, "lease_seconds": args.lease}
    return send_intent(args, "extend", body, render.extend_summary)


def manifest_options(p: argparse.ArgumentParser, file_help: str) -> None:
    """What to compose (compose, reserve, preview): flags, or a JSON body with --file."""
    p.add_argument("--file", type=Path, help=file_help + " (no other flag of the body with it)")
    p.add_argument(
        "--host",
        type=identifier("host id"),
        help="the host to compose on (left out: the engine picks one, of those --host-label"
        " names if given)",
    )
    p.add_argument(
        "--host-label",
        action="append",
        default=[],
        type=key_value,
        metavar="K=V",
        help="pick a host by label",
    )
    p.add_argument("--gpu", type=positive_count, metavar="N", help="number of GPUs")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="an acceptable GPU model (repeatable: any of them)",
    )
    p.add_argument(
        "--min-generation", type=int, metavar="N", help="GPUs of generation N or newer only"
    )
    p.add_argument("--memory", type=positive_number, metavar="GIB", help="a memory slice of GIB")
    p.add_argument("--nic", type=positive_count, metavar="N", help="number of NICs")
    p.add_argument("--nvme", type=positive_count, metavar="N", help="number of NVMe drives")
    p.add_argument(
        "--device-id", action="append", default=[], type=identifier("device id"), help="a device"
    )
    p.add_argument(
        "--bandwidth", type=finite_number, default=0.0, metavar="GBPS", help="per device"
    )
    p.add_argument(
        "--max-hops", type=positive_count, metavar="N", help="at most N hops from host to device"
    )
    p.add_argument(
        "--max-latency-ns", type=int, metavar="NS", help="at most NS nanoseconds of path latency"
    )
    p.add_argument("--exclusive", action="store_true", help="no switch shared with others")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        type=key_value,
        metavar="K=V",
        help="device label constraint",
    )
    p.add_argument(
        "--composition-label",
        action="append",
        default=[],
        type=key_value,
        metavar="K=V",
        help="a label of the composition itself, kept with it (its KV value, composition get)"
        " to select by; --label constrains devices",
    )
    p.add_argument("--lease", type=lease_seconds, metavar="SECONDS", help="lease length")
    p.add_argument("--reason", default="", help="why, recorded with the event")


# The flags `manifest_options` builds a body from, by dest: --file takes the place of every one
# of them (a compose given both went out as the file's, the flags dropped without a word).
_BODY_FLAGS = {
    "host": "--host",
    "host_label": "--host-label",
    "gpu": "--gpu",
    "model": "--model",
    "min_generation": "--min-generation",
    "memory": "--memory",
    "nic": "--nic",
    "nvme": "--nvme",
    "device_id": "--device-id",
    "bandwidth": "--bandwidth",
    "max_hops": "--max-hops",
    "max_latency_ns": "--max-latency-ns",
    "exclusive": "--exclusive",
    "label": "--label",
    "composition_label": "--composition-label",
    "lease": "--lease",
    "reason": "--reason",
}


def manifest(args: argparse.Namespace, verb: str = "compose") -> dict[str, Any]:
    """The body `manifest_options` describe: read from --file, or built from the flags; a body
    flag given with --file is a usage error (nothing is sent), the file being the whole body."""
    if not args.file:
        body = _compose_body(args)
        if "devices" not in body and "device_ids" not in body:
            # Said in the flags' terms, before anything is sent (the engine would say it in
            # the wire's: `devices` or `device_ids`).
            raise CliError(
                f"nothing to {verb}: give --gpu, --memory, --nic, --nvme or --device-id",
                code="usage",
                hint="--gpu 2 asks for two GPUs, --memory 256 for a 256 GiB slice",
                exit=EXIT_USAGE,
            )
        return body
    given = [flag for dest, flag in _BODY_FLAGS.items() if _given(getattr(args, dest))]
    if given:
        raise CliError(
            f"--file is the whole body: {', '.join(given)} cannot be given with it",
            code="usage",
            hint="put them in the file, or drop --file",
            exit=EXIT_USAGE,
        )
    return read_json(args.file)


def _given(value: Any) -> bool:
    """Whether a body flag holds other than its default (None, [], False, "", --bandwidth's
    0.0); an --min-generation 0 is given."""
    if isinstance(value, float):
        return value != 0.0
    return value is not None and value is not False and value != "" and value != []


def add_commands(sub: Any) -> None:
    """`compose` and `release`."""
    compose_parser = sub.add_parser("compose", help="compose a host and devices (flags or --file)")
    manifest_options(compose_parser, "a compose body (JSON) instead of flags")
    intent_options(compose_parser)
    compose_parser.set_defaults(run=compose)

    release_parser = sub.add_parser("release", help="release a composition")
    release_parser.add_argument(
        "composition_id", type=identifier("composition id"), help="the composition to release"
    )
    release_parser.add_argument("--reason", default="", help="why, recorded with the event")
    intent_options(release_parser)
    release_parser.set_defaults(run=release)


def add_extend(sub: Any) -> None:
    """`extend`."""
    extend_parser = sub.add_parser("extend", help="extend a composition's lease")
    extend_parser.add_argument(
        "composition_id",
        type=identifier("composition id"),
        help="the composition whose lease runs on",
    )
    extend_parser.add_argument(
        "--lease",
        type=lease_seconds,
        required=True,
        metavar="SECONDS",
        help="the new lease length, counted from now",
    )
    intent_options(extend_parser)
    extend_parser.set_defaults(run=extend)
