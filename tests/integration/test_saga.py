"""The compose saga over real NATS and Postgres, against a simulated fabric that can fail.

After every step the simulated hardware is compared with the log: what the fabric holds must
be exactly what the live compositions need, whatever failed on the way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric
from harness import Harness, serving

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.engine.core.fabric import FabricChange, FabricCircuit, FabricSnapshot
from trellis.engine.core.fabric_plan import reconcile
from trellis.engine.service import saga

DOMAIN = "hall-1"
DEADLINE = 0.5  # seconds a saga may take before it is abandoned and undone
A100 = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["A100"]}]}  # over ocs 0-2
CIRCUIT = FabricCircuit(ocs="ocs-1", a_port=0, b_port=2)


class ProgramLog(SimulatedFabric):
    """The simulated fabric, noting the operations of each `program` call it gets."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.programs: list[list[str]] = []

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        self.programs.append([change.op for change in changes])
        await super().program(domain, changes, fence=fence, started=started)


@pytest_asyncio.fixture
async def sim() -> SimulatedFabric:
    return ProgramLog(seed=7)


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, sim: SimulatedFabric
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, fabric=sim, saga_deadline=DEADLINE
    ) as harness:
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", fabric()))
        yield harness


async def compose(h: Harness, body: dict[str, Any], tenant: str = "acme") -> dict[str, Any]:
    return await h.client.intent(DOMAIN, tenant, "compose", body)


async def in_step(h: Harness, sim: SimulatedFabric) -> tuple[list[FabricCircuit], list[str]]:
    """Wait until the fabric follows the log, check it does, and say what it holds:
    (circuits, "device@host" bindings)."""
    await h.fabric_idle(DOMAIN)
    held = await sim.snapshot(DOMAIN)
    state = h.engine.state(DOMAIN)
    assert state is not None
    plan = reconcile(held, state)
    assert plan.in_step and not plan.pending, plan
    return held.circuits, [f"{b.device}@{b.host}" for b in held.bindings]


def snapshots_taken(sim: SimulatedFabric) -> int:
    return sum(op == "snapshot" for op, _, _ in sim.calls)


async def types_of(h: Harness) -> list[str]:
    return [e.type async for e in h.store.read(DOMAIN)]


async def free_gpus(h: Harness) -> list[str]:
    reply = await h.client.query(DOMAIN, "free", {"kind": "gpu"})
    return sorted(d["id"] for d in expect_ok(reply)["devices"])


async def test_compose_programs_the_circuit_and_the_binding_then_answers_active(
    h: Harness, sim: SimulatedFabric
) -> None:
    result = expect_ok(await compose(h, A100))

    assert result["state"] == "active"
    assert await in_step(h, sim) == ([CIRCUIT], ["gpu-02@host-01"])
    # Reserved first, programmed after, then established: the log tells the saga in order.
    assert (await types_of(h))[-5:] == [
        "CompositionRequested",
        "CircuitCreated",
        "DevicesReserved",
        "PathEstablished",
        "CompositionActivated",
    ]
    ops = [op for op, _, _ in sim.calls if op != "snapshot"]
    assert ops == ["create_circuit", "bind"]


async def test_a_driver_error_undoes_the_saga_and_the_reply_says_what_failed(
    h: Harness, sim: SimulatedFabric
) -> None:
    sim.fail_next("bind", "gpu-02")

    error = expect_error(await compose(h, A100), "failed")

    assert error["details"]["step"] == "bind"
    assert error["details"]["target"] == "gpu-02"
    assert "gpu-02" in error["message"] and "rolled back" in error["message"]
    assert (await types_of(h))[-2:] == ["CompositionFailed", "CircuitRemoved"]
    why = expect_ok(await h.client.query(DOMAIN, "why", {"id": error["details"]["composition_id"]}))
    assert "could not establish it" in why["text"] and "nothing of it is held" in why["text"]
    # The circuit it had created is gone again and nothing stays reserved.
    assert await in_step(h, sim) == ([], [])
    assert await free_gpus(h) == ["gpu-01", "gpu-02"]
    assert expect_ok(await compose(h, A100))["state"] == "active"


