"""The simulated fabric: hardware truths, idempotency, and deterministic fault injection."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from trellis.adapters.fabric.sim import (
    KEPT_GENERATIONS,
    LINEAGE,
    SavedFabric,
    ScriptedFault,
    SimulatedFabric,
    parse_script,
    read_state_file,
)
from trellis.engine.core.errors import FabricError
from trellis.engine.core.fabric import FabricBinding, FabricChange, FabricCircuit, FabricSnapshot
from trellis.engine.service.ports import FabricDriver

D = "d1"


def circuit(a: int, b: int, ocs: str = "ocs-1") -> FabricCircuit:
    return FabricCircuit(ocs=ocs, a_port=a, b_port=b)


def binding(
    device: str = "gpu-1",
    host: str = "host-1",
    composition: str = "c-1",
    via: tuple[str, ...] = ("sw-1",),
) -> FabricBinding:
    return FabricBinding(
        host=host, device=device, path=[host, *via, device], composition_id=composition
    )


async def outcome(fabric: SimulatedFabric, i: int) -> str | None:
    """Bind device gpu-<i> and say which component failed (None: it worked)."""
    try:
        await fabric.bind(D, binding(device=f"gpu-{i}", composition=f"c-{i}"))
    except FabricError as e:
        return e.component
    return None


async def outcomes(fabric: SimulatedFabric, n: int) -> list[str | None]:
    return [await outcome(fabric, i) for i in range(n)]


@pytest.fixture
def fabric() -> SimulatedFabric:
    return SimulatedFabric()


# -- the port ----------------------------------------------------------------------------------


async def test_the_simulated_fabric_is_a_fabric_driver() -> None:
    driver: FabricDriver = SimulatedFabric()  # mypy checks the Protocol here
    assert await driver.snapshot(D) == FabricSnapshot(circuits=[], bindings=[])


# -- circuits ----------------------------------------------------------------------------------


async def test_a_created_circuit_appears_in_the_snapshot(fabric: SimulatedFabric) -> None:
    await fabric.create_circuit(D, circuit(1, 5))
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 5)]


async def test_creating_the_same_circuit_twice_programs_it_once(fabric: SimulatedFabric) -> None:
    await fabric.create_circuit(D, circuit(1, 5))
    await fabric.create_circuit(D, circuit(1, 5))
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 5)]


async def test_a_circuit_on_a_port_of_another_circuit_is_refused_naming_the_port(
    fabric: SimulatedFabric,
) -> None:
    await fabric.create_circuit(D, circuit(1, 5))
    with pytest.raises(FabricError, match=r"ocs-1 port 5 is already in circuit 1-5") as err:
        await fabric.create_circuit(D, circuit(5, 7))
    assert err.value.component == "ocs-1"
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 5)]
    await fabric.create_circuit(D, circuit(6, 7))  # the refused circuit's other port stayed free


async def test_circuits_sharing_one_port_number_on_two_switches_do_not_conflict(
    fabric: SimulatedFabric,
) -> None:
    await fabric.create_circuit(D, circuit(1, 5, ocs="ocs-1"))
    await fabric.create_circuit(D, circuit(1, 5, ocs="ocs-2"))
    assert len((await fabric.snapshot(D)).circuits) == 2


async def test_a_circuit_must_join_two_ports_given_in_ascending_order(
    fabric: SimulatedFabric,
) -> None:
    for a, b in [(3, 3), (5, 1)]:
        with pytest.raises(FabricError, match="a_port < b_port") as err:
            await fabric.create_circuit(D, circuit(a, b))
        assert err.value.component == "ocs-1"
    assert (await fabric.snapshot(D)).circuits == []


async def test_removing_a_circuit_frees_both_its_ports(fabric: SimulatedFabric) -> None:
    await fabric.create_circuit(D, circuit(1, 5))
    await fabric.remove_circuit(D, circuit(1, 5))
    assert (await fabric.snapshot(D)).circuits == []
    await fabric.create_circuit(D, circuit(1, 2))
    await fabric.create_circuit(D, circuit(5, 6))


async def test_removing_an_absent_circuit_does_nothing(fabric: SimulatedFabric) -> None:
    await fabric.remove_circuit(D, circuit(1, 5))
    await fabric.create_circuit(D, circuit(1, 5))
    await fabric.remove_circuit(D, circuit(1, 6))  # shares port 1, but is not what is held
    await fabric.remove_circuit(D, circuit(1, 5, ocs="ocs-2"))
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 5)]


async def test_domains_are_separate_fabrics(fabric: SimulatedFabric) -> None:
    await fabric.create_circuit("d1", circuit(1, 5))
    await fabric.create_circuit("d2", circuit(5, 9))
    await fabric.bind("d1", binding(host="host-1"))
    await fabric.bind("d2", binding(host="host-2"))
    assert (await fabric.snapshot("d1")).circuits == [circuit(1, 5)]
    assert (await fabric.snapshot("d2")).bindings == [binding(host="host-2")]
    assert await fabric.snapshot("d3") == FabricSnapshot(circuits=[], bindings=[])


async def test_of_two_concurrent_circuits_on_one_port_exactly_one_is_programmed() -> None:
    fabric = SimulatedFabric(latency=0.01)
    results = await asyncio.gather(
        fabric.create_circuit(D, circuit(1, 5)),
        fabric.create_circuit(D, circuit(1, 6)),
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], FabricError) and "port 1" in str(results[1])
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 5)]


# -- bindings ----------------------------------------------------------------------------------


async def test_a_bound_device_appears_in_the_snapshot(fabric: SimulatedFabric) -> None:
    await fabric.bind(D, binding())
    assert (await fabric.snapshot(D)).bindings == [binding()]


async def test_binding_the_same_device_twice_binds_it_once(fabric: SimulatedFabric) -> None:
    await fabric.bind(D, binding())
    await fabric.bind(D, binding())
    assert (await fabric.snapshot(D)).bindings == [binding()]


async def test_binding_a_device_held_by_another_host_is_refused(fabric: SimulatedFabric) -> None:
    await fabric.bind(D, binding(host="host-1"))
    with pytest.raises(FabricError, match="gpu-1 is already bound to host host-1") as err:
        await fabric.bind(D, binding(host="host-2", composition="c-2"))
    assert err.value.component == "gpu-1"
    assert (await fabric.snapshot(D)).bindings == [binding(host="host-1")]


async def test_rebinding_over_another_path_without_unbinding_is_refused(
    fabric: SimulatedFabric,
) -> None:
    await fabric.bind(D, binding(via=("sw-1",)))
    with pytest.raises(FabricError, match="over host-1>sw-1>gpu-1"):
        await fabric.bind(D, binding(via=("sw-2",)))
    await fabric.unbind(D, binding(via=("sw-1",)))
    await fabric.bind(D, binding(via=("sw-2",)))
    assert (await fabric.snapshot(D)).bindings == [binding(via=("sw-2",))]


async def test_one_host_may_hold_a_device_for_two_compositions(fabric: SimulatedFabric) -> None:
    # Memory slices: two compositions of one host each take a slice of the same pool.
    await fabric.bind(D, binding(device="mem-1", composition="c-1"))
    await fabric.bind(D, binding(device="mem-1", composition="c-2"))
    assert len((await fabric.snapshot(D)).bindings) == 2


async def test_shared_devices_may_be_bound_to_several_hosts() -> None:
    for shared in (["mem-1"], lambda device: device.startswith("mem-")):
        fabric = SimulatedFabric(shared_devices=shared)
        await fabric.bind(D, binding(device="mem-1", host="host-1", composition="c-1"))
        await fabric.bind(D, binding(device="mem-1", host="host-2", composition="c-2"))
        await fabric.bind(D, binding(device="gpu-1", host="host-1"))
        with pytest.raises(FabricError, match="already bound to host host-1"):
            await fabric.bind(D, binding(device="gpu-1", host="host-2", composition="c-2"))
        assert [b.host for b in (await fabric.snapshot(D)).bindings] == [
            "host-1",
            "host-1",
            "host-2",
        ]


async def test_a_binding_path_must_run_from_its_host_to_its_device(
    fabric: SimulatedFabric,
) -> None:
    bad = [
        FabricBinding(host="host-1", device="gpu-1", path=[], composition_id="c-1"),
        FabricBinding(host="host-1", device="gpu-1", path=["sw-1", "gpu-1"], composition_id="c"),
        FabricBinding(host="host-1", device="gpu-1", path=["host-1", "sw-1"], composition_id="c"),
    ]
    for b in bad:
        with pytest.raises(FabricError) as err:
            await fabric.bind(D, b)
        assert err.value.component == "gpu-1"
    assert (await fabric.snapshot(D)).bindings == []


async def test_unbinding_releases_the_device_for_another_host(fabric: SimulatedFabric) -> None:
    await fabric.bind(D, binding(host="host-1"))
    await fabric.unbind(D, binding(host="host-1"))
    assert (await fabric.snapshot(D)).bindings == []
    await fabric.bind(D, binding(host="host-2"))


async def test_unbinding_needs_host_device_and_composition_but_not_the_path(
    fabric: SimulatedFabric,
) -> None:
    await fabric.bind(D, binding(via=("sw-1",)))
    await fabric.unbind(D, binding(via=("sw-9", "ocs-1")))
    assert (await fabric.snapshot(D)).bindings == []


async def test_unbinding_what_is_not_held_does_nothing(fabric: SimulatedFabric) -> None:
    await fabric.unbind(D, binding())  # nothing bound at all
    await fabric.bind(D, binding(host="host-1", composition="c-1"))
    await fabric.unbind(D, binding(host="host-2", composition="c-1"))  # another host's
    await fabric.unbind(D, binding(host="host-1", composition="c-9"))  # another composition's
    assert (await fabric.snapshot(D)).bindings == [binding(host="host-1", composition="c-1")]


async def test_the_snapshot_is_a_copy_in_a_stable_order(fabric: SimulatedFabric) -> None:
    mine = binding(device="gpu-2")
    await fabric.bind(D, mine)
    await fabric.bind(D, binding(device="gpu-1"))
    await fabric.create_circuit(D, circuit(7, 8))
    await fabric.create_circuit(D, circuit(1, 2))
    mine.path.append("elsewhere")  # the caller's list is not the hardware's
    snap = await fabric.snapshot(D)
    snap.bindings[0].path.clear()
    again = await fabric.snapshot(D)
    assert [b.device for b in again.bindings] == ["gpu-1", "gpu-2"]
    assert again.bindings[1].path == ["host-1", "sw-1", "gpu-2"]
    assert again.circuits == [circuit(1, 2), circuit(7, 8)]


# -- latency -----------------------------------------------------------------------------------


async def test_operations_take_the_configured_latency() -> None:
    fabric = SimulatedFabric(latency=0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await fabric.create_circuit(D, circuit(1, 2))
    assert loop.time() - start >= 0.04
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.bind(D, binding()), timeout=0.001)


async def test_latency_can_be_set_per_operation() -> None:
    fabric = SimulatedFabric(latency={"bind": 5.0})
    await asyncio.wait_for(fabric.create_circuit(D, circuit(1, 2)), timeout=1.0)
    await asyncio.wait_for(fabric.snapshot(D), timeout=1.0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.bind(D, binding()), timeout=0.01)


async def test_jitter_does_not_change_which_operations_fail() -> None:
    calm = SimulatedFabric(seed=3, failure_rate=0.5)
    jittery = SimulatedFabric(seed=3, failure_rate=0.5, jitter=0.001)
    assert await outcomes(calm, 20) == await outcomes(jittery, 20)


async def test_knobs_out_of_range_are_refused() -> None:
    for knobs in [
        {"latency": -1.0},
        {"latency": {"bind": -0.1}},
        {"latency": {"bnid": 0.1}},
        {"jitter": -0.1},
        {"failure_rate": 1.5},
        {"hang_rate": -0.1},
    ]:
        with pytest.raises(ValueError):
            SimulatedFabric(**knobs)  # type: ignore[arg-type]


# -- random failures and hangs -----------------------------------------------------------------


async def test_a_failure_rate_of_one_fails_every_change_and_changes_nothing() -> None:
    fabric = SimulatedFabric(failure_rate=1.0)
    with pytest.raises(FabricError) as err:
        await fabric.create_circuit(D, circuit(1, 2))
    assert err.value.component == "ocs-1"
    with pytest.raises(FabricError) as err:
        await fabric.bind(D, binding(device="gpu-7"))
    assert err.value.component == "gpu-7"
    for op in (fabric.remove_circuit(D, circuit(1, 2)), fabric.unbind(D, binding())):
        with pytest.raises(FabricError):
            await op
    assert await fabric.snapshot(D) == FabricSnapshot(circuits=[], bindings=[])


async def test_random_failures_are_a_mix_fixed_by_the_seed() -> None:
    first = await outcomes(SimulatedFabric(seed=7, failure_rate=0.5), 40)
    assert 5 < first.count(None) < 35
    assert all(c in (None, f"gpu-{i}") for i, c in enumerate(first))  # the device that failed
    assert await outcomes(SimulatedFabric(seed=7, failure_rate=0.5), 40) == first
    assert await outcomes(SimulatedFabric(seed=8, failure_rate=0.5), 40) != first


async def test_reading_the_snapshot_does_not_shift_the_seeded_sequence() -> None:
    quiet = SimulatedFabric(seed=5, failure_rate=0.5)
    watched = SimulatedFabric(seed=5, failure_rate=0.5)
    expected = await outcomes(quiet, 10)
    seen = []
    for i in range(10):
        await watched.snapshot(D)
        seen.append(await outcome(watched, i))
    assert seen == expected


async def test_hang_mode_blocks_changes_until_the_caller_gives_up() -> None:
    fabric = SimulatedFabric(hang_rate=1.0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.create_circuit(D, circuit(1, 2)), timeout=0.05)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.bind(D, binding()), timeout=0.05)
    # Reading still answers, and shows that nothing was programmed.
    assert await asyncio.wait_for(fabric.snapshot(D), timeout=1.0) == FabricSnapshot(
        circuits=[], bindings=[]
    )


# -- scripted faults ---------------------------------------------------------------------------


async def test_fail_next_fails_only_the_next_call_of_that_operation(
    fabric: SimulatedFabric,
) -> None:
    fabric.fail_next("bind")
    await fabric.create_circuit(D, circuit(1, 2))  # another operation: untouched
    with pytest.raises(FabricError, match="injected") as err:
        await fabric.bind(D, binding())
    assert err.value.component == "gpu-1"
    assert (await fabric.snapshot(D)).bindings == []
    await fabric.bind(D, binding())
    assert fabric.pending_faults == 0


async def test_fail_next_can_fail_several_calls(fabric: SimulatedFabric) -> None:
    fabric.fail_next("create_circuit", times=2)
    assert fabric.pending_faults == 2
    for _ in range(2):
        with pytest.raises(FabricError):
            await fabric.create_circuit(D, circuit(1, 2))
    await fabric.create_circuit(D, circuit(1, 2))


async def test_fail_next_for_a_component_waits_for_a_call_touching_it(
    fabric: SimulatedFabric,
) -> None:
    fabric.fail_next("bind", component="sw-2")
    await fabric.bind(D, binding(device="gpu-1", via=("sw-1",)))
    with pytest.raises(FabricError) as err:
        await fabric.bind(D, binding(device="gpu-2", composition="c-2", via=("sw-2",)))
    assert err.value.component == "sw-2"
    await fabric.bind(D, binding(device="gpu-2", composition="c-2", via=("sw-2",)))


async def test_a_failure_after_the_change_took_effect_leaves_it_programmed(
    fabric: SimulatedFabric,
) -> None:
    # A lost reply: the engine sees an error, the hardware holds the circuit; retrying is safe.
    fabric.fail_next("create_circuit", applied=True)
    with pytest.raises(FabricError):
        await fabric.create_circuit(D, circuit(1, 2))
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 2)]
    await fabric.create_circuit(D, circuit(1, 2))
    fabric.fail_next("unbind", applied=True)
    await fabric.bind(D, binding())
    with pytest.raises(FabricError):
        await fabric.unbind(D, binding())
    assert (await fabric.snapshot(D)).bindings == []


async def test_the_snapshot_can_be_made_to_fail(fabric: SimulatedFabric) -> None:
    fabric.fail_next("snapshot")
    with pytest.raises(FabricError) as err:
        await fabric.snapshot(D)
    assert err.value.component is None
    await fabric.snapshot(D)


async def test_hang_next_hangs_the_next_call_and_only_that_one(fabric: SimulatedFabric) -> None:
    fabric.hang_next("bind")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.bind(D, binding()), timeout=0.05)
    assert (await fabric.snapshot(D)).bindings == []
    await asyncio.wait_for(fabric.bind(D, binding()), timeout=1.0)


async def test_a_hung_call_ends_when_cancelled(fabric: SimulatedFabric) -> None:
    fabric.hang_next("remove_circuit")
    task = asyncio.create_task(fabric.remove_circuit(D, circuit(1, 2)))
    await asyncio.sleep(0.01)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_hang_after_the_change_took_effect_leaves_it_programmed(
    fabric: SimulatedFabric,
) -> None:
    fabric.hang_next("create_circuit", component="ocs-2", applied=True)
    await fabric.create_circuit(D, circuit(1, 2, ocs="ocs-1"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.create_circuit(D, circuit(1, 2, ocs="ocs-2")), 0.05)
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 2, "ocs-1"), circuit(1, 2, "ocs-2")]


async def test_scripted_faults_fire_in_the_order_they_were_scripted(
    fabric: SimulatedFabric,
) -> None:
    fabric.fail_next("bind")
    fabric.hang_next("bind")
    with pytest.raises(FabricError):
        await fabric.bind(D, binding())
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.bind(D, binding()), timeout=0.05)
    await fabric.bind(D, binding())


async def test_scripting_a_fault_that_could_never_fire_is_refused(
    fabric: SimulatedFabric,
) -> None:
    with pytest.raises(ValueError, match="unknown fabric operation"):
        fabric.fail_next("bnid")
    with pytest.raises(ValueError, match="times"):
        fabric.hang_next("bind", times=0)
    with pytest.raises(ValueError, match="snapshot"):
        fabric.fail_next("snapshot", applied=True)
    assert fabric.pending_faults == 0


# -- broken components -------------------------------------------------------------------------


async def test_a_broken_ocs_fails_every_circuit_operation_on_it_until_repaired(
    fabric: SimulatedFabric,
) -> None:
    await fabric.create_circuit(D, circuit(1, 2))
    fabric.break_component("ocs-1")
    assert fabric.broken == {"ocs-1"}
    for op in (fabric.create_circuit(D, circuit(3, 4)), fabric.remove_circuit(D, circuit(1, 2))):
        with pytest.raises(FabricError, match="ocs-1 is broken") as err:
            await op
        assert err.value.component == "ocs-1"
    await fabric.create_circuit(D, circuit(3, 4, ocs="ocs-2"))  # the other switch works
    assert len((await fabric.snapshot(D)).circuits) == 2  # reading still works
    fabric.repair_component("ocs-1")
    await fabric.remove_circuit(D, circuit(1, 2))


async def test_a_broken_host_device_or_path_node_fails_bindings_that_touch_it(
    fabric: SimulatedFabric,
) -> None:
    await fabric.bind(D, binding())
    for component in ("host-1", "sw-1", "gpu-1"):
        fabric.break_component(component)
        for op in (fabric.bind(D, binding(composition="c-2")), fabric.unbind(D, binding())):
            with pytest.raises(FabricError) as err:
                await op
            assert err.value.component == component
        fabric.repair_component(component)
    await fabric.bind(D, binding(device="gpu-2", composition="c-2", via=("sw-2",)))
    await fabric.unbind(D, binding())
    assert fabric.broken == frozenset()


async def test_repairing_a_sound_component_does_nothing(fabric: SimulatedFabric) -> None:
    fabric.repair_component("ocs-9")
    assert fabric.broken == frozenset()


# -- the call log and reset --------------------------------------------------------------------


async def test_every_call_is_logged_with_its_arguments_even_when_it_fails() -> None:
    fabric = SimulatedFabric()
    fabric.fail_next("bind")
    fabric.hang_next("unbind")
    await fabric.create_circuit(D, circuit(1, 2))
    with pytest.raises(FabricError):
        await fabric.bind(D, binding())
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.unbind("d2", binding()), timeout=0.01)
    await fabric.snapshot(D)
    assert fabric.calls == [
        ("create_circuit", D, (circuit(1, 2),)),
        ("bind", D, (binding(),)),
        ("unbind", "d2", (binding(),)),
        ("snapshot", D, ()),
    ]


async def test_reset_forgets_everything_but_the_knobs_and_replays_the_seed() -> None:
    fabric = SimulatedFabric(seed=11, failure_rate=0.5)
    first = await outcomes(fabric, 12)
    fabric.break_component("ocs-1")
    fabric.fail_next("snapshot")
    fabric.reset()
    assert fabric.calls == [] and fabric.broken == frozenset() and fabric.pending_faults == 0
    assert await fabric.snapshot(D) == FabricSnapshot(circuits=[], bindings=[])
    assert await outcomes(fabric, 12) == first
    assert fabric.failure_rate == 0.5


# -- the state file ----------------------------------------------------------------------------


class Crash(Exception):
    """The process dies here."""


def saved(path: Path) -> dict[str, FabricSnapshot]:
    """What the state file holds (a new engine process would start from this)."""
    held = read_state_file(path)
    assert held is not None, f"no state file at {path}"
    return held


async def test_what_is_programmed_survives_in_a_new_instance_on_the_same_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "deep" / "fabric.json"
    first = SimulatedFabric(state_file=path)
    assert read_state_file(path) is None  # nothing changed yet, nothing written
    slice_ = msgspec.structs.replace(binding(device="mem-1"), capacity_gib=64.0)
    await first.create_circuit(D, circuit(1, 5))
    await first.create_circuit(D, circuit(2, 6))
    await first.remove_circuit(D, circuit(2, 6))
    await first.bind(D, binding())
    await first.bind(D, slice_)
    await first.create_circuit("d2", circuit(3, 4, ocs="ocs-9"))

    second = SimulatedFabric(state_file=path)
    for domain in (D, "d2"):
        assert await second.snapshot(domain) == await first.snapshot(domain)
    assert (await second.snapshot(D)).bindings == [binding(), slice_]
    # It holds them, not just lists them: the hardware's rules apply to what it loaded.
    with pytest.raises(FabricError, match="port 5 is already in circuit 1-5"):
        await second.create_circuit(D, circuit(5, 7))
    with pytest.raises(FabricError, match="already bound to host host-1"):
        await second.bind(D, binding(host="host-2", composition="c-2"))


def generations(path: Path) -> list[Path]:
    """The generations of the state file on disk, oldest first."""
    return sorted(path.parent.glob(f"{path.name}.g*"), key=lambda g: int(g.suffix[2:]))


async def test_emptied_domains_leave_the_file_and_a_no_op_does_not_rewrite_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    await fabric.create_circuit(D, circuit(1, 5))
    await fabric.create_circuit("d2", circuit(1, 5))
    await fabric.remove_circuit("d2", circuit(1, 5))
    assert set(saved(path)) == {D}
    published: list[object] = []
    real_link = os.link
    monkeypatch.setattr(os, "link", lambda *a: published.append(a) or real_link(*a))
    await fabric.create_circuit(D, circuit(1, 5))  # already there: idempotent
    await fabric.remove_circuit(D, circuit(3, 4))  # not there
    await fabric.snapshot(D)
    assert published == []


async def test_a_crash_before_the_link_leaves_the_previous_complete_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    await fabric.create_circuit(D, circuit(1, 2))
    before = generations(path)

    def crash(*args: object) -> None:
        raise Crash

    monkeypatch.setattr(os, "link", crash)
    with pytest.raises(Crash):
        await fabric.create_circuit(D, circuit(3, 4))
    monkeypatch.undo()

    assert generations(path) == before and saved(path)[D].circuits == [circuit(1, 2)]
    # As if the crash had cut a temporary file short: it is no generation, nobody reads it.
    path.with_name(f"{path.name}.{os.getpid()}-0123456789abcdef.tmp").write_bytes(b'{"for')
    assert (await SimulatedFabric(state_file=path).snapshot(D)).circuits == [circuit(1, 2)]
    # The process that survived it holds what the hardware holds, not the change that failed.
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 2)]


async def test_a_write_that_fails_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk every failed change left a `.tmp` file for good: the write failed
    before the block that removes it."""
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    await fabric.create_circuit(D, circuit(1, 2))

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    for ports in ((3, 4), (5, 6)):
        with pytest.raises(OSError, match="No space left"):
            await fabric.create_circuit(D, circuit(*ports))
    monkeypatch.undo()

    assert list(tmp_path.glob("*.tmp")) == []
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 2)]


