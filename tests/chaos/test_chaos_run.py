"""The bounded chaos run (issue 9 item 10): faults under load, then an audit of the raw log.

Real processes throughout. The engine is `trellis up` (this checkout's code) in a process of its
own, over a 3-node NATS cluster of the test's own (JetStream replicas 3: the stream
TRELLIS_EVENTS lives on every node) and a Postgres of the test's own, which the run restarts.
Its simulated fabric keeps the hardware's state in a file, as hardware outlives an engine.

Load: CLIENTS clients in four tenants compose and release, paced, on a small hall where GPUs,
memory, host cables and OCS ports are all scarce, so composes race for them and some are
refused. A client resends on a timeout, on no responders and on `unavailable`, with the same
request_id, as the contract says, and keeps every final answer it gets. The faults (FAULTS)
come one after another, each once the system has recovered from the one before (the stream
has a leader and current copies on every running node) and the load has moved on:

- `writer`: SIGKILL the engine that writes the domain, then start another `trellis up`;
- `nats`: SIGKILL the NATS node the engine's intake is connected to, made the stream's leader
  first; start it again once the other two have elected a leader and served the load;
- `postgres`: stop Postgres (a fast shutdown drops every connection) until the load is told
  `unavailable`, then start it again.

The clients go on until the faults are over, then a few cycles more, within a fixed cap.

Then tests/chaos/checker.py audits what an outsider can read: the rows of trellis_events and
trellis_requests, the stream's messages and the clients' answers, never the engine's fold. The
run prints its table of zeros (tests/zeros.py) and fails if any of them is not zero.

ENGINES engines run at once (two): one writes the domain, by its writer lease; the `writer` fault
kills whichever one holds that lease (`Fleet.writer()` asks the lease table), the other takes
the domain over, and a fresh engine is started in the dead one's place. The run records how
long each takeover took (the contract: within 5 s of a writer's death, within 10 s of its
pause).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats.errors
import pytest
import pytest_asyncio
from checker import PROMISES, Ack, LogRow, check, read_log, read_stream
from engines import REPO, EngineProcess, Fleet, client_at, fleet_env
from nats.aio.client import Client as NATS
from zeros import zeros

from trellis.adapters.embedded.cluster import ClusterNode, NatsCluster
from trellis.adapters.embedded.postgres_server import EmbeddedPostgres
from trellis.adapters.nats.client import TrellisClient

DOMAIN = "hall"
PREFIX = "trellis"  # the cluster is the run's own: the real names TRELLIS_EVENTS, TRELLIS_STATE
STREAM = "TRELLIS_EVENTS"
ENGINES = 2
TAKEOVER_WITHIN_S = 5.0  # ARCHITECTURE §10: a standby takes a dead writer's domain over
# ARCHITECTURE §10: a paused (SIGSTOP) writer costs at most its detection window, 10 s.
PAUSED_TAKEOVER_WITHIN_S = 10.0
TENANTS = ("acme", "globex", "initech", "umbrella")
CLIENTS = 8
FAULTS = ("writer", "nats", "pause", "postgres", "writer")
# Final answers the load must get before each fault and after each recovery.
PROGRESS = 15
# Each client composes and releases until the faults are over, then TAIL_CYCLES more: at most
# MAX_CYCLES in all, so the count of intents is bounded whatever the machine's speed.
TAIL_CYCLES = 3
MAX_CYCLES = 150
HOLD_S = 0.4  # the longest a client holds a composition before releasing it
PAUSE_S = (0.05, 0.15)  # a client's pause between cycles: a paced load, not a flood
REQUEST_TIMEOUT_S = 2.0
# Bounds only a hang reaches: one intent's resends, one wait for the system, the whole run.
ANSWER_WITHIN_S = 60.0
WAIT_WITHIN_S = 60.0
RUN_WITHIN_S = 240.0
REFUSALS = ("no_capacity", "no_path")  # what contention may answer; anything else is unexpected

TABLE = "chaos run (issue 9 item 10)"
LEFT_OVER = ("compositions left at the end", "circuits left at the end")
UNEXPECTED = "unexpected answers"
# Fencing (issue 9 item 7): no event committed under an epoch older than one before it, and the
# simulated hardware holds exactly what the log says (`trellis fabric check`).
STALE_COMMITS = "commits under a superseded writer epoch"
HARDWARE_UNLIKE = "hardware unlike the log"
ASLEEP_S = 2.5  # how long past the end of its lease the paused writer sleeps
POLL_S = 0.05  # how often a wait for a takeover looks at the lease table


def contended_hall(racks: int = 4) -> dict[str, Any]:
    """Racks of a spine switch, two hosts, a leaf of three GPUs and a memory pool of 1 TiB; the
    spines joined by one OCS, one port each. Twelve GPUs for eight clients; a host cable carries
    three GPUs' bandwidth; a GPU in another rack needs a circuit, and an OCS port is in one
    circuit, owned by one host, at a time."""
    nodes: list[dict[str, Any]] = [{"id": "ocs-1", "kind": "ocs", "ports": racks, "latency_ns": 30}]
    links: list[dict[str, Any]] = []

    def link(id: str, a: str, b: str, gbps: float, **ports: int) -> None:
        links.append({"id": id, "a": a, "b": b, "capacity_gbps": gbps, "latency_ns": 50, **ports})

    for r in range(racks):
        spine, leaf, pool = f"r{r}-spine", f"r{r}-leaf", f"r{r}-mem"
        nodes += [
            {"id": spine, "kind": "switch", "latency_ns": 150},
            {"id": leaf, "kind": "switch", "latency_ns": 150},
            {"id": pool, "kind": "device", "device_kind": "memory", "capacity_gib": 1024},
        ]
        link(f"{spine}-up", spine, "ocs-1", 200, b_port=r)
        link(f"{leaf}-l", spine, leaf, 128)
        link(f"{pool}-l", spine, pool, 64)
        for h in range(2):
            nodes.append({"id": f"r{r}-h{h}", "kind": "host", "labels": {"rack": f"r{r}"}})
            link(f"r{r}-h{h}-l", f"r{r}-h{h}", spine, 96)
        for g in range(3):
            gpu = f"r{r}-g{g}"
            nodes.append({"id": gpu, "kind": "device", "device_kind": "gpu", "model": "H100"})
            link(f"{gpu}-l", leaf, gpu, 64)
    return {"nodes": nodes, "links": links}


HOSTS = [n["id"] for n in contended_hall()["nodes"] if n["kind"] == "host"]


def composition(rng: random.Random) -> dict[str, Any]:
    """A compose body: GPUs, a memory slice, or both, on a random host."""
    gpus = {"kind": "gpu", "count": rng.choice([1, 2]), "bandwidth_gbps": 32}
    memory = {"kind": "memory", "capacity_gib": rng.choice([256, 512]), "bandwidth_gbps": 16}
    devices = rng.choice([[gpus], [gpus], [memory], [{**gpus, "count": 1}, memory]])
    return {"host": rng.choice(HOSTS), "devices": devices}


def held(log: list[LogRow]) -> Counter[str]:
    """What the log's compositions reserved, by kind, and the circuits they made."""
    kinds: Counter[str] = Counter()
    for row in log:
        if row.type == "DevicesReserved":
            kinds.update(b["kind"] for b in row.payload()["devices"])
        elif row.type == "CircuitCreated":
            kinds["OCS circuits"] += 1
    return kinds