class BrokenDriver(ProgramLog):
    """A driver that breaks its word: a bind or unbind of `bad_device` raises what vendor data
    it cannot read raised (AttributeError), not FabricError."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_device: str | None = None

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        for change in changes:
            if change.binding is not None and change.binding.device == self.bad_device:
                if started is not None:
                    started(change)
                raise AttributeError("'str' object has no attribute 'get'")
        await super().program(domain, changes, fence=fence, started=started)


@pytest.mark.parametrize("sim", [BrokenDriver(seed=7)], ids=["broken driver"])
async def test_a_driver_that_raises_another_error_still_fails_and_undoes_the_saga(
    h: Harness, sim: BrokenDriver
) -> None:
    """A driver's AttributeError left the composition pending, its devices held, retried by
    every pass and answered by none (the compose timed out unavailable). Its undo fails the
    same way here: the failure is recorded all the same, and a pass finishes the undoing."""
    sim.bad_device = "gpu-02"

    error = expect_error(await compose(h, A100), "failed")

    assert (error["details"]["step"], error["details"]["target"]) == ("bind", "gpu-02")
    assert "AttributeError" in error["details"]["error"]
    assert "CompositionFailed" in await types_of(h)
    sim.bad_device = None
    assert await in_step(h, sim) == ([], [])
    assert await free_gpus(h) == ["gpu-01", "gpu-02"]
    assert expect_ok(await compose(h, A100))["state"] == "active"


class UnreadableState(ProgramLog):
    """A simulated fabric whose state file is `damaged`: every read and write
    raises the ValueError its reader raises, not FabricError."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.damaged = False

    def _check(self) -> None:
        if self.damaged:
            raise ValueError("fabric-sim.json.g3 is not a simulated fabric state file")

    async def snapshot(self, domain: str, *, fence: int | None = None) -> FabricSnapshot:
        self._check()
        return await super().snapshot(domain, fence=fence)

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        self._check()
        await super().program(domain, changes, fence=fence, started=started)


@pytest.mark.parametrize("sim", [UnreadableState(seed=7)], ids=["unreadable state"])
async def test_a_fabric_that_cannot_be_read_still_answers_every_compose(
    h: Harness, sim: UnreadableState
) -> None:
    """The second compose after the state file broke stayed pending for good (and its
    composer was told `unavailable`): a pass whose snapshot raised anything but FabricError
    started no saga for the pending compositions, so none met its deadline."""
    sim.damaged = True
    expect_error(await compose(h, A100), "failed")
    error = expect_error(await compose(h, A100), "failed")
    assert "not a simulated fabric state file" in error["details"]["error"]
    sim.damaged = False
    assert await in_step(h, sim) == ([], [])
    assert expect_ok(await compose(h, A100))["state"] == "active"


async def test_a_lost_reply_is_undone_too(h: Harness, sim: SimulatedFabric) -> None:
    """The controller applied the bind but its answer never came: undo must not trust the
    error to mean 'nothing happened'."""
    sim.fail_next("bind", applied=True)

    expect_error(await compose(h, A100), "failed")

    assert await in_step(h, sim) == ([], [])


async def test_a_hung_operation_is_abandoned_at_the_deadline_and_undone(
    h: Harness, sim: SimulatedFabric
) -> None:
    sim.hang_next("bind", applied=True)

    error = expect_error(await compose(h, A100), "failed")

    assert error["details"]["step"] == "bind"
    assert f"no answer within {DEADLINE:g}s" in error["details"]["error"]
    assert await in_step(h, sim) == ([], [])
    assert await free_gpus(h) == ["gpu-01", "gpu-02"]


async def test_a_failed_circuit_fails_the_composition_before_any_binding(
    h: Harness, sim: SimulatedFabric
) -> None:
    sim.fail_next("create_circuit", "ocs-1")

    error = expect_error(await compose(h, A100), "failed")

    assert (error["details"]["step"], error["details"]["target"]) == ("create_circuit", "ocs-1:0-2")
    assert not any(op == "bind" for op, _, _ in sim.calls)
    assert await in_step(h, sim) == ([], [])


async def test_a_resend_during_the_saga_gets_the_same_settled_answer(
    h: Harness, sim: SimulatedFabric
) -> None:
    sim.hang_next("bind")
    body = {**A100, "request_id": "r-twice"}

    first, again = await asyncio.gather(compose(h, body), _after(0.1, compose(h, body)))

    # The same answer, the resends marked as the replays they are.
    replayed = {**expect_error(first, "failed")["details"], "replayed": True}
    assert expect_error(again, "failed") == {**first["error"], "details": replayed}
    later = await compose(h, body)
    assert later == again
    assert (await types_of(h)).count("CompositionFailed") == 1


async def test_a_resend_after_success_replays_the_active_answer(
    h: Harness, sim: SimulatedFabric
) -> None:
    body = {**A100, "request_id": "r-once"}
    first = await compose(h, body)

    again = await compose(h, body)

    assert again["replayed"] is True and first["replayed"] is False
    assert again["result"] == first["result"] and again["position"] == first["position"]


async def test_release_and_expiry_take_the_paths_off_the_hardware(
    h: Harness, sim: SimulatedFabric
) -> None:
    cid = expect_ok(await compose(h, A100))["composition_id"]
    await in_step(h, sim)

    reply = await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid})

    expect_ok(reply)
    assert await in_step(h, sim) == ([], [])
    unbound = [args[0] for op, _, args in sim.calls if op == "unbind"]
    assert [(b.device, b.composition_id) for b in unbound] == [("gpu-02", cid)]