async def test_every_generation_a_reader_can_see_is_complete_and_few_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fabric.json"
    seen: list[int] = []
    real_link = os.link

    def checked_link(src: str, dst: str) -> None:
        # The moment before it is published, the new generation is already whole.
        msgspec.json.decode(Path(src).read_bytes(), type=SavedFabric)
        real_link(src, dst)
        seen.append(sum(len(s.circuits) + len(s.bindings) for s in saved(path).values()))

    monkeypatch.setattr(os, "link", checked_link)
    fabric = SimulatedFabric(state_file=path)
    for i in range(9):
        await fabric.create_circuit(D, circuit(2 * i, 2 * i + 1))
    await fabric.bind(D, binding())
    await fabric.unbind(D, binding())
    assert seen == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 9]  # one per call awaited, in their order
    # The eight newest, and the newest old one, left for the next publication to reuse.
    assert [g.name for g in generations(path)] == [f"fabric.json.g{n}" for n in range(3, 12)]
    assert len(generations(path)) == KEPT_GENERATIONS + 1
    assert set(tmp_path.iterdir()) == set(generations(path))  # and no temporary file is left


async def test_a_publication_reuses_an_old_generations_file_rather_than_making_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No inode to allocate per generation: on ext4 without a journal that allocation scans
    past every recently freed inode, and was most of the state thread's CPU under load."""
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    for i in range(KEPT_GENERATIONS + 1):  # from then on an old generation is left over
        await fabric.create_circuit(D, circuit(2 * i, 2 * i + 1))
    made: list[str] = []
    real_open = os.open

    def counted_open(file: str, flags: int, *args: int) -> int:
        if flags & os.O_CREAT:
            made.append(str(file))
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", counted_open)
    inodes = {g.stat().st_ino for g in generations(path)}
    for i in range(20):
        await fabric.create_circuit("d2", circuit(2 * i, 2 * i + 1))
    assert made == []
    assert {g.stat().st_ino for g in generations(path)} == inodes  # the same files, reused
    assert len(saved(path)["d2"].circuits) == 20 and len(saved(path)[D].circuits) == 9
    assert [g.name for g in generations(path)] == [f"fabric.json.g{n}" for n in range(21, 30)]
    assert set(tmp_path.iterdir()) == set(generations(path))