# ---- the load: clients that resend as the contract says ----


class Load:
    """Every final answer the clients got, and how often they had to ask again."""

    def __init__(self) -> None:
        self.acks: list[Ack] = []
        self.resends: Counter[str] = Counter()
        self.progress = asyncio.Event()
        self.faults_over = False

    async def ask(
        self, client: TrellisClient, actor: str, verb: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Send until the answer is final: not a timeout, no responders or `unavailable`."""
        family = f"admin.{DOMAIN}" if actor == "operator" else f"intent.{DOMAIN}.{actor}"
        payload = msgspec.json.encode(body)
        deadline = time.monotonic() + ANSWER_WITHIN_S
        while True:
            try:
                reply = await client.raw(f"{family}.{verb}", payload)
            except nats.errors.NoRespondersError:
                self.resends["no responders"] += 1
            except (TimeoutError, nats.errors.Error):
                self.resends["a timeout or a lost connection"] += 1
            else:
                if reply.get("error", {}).get("code") != "unavailable":
                    self.acks.append(Ack(DOMAIN, actor, verb, body["request_id"], reply))
                    self.progress.set()
                    return reply
                self.resends["unavailable"] += 1
                self.progress.set()
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{actor} {verb} {body['request_id']} unanswered for {ANSWER_WITHIN_S}s"
                )
            await asyncio.sleep(0.05)

    async def until(self, done: Callable[[], bool], what: str) -> None:
        """Until `done()` holds, looked at after every answer; fails naming `what` otherwise."""
        deadline = time.monotonic() + WAIT_WITHIN_S
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {what} within {WAIT_WITHIN_S}s")
            self.progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress.wait(), left)

    async def moved_on(self, what: str) -> None:
        """Until the clients have got PROGRESS more final answers."""
        mark = len(self.acks)
        await self.until(lambda: len(self.acks) >= mark + PROGRESS, f"{PROGRESS} answers {what}")


async def client_loop(client: TrellisClient, number: int, load: Load) -> None:
    """Compose, hold a moment, release, pause; until TAIL_CYCLES cycles after the faults are
    over. Request ids name the tenant, the client and the cycle."""
    rng = random.Random(number)
    tenant = TENANTS[number % len(TENANTS)]
    tail = 0
    for cycle in range(MAX_CYCLES):
        if load.faults_over:
            if tail == TAIL_CYCLES:
                return
            tail += 1
        rid = f"{tenant}-{number}-{cycle}"
        body = {"request_id": f"{rid}-c", **composition(rng)}
        composed = await load.ask(client, tenant, "compose", body)
        if composed["ok"]:
            await asyncio.sleep(rng.uniform(0, HOLD_S))
            cid = composed["result"]["composition_id"]
            await load.ask(
                client, tenant, "release", {"request_id": f"{rid}-r", "composition_id": cid}
            )
        await asyncio.sleep(rng.uniform(*PAUSE_S))
    pytest.fail(f"the faults outlasted {MAX_CYCLES} cycles of client {number}")


# ---- the faults ----


class Chaos:
    """The run's servers and engines, and the faults it injects into them, one at a time."""

    def __init__(
        self, cluster: NatsCluster, postgres: EmbeddedPostgres, fleet: Fleet, load: Load, nc: NATS
    ) -> None:
        self.cluster = cluster
        self.postgres = postgres
        self.fleet = fleet
        self.load = load
        self.nc = nc
        self.injected: Counter[str] = Counter()
        self.takeovers: list[float] = []  # seconds from a writer's death to its successor
        self.paused_takeovers: list[float] = []  # seconds from a writer's pause to its successor
        self.woken: list[EngineProcess] = []  # writers paused past their lease, then woken

    async def inject(self, fault: str) -> None:
        """One fault, once the system has recovered from the one before: the stream has a
        leader and current copies on every running node, and the load moves."""
        await self.stream_settled()
        await self.load.moved_on(f"before the {fault} fault")
        faults = {
            "writer": self.kill_writer,
            "pause": self.pause_writer,
            "nats": self.kill_nats_node,
            "postgres": self.restart_postgres,
        }
        await faults[fault]()
        self.injected[fault] += 1

    async def kill_writer(self) -> None:
        """SIGKILL the writer; time the survivor's takeover; start another engine in its
        place."""
        writer, epoch = await self.fleet.writer()
        await writer.kill()
        killed = time.monotonic()
        while True:
            survivor, now = await self.fleet.writer()
            if survivor is not writer and now > epoch:
                break
        self.takeovers.append(time.monotonic() - killed)
        await self.fleet.start_one()
        await self.load.moved_on("after the writer was killed")

    async def pause_writer(self) -> None:
        """SIGSTOP the writer until the other engine has taken its domain over and served the
        load a while, then SIGCONT it: it wakes with a lease long gone, work in flight, and
        requests queued for it. Its commits and fabric calls must all be refused."""
        writer, epoch = await self.fleet.writer()
        writer.proc.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        try:
            while True:
                survivor, now = await self.fleet.writer()
                if survivor is not writer and now > epoch:
                    break
                # The paused writer holds its lease a while yet, and `writer()` answers it at
                # once: look again shortly, not in a loop of connections.
                await asyncio.sleep(POLL_S)
            self.paused_takeovers.append(time.monotonic() - paused)
            await self.load.moved_on("with the writer paused")
            await asyncio.sleep(ASLEEP_S)
        finally:
            writer.proc.send_signal(signal.SIGCONT)
        self.woken.append(writer)
        await self.load.moved_on("after the paused writer woke")

    async def kill_nats_node(self) -> None:
        """SIGKILL the node the writer's intake uses, made the stream's leader first; start it
        again once the other two have elected a leader and served the load."""
        victim = self.node_of("trellis-engine")
        await self.stream_settled(leader=victim)
        await asyncio.to_thread(victim.kill)
        await self.stream_settled()
        await self.load.moved_on(f"with {victim.server_name} down")
        await asyncio.to_thread(self.cluster.restart, self.cluster.nodes.index(victim))
        await self.stream_settled()
        await self.load.moved_on(f"after {victim.server_name} came back")

    async def restart_postgres(self) -> None:
        """Stop Postgres until the load has been told `unavailable`; start it again."""
        told = self.load.resends["unavailable"]
        await asyncio.to_thread(self.postgres.stop)
        await self.load.until(
            lambda: self.load.resends["unavailable"] > told, "`unavailable` while Postgres is down"
        )
        await asyncio.to_thread(self.postgres.start)
        await self.load.moved_on("after Postgres came back")

    def node_of(self, connection: str) -> ClusterNode:
        """The running node that holds the connection named `connection`."""
        for node in self.cluster.nodes:
            if node.running:
                names = [c.get("name") for c in node.monitor("connz").get("connections") or []]
                if connection in names:
                    return node
        pytest.fail(f"no NATS node holds a connection named {connection}")

    async def stream_settled(self, leader: ClusterNode | None = None) -> None:
        """Until the stream has a leader on a running node (`leader`, when given: asked to step
        down in its favour) and every other running node holds a current copy."""
        running = {node.server_name for node in self.cluster.nodes if node.running}
        js = self.nc.jetstream()
        deadline = time.monotonic() + WAIT_WITHIN_S
        while time.monotonic() < deadline:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                info = (await asyncio.wait_for(js.stream_info(STREAM), 2)).cluster
                if info is not None and info.leader in running:
                    current = {p.name for p in info.replicas or [] if p.current}
                    if leader is not None and info.leader != leader.server_name:
                        preferred = {"placement": {"preferred": leader.server_name}}
                        subject = f"$JS.API.STREAM.LEADER.STEPDOWN.{STREAM}"
                        await self.nc.request(subject, json.dumps(preferred).encode(), timeout=2)
                    elif running - {info.leader} <= current:
                        return
            await asyncio.sleep(0.2)
        pytest.fail(f"the stream {STREAM} did not settle on {sorted(running)}")


# ---- the run ----


@pytest_asyncio.fixture
async def fleet(
    nats_cluster: NatsCluster, own_postgres: EmbeddedPostgres, tmp_path: Path
) -> AsyncIterator[Fleet]:
    """ENGINES `trellis up` over the run's cluster and Postgres, in a schema of its own."""
    env = await fleet_env(
        nats_cluster.url,
        own_postgres,
        tmp_path,
        TRELLIS_JS_REPLICAS="3",
        TRELLIS_SUBJECT_PREFIX=PREFIX,
        TRELLIS_FABRIC_STATE=str(tmp_path / "fabric-sim.json"),
    )
    engines = Fleet(env, tmp_path, DOMAIN)
    try:
        for _ in range(ENGINES):
            await engines.start_one()
        yield engines
    finally:
        await engines.stop()


@pytest.mark.slow
@pytest.mark.alone  # it times the takeovers on the machine's two cores
async def test_chaos_run_loses_nothing_and_breaks_no_promise(
    nats_cluster: NatsCluster, own_postgres: EmbeddedPostgres, fleet: Fleet
) -> None:
    started = time.monotonic()
    load = Load()
    schema = fleet.env["TRELLIS_DB_SCHEMA"]
    async with asyncio.timeout(RUN_WITHIN_S), contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                client_at(
                    nats_cluster,
                    i % 3,
                    prefix=PREFIX,
                    timeout=REQUEST_TIMEOUT_S,
                    name="chaos-client",
                )
            )
            for i in range(4)
        ]
        body = {"request_id": "import", **contended_hall()}
        imported = await load.ask(clients[0], "operator", "import-topology", body)
        assert imported["ok"], imported
        chaos = Chaos(nats_cluster, own_postgres, fleet, load, clients[0].nc)

        # When: the clients compose and release while the faults come one after another.
        async def faults() -> None:
            for fault in FAULTS:
                await chaos.inject(fault)
            load.faults_over = True

        async with asyncio.TaskGroup() as group:
            group.create_task(faults())
            for number in range(CLIENTS):
                group.create_task(client_loop(clients[number % len(clients)], number, load))

        # Then: the stream catches up with the log (else the audit counts what it lacks)...
        js = clients[0].nc.jetstream()
        events, _ = await read_log(own_postgres.url, schema)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                while (await js.stream_info(STREAM)).state.messages < len(events):
                    await asyncio.sleep(0.2)
        hardware_unlike = await fabric_check(fleet)
        await fleet.stop()
        log, requests = await read_log(own_postgres.url, schema)
        stale = await stale_commits(own_postgres.url, schema)
        stream = await read_stream(js, STREAM, f"{PREFIX}.events.>")

    # ...and the audit of the raw log, the stream and the answers finds every promise kept.
    findings = check(log, requests, load.acks, stream)
    unexpected = [
        a for a in load.acks if not a.reply["ok"] and a.reply["error"]["code"] not in REFUSALS
    ]
    table = zeros(TABLE)
    table.promise(*PROMISES, *LEFT_OVER, UNEXPECTED, STALE_COMMITS, HARDWARE_UNLIKE)
    for promise, count in findings.broken.items():
        table.add(promise, count)
    table.add(LEFT_OVER[0], len(findings.live_at_end))
    table.add(LEFT_OVER[1], len(findings.circuits_at_end))
    table.add(UNEXPECTED, len(unexpected))
    table.add(STALE_COMMITS, stale)
    table.add(HARDWARE_UNLIKE, hardware_unlike)
    for woken in chaos.woken:
        said = woken.said()
        table.tried("woken writer: appends refused", said.count("no longer its writer"))
        table.tried("woken writer: fabric calls refused", said.count("fabric refused this writer"))
        table.tried("woken writer: stopped writing", said.count("stops writing it"))
    for fault, count in chaos.injected.items():
        table.tried(f"faults injected: {fault}", count)
    table.tried("intents acked", len(load.acks))
    answers = Counter(
        f"{a.verb} ok" if a.reply["ok"] else f"{a.verb} {a.reply['error']['code']}"
        for a in load.acks
    )
    for answer, count in answers.items():
        table.tried(f"answers: {answer}", count)
    for why, count in load.resends.items():
        table.tried(f"resends after {why}", count)
    for what, count in held(log).items():
        table.tried(f"reserved: {what}", count)
    table.tried("events in the log", len(log))
    table.tried("messages in the stream", len(stream))
    table.tried("seconds of load and faults", round(time.monotonic() - started))
    table.tried("writer takeover, slowest (ms)", round(1000 * max(chaos.takeovers)))
    table.tried("paused writer's takeover, slowest (ms)", round(1000 * max(chaos.paused_takeovers)))

    assert Counter(dict(chaos.injected)) == Counter(FAULTS)
    assert max(chaos.takeovers) < TAKEOVER_WITHIN_S, chaos.takeovers
    assert max(chaos.paused_takeovers) < PAUSED_TAKEOVER_WITHIN_S, chaos.paused_takeovers
    assert findings.clean(), findings.report()
    assert findings.live_at_end == [] and findings.circuits_at_end == [], findings
    assert unexpected == [], unexpected[:5]
    assert stale == 0 and hardware_unlike == 0, (stale, hardware_unlike)
    assert all("stops writing it" in w.said() for w in chaos.woken)


