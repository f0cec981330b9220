"""A tenant's intents: `compose`, `release`, `extend`."""

from __future__ import annotations

import argparse
from typing import Any

from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.talk import pairs, read_json, send_intent


def compose(args: argparse.Namespace) -> int:
    body = read_json(args.file) if args.file else _compose_body(args)
    return send_intent(args, "compose", body, render.compose_summary)


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
        constraints["labels"] = pairs(args.label)
    body: dict[str, Any] = {"constraints": constraints, "reason": args.reason}
    if args.host:
        body["host"] = args.host
    else:
        body["host_selector"] = {"labels": pairs(args.host_label)}
    if devices:
        body["devices"] = devices
    if args.device_id:
        body["device_ids"] = args.device_id
    if args.lease:
        body["lease_seconds"] = args.lease
    return body


def release(args: argparse.Namespace) -> int:
    body = {"composition_id": args.composition_id, "reason": args.reason}
    return send_intent(args, "release", body, render.release_summary)


def extend(args: argparse.Namespace) -> int:
    body = {"composition_id": args.composition_id, "lease_seconds": args.lease}
    return send_intent(args, "extend", body, render.extend_summary)