async def test_a_publication_lists_the_folder_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once before the change (has another process published?) and once after its link (is
    this generation the newest, and which are old?): the newest is read from that second
    listing, not from a third made just after it."""
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    await fabric.create_circuit(D, circuit(0, 1))
    listed: list[str] = []
    real_scandir = os.scandir

    def counted_scandir(directory: Path) -> Iterator[os.DirEntry[str]]:
        listed.append(str(directory))
        return real_scandir(directory)

    monkeypatch.setattr(os, "scandir", counted_scandir)
    for i in range(1, 4):
        await fabric.create_circuit(D, circuit(2 * i, 2 * i + 1))
    assert listed == [str(tmp_path)] * 6


async def test_changes_queued_together_are_written_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group commit: one program call, and calls made while a write is under way, become
    one generation (one durable write), and each call still returns only once it holds."""
    path = tmp_path / "fabric.json"
    published: list[int] = []
    real_link = os.link

    def counted_link(src: str, dst: str) -> None:
        real_link(src, dst)
        published.append(sum(len(s.circuits) + len(s.bindings) for s in saved(path).values()))

    monkeypatch.setattr(os, "link", counted_link)
    fabric = SimulatedFabric(state_file=path)
    changes = [FabricChange(op="create_circuit", circuit=circuit(1, 2)),
               FabricChange(op="bind", binding=binding())]  # fmt: skip
    await fabric.program(D, changes)
    assert published == [2]  # both changes, one generation
    await asyncio.gather(
        *(fabric.create_circuit(D, circuit(2 * i + 3, 2 * i + 4)) for i in range(8))
    )
    # The first call's write was under way while the others queued: they follow as one.
    assert len(published) < 1 + 8 and published[-1] == 10
    assert saved(path)[D].circuits[-1] == circuit(17, 18)