async def stale_commits(url: str, schema: str) -> int:
    """Events committed under a writer epoch older than one already seen before them in the
    domain: what a writer that lost its lease would have written."""
    conn = await asyncpg.connect(url, server_settings={"search_path": schema})
    try:
        rows = await conn.fetch(
            "SELECT domain, fence FROM trellis_events WHERE fence IS NOT NULL ORDER BY position"
        )
    finally:
        await conn.close()
    newest: dict[str, int] = {}
    stale = 0
    for row in rows:
        if row["fence"] < newest.get(row["domain"], 0):
            stale += 1
        newest[row["domain"]] = max(newest.get(row["domain"], 0), row["fence"])
    return stale


async def fabric_check(fleet: Fleet) -> int:
    """1 if `trellis fabric check` finds the simulated hardware unlike the log once the engines
    are at rest, else 0. The engine that writes the domain answers it (the `fabric` query), so
    it is asked before the fleet stops, and again while that engine is still programming the
    fabric (`settling`) or cannot answer yet."""
    async with asyncio.timeout(WAIT_WITHIN_S):
        while True:
            check = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trellis.adapters.entrypoints.cli", "fabric", "check",
                "--domain", DOMAIN, "-o", "json",
                cwd=REPO, env=fleet.env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await check.communicate()
            if check.returncode not in (0, 1):
                pytest.fail(f"trellis fabric check failed: {err.decode()}")
            report = json.loads(out)
            if check.returncode == 0 or report.get("settling") is False:
                return check.returncode or 0
            await asyncio.sleep(0.2)
