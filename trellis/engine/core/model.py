"""Fabric building blocks as they appear on the wire and in events: nodes and links.

These Structs are part of stored events, so they follow the event rules: add fields only, with
defaults; never rename or retype.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from trellis.engine.core.ids import PLAIN_TEXT, Id, Labels

NodeKind = Literal["host", "switch", "ocs", "device"]
DeviceKind = Literal["gpu", "memory", "nic", "nvme", "accelerator"]
Health = Literal["healthy", "degraded", "failed"]

# Every integer fits int64 (ARCHITECTURE §1): the log's bigint columns, the projections and the
# compiled path core hold them as such, and one value beyond it poisoned a whole domain.
INT64_MAX = 2**63 - 1
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
# The path core adds the latency_ns of a path's links and switches in int64. It numbers nodes and
# links with int32, so a path has fewer than 2**32 parts; at most one second (1e9 < 2**30) each,
# every sum stays below 2**62 (the core's "no limit").
MAX_LATENCY_NS = 10**9
LatencyNs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LATENCY_NS)]
MAX_PORTS = 65536
Port = Annotated[int, msgspec.Meta(ge=0, le=MAX_PORTS - 1)]
# Quantities (GiB, Gbps, cost per hour) are finite: JSON has no NaN or Infinity, and msgspec
# refuses a number beyond a double's range. The bound, far above any device or cable, keeps the
# sums the engine forms (bandwidth reserved on a link, slices of a memory pool) finite: each is
# also bounded by the capacity it is drawn from.
MAX_QUANTITY = 1e12
NonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=MAX_QUANTITY)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0, le=MAX_QUANTITY)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=PLAIN_TEXT)]

# Fields that only make sense on a device node; validated in one place below.
_DEVICE_FIELDS = ("vendor", "model", "generation", "memory_gib", "capacity_gib", "cost_per_hour")


class Spec(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Policy for every fabric spec: immutable, strict on input, compact on output."""


class NodeSpec(Spec):
    """A host, PCIe switch, optical circuit switch or pooled device."""

    id: Id
    kind: NodeKind
    labels: Labels = {}
    latency_ns: LatencyNs = 0
    ports: Annotated[int, msgspec.Meta(ge=1, le=MAX_PORTS)] | None = None
    device_kind: DeviceKind | None = None
    vendor: Name | None = None
    model: Name | None = None
    generation: NonNegInt | None = None
    memory_gib: NonNegFloat | None = None
    capacity_gib: NonNegFloat | None = None
    cost_per_hour: NonNegFloat | None = None

    def __post_init__(self) -> None:
        # msgspec turns ValueError here into a ValidationError naming this object.
        if self.kind == "ocs" and self.ports is None:
            raise ValueError(f"ocs {self.id} needs `ports`")
        if self.kind != "ocs" and self.ports is not None:
            raise ValueError(f"`ports` is only valid on an ocs, not on {self.kind} {self.id}")
        if self.kind in ("host", "device") and self.latency_ns:
            raise ValueError(f"`latency_ns` is only valid on a switch or ocs, not on {self.id}")
        if self.kind == "device":
            if self.device_kind is None:
                raise ValueError(f"device {self.id} needs `device_kind`")
            if self.device_kind == "memory" and self.capacity_gib is None:
                raise ValueError(f"memory device {self.id} needs `capacity_gib`")
        else:
            extra = [f for f in ("device_kind", *_DEVICE_FIELDS) if getattr(self, f) is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} only valid on a device, not on {self.id}")


class LinkSpec(Spec):
    """A cable between two nodes; an end on an OCS names its port."""

    id: Id
    a: Id
    b: Id
    capacity_gbps: PositiveFloat
    latency_ns: LatencyNs = 0
    a_port: Port | None = None
    b_port: Port | None = None

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"link {self.id} connects {self.a} to itself")