async def test_a_program_stops_at_the_first_failure_and_keeps_what_came_before(
    tmp_path: Path,
) -> None:
    fabric = SimulatedFabric(state_file=tmp_path / "fabric.json")
    fabric.fail_next("bind", "gpu-1")
    told: list[FabricChange] = []
    changes = [FabricChange(op="create_circuit", circuit=circuit(1, 2)),
               FabricChange(op="bind", binding=binding()),
               FabricChange(op="create_circuit", circuit=circuit(3, 4))]  # fmt: skip
    with pytest.raises(FabricError, match="injected failure at gpu-1"):
        await fabric.program(D, changes, started=told.append)
    assert told[-1] == changes[1]  # the last change told is the one that failed
    assert saved(tmp_path / "fabric.json")[D] == FabricSnapshot(
        circuits=[circuit(1, 2)], bindings=[]
    )
    assert [op for op, _, _ in fabric.calls] == ["create_circuit", "bind"]  # nothing after it


async def test_a_program_names_the_change_the_hardware_refused(tmp_path: Path) -> None:
    """A refusal found where the state is (a port taken), not by a scripted fault."""
    fabric = SimulatedFabric(state_file=tmp_path / "fabric.json")
    await fabric.create_circuit(D, circuit(1, 2))
    told: list[FabricChange] = []
    changes = [FabricChange(op="bind", binding=binding()),
               FabricChange(op="create_circuit", circuit=circuit(2, 3)),
               FabricChange(op="create_circuit", circuit=circuit(4, 5))]  # fmt: skip
    with pytest.raises(FabricError, match="port 2 is already in circuit 1-2"):
        await fabric.program(D, changes, started=told.append)
    assert told[-1] == changes[1]
    assert (await fabric.snapshot(D)).bindings == [binding()]  # the change before it holds