async def test_a_compose_after_a_release_waits_for_its_let_go(
    h: Harness, sim: SimulatedFabric
) -> None:
    """The release is answered once recorded; what it lets go is made before anything of the
    next saga, so the device it frees is free before it is bound again."""
    first = expect_ok(await compose(h, A100))["composition_id"]
    await in_step(h, sim)
    sim.latency = {"unbind": 0.2, "snapshot": 0.3}  # a pass, were one needed, comes later

    expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": first}))
    again = expect_ok(await compose(h, A100))

    assert again["state"] == "active"
    assert await in_step(h, sim) == ([CIRCUIT], ["gpu-02@host-01"])
    calls = [(op, args[0]) for op, _, args in sim.calls if op in ("unbind", "bind")]
    assert [(op, b.composition_id) for op, b in calls[-2:]] == [
        ("unbind", first),
        ("bind", again["composition_id"]),
    ]


async def one_composed_quietly(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> tuple[ProgramLog, str]:
    """Given: a long hold-back for lone releases, and one composition active, the hardware in
    step and no call noted yet; the fabric and the composition's id."""
    monkeypatch.setattr(saga, "LINGER_S", 30.0)
    sim = h.fabric
    assert isinstance(sim, ProgramLog)
    first = expect_ok(await compose(h, A100))["composition_id"]
    await in_step(h, sim)
    sim.programs.clear()
    return sim, first


async def released_then_composed_in_one_call(h: Harness, sim: ProgramLog, first: str) -> None:
    """When `first` is released and the same is composed again, the compose saga's one call
    lets go of the release first, then binds."""
    expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": first}))
    again = expect_ok(await compose(h, A100))

    assert again["state"] == "active"
    assert await in_step(h, sim) == ([CIRCUIT], ["gpu-02@host-01"])
    assert len(sim.programs) == 1, sim.programs
    assert sim.programs[0][0] == "unbind" and sim.programs[0][-1] == "bind"


async def test_a_lone_release_is_let_go_in_the_next_compose_call(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release in a quiet moment waits (LINGER_S, long here) for the next compose saga to
    carry it: one call, one durable write, instead of a call the saga waits for, then its own."""
    sim, first = await one_composed_quietly(h, monkeypatch)

    await released_then_composed_in_one_call(h, sim, first)


async def test_a_lone_release_waits_on_for_a_reservation_being_appended(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold-back runs out while the next compose's reservation is still being appended
    (slow here): the release waits on for that commit, and the compose saga carries it, rather
    than a call of its own that the saga would then wait for before making its own."""
    sim, first = await one_composed_quietly(h, monkeypatch)
    monkeypatch.setattr(saga, "LINGER_S", 0.2)
    append = h.store.append

    async def slow_reservations(*args: Any, **kwargs: Any) -> Any:
        if any(e.type == "DevicesReserved" for e in args[2]):
            await asyncio.sleep(4 * saga.LINGER_S)
        return await append(*args, **kwargs)

    monkeypatch.setattr(h.store, "append", slow_reservations)

    await released_then_composed_in_one_call(h, sim, first)


async def test_a_lone_release_goes_alone_when_no_reservation_comes(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a compose on its way, what a release let go goes on its own call at the end of
    its hold-back."""
    sim, first = await one_composed_quietly(h, monkeypatch)
    monkeypatch.setattr(saga, "LINGER_S", 0.05)

    expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": first}))

    assert await in_step(h, sim) == ([], [])
    assert sim.programs == [["unbind", "remove_circuit"]]


@pytest.mark.parametrize("fault", ["fail", "hang"])
async def test_a_let_go_that_fails_or_hangs_in_a_compose_call_leaves_the_compose_to_succeed(
    h: Harness, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """When the part a saga carried for a release fails, or hangs past its own deadline (as a
    let-go call of its own would), nothing of the compose was tried: the saga makes its own
    changes alone, within a deadline of their own, and a pass finishes letting go."""
    sim, first = await one_composed_quietly(h, monkeypatch)
    (sim.fail_next if fault == "fail" else sim.hang_next)("unbind", times=1)

    expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": first}))
    again = expect_ok(await compose(h, A100))

    assert again["state"] == "active"
    assert await in_step(h, sim) == ([CIRCUIT], ["gpu-02@host-01"])
    assert sim.pending_faults == 0
    assert sim.programs[0][0] == "unbind" and sim.programs[0][-1] == "bind"  # carried


async def test_composes_and_releases_in_step_need_no_pass(h: Harness, sim: SimulatedFabric) -> None:
    """Once a pass found the hardware in step, a reservation, a settlement and a release each
    say all the hardware must do: no snapshot is taken to find it out."""
    await in_step(h, sim)
    sync = h.engine.fabric_sync(DOMAIN)
    assert sync is not None
    passes, snapshots = sync.passes, snapshots_taken(sim)

    for _ in range(3):
        cid = expect_ok(await compose(h, A100))["composition_id"]
        expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid}))

    assert snapshots_taken(sim) == snapshots
    assert await in_step(h, sim) == ([], [])
    assert sync.passes == passes
    # A fault says nothing exact about the hardware: a pass looks.
    fault = {"component": "gpu-01", "state": "failed", "detail": "xid 79"}
    expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))
    await in_step(h, sim)
    assert sync.passes > passes


async def test_what_a_release_could_not_let_go_of_a_later_pass_takes_away(
    h: Harness, sim: SimulatedFabric
) -> None:
    cid = expect_ok(await compose(h, A100))["composition_id"]
    await in_step(h, sim)
    sim.fail_next("unbind", times=1)

    reply = await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid})

    assert expect_ok(reply)["state"] == "released"  # recorded: the hardware follows
    assert await in_step(h, sim) == ([], [])
    assert sim.pending_faults == 0
    assert expect_ok(await compose(h, A100))["state"] == "active"


async def test_an_expired_lease_takes_the_paths_off_the_hardware(
    h: Harness, sim: SimulatedFabric
) -> None:
    expect_ok(await compose(h, {**A100, "lease_seconds": 1}))
    assert (await in_step(h, sim))[1] == ["gpu-02@host-01"]

    await asyncio.sleep(1.1)  # the engine's clock is the system clock here; leases are seconds
    (reply,) = await h.engine.expire_due_leases()

    assert b'"expired":["c-' in reply
    assert await in_step(h, sim) == ([], [])


async def test_a_reroute_moves_the_binding_to_the_new_path_on_the_hardware(
    h: Harness, sim: SimulatedFabric
) -> None:
    """gpu-01 hangs off ocs-1 port 1; losing sw-1's uplink leaves no other path, but a
    second uplink on port 4 gives the reroute somewhere to go."""
    expect_ok(
        await h.client.admin(
            DOMAIN,
            "add-link",
            {
                "link": {
                    "id": "l-uplink-2",
                    "a": "sw-1",
                    "b": "ocs-1",
                    "b_port": 4,
                    "capacity_gbps": 256,
                }
            },
        )
    )
    expect_ok(await compose(h, {"host": "host-01", "device_ids": ["gpu-01"]}))
    [before], _ = await in_step(h, sim)
    used, spare = ("l-uplink", 4) if before.a_port == 0 else ("l-uplink-2", 0)

    fault = {"component": used, "state": "failed", "detail": "los"}
    expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))

    circuits, bindings = await in_step(h, sim)
    assert circuits == [FabricCircuit(ocs="ocs-1", a_port=min(1, spare), b_port=max(1, spare))]
    assert bindings == ["gpu-01@host-01"]
    assert "PathRerouted" in await types_of(h)


async def test_a_hung_saga_does_not_hold_up_the_rest_of_the_domain(
    h: Harness, sim: SimulatedFabric
) -> None:
    sim.hang_next("bind", "gpu-02")
    stuck = asyncio.create_task(compose(h, A100))
    await _pending_composition(h)

    other = await compose(h, {"host": "host-01", "device_ids": ["nic-01"]})

    assert expect_ok(other)["state"] == "active"
    assert not stuck.done()  # still within its deadline
    expect_error(await stuck, "failed")
    assert (await in_step(h, sim))[1] == ["nic-01@host-01"]


async def test_a_pending_composition_cannot_be_released(h: Harness, sim: SimulatedFabric) -> None:
    sim.hang_next("bind")
    composing = asyncio.create_task(compose(h, A100))
    cid = await _pending_composition(h)

    reply = await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid})

    assert "being established" in expect_error(reply, "conflict")["message"]
    expect_error(await composing, "failed")


async def test_what_could_not_be_undone_at_once_is_removed_by_a_later_pass(
    h: Harness, sim: SimulatedFabric
) -> None:
    """The bind fails after taking effect and the device's controller then refuses the undo:
    the log says failed at once, and the hardware follows once the controller is back."""
    sim.fail_next("bind", applied=True)
    sim.fail_next("unbind", times=1)

    expect_error(await compose(h, A100), "failed")

    assert await in_step(h, sim) == ([], [])
    assert sim.pending_faults == 0


async def _after(seconds: float, work: Any) -> Any:
    await asyncio.sleep(seconds)
    return await work


async def _pending_composition(h: Harness) -> str:
    """The id of the one composition pending in the domain, once there is one."""
    for _ in range(200):
        state = h.engine.state(DOMAIN)
        pending = [
            c for c, v in (state.compositions if state else {}).items() if v.state == "pending"
        ]
        if pending:
            return pending[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no composition became pending")
