"""Upcasting: old payloads decode into today's Structs (issue 10 item 7).

The one real change so far: from schema version 2, every DeviceBinding (in DevicesReserved,
PathRerouted and DeviceReplaced) records the device's `model` and `cost_per_hour`. The v1
payloads under payloads/v1/ were written by the code before the change.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from trellis.engine.core.events import (
    EVENT_TYPES,
    SCHEMA_VERSIONS,
    DeviceBinding,
    DeviceReplaced,
    DevicesReserved,
    PathRerouted,
    encode,
)
from trellis.engine.core.upcast import UPCASTERS, upcast

PAYLOADS = Path(__file__).parent / "payloads"


def v1(name: str) -> bytes:
    return (PAYLOADS / "v1" / f"{name}.json").read_bytes()


def test_a_v1_devices_reserved_decodes_into_the_v2_struct_with_nothing_recorded() -> None:
    event = upcast("DevicesReserved", 1, v1("DevicesReserved"))
    assert isinstance(event, DevicesReserved)
    gpu, memory = event.devices
    assert (gpu.device, gpu.kind, gpu.model, gpu.cost_per_hour) == ("gpu-042", "gpu", None, None)
    assert gpu.path == ["host-01", "sw-r1", "ocs-1", "gpu-042"]
    assert [(c.ocs, c.a_port, c.b_port) for c in gpu.circuits] == [("ocs-1", 3, 42)]
    assert (gpu.bandwidth_gbps, gpu.entry) == (64.0, 0)
    assert (memory.device, memory.capacity_gib, memory.model) == ("mem-01", 512.0, None)


def test_v1_bindings_of_a_replacement_and_a_reroute_decode_too() -> None:
    replaced = upcast("DeviceReplaced", 1, v1("DeviceReplaced"))
    assert isinstance(replaced, DeviceReplaced)
    assert (replaced.old_device, replaced.binding.device) == ("gpu-042", "gpu-043")
    assert replaced.binding.model is None and replaced.reason == "gpu-042 failed: xid 79"
    rerouted = upcast("PathRerouted", 1, v1("PathRerouted"))
    assert isinstance(rerouted, PathRerouted)
    assert rerouted.binding.path[1] == "sw-r2" and rerouted.binding.cost_per_hour is None


@pytest.mark.parametrize("name", ["DevicesReserved", "DeviceReplaced", "PathRerouted"])
def test_a_v1_payload_is_not_a_v2_payload(name: str) -> None:
    # The change is real: the v2 Struct requires the keys a v1 payload lacks.
    assert SCHEMA_VERSIONS[name] == 2
    with pytest.raises(msgspec.ValidationError, match="missing required field `model`"):
        upcast(name, 2, v1(name))


def test_v2_bindings_carry_model_and_price_as_written() -> None:
    binding = DeviceBinding(
        device="gpu-042",
        kind="gpu",
        model="H100",
        cost_per_hour=2.5,
        path=["host-01", "gpu-042"],
        links=["l-1"],
        hops=1,
        latency_ns=50,
    )
    data = encode(DevicesReserved(composition_id="c-1", devices=[binding]))
    assert b'"model":"H100","cost_per_hour":2.5' in data
    assert upcast("DevicesReserved", 2, data) == DevicesReserved(
        composition_id="c-1", devices=[binding]
    )


@pytest.mark.parametrize("name", sorted(EVENT_TYPES))
def test_every_old_version_has_an_upcaster_and_a_checked_in_payload(name: str) -> None:
    for version in range(1, SCHEMA_VERSIONS[name]):
        assert (name, version) in UPCASTERS
        assert (PAYLOADS / f"v{version}" / f"{name}.json").is_file()