async def test_a_state_file_written_before_generations_is_where_they_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fabric.json"
    first = SimulatedFabric(state_file=path)
    await first.create_circuit(D, circuit(1, 2))
    path.write_bytes(generations(path)[-1].read_bytes())  # as an older Trellis kept it
    generations(path)[-1].unlink()

    fabric = SimulatedFabric(state_file=path)
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 2)]
    await fabric.create_circuit(D, circuit(3, 4))
    path.write_text("no longer read")
    assert saved(path)[D].circuits == [circuit(1, 2), circuit(3, 4)]
    assert [g.name for g in generations(path)] == ["fabric.json.g1"]


async def test_a_reader_that_finds_its_generation_deleted_reads_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fabric.json"
    writer = SimulatedFabric(state_file=path)
    await writer.create_circuit(D, circuit(1, 2))
    loop = asyncio.get_running_loop()
    real_read = Path.read_bytes

    def overtaken_read(self: Path) -> bytes:
        # Between listing the generations and reading the newest, enough newer ones are
        # published that the one it listed is gone (its file reused under another name).
        monkeypatch.setattr(Path, "read_bytes", real_read)
        for i in range(KEPT_GENERATIONS + 1):
            change = writer.create_circuit("d2", circuit(2 * i + 10, 2 * i + 11))
            asyncio.run_coroutine_threadsafe(change, loop).result()
        assert not self.exists()
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", overtaken_read)
    held = await asyncio.to_thread(read_state_file, path)
    assert held is not None and len(held["d2"].circuits) == KEPT_GENERATIONS + 1


