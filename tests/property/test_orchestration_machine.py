"""The orchestration state machine (issue 5): the real engine under random operations.

Hypothesis drives one engine per example, served over real NATS and Postgres in a schema and
subject prefix of its own, on a SimulatedFabric with a seeded small failure rate and a clock
the machine moves. Rules: compose (possible and impossible requests; one in three with its
saga made to fail or hang, so it is compensated), two composes at once, a compose whose path
fails or is drained while its saga runs, release, extend, advance the clock and expire leases,
report a fault (failed, degraded) or a recovery on any host, switch, OCS, device or link,
drain (with or without force), undrain, script a fault for the next undo, cleanup or repair,
resend the last request.

Checked after every step, once the engine is quiescent (the fabric sync idle, the projections
caught up with the head of the log):
1. replay: the whole log folded from scratch equals the engine's live state;
2. hardware == log: the fabric holds exactly the circuits and bindings of the live
   compositions, none is pending, and `reconcile` finds nothing to do; and, at the moment each
   compose settled (SettlementAudit), an established one was held whole and a failed one not
   at all (passes heal a saga that skipped a bind or an undo, so quiescence alone cannot tell);
3. projections == state: `connections` lists exactly the live bindings and why, `free` exactly
   the usable devices with capacity left, proj_components and proj_devices the marks, holders
   and slices, and proj_compositions the state, lease, devices and impairments of every
   composition the machine made;
4. the pure invariants: no device owned twice, bandwidth within capacity, circuits one per
   port, exclusive switches private, paths well formed; active compositions run over usable
   parts only, impaired ones name a reason and have a part down;
5. every reply is well formed per the contract; a failed compose says what failed; a resend
   gets the first answer.

A failure is shrunk, which takes Hypothesis up to five minutes against the real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from integration.harness import Harness, ManualClock, serving
from isolation import (
    Database,
    create_schema,
    delete_relay_targets,
    drop_schema,
    unique_schema_name,
    unique_subject_prefix,
)
from test_placement_properties import check_invariants

from trellis.adapters.fabric.in_turn import program_in_turn
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.engine.core.compose import composition_id
from trellis.engine.core.errors import ERROR_CODES
from trellis.engine.core.fabric import FabricBinding, FabricChange, FabricCircuit, FabricSnapshot
from trellis.engine.core.fabric_plan import bindings_of, circuits_of, reconcile
from trellis.engine.core.intents import settle_request_id
from trellis.engine.core.state import Composition, DomainState, LinkState, NodeState, evolve, usable

DOMAIN = "hall"
TENANTS = ("acme", "bolt")
START = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
# Short, so a hang costs little. A saga slower than this on a busy machine fails and is undone,
# which the machine accepts like any other failed compose.
SAGA_DEADLINE = 0.25
QUIET_TIMEOUT = 30.0  # a fabric that never settles fails the step instead of hanging the run

SETTINGS = settings(
    max_examples=10,
    stateful_step_count=15,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

Doc = dict[str, Any]

# (fail | hang | None, the operation, whether it takes effect first): how a compose's saga is
# made to fail, one time in three.
SABOTAGE = st.tuples(
    st.sampled_from([None, None, None, None, "fail", "hang"]),
    st.sampled_from(["bind", "bind", "create_circuit"]),
    st.booleans(),
)


class SettlementAudit:
    """A FabricDriver around the SimulatedFabric that looks at the hardware the moment each
    compose saga has settled.

    Passes reconcile the hardware with the log, so a saga that skipped a bind or an undo is
    healed by the next pass and quiescence alone cannot tell. So at the start of every fabric
    call, before it runs, this looks for compositions that left `pending` since the last call:
    nothing has touched their part of the hardware since they settled (what passes and other
    sagas had in flight then was planned while they were pending, and passes leave pending
    compositions alone). An established composition must be held whole (every circuit and
    binding it reserved), a failed one must hold no binding, nor a circuit the log gave up,
    unless one of its own undo steps failed (later passes finish the undo, by design). A
    commit that says all the hardware must do takes no pass, so an established composition
    may be released before any other call: then the call that lets it go (a `program` that
    unbinds it; a failed one's undo always comes before its settlement, and a pass looks
    first) finds it, and it must still be held whole before that call runs.
    """

    def __init__(self, sim: SimulatedFabric) -> None:
        self.sim = sim
        self.state: Callable[[], DomainState | None] = lambda: None
        self.violations: list[str] = []
        self._pending: dict[str, tuple[Composition, int]] = {}  # -> (it, failures seen then)
        self._overlapping: set[str] = set()  # pending together: their undos share circuits
        self._undo_failures: list[FabricBinding | FabricCircuit] = []  # unbinds, removals
        self._letting_go: Counter[str] = Counter()  # compositions programs in flight unbind

    async def create_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        await self._audit(domain)
        await self.sim.create_circuit(domain, circuit, fence=fence)

    async def remove_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        await self._audit(domain)
        await self._undoing(circuit, self.sim.remove_circuit(domain, circuit, fence=fence))

    async def bind(self, domain: str, binding: FabricBinding, *, fence: int | None = None) -> None:
        await self._audit(domain)
        await self.sim.bind(domain, binding, fence=fence)

    async def unbind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> None:
        await self._audit(domain)
        await self._undoing(binding, self.sim.unbind(domain, binding, fence=fence))

    async def snapshot(self, domain: str, *, fence: int | None = None) -> FabricSnapshot:
        await self._audit(domain)
        return await self.sim.snapshot(domain, fence=fence)

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        # Change by change, so each is audited (and each undo step counted) as a call.
        unbound = Counter(
            {c.binding.composition_id for c in changes if c.op == "unbind" and c.binding}
        )
        self._letting_go.update(unbound)
        try:
            await program_in_turn(self, domain, changes, fence=fence, started=started)
        finally:
            self._letting_go.subtract(unbound)

    async def _undoing(self, what: FabricBinding | FabricCircuit, call: Awaitable[None]) -> None:
        try:
            await call
        except BaseException:  # an error, or cancelled at the engine's deadline
            self._undo_failures.append(what)
            raise

    async def _audit(self, domain: str) -> None:
        state = self.state()
        if state is None:
            return
        pending = [cid for cid, c in state.compositions.items() if c.state == "pending"]
        for cid in pending:
            self._pending.setdefault(cid, (state.compositions[cid], len(self._undo_failures)))
        if len(pending) > 1:
            self._overlapping.update(pending)
        settled = [cid for cid in self._pending if cid not in pending]
        if not settled:
            return
        held = await self.sim.snapshot(domain)
        bound = {(b.device, b.composition_id): b for b in held.bindings}
        known = {
            FabricCircuit(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port)
            for c in state.circuits.values()
        }
        for cid in settled:
            composition, since = self._pending.pop(cid)
            circuits = circuits_of(composition)
            # Established: still live, or let go by the call being made (released or expired).
            if cid in state.compositions or self._letting_go[cid] > 0:
                missing = [
                    b.device for b in bindings_of(composition) if bound.get((b.device, cid)) != b
                ]
                missing += [str(c) for c in circuits if c not in held.circuits]
                if missing:
                    self.violations.append(f"{cid} was established without {missing}")
                continue
            # Failed (a pending composition is neither released nor expired).
            if any(
                arg in circuits if isinstance(arg, FabricCircuit) else arg.composition_id == cid
                for arg in self._undo_failures[since:]
            ):
                continue
            left = [device for device, owner in bound if owner == cid]
            if cid not in self._overlapping:
                left += [str(c) for c in circuits if c in held.circuits and c not in known]
            if left:
                self.violations.append(f"{cid} failed but the fabric still holds {left}")


# ---- small random fabrics ----


@dataclass(frozen=True)
class Fabric:
    doc: Doc  # the import-topology body
    hosts: list[str]
    devices: dict[str, str]  # device id -> kind
    components: list[str]  # every node and link id
    ports: dict[str, str]  # "o1:<port>" -> the cable on it, for every cabled OCS port

    @property
    def targets(self) -> list[str]:
        """What faults, drains and recoveries may name: components and OCS ports."""
        return [*self.components, *self.ports]

    def resolve(self, ref: str) -> str:
        """The node or link a reference marks (an OCS port marks its cable)."""
        return self.ports.get(ref, ref)


@st.composite
def fabrics(draw: st.DrawFn) -> Fabric:
    """1-2 hosts, 1-3 switches in a row, usually an OCS with 4-6 ports, 3-6 devices behind a
    switch, the OCS or both, some with two cables (so paths can be rerouted); capacities small
    enough to run out."""
    hosts = ["h1", "h2"][: draw(st.integers(1, 2))]
    switches = ["s1", "s2", "s3"][: draw(st.integers(1, 3))]
    ocs_ports = draw(st.sampled_from([0, 4, 6, 6]))
    nodes: list[Doc] = [
        {"id": h, "kind": "host", "labels": {"rack": draw(st.sampled_from(["r1", "r2"]))}}
        for h in hosts
    ]
    nodes += [
        {"id": s, "kind": "switch", "latency_ns": draw(st.sampled_from([0, 150]))} for s in switches
    ]
    if ocs_ports:
        nodes.append({"id": "o1", "kind": "ocs", "ports": ocs_ports, "latency_ns": 30})
    devices: dict[str, str] = {}
    for i in range(draw(st.integers(3, 6))):
        kind = draw(st.sampled_from(["gpu", "gpu", "gpu", "memory", "nic"]))
        device_id = f"{kind[0]}{i}"
        devices[device_id] = kind
        node: Doc = {"id": device_id, "kind": "device", "device_kind": kind}
        node["labels"] = {"zone": draw(st.sampled_from(["eu", "us"]))}
        if kind == "gpu":
            node["model"] = draw(st.sampled_from(["A100", "H100"]))
            node["generation"] = draw(st.sampled_from([8, 9]))
        elif kind == "memory":
            node["capacity_gib"] = draw(st.sampled_from([64.0, 128.0]))
        nodes.append(node)

    links: list[Doc] = []
    free_ports = list(range(ocs_ports))

    def cable(a: str, b: str) -> bool:
        doc: Doc = {
            "id": f"l{len(links) + 1:02d}",
            "a": a,
            "b": b,
            "capacity_gbps": draw(st.sampled_from([50.0, 100.0, 200.0])),
            "latency_ns": draw(st.sampled_from([0, 50, 100])),
        }
        if b == "o1":
            if not free_ports:
                return False
            doc["b_port"] = free_ports.pop(0)
        links.append(doc)
        return True

    for h in hosts:
        first = draw(st.sampled_from(switches))
        cable(h, first)
        if len(switches) > 1 and draw(st.booleans()):
            cable(h, draw(st.sampled_from([s for s in switches if s != first])))
    for a, b in itertools.pairwise(switches):
        cable(a, b)
    if ocs_ports:
        for up in draw(st.lists(st.sampled_from(hosts + switches), min_size=1, max_size=2)):
            cable(up, "o1")
    for device_id in devices:
        # Devices behind the OCS only are reached over a circuit, which a host then owns.
        where = draw(st.sampled_from(["switch", "ocs", "both"] if ocs_ports else ["switch"]))
        ends = [] if where == "ocs" else [draw(st.sampled_from(switches))]
        if where == "switch" and len(switches) > 1 and draw(st.booleans()):
            ends.append(draw(st.sampled_from([s for s in switches if s != ends[0]])))
        if where != "switch":
            ends.append("o1")
        if not any([cable(device_id, end) for end in ends]):  # the OCS ran out of ports
            cable(device_id, switches[0])

    doc = {"nodes": nodes, "links": links}
    components = [n["id"] for n in nodes] + [lk["id"] for lk in links]
    ports = {f"o1:{lk['b_port']}": lk["id"] for lk in links if "b_port" in lk}
    return Fabric(doc=doc, hosts=hosts, devices=devices, components=components, ports=ports)


def rarely(values: list[Any]) -> st.SearchStrategy[Any]:
    """The first value nine times in ten, else one of the others."""
    return st.sampled_from([values[0]] * 9 * (len(values) - 1) + values[1:])


@st.composite
def compose_bodies(draw: st.DrawFn, fabric: Fabric) -> Doc:
    """Mostly satisfiable requests; each bound or amount is sometimes out of reach (absent
    kinds, too many devices, too much bandwidth or memory, one hop, too little latency, a host
    or device that does not exist), so about a third cannot be served."""
    body: Doc = {}
    if draw(rarely([False, True])):
        pool = [*sorted(fabric.devices), "ghost-dev"]
        body["device_ids"] = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2))
        body["device_ids"] = list(dict.fromkeys(body["device_ids"]))
    else:
        kinds = sorted(set(fabric.devices.values()))
        entries = []
        for _ in range(draw(st.sampled_from([1, 1, 2]))):
            kind = draw(
                rarely([st.sampled_from(kinds), st.just("accelerator")]).flatmap(lambda s: s)
            )
            entry: Doc = {
                "kind": kind,
                "count": draw(rarely([1, 2, 4])),
                "bandwidth_gbps": draw(rarely([0.0, 25.0, 80.0, 300.0])),
            }
            if kind == "memory":
                entry["capacity_gib"] = draw(rarely([16.0, 32.0, 200.0]))
            if kind == "gpu" and draw(rarely([False, True])):
                entry["min_generation"] = 9
            entries.append(entry)
        body["devices"] = entries
    where = draw(rarely(["host", "selector", "ghost"]))
    if where == "selector":
        body["host_selector"] = {"labels": {"rack": draw(st.sampled_from(["r1", "r2"]))}}
    else:
        body["host"] = "ghost-host" if where == "ghost" else draw(st.sampled_from(fabric.hosts))
    constraints: Doc = {"isolation": draw(st.sampled_from(["shared", "shared", "exclusive"]))}
    max_hops = draw(rarely([None, 1, 4, 6]))
    if max_hops is not None:
        constraints["max_hops"] = max_hops
    max_latency = draw(rarely([None, 100, 400]))
    if max_latency is not None:
        constraints["max_latency_ns"] = max_latency
    zone = draw(rarely([None, "eu", "us"]))
    if zone is not None:
        constraints["labels"] = {"zone": zone}
    body["constraints"] = constraints
    lease = draw(st.sampled_from([None, 30, 300, 3600]))
    if lease is not None:
        body["lease_seconds"] = lease
    return body


# ---- reply checks (ARCHITECTURE section 3) ----


def ok_result(reply: dict[str, Any]) -> Any:
    assert set(reply) == {"ok", "result", "position", "replayed"}, reply
    assert reply["ok"] is True and isinstance(reply["result"], dict), reply
    assert isinstance(reply["position"], int) and reply["position"] >= 0, reply
    assert isinstance(reply["replayed"], bool), reply
    return reply["result"]


def error_of(reply: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    assert set(reply) == {"ok", "error"} and reply["ok"] is False, reply
    error: dict[str, Any] = reply["error"]
    assert set(error) == {"code", "message", "details"}, reply
    assert error["code"] in ERROR_CODES and error["code"] in allowed, reply
    assert isinstance(error["message"], str) and error["message"], reply
    assert isinstance(error["details"], dict), reply
    return error


def encoded(state: DomainState) -> bytes:
    return msgspec.json.encode(state)


def parts_of(composition: Composition) -> list[str]:
    """Everything its paths pass, host and devices included."""
    return [p for b in composition.bindings for p in (*b.path, *b.links)]


def part(state: DomainState, component: str) -> NodeState | LinkState:
    found = state.component(component)
    assert found is not None, f"{component} is not in the fabric"
    return found


# ---- the machine ----


class OrchestrationMachine(RuleBasedStateMachine):
    """One engine per example; the test function sets the server URLs on a subclass."""

    nats_url: str
    database: Database

    compositions = Bundle("compositions")

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.cleanup = contextlib.ExitStack()  # teardown undoes `start`, last step first
        self.cleanup.callback(self.runner.close)
        self.h: Harness
        self.started = False
        self.fabric: Fabric
        self.sim: SimulatedFabric
        self.audit: SettlementAudit
        self.clock = ManualClock(START)
        self.requests = 0
        self.owners: dict[str, str] = {}  # every composition id ever made -> tenant
        self.last: tuple[str, str | None, str, Doc, dict[str, Any]] | None = None

    def run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    # ---- setup and teardown ----

    @initialize(
        target=compositions,
        data=st.data(),
        fabric=fabrics(),
        seed=st.integers(0, 2**16),
        failure_rate=st.sampled_from([0.0, 0.03, 0.06]),
    )
    def start(self, data: st.DataObject, fabric: Fabric, seed: int, failure_rate: float) -> Any:
        """Serve the fabric and compose a few things, so every example has something to
        release, expire, fault and drain under."""
        self.fabric = fabric
        self.sim = SimulatedFabric(seed=seed, failure_rate=failure_rate)
        self.audit = SettlementAudit(self.sim)
        schema, prefix = unique_schema_name(), unique_subject_prefix()
        self.run(create_schema(self.database, schema))
        self.cleanup.callback(lambda: self.run(drop_schema(self.database, schema)))
        self.cleanup.callback(lambda: self.run(delete_relay_targets(self.nats_url, prefix)))
        engine = serving(
            self.nats_url,
            self.database.url,
            schema,
            prefix,
            clock=self.clock,
            fabric=self.audit,
            saga_deadline=SAGA_DEADLINE,
        )
        self.h = self.run(engine.__aenter__())
        self.cleanup.callback(lambda: self.run(engine.__aexit__(None, None, None)))
        self.started = True
        self.audit.state = lambda: self.h.engine.state(DOMAIN)
        ok_result(self.send("admin", None, "import-topology", fabric.doc))
        made: list[str] = []
        for _ in range(data.draw(st.integers(2, 5), label="composes")):
            tenant = data.draw(st.sampled_from(TENANTS), label="tenant")
            body = data.draw(compose_bodies(fabric), label="body")
            self.sabotage(*data.draw(SABOTAGE, label="sabotage"))
            made += self.composed(tenant, body)
        return multiple(*made)

    def teardown(self) -> None:
        self.cleanup.close()

    # ---- talking to the engine ----

    def send(
        self, family: str, tenant: str | None, verb: str, body: Doc, request_id: str | None = None
    ) -> dict[str, Any]:
        """One request over NATS; the machine's next request id unless one is given."""
        body = self.identified(body, request_id)
        reply = self.run(self.request(family, tenant, verb, body))
        self.last = (family, tenant, verb, body, reply)
        return reply

    def identified(self, body: Doc, request_id: str | None = None) -> Doc:
        """`body` with a request id that is the same in every run of an example (ids name
        compositions, and their order decides which is repaired first)."""
        if request_id is None:
            self.requests += 1
            request_id = f"r{self.requests}"
        return {"request_id": request_id, **body}

    async def request(
        self, family: str, tenant: str | None, verb: str, body: Doc
    ) -> dict[str, Any]:
        if family == "admin":
            return await self.h.client.admin(DOMAIN, verb, body)
        assert tenant is not None
        return await self.h.client.intent(DOMAIN, tenant, verb, body)

    @property
    def state(self) -> DomainState:
        state = self.h.engine.state(DOMAIN)
        assert state is not None
        return state

    # ---- rules ----

    @rule(target=compositions, data=st.data(), tenant=st.sampled_from(TENANTS), how=SABOTAGE)
    def compose(self, data: st.DataObject, tenant: str, how: tuple[str | None, str, bool]) -> Any:
        body = data.draw(compose_bodies(self.fabric), "body")
        self.sabotage(*how)
        return multiple(*self.composed(tenant, body))

    def sabotage(self, kind: str | None, op: str, applied: bool) -> None:
        """Make the next `op` fail or hang (after taking effect, if `applied`), so the compose
        about to be sent fails and what its saga programmed must be undone. A fault its saga
        does not meet (a rejected compose, no circuit to create) waits for a later call."""
        if kind is not None:
            script = self.sim.fail_next if kind == "fail" else self.sim.hang_next
            script(op, applied=applied)

    @rule(target=compositions, data=st.data(), how=SABOTAGE)
    def compose_two_at_once(self, data: st.DataObject, how: tuple[str | None, str, bool]) -> Any:
        """Two composes in flight together: their sagas may run in one pass and share a new
        circuit of their host, and one may fail while the other succeeds."""
        asks = [
            (
                data.draw(st.sampled_from(TENANTS), label="tenant"),
                self.identified(data.draw(compose_bodies(self.fabric), label="body")),
            )
            for _ in range(2)
        ]
        self.sabotage(*how)

        async def both() -> list[dict[str, Any]]:
            return list(
                await asyncio.gather(
                    *(self.request("intent", tenant, "compose", body) for tenant, body in asks)
                )
            )

        self.last = None
        made: list[str] = []
        for (tenant, _), reply in zip(asks, self.run(both()), strict=True):
            made += self.compose_answered(tenant, reply, alone=False)
        return multiple(*made)

    @rule(
        target=compositions,
        data=st.data(),
        tenant=st.sampled_from(TENANTS),
        mark=st.sampled_from(["failed", "degraded", "drain"]),
        pick=st.integers(0, 20),
    )
    def compose_while_a_part_fails(
        self, data: st.DataObject, tenant: str, mark: str, pick: int
    ) -> Any:
        """A part of the new composition's paths (the `pick`-th) fails or is drained with
        force while its saga is still programming the fabric (each operation takes a little
        while here): it must come out impaired or repaired at activation, or failed, never
        active over a broken part."""
        body = self.identified(data.draw(compose_bodies(self.fabric), "body"))
        cid = composition_id(DOMAIN, tenant, body["request_id"])

        async def both() -> tuple[dict[str, Any], dict[str, Any] | None]:
            composing = asyncio.create_task(self.request("intent", tenant, "compose", body))
            while not composing.done():
                pending = self.state.compositions.get(cid)
                if pending is not None:
                    parts = parts_of(pending)
                    component = parts[pick % len(parts)]
                    verb, marking = (
                        ("drain", {"id": component, "force": True})
                        if mark == "drain"
                        else ("report-fault", {"component": component, "state": mark})
                    )
                    marked = await self.request("admin", None, verb, self.identified(marking))
                    return await composing, marked
                await asyncio.sleep(0.001)
            return await composing, None  # refused: nothing to break

        self.sim.latency = {"create_circuit": 0.02, "bind": 0.02}
        try:
            composed, marked = self.run(both())
        finally:
            self.sim.latency = 0.0
        self.last = None
        if marked is not None:
            ok_result(marked)
        made = self.compose_answered(tenant, composed, alone=False)
        if made and any(
            type(e).__name__ == "CompositionImpaired"
            for e in self.run(self.events_caused_by(settle_request_id(made[0])))
        ):
            event("compose: a part failed while its saga ran")
        return multiple(*made)

    async def events_caused_by(self, request_id: str) -> list[Any]:
        return [r.event() async for r in self.h.store.read(DOMAIN) if r.causation_id == request_id]

    def composed(self, tenant: str, body: Doc) -> list[str]:
        """Compose and check the answer; the composition ids it made (live or failed)."""
        return self.compose_answered(tenant, self.send("intent", tenant, "compose", body))

    def compose_answered(self, tenant: str, reply: dict[str, Any], alone: bool = True) -> list[str]:
        """Check a compose reply (against the state too, when nothing else ran meanwhile);
        the composition ids it made (live or failed)."""
        event(f"compose: {reply['result']['state'] if reply['ok'] else reply['error']['code']}")
        if reply["ok"]:
            result = ok_result(reply)
            assert set(result) == {"composition_id", "host", "state", "expires_at", "devices"}
            cid = result["composition_id"]
            self.owners[cid] = tenant
            assert result["state"] in ("active", "impaired"), reply
            live = self.state.compositions[cid]
            if alone:
                assert result["state"] == live.state
                assert [(d["id"], d["path"]) for d in result["devices"]] == [
                    (b.device, b.path) for b in live.bindings
                ]
            for device in result["devices"]:
                assert device["path"][0] == result["host"] and device["path"][-1] == device["id"]
            return [cid]
        error = error_of(
            reply, {"invalid", "not_found", "no_capacity", "no_path", "failed", "unavailable"}
        )
        details = error["details"]
        if error["code"] in ("no_capacity", "no_path"):
            assert isinstance(details.get("funnel"), list), reply
        if error["code"] == "failed":  # the saga failed and was rolled back: it says where
            cid = details["composition_id"]
            self.owners[cid] = tenant
            event(f"compose failed at {details['step']}")
            assert details["step"] in ("create_circuit", "bind"), reply
            assert details["target"], reply
            assert cid not in self.state.compositions, reply
            return [cid]
        if error["code"] == "unavailable":
            # Still being established when the reply was due; checked once settled.
            cid = details["composition_id"]
            self.owners[cid] = tenant
            event("compose failed at no settlement in time")
            return [cid]
        return []

    @rule(target=compositions, data=st.data(), tenant=st.sampled_from(TENANTS), how=SABOTAGE)
    def reserve_then_apply(
        self, data: st.DataObject, tenant: str, how: tuple[str | None, str, bool]
    ) -> Any:
        """Reserve what a compose would take, then apply it: the same devices, settled by the
        saga as a compose is (or failed and undone)."""
        body = data.draw(compose_bodies(self.fabric), "body")
        reply = self.send("intent", tenant, "reserve", {"manifest": body})
        event(f"reserve: {'ok' if reply['ok'] else reply['error']['code']}")
        if not reply["ok"]:
            error_of(reply, {"invalid", "not_found", "no_capacity", "no_path"})
            return multiple()
        made = ok_result(reply)
        rid, devices = made["reservation_id"], [d["id"] for d in made["devices"]]
        state = self.state
        assert rid in state.reservations
        assert not set(devices) & set(state.device_owner)
        self.sabotage(*how)
        applied = self.send("intent", tenant, "apply", {"reservation_id": rid})
        made_ids = self.compose_answered(tenant, applied)
        if applied["ok"]:
            assert [d["id"] for d in applied["result"]["devices"]] == devices
        assert rid not in self.state.reservations
        return multiple(*made_ids)

    @rule(data=st.data(), tenant=st.sampled_from(TENANTS), seconds=st.sampled_from([30, 600]))
    def reserve_and_hold(self, data: st.DataObject, tenant: str, seconds: int) -> None:
        """A reservation left to expire (advance_clock_and_expire): its devices are nobody
        else's meanwhile, and the hardware is not touched."""
        body = data.draw(compose_bodies(self.fabric), "body")
        reply = self.send(
            "intent", tenant, "reserve", {"manifest": body, "duration_seconds": seconds}
        )
        if reply["ok"]:
            for device in ok_result(reply)["devices"]:
                assert device["id"] not in self.state.device_owner
        else:
            error_of(reply, {"invalid", "not_found", "no_capacity", "no_path"})

    @rule(cid=compositions, intruder=st.integers(0, 5))
    def release(self, cid: str, intruder: int) -> None:
        owner = self.owners[cid]
        tenant = owner if intruder else next(t for t in TENANTS if t != owner)
        live = self.state.compositions.get(cid)
        reply = self.send("intent", tenant, "release", {"composition_id": cid})
        if tenant != owner or live is None:  # another's is answered as an unknown id
            error_of(reply, {"not_found"})
        elif reply["ok"]:
            result = ok_result(reply)
            assert result["state"] == "released" and cid not in self.state.compositions
            assert result["devices"] == [b.device for b in live.bindings]
        else:
            assert live.state == "pending", reply
            error_of(reply, {"conflict"})

    @rule(cid=compositions, seconds=st.sampled_from([30, 600, 7200]))
    def extend(self, cid: str, seconds: int) -> None:
        live = self.state.compositions.get(cid)
        body = {"composition_id": cid, "lease_seconds": seconds}
        reply = self.send("intent", self.owners[cid], "extend", body)
        if live is None:
            error_of(reply, {"not_found"})
            return
        result = ok_result(reply)
        base = max(self.clock.now(), live.expires_at) if live.expires_at else self.clock.now()
        expected = base + timedelta(seconds=seconds)
        assert datetime.fromisoformat(result["expires_at"]) == expected, reply
        assert self.state.compositions[cid].expires_at == expected

    @rule(seconds=st.sampled_from([20, 300, 3600, 7200]))
    def advance_clock_and_expire(self, seconds: int) -> None:
        self.clock.advance(seconds)
        self.last = None
        for raw in self.run(self.h.engine.expire_due_leases()):
            # If the lease keeper ended the same leases first, this is its answer replayed.
            result = ok_result(msgspec.json.decode(raw))
            assert all(cid not in self.state.compositions for cid in result["expired"])
        now = self.clock.now()
        assert all(r.expires_at > now for r in self.state.reservations.values())
        assert not [
            cid
            for cid, c in self.state.compositions.items()
            if c.expires_at is not None and c.expires_at <= now and c.state != "pending"
        ]

    @rule(data=st.data(), health=st.sampled_from(["failed", "degraded"]))
    def report_fault(self, data: st.DataObject, health: str) -> None:
        ref = data.draw(st.sampled_from(self.fabric.targets), label="component")
        self.check_marked(ref, "report-fault", {"component": ref, "state": health})
        assert part(self.state, self.fabric.resolve(ref)).health == health

    @rule(data=st.data())
    def recover(self, data: st.DataObject) -> None:
        down = self.targets_where(lambda c: c.health != "healthy")
        ref = data.draw(st.sampled_from(down or self.fabric.targets), label="component")
        self.check_marked(ref, "report-fault", {"component": ref, "state": "healthy"})
        assert part(self.state, self.fabric.resolve(ref)).health == "healthy"

    @rule(data=st.data(), force=st.booleans())
    def drain(self, data: st.DataObject, force: bool) -> None:
        ref = data.draw(st.sampled_from(self.fabric.targets), label="component")
        before = self.state
        reply = self.check_marked(ref, "drain", {"id": ref, "force": force})
        if reply["ok"]:
            assert part(self.state, self.fabric.resolve(ref)).drained
        else:  # only an exclusive composition that cannot move stops a drain, unless forced
            assert not force and encoded(self.state) == encoded(before)
            assert before.compositions[reply["error"]["details"]["composition"]].exclusive

    @rule(data=st.data())
    def undrain(self, data: st.DataObject) -> None:
        drained = self.targets_where(lambda c: c.drained)
        ref = data.draw(st.sampled_from(drained or self.fabric.targets), label="id")
        self.check_marked(ref, "undrain", {"id": ref})
        assert not part(self.state, self.fabric.resolve(ref)).drained

    def targets_where(self, marked: Callable[[NodeState | LinkState], bool]) -> list[str]:
        state = self.state
        return [r for r in self.fabric.targets if marked(part(state, self.fabric.resolve(r)))]

    @rule(
        kind=st.sampled_from(["fail", "hang"]),
        op=st.sampled_from(["unbind", "remove_circuit", "bind", "create_circuit"]),
        applied=st.booleans(),
    )
    def script_fabric_fault(self, kind: str, op: str, applied: bool) -> None:
        """The next `op` fails or hangs (after taking effect, if `applied`): an undo, cleanup
        or repair that meets it leaves work for the next pass."""
        script = self.sim.fail_next if kind == "fail" else self.sim.hang_next
        script(op, applied=applied)

    @precondition(lambda self: self.last is not None)
    @rule()
    def resend_the_last_request(self) -> None:
        """The same request_id and body again: the first answer, marked as a replay."""
        assert self.last is not None
        family, tenant, verb, body, first = self.last
        again = self.send(family, tenant, verb, body, request_id=body["request_id"])
        self.last = None  # once is enough
        if first.get("ok"):
            assert again == {**first, "replayed": True}, (first, again)
        elif first["error"]["code"] in ("no_capacity", "no_path") or (
            "step" in first["error"]["details"]
        ):
            # Recorded rejections and failed sagas are stored answers, marked as replayed.
            error = first["error"]
            marked = {
                **first,
                "error": {**error, "details": {**error["details"], "replayed": True}},
            }
            assert again == marked, (first, again)
        else:
            error_of(again, set(ERROR_CODES))

    def check_marked(self, ref: str, verb: str, body: Doc) -> dict[str, Any]:
        reply = self.send("admin", None, verb, body)
        if reply["ok"]:
            result = ok_result(reply)
            assert result["component"] == ref, reply
            assert result["link"] == (self.fabric.ports.get(ref)), reply
            state = self.state
            for cid in result["impaired"]:
                assert state.compositions[cid].state == "impaired", reply
        else:
            error_of(reply, {"conflict"})
        return reply

    # ---- after every step ----

    @invariant()
    def everything_agrees(self) -> None:
        if self.started:  # hypothesis checks invariants before `start` too
            self.run(self.check_quiescent())

    async def check_quiescent(self) -> None:
        """Wait until nothing moves, then compare log, replay, hardware and projections. If
        something committed meanwhile (the lease keeper), look again."""
        h = self.h
        sync = h.engine.fabric_sync(DOMAIN)
        assert sync is not None
        for _ in range(10):
            await asyncio.wait_for(sync.wait_idle(), QUIET_TIMEOUT)
            head = await h.store.head(DOMAIN)
            state = self.state
            now = self.clock.now()
            if any(
                c.expires_at is not None and c.expires_at <= now and c.state != "pending"
                for c in state.compositions.values()
            ):
                # Due while it was still being established: the keeper would end it any time.
                await h.engine.expire_due_leases()
                continue
            assert await h.followers.wait_for(
                "projections", DOMAIN, head.position, timeout=QUIET_TIMEOUT
            )
            await self.check_replay(state)
            await self.check_hardware(state)
            await self.check_projections(state)
            check_state(state)
            if await h.store.head(DOMAIN) == head:
                return
        raise AssertionError("the engine did not come to rest")

    async def check_replay(self, state: DomainState) -> None:
        folded = DomainState(domain=DOMAIN)
        async for recorded in self.h.store.read(DOMAIN):
            folded = evolve(folded, recorded.event())
        assert encoded(folded) == encoded(state), "replaying the log gives another state"

    async def check_hardware(self, state: DomainState) -> None:
        assert not self.audit.violations, self.audit.violations
        snapshot = await self.sim.snapshot(DOMAIN)
        plan = reconcile(snapshot, state)
        assert plan.in_step, plan
        assert not plan.pending, plan
        circuits = {
            FabricCircuit(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port)
            for c in state.circuits.values()
        }
        assert set(snapshot.circuits) == circuits
        bindings = [b for c in state.compositions.values() for b in bindings_of(c)]
        key = lambda b: (b.device, b.composition_id)  # noqa: E731
        assert sorted(snapshot.bindings, key=key) == sorted(bindings, key=key)

    async def check_projections(self, state: DomainState) -> None:
        reply = await self.h.client.query(DOMAIN, "connections")
        rows = ok_result(reply)["connections"]
        got = sorted(
            (
                r["device"],
                r["host"],
                r["composition_id"],
                r["tenant"],
                r["path"],
                r["bandwidth_gbps"],
                r["capacity_gib"],
                r["why"]["request_id"],
            )
            for r in rows
        )
        expected = sorted(
            (
                b.device,
                c.host,
                c.id,
                c.tenant,
                b.path,
                b.bandwidth_gbps,
                b.capacity_gib,
                c.request.request_id,
            )
            for c in state.compositions.values()
            for b in c.bindings
        )
        assert got == expected

        # `free`: usable devices nobody holds or reserves whole (a pool named in `device_ids`
        # is taken whole), pools with GiB to spare; worked out from the bindings of the
        # compositions and reservations, not the indexes.
        held = [b for c in state.compositions.values() for b in c.bindings]
        held += [b for r in state.reservations.values() for b in r.devices]
        whole = {b.device for b in held if b.capacity_gib is None}
        sliced: dict[str, float] = defaultdict(float)  # by compositions and reservations
        composed: dict[str, float] = defaultdict(float)  # by compositions (the projection's)
        for b in held:
            if b.capacity_gib is not None:
                sliced[b.device] += b.capacity_gib
        for c in state.compositions.values():
            for b in c.bindings:
                if b.capacity_gib is not None:
                    composed[b.device] += b.capacity_gib
        expected_free: dict[str, float | None] = {}
        for device_id, node in state.nodes.items():
            if node.spec.kind != "device" or not usable(node) or device_id in whole:
                continue
            if node.spec.device_kind == "memory":
                left = (node.spec.capacity_gib or 0.0) - sliced[device_id]
                if left > 1e-9:
                    expected_free[device_id] = round(left, 6)
            else:
                expected_free[device_id] = None
        free = ok_result(await self.h.client.query(DOMAIN, "free"))["devices"]
        got_free = {d["id"]: round(d["free_gib"], 6) if "free_gib" in d else None for d in free}
        assert got_free == expected_free

        # The devices projection: every component's marks, every device's holder and slices.
        pool = self.h.projections.pool
        marks = {
            r["id"]: (r["health"], r["drained"], r["detail"])
            for r in await pool.fetch(
                "SELECT id, health, drained, detail FROM proj_components WHERE domain = $1",
                DOMAIN,
            )
        }
        assert marks == {
            c: (part(state, c).health, part(state, c).drained, part(state, c).detail)
            for c in self.fabric.components
        }
        holders = {
            r["device"]: (r["owner"], round(r["memory_used_gib"] or 0.0, 6))
            for r in await pool.fetch(
                "SELECT device, owner, memory_used_gib FROM proj_devices WHERE domain = $1",
                DOMAIN,
            )
        }
        assert holders == {
            d: (state.device_owner.get(d), round(composed[d], 6)) for d in self.fabric.devices
        }

        # The compositions projection: live ones in their state, the rest released or failed.
        records = await pool.fetch(
            "SELECT composition_id, state, expires_at, devices, impaired_by"
            " FROM proj_compositions WHERE domain = $1",
            DOMAIN,
        )
        projected = {r["composition_id"]: r for r in records}
        for cid in self.owners:
            row = projected.get(cid)
            live = state.compositions.get(cid)
            if live is None:
                assert row is not None and row["state"] in ("released", "failed"), cid
                continue
            assert row is not None and row["state"] == live.state, cid
            assert row["expires_at"] == live.expires_at, cid
            devices = [(d["id"], d["path"]) for d in msgspec.json.decode(row["devices"])]
            assert devices == [(b.device, b.path) for b in live.bindings], cid
            # What `why` and `composition` say impairs it: exactly what the state says.
            impaired_by = {i["component"] for i in msgspec.json.decode(row["impaired_by"])}
            assert impaired_by == set(live.impaired_by), (cid, impaired_by, live.impaired_by)


def check_state(state: DomainState) -> None:
    """The placement invariants, plus what orchestration promises about health."""
    check_invariants(state)
    for switch, holders in state.exclusive_tenants.items():
        assert set(state.switch_tenants.get(switch, {})) == set(holders), switch
        assert len(holders) == 1, switch
    for composition in state.compositions.values():
        assert composition.state in ("active", "impaired"), composition.id
        down = [p for p in parts_of(composition) if not usable(part(state, p))]
        if composition.state == "active":
            assert not down, (composition.id, down)
            assert not composition.impaired_by, composition.id
        else:
            assert composition.impaired_by, composition.id
            assert down, f"{composition.id} is impaired but every part of it is up"
            # It names only what lies on its paths: a partial repair drops what it moved off.
            off = [c for c in composition.impaired_by if not composition.uses(c)]
            assert not off, f"{composition.id} names {off}, which no path of it passes"


def test_orchestration_keeps_log_hardware_and_projections_in_step(
    nats_url: str, database: Database
) -> None:
    machine = type(
        "Orchestration",
        (OrchestrationMachine,),
        {"nats_url": nats_url, "database": database},
    )
    run_state_machine_as_test(machine, settings=SETTINGS)
