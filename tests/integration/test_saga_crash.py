"""An engine killed mid-saga: on restart it completes or compensates what it left unfinished.

Issue 5, item 2. A real `trellis up` process drives the simulated fabric, whose "hardware" lives
in a state file and so survives the process, as real hardware would. The first bind hangs (and
the saga deadline is long), so the engine is truly in the middle of the compose saga when it is
killed with SIGKILL: the log holds the reservation, the hardware holds the circuit, and the
device is not bound yet (or is, and the reply was lost). A new engine then either finishes the
saga (the composition becomes active) or, when the fabric refuses the bind, undoes it (the
composition fails and everything is free again). Either way no reservation or circuit is
leaked, and the hardware holds what the log says.

    host-01 ─ sw-1 ─ ocs-1:0  ≈circuit≈  ocs-1:1 ─ gpu-01      (tests/integration/fabrics.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import reduce
from pathlib import Path

import msgspec
import pytest
from fabrics import event_types, expect_error, expect_ok, fabric
from nats.errors import NoRespondersError

from trellis.adapters.fabric.sim import read_state_file
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.fabric import FabricBinding, FabricCircuit, FabricSnapshot
from trellis.engine.core.fabric_plan import reconcile
from trellis.engine.core.state import DomainState, evolve

REPO = Path(__file__).resolve().parents[2]
DOMAIN = "hall-1"
TENANT = "acme"
COMPOSE = {"request_id": "crash-1", "host": "host-01", "device_ids": ["gpu-01"]}
CIRCUIT = FabricCircuit(ocs="ocs-1", a_port=0, b_port=1)
BINDING = FabricBinding(
    host="host-01", device="gpu-01", path=["host-01", "sw-1", "ocs-1", "gpu-01"], composition_id=""
)
EMPTY = FabricSnapshot(circuits=[], bindings=[])


class Rig:
    """One test's servers, schema, subjects and files, shared by the engines it starts."""

    def __init__(
        self, nats_url: str, database_url: str, schema: str, prefix: str, tmp_path: Path
    ) -> None:
        self.database_url = database_url
        self.schema = schema
        self.state_file = tmp_path / "fabric-sim.json"
        self.logs = tmp_path
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
            "TRELLIS_NATS_URL": nats_url,
            "TRELLIS_DATABASE_URL": database_url,
            "TRELLIS_DB_SCHEMA": schema,
            "TRELLIS_SUBJECT_PREFIX": prefix,
            "TRELLIS_DATA_DIR": str(tmp_path / "data"),
            "TRELLIS_FABRIC_STATE": str(self.state_file),
            "TRELLIS_SAGA_DEADLINE": "60",  # the hang, not the deadline, is what stops the saga
        }
        self.started = 0

    def hardware(self) -> FabricSnapshot:
        """What the simulated hardware of the domain holds, as its state file says."""
        return (read_state_file(self.state_file) or {}).get(DOMAIN, EMPTY)

    async def log_state(self) -> DomainState:
        """The domain folded from the log, with the engine's own `evolve`."""
        store = await PostgresEventStore.open(self.database_url, schema=self.schema)
        try:
            events = [recorded.event() async for recorded in store.read(DOMAIN)]
        finally:
            await store.close()
        return reduce(evolve, events, DomainState(domain=DOMAIN))

    async def event_types(self) -> list[str]:
        return await event_types(self.database_url, self.schema, DOMAIN)