@pytest.mark.parametrize("cut_short", [False, True])
async def test_a_reader_whose_generation_is_reused_as_it_reads_reads_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut_short: bool
) -> None:
    """A reader that opened a generation just before its file was reused for a later one reads
    that one, or (caught mid-write) a file cut short: it finds the name gone and lists again."""
    path = tmp_path / "fabric.json"
    writer = SimulatedFabric(state_file=path)
    await writer.create_circuit(D, circuit(1, 2))
    loop = asyncio.get_running_loop()
    real_read = Path.read_bytes
    read: list[bytes] = []

    def overtaken_read(self: Path) -> bytes:
        monkeypatch.setattr(Path, "read_bytes", real_read)
        with open(self, "rb") as opened:
            # Opened, and then enough newer generations are published that its file is reused.
            for i in range(KEPT_GENERATIONS + 1):
                change = writer.create_circuit("d2", circuit(2 * i + 10, 2 * i + 11))
                asyncio.run_coroutine_threadsafe(change, loop).result()
            assert not self.exists()
            data = opened.read()
        read.append(data)
        return data[: len(data) // 2] if cut_short else data

    monkeypatch.setattr(Path, "read_bytes", overtaken_read)
    held = await asyncio.to_thread(read_state_file, path)
    # What it read was the later generation written over the file it opened, not its own.
    reused = msgspec.json.decode(read[0], type=SavedFabric)
    assert len(reused.domains["d2"].circuits) == KEPT_GENERATIONS + 1
    assert held is not None and len(held["d2"].circuits) == KEPT_GENERATIONS + 1


@pytest.mark.parametrize(
    ("changes", "lost_track"), [(KEPT_GENERATIONS + 2, False), (LINEAGE + 1, True)]
)
async def test_a_writer_that_links_a_generation_deleted_while_it_stood_still_published_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changes: int, lost_track: bool
) -> None:
    path = tmp_path / "fabric.json"
    stale, other = SimulatedFabric(state_file=path), SimulatedFabric(state_file=path)
    await stale.create_circuit(D, circuit(1, 2))
    loop = asyncio.get_running_loop()
    real_link = os.link

    def stalled_link(src: str, dst: str) -> None:
        # It stands still between reading generation 1 and linking generation 2, while the
        # other makes so many changes that generation 2 is deleted as old: the name is free.
        monkeypatch.setattr(os, "link", real_link)
        for i in range(changes):
            change = other.create_circuit("d2", circuit(2 * i + 10, 2 * i + 11))
            asyncio.run_coroutine_threadsafe(change, loop).result()
        assert not Path(dst).exists()
        real_link(src, dst)

    monkeypatch.setattr(os, "link", stalled_link)
    if lost_track:
        # So long that the newest generation's lineage no longer reaches back to its own: it
        # cannot tell, and says so as a lost reply would.
        with pytest.raises(FabricError, match="lost track of whether this change took effect"):
            await stale.bind(D, binding())
        assert (await stale.snapshot(D)).bindings == []
    else:
        # Its change is made again, on the newest generation.
        await stale.bind(D, binding())
        assert saved(path)[D].bindings == [binding()]
    assert len(saved(path)["d2"].circuits) == changes
    assert (await other.snapshot(D)) == (await stale.snapshot(D))


async def test_scripted_faults_that_took_effect_are_in_the_file_and_others_are_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    fabric.fail_next("create_circuit", applied=True)
    fabric.hang_next("bind", applied=True)
    fabric.fail_next("bind", component="gpu-2")
    fabric.hang_next("create_circuit")
    with pytest.raises(FabricError):
        await fabric.create_circuit(D, circuit(1, 2))
    with pytest.raises(TimeoutError):  # long enough for the write before the hang to land
        await asyncio.wait_for(fabric.bind(D, binding()), timeout=0.5)
    with pytest.raises(FabricError):
        await fabric.bind(D, binding(device="gpu-2", composition="c-2"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.create_circuit(D, circuit(3, 4)), timeout=0.05)
    assert saved(path) == {D: FabricSnapshot(circuits=[circuit(1, 2)], bindings=[binding()])}


async def test_reset_empties_the_state_file_too(tmp_path: Path) -> None:
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    await fabric.bind(D, binding())
    fabric.reset()
    assert saved(path) == {}
    assert await SimulatedFabric(state_file=path).snapshot(D) == FabricSnapshot(
        circuits=[], bindings=[]
    )


def test_a_file_that_is_no_state_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "fabric.json"
    path.write_text('{"domains": {"d1": {"circuits": [{"ocs": "ocs-1"}]}}}')
    with pytest.raises(ValueError, match=f"{path} is not a simulated fabric state file"):
        SimulatedFabric(state_file=path)
    path.write_text('{"format": 7, "domains": {}}')
    with pytest.raises(ValueError, match="format 7"):
        read_state_file(path)


# -- one state file, several processes --------------------------------------------------------

# A process sharing the state file that stops itself (SIGSTOP, as the chaos run pauses an
# engine) in the middle of one operation: after it has read the state and written what it
# would publish, before it has published it (its first fsync of a regular file).
STOPPED_MID_OPERATION = """
import asyncio, os, signal, stat, sys, threading
from collections.abc import Iterator
from pathlib import Path
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.engine.core.errors import WriterFenced
from trellis.engine.core.fabric import FabricCircuit

real_fsync = os.fsync

def fsync(fd):
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.fsync = real_fsync
        # To this thread: it takes the stop on its way back from the call. Sent to the process,
        # the kernel may hand the stop to another thread, and on a busy machine this one ran on
        # to publish before it took effect (the stale write then won, or was seen too early).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    real_fsync(fd)

path, domain, fence = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
fabric = SimulatedFabric(state_file=path)
os.fsync = fsync
try:
    asyncio.run(
        fabric.create_circuit(
            domain, FabricCircuit(ocs="ocs-1", a_port=7, b_port=8),
            fence=int(fence) if fence else None,
        )
    )
    print("created")
except WriterFenced:
    print("fenced")
"""


def stopped(pid: int) -> bool:
    """Whether the child `pid` is stopped now (it must not have ended instead)."""
    done, status = os.waitpid(pid, os.WUNTRACED | os.WNOHANG)
    assert not (done and (os.WIFEXITED(status) or os.WIFSIGNALED(status))), "it ended"
    return bool(done) and os.WIFSTOPPED(status)


@pytest.mark.parametrize(
    ("domain", "fence", "said", "held"),
    [
        # The old writer of D, woken: the fence it carries is behind its successor's.
        (D, "1", "fenced", {D: [circuit(1, 2), circuit(3, 4)]}),
        # An engine serving another domain: its change is made on the newest state, not lost.
        ("d2", "", "created", {D: [circuit(1, 2), circuit(3, 4)], "d2": [circuit(7, 8)]}),
    ],
)
async def test_a_process_stopped_mid_operation_blocks_no_other_and_its_stale_write_loses(
    tmp_path: Path, domain: str, fence: str, said: str, held: dict[str, list[FabricCircuit]]
) -> None:
    path = tmp_path / "fabric.json"
    fabric = SimulatedFabric(state_file=path)
    await fabric.create_circuit(D, circuit(1, 2), fence=1)
    child = subprocess.Popen(
        [sys.executable, "-c", STOPPED_MID_OPERATION, str(path), domain, fence],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(3000):
            if stopped(child.pid):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the other process never stopped in its operation")
        # Its successor works on, as it would on real hardware; a lock held by the stopped
        # process would keep these waiting until the timeout.
        await asyncio.wait_for(fabric.create_circuit(D, circuit(3, 4), fence=2), timeout=10)
        assert await asyncio.wait_for(fabric.snapshot("d2"), timeout=10) == FabricSnapshot(
            circuits=[], bindings=[]
        )
    finally:
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate(timeout=60)
    assert (child.returncode, out.decode().strip()) == (0, said), err.decode()
    assert {d: s.circuits for d, s in saved(path).items()} == held
    assert fabric.fence_of(D) == 2 == SimulatedFabric(state_file=path).fence_of(D)


# -- scripts -----------------------------------------------------------------------------------


def test_a_script_lists_faults_in_order() -> None:
    script = "hang:bind, fail:create_circuit:ocs-1,fail:bind*2,hang:unbind:gpu-01*3+applied"
    assert parse_script(script) == [
        ScriptedFault(kind="hang", op="bind"),
        ScriptedFault(kind="fail", op="create_circuit", component="ocs-1"),
        ScriptedFault(kind="fail", op="bind", times=2),
        ScriptedFault(kind="hang", op="unbind", component="gpu-01", times=3, applied=True),
    ]
    assert parse_script("") == parse_script("  ") == []


@pytest.mark.parametrize(
    ("script", "complaint"),
    [
        ("hang", "cannot read fault 'hang': expected KIND:OP"),
        ("hang:bind,", "cannot read fault ''"),
        ("fail:bind:gpu 1", "cannot read fault"),
        ("break:bind", "kind must be fail or hang"),
        ("fail:bnid", "'bnid' is no fabric operation"),
        ("fail:bind*0", "times must be at least 1"),
        ("hang:snapshot+applied", "a snapshot changes nothing"),
    ],
)
def test_a_script_that_cannot_be_read_is_refused_saying_why(script: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=re.escape(complaint)):
        parse_script(script)


async def test_armed_script_faults_fire_like_scripted_ones(fabric: SimulatedFabric) -> None:
    for fault in parse_script("fail:bind:gpu-2,hang:create_circuit+applied"):
        fault.arm(fabric)
    assert fabric.pending_faults == 2
    await fabric.bind(D, binding())
    assert await outcome(fabric, 2) == "gpu-2"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fabric.create_circuit(D, circuit(1, 2)), timeout=0.05)
    assert (await fabric.snapshot(D)).circuits == [circuit(1, 2)]