@contextlib.asynccontextmanager
async def trellis_up(
    rig: Rig, client: TrellisClient, fabric_script: str = ""
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`trellis up` in a process of its own, running this checkout's code; yields once it
    answers, and stops it on exit unless the test killed it first."""
    rig.started += 1
    log = rig.logs / f"engine-{rig.started}.log"
    env = {**rig.env, "TRELLIS_FABRIC_SCRIPT": fabric_script}
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trellis.adapters.entrypoints.cli", "-v", "up",
            cwd=REPO, env=env, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        await until(lambda: answers(client), 30, f"engine {rig.started} serving", proc, log)
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def answers(client: TrellisClient) -> bool:
    try:
        await asyncio.wait_for(client.query(DOMAIN, "topology"), 0.5)
    except (TimeoutError, NoRespondersError):
        return False
    return True  # `not_found` before the import is an answer too


async def until(
    check: Callable[[], Awaitable[bool]],
    seconds: float,
    what: str,
    proc: asyncio.subprocess.Process | None = None,
    log: Path | None = None,
) -> None:
    """Poll `check` until it holds; fail naming `what` (and the engine's output) if it does not
    within `seconds` or the engine process ends."""
    deadline = time.monotonic() + seconds
    while not await check():
        ended = proc is not None and proc.returncode is not None
        if ended or time.monotonic() > deadline:
            output = log.read_text()[-3000:] if log else ""
            pytest.fail(
                f"no {what} within {seconds}s{' (engine exited)' if ended else ''}\n{output}"
            )
        await asyncio.sleep(0.05)


@pytest.fixture
def rig(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> Rig:
    return Rig(nats_url, database_url, pg_schema, subject_prefix, tmp_path)


@contextlib.asynccontextmanager
async def client_of(rig: Rig, timeout: float) -> AsyncIterator[TrellisClient]:
    async with TrellisClient.connected(
        rig.env["TRELLIS_NATS_URL"],
        prefix=rig.env["TRELLIS_SUBJECT_PREFIX"],
        timeout=timeout,
        name="test-client",
    ) as client:
        yield client


async def killed_mid_saga(rig: Rig, hang: str) -> str:
    """Given: an engine whose first bind hangs as `hang` says; a compose that needs an OCS
    circuit; the engine killed once the log holds the reservation, the hardware the circuit,
    and the bind is under way. Returns the composition's id."""
    async with client_of(rig, timeout=10) as client, trellis_up(rig, client, hang) as up:
        expect_ok(await client.admin(DOMAIN, "import-topology", fabric()))
        impatient = TrellisClient(client.nc, prefix=client.prefix, timeout=0.5)
        with pytest.raises(TimeoutError):  # the compose is answered once settled: never, here
            await impatient.intent(DOMAIN, TENANT, "compose", COMPOSE)

        bound = 1 if hang.endswith("+applied") else 0

        async def bind_under_way() -> bool:
            if "DevicesReserved" not in await rig.event_types():
                return False
            held = rig.hardware()
            return held.circuits == [CIRCUIT] and len(held.bindings) == bound

        await until(bind_under_way, 10, "the reservation, the circuit and the bind under way")
        up.kill()  # SIGKILL: no shutdown, no cleanup, mid-bind
        await up.wait()

    log = await rig.log_state()
    (composition,) = log.compositions.values()
    assert composition.state == "pending"
    return composition.id


# The bind hangs before it takes effect (nothing is bound when the engine dies), or after (the
# device is bound and the reply is lost).
HANGS = pytest.mark.parametrize("hang", ["hang:bind", "hang:bind+applied"])


async def assert_hardware_follows_the_log(rig: Rig, client: TrellisClient) -> DomainState:
    """Then: the hardware holds exactly what the log says, by the engine's own reconciliation
    and by what the queries answer; returns the log's state."""
    log = await rig.log_state()
    hardware = rig.hardware()
    plan = reconcile(hardware, log)
    assert plan.in_step and plan.pending == [], plan
    topology = expect_ok(await client.query(DOMAIN, "topology"))
    circuits = [(c["ocs"], c["a_port"], c["b_port"]) for c in topology["circuits"]]
    assert circuits == [(c.ocs, c.a_port, c.b_port) for c in hardware.circuits]
    connections = expect_ok(await client.query(DOMAIN, "connections"))["connections"]
    connected = [(c["host"], c["device"], c["composition_id"], c["path"]) for c in connections]
    bound = [(b.host, b.device, b.composition_id, b.path) for b in hardware.bindings]
    assert connected == bound
    return log


@HANGS
async def test_a_restarted_engine_completes_the_saga_a_crash_interrupted(
    rig: Rig, hang: str
) -> None:
    cid = await killed_mid_saga(rig, hang)

    # When: the engine starts again, and the fabric works.
    async with client_of(rig, timeout=10) as client, trellis_up(rig, client):
        # Then: the client's resend gets the settled answer: active, a replay.
        reply = await client.intent(DOMAIN, TENANT, "compose", COMPOSE)
        result = expect_ok(reply)
        assert reply["replayed"] is True
        assert (result["composition_id"], result["state"]) == (cid, "active")
        assert [d["id"] for d in result["devices"]] == ["gpu-01"]

        # ...and the hardware holds what the log says: the circuit and the binding.
        log = await assert_hardware_follows_the_log(rig, client)
        assert rig.hardware() == FabricSnapshot(
            circuits=[CIRCUIT], bindings=[msgspec.structs.replace(BINDING, composition_id=cid)]
        )
        assert log.compositions[cid].state == "active"
        assert log.device_owner == {"gpu-01": cid}
        assert (await rig.event_types())[-2:] == ["PathEstablished", "CompositionActivated"]


@HANGS
async def test_a_restarted_engine_compensates_when_the_fabric_refuses_to_finish(
    rig: Rig, hang: str
) -> None:
    cid = await killed_mid_saga(rig, hang)

    # When: the engine starts again, and the fabric refuses the bind.
    async with client_of(rig, timeout=10) as client, trellis_up(rig, client, "fail:bind"):
        # Then: the resend hears the failure and the step that failed.
        error = expect_error(await client.intent(DOMAIN, TENANT, "compose", COMPOSE), "failed")
        assert error["details"]["composition_id"] == cid
        assert (error["details"]["step"], error["details"]["target"]) == ("bind", "gpu-01")

        # ...the saga is undone on the hardware and in the log: nothing held, nothing leaked.
        log = await assert_hardware_follows_the_log(rig, client)
        assert rig.hardware() == EMPTY
        assert log.compositions == {} and log.device_owner == {} and log.circuits == {}
        types = await rig.event_types()
        assert "CompositionFailed" in types and types[-1] == "CircuitRemoved"
        free = expect_ok(await client.query(DOMAIN, "free", {"kind": "gpu"}))
        assert "gpu-01" in [d["id"] for d in free["devices"]]
        assert expect_ok(await client.query(DOMAIN, "topology"))["circuits"] == []
