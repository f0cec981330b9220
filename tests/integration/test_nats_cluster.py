"""Engines over a 3-node NATS cluster (JetStream replicas 3), and one node SIGKILLed mid-load.

The cluster is adapters/embedded/cluster.py's, on loopback ports. Engines and clients are
given every node's URL (a comma-separated TRELLIS_NATS_URL), so they move to a survivor when
their node dies. Clients resend on a timeout or `unavailable` with the same request_id, as the
contract says; afterwards the log, the stream and the bucket must each hold everything once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
from engines import client_at
from fabrics import expect_ok, fetch, one_switch
from harness import engine_at
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from trellis.adapters.bootstrap import RunningEngine
from trellis.adapters.embedded.cluster import ClusterNode, NatsCluster
from trellis.adapters.embedded.process import free_port
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats, nats_servers
from trellis.adapters.nats.jetstream import (
    Envelope,
    StreamConfigError,
    StreamLimits,
    bucket_name,
    ensure_bucket,
    ensure_stream,
    stream_name,
)
from trellis.adapters.nats.kv_state import device_entry, host_entry
from trellis.engine.core.state import DomainState

PREFIX = "trellis"  # the cluster is the test's own: the real names TRELLIS_EVENTS, TRELLIS_STATE
STREAM, KV_STREAM = stream_name(PREFIX), f"KV_{bucket_name(PREFIX)}"
DOMAINS = ("hall-a", "hall-b")
GPUS = 6
REQUEST_TIMEOUT_S = 2.0
CATCH_UP_S = 30.0


# ---- the cluster itself ----


async def test_a_comma_separated_url_reaches_a_live_server_past_a_dead_one(nats_url: str) -> None:
    dead, live = f"nats://127.0.0.1:{free_port()}", nats_servers(nats_url)[0]
    nc = await connect_nats(f"{dead}, {live}", name="test-two-urls")
    try:
        assert nc.is_connected and nc.connected_url is not None
        assert nc.connected_url.geturl() == live
        assert {url.geturl() for url in nc.servers} >= {dead, live}
    finally:
        await nc.close()


@pytest.mark.slow
def test_a_cluster_taken_from_before_its_first_start_moves_every_node(tmp_path: Path) -> None:
    # Another process binds node 2's route port between construction and start (the OS chose
    # it, as it chooses client connections' source ports). Every route names it, so the whole
    # cluster is placed again; once it has run, its ports stay put.
    cluster = NatsCluster(tmp_path / "cluster", size=2)
    taken = cluster.nodes[1].route_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert taken not in {n.route_port for n in cluster.nodes}
            assert cluster.meta_leader() in {n.server_name for n in cluster.nodes}
            ports = [(n.port, n.route_port, n.http_port) for n in cluster.nodes]
            cluster.stop()
            cluster.start()
            assert [(n.port, n.route_port, n.http_port) for n in cluster.nodes] == ports


async def test_the_stream_and_bucket_go_to_three_replicas_and_a_killed_node_rejoins_with_its_data(
    nats_cluster: NatsCluster,
) -> None:
    nc = await connect_nats(nats_cluster.url, name="test-replicas")
    try:
        js = nc.jetstream()
        # Made with one replica first, as a deployment that grew into a cluster has them...
        await ensure_stream(js, PREFIX, StreamLimits())
        await ensure_bucket(js, PREFIX)
        assert await replicas(js, STREAM) == await replicas(js, KV_STREAM) == 1
        # ...then brought to three in place by the next start.
        await ensure_stream(js, PREFIX, StreamLimits(replicas=3))
        kv, _ = await ensure_bucket(js, PREFIX, replicas=3)
        assert await replicas(js, STREAM) == await replicas(js, KV_STREAM) == 3
        await all_current(js, nats_cluster)
        for i in range(5):
            await probe(js, i)
        await kv.put("hall-a.host.host-01", b"{}")

        # The JetStream meta leader dies: the other two elect one of them, and take writes.
        names = [node.server_name for node in nats_cluster.nodes]
        index = names.index(str(nats_cluster.meta_leader()))
        victim = nats_cluster.kill(index)
        await asyncio.to_thread(nats_cluster.wait_ready)
        assert nats_cluster.meta_leader() in set(names) - {victim.server_name}
        for i in range(5, 10):
            await probe(js, i)
        # It comes back at the same ports with its store and catches up with what it missed.
        await asyncio.to_thread(nats_cluster.restart, index)
        await all_current(js, nats_cluster)
        info = await js.stream_info(STREAM)
        assert info.state.messages == 10 and info.state.last_seq == 10
        assert (await kv.get("hall-a.host.host-01")).value == b"{}"
        assert victim.server_name in {info.cluster.leader, *(p.name for p in info.cluster.replicas)}
    finally:
        await nc.close()


async def test_more_replicas_than_servers_is_refused_in_one_sentence(
    nats_url: str, subject_prefix: str
) -> None:
    nc = await connect_nats(nats_url, name="test-too-many-replicas")
    try:
        js = nc.jetstream()  # the session's server: one node, not clustered
        refused = r"TRELLIS_EVENTS_\w+ with 3 replica.*TRELLIS_JS_REPLICAS.*non-clustered mode"
        with pytest.raises(StreamConfigError, match=refused):
            await ensure_stream(js, subject_prefix, StreamLimits(replicas=3))
        with pytest.raises(StreamConfigError, match=r"bucket TRELLIS_STATE_\w+ with 3 replica"):
            await ensure_bucket(js, subject_prefix, replicas=3)
    finally:
        await nc.close()


# ---- engines over the cluster, one node killed mid-load ----


class Load:
    """What the clients were told, by phase: "before" the kill, "killed", "restarted"."""

    def __init__(self) -> None:
        self.phase = "before"
        self.acked: list[tuple[str, str, str, str, dict[str, Any]]] = []  # domain, tenant, verb...
        self.per_phase: Counter[tuple[str, str]] = Counter()  # (tenant, phase) -> acked intents
        self.progress = asyncio.Event()

    def ack(self, domain: str, tenant: str, verb: str, rid: str, reply: dict[str, Any]) -> None:
        self.acked.append((domain, tenant, verb, rid, reply))
        self.per_phase[(tenant, self.phase)] += 1
        self.progress.set()

    async def until(self, done: Any, timeout: float = CATCH_UP_S) -> None:
        """Until `done()` holds; fails after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while True:
                self.progress.clear()  # before the check, so no ack slips between the two
                if done():
                    return
                await self.progress.wait()


async def answered(
    client: TrellisClient, domain: str, tenant: str, verb: str, body: dict[str, Any]
) -> dict[str, Any]:
    """The contract's client: resend with the same request_id until the answer is something
    other than a timeout, no responders (an engine moving to another node), `unavailable`, or
    `throttled` (resent once its `retry_after_ms` has passed)."""
    async with asyncio.timeout(CATCH_UP_S):
        while True:
            try:
                reply = await client.intent(domain, tenant, verb, body)
            except (nats.errors.Error, TimeoutError):
                reply = None
            error = (reply or {}).get("error", {})
            if reply is not None and error.get("code") not in ("unavailable", "throttled"):
                return reply
            retry_after_ms = error.get("details", {}).get("retry_after_ms", 50)
            await asyncio.sleep(max(retry_after_ms, 50) / 1000)


async def cycle(client: TrellisClient, domain: str, tenant: str, n: int, load: Load) -> None:
    """Compose a GPU, then release it: request ids `<tenant>-compose-<n>`, `...-release-<n>`."""
    rid = f"{tenant}-compose-{n}"
    body = {"request_id": rid, "host": "host-01", "devices": [{"kind": "gpu"}]}
    composed = expect_ok(await answered(client, domain, tenant, "compose", body))
    load.ack(domain, tenant, "compose", rid, composed)
    rid = f"{tenant}-release-{n}"
    body = {"request_id": rid, "composition_id": composed["composition_id"]}
    released = expect_ok(await answered(client, domain, tenant, "release", body))
    load.ack(domain, tenant, "release", rid, released)


async def work(
    client: TrellisClient, domain: str, tenant: str, load: Load, stop: asyncio.Event
) -> None:
    """Compose and release, again and again, until `stop`."""
    n = 0
    while not stop.is_set():
        await cycle(client, domain, tenant, n, load)
        n += 1


@contextlib.asynccontextmanager
async def at_node(cluster: NatsCluster, index: int) -> AsyncIterator[TrellisClient]:
    """A client that starts at node `index` (checked) and fails over to the others."""
    async with client_at(cluster, index, prefix=PREFIX, timeout=REQUEST_TIMEOUT_S) as client:
        assert cluster.node_at(client.nc.connected_url.netloc) is cluster.nodes[index]
        yield client


@pytest.mark.slow
async def test_engines_over_a_cluster_lose_nothing_when_a_nats_node_is_killed_mid_load(
    nats_cluster: NatsCluster, database_url: str, pg_schema: str
) -> None:
    cluster, limits = nats_cluster, StreamLimits(replicas=3)
    # Given: two engines over the cluster, one per domain, each given every node's URL...
    async with contextlib.AsyncExitStack() as stack:
        engines: dict[str, RunningEngine] = {}
        for domain in DOMAINS:
            engines[domain] = await stack.enter_async_context(
                engine_at(
                    cluster.url,
                    database_url,
                    schema=pg_schema,
                    prefix=PREFIX,
                    domains=[domain],
                    stream_limits=limits,
                )
            )
        clients = [await stack.enter_async_context(at_node(cluster, i)) for i in range(3)]
        for domain in DOMAINS:
            expect_ok(await clients[0].admin(domain, "import-topology", one_switch(GPUS)))
        js = clients[0].nc.jetstream()
        assert await replicas(js, STREAM) == await replicas(js, KV_STREAM) == 3

        # ...the victim: the node that hall-a's engine takes its intents from, made the leader
        # of the stream and of the bucket, so the relay loses both mid-publish.
        engine_a = engines["hall-a"]
        victim = cluster.node_at(engine_a.nc.connected_url.netloc)
        for stream in (STREAM, KV_STREAM):
            await lead_at(clients[0].nc, stream, victim)

        # When: six clients, two on each node, compose and release on both domains...
        load, stop = Load(), asyncio.Event()
        tenants = {f"t{i}": (clients[i % 3], DOMAINS[i % 2]) for i in range(6)}
        async with asyncio.TaskGroup() as group:
            for tenant, (client, domain) in tenants.items():
                group.create_task(work(client, domain, tenant, load, stop))
            await load.until(lambda: len(load.acked) >= 30)
            # ...the victim is SIGKILLed mid-load...
            load.phase = "killed"
            await asyncio.to_thread(victim.kill)
            await load.until(lambda: all(load.per_phase[(t, "killed")] >= 6 for t in tenants))
            # ...and comes back, while the load goes on.
            await asyncio.to_thread(cluster.restart, cluster.nodes.index(victim))
            load.phase = "restarted"
            await load.until(lambda: all(load.per_phase[(t, "restarted")] >= 4 for t in tenants))
            stop.set()

        # Then: the engine whose node died moved to another one and served from there...
        assert engine_a.nc.is_connected and engine_a.nc.stats["reconnects"] >= 1
        # ...as did the clients that started there (whose requests in flight were resent, or
        # went out from the client's buffer after its reconnect).
        moved = clients[cluster.nodes.index(victim)].nc
        assert moved.is_connected and moved.stats["reconnects"] >= 1
        assert cluster.node_at(moved.connected_url.netloc) is not victim
        # ...and both engines still serve, through the restarted node too.
        async with at_node(cluster, cluster.nodes.index(victim)) as late:
            for domain in DOMAINS:
                await cycle(late, domain, "late", 0, load)

        # Every acknowledged intent is in the log exactly once, and nothing else is.
        await every_ack_in_the_log_once(database_url, pg_schema, load)
        # No reservation leaked: every composition ended, every GPU is free, the fabric is bare.
        for domain, running in engines.items():
            state = running.engine.state(domain)
            assert state is not None
            assert state.compositions == {} and state.device_owner == {}
            sync = running.engine.fabric_sync(domain)
            assert sync is not None
            await asyncio.wait_for(sync.wait_idle(), CATCH_UP_S)
            held = await running.fabric.snapshot(domain)
            assert held.bindings == [] and held.circuits == []
            free = expect_ok(await clients[1].query(domain, "free", {"kind": "gpu"}))
            assert len(free["devices"]) == GPUS

        # The stream holds every event of the log once, in order within each domain...
        log = await fetch(
            database_url, pg_schema, "SELECT id, domain FROM trellis_events ORDER BY position"
        )
        envelopes = await stream_contents(js, len(log))
        assert Counter(e.id for e in envelopes) == Counter(str(r["id"]) for r in log)
        for domain in DOMAINS:
            in_stream = [e.id for e in envelopes if e.domain == domain]
            assert in_stream == [str(r["id"]) for r in log if r["domain"] == domain]
        # ...on all three nodes again, and the bucket holds what the engines believe.
        await all_current(js, cluster)
        kv_expected = {
            key: value
            for domain, running in engines.items()
            for key, value in kv_of(running.engine.state(domain)).items()
        }
        await bucket_holds(js, kv_expected)


# ---- helpers ----


async def stream_info(js: JetStreamContext, stream: str) -> Any:
    """The stream's info, or TimeoutError after 2 s (while its group has no leader, nobody
    answers)."""
    return await asyncio.wait_for(js.stream_info(stream), 2)


async def replicas(js: JetStreamContext, stream: str) -> int:
    return int((await js.stream_info(stream)).config.num_replicas or 1)


async def probe(js: JetStreamContext, i: int) -> None:
    """Store message `i` in the stream, resending (deduplicated by its id) while JetStream
    elects a new leader."""
    headers = {"Nats-Msg-Id": f"probe-{i}"}
    async with asyncio.timeout(CATCH_UP_S):
        while True:
            try:
                subject = f"{PREFIX}.events.hall-a.Probe"
                await js.publish(subject, b"%d" % i, stream=STREAM, timeout=2, headers=headers)
                return
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(0.2)


async def lead_at(nc: NATS, stream: str, node: ClusterNode) -> None:
    """Move `stream`'s leader to `node` (a stepdown that names it the preferred leader)."""
    js = nc.jetstream()
    request = json.dumps({"placement": {"preferred": node.server_name}}).encode()
    async with asyncio.timeout(CATCH_UP_S):
        while True:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                if (await stream_info(js, stream)).cluster.leader == node.server_name:
                    return
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, timeout=2)
            await asyncio.sleep(0.2)


async def all_current(js: JetStreamContext, cluster: NatsCluster) -> None:
    """Until every node holds a current copy of the stream and the bucket, with no lag."""
    names = {node.server_name for node in cluster.nodes}
    async with asyncio.timeout(CATCH_UP_S):
        for stream in (STREAM, KV_STREAM):
            while True:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    info = (await stream_info(js, stream)).cluster
                    peers = info.replicas or []
                    if {info.leader, *(p.name for p in peers)} == names and all(
                        p.current and not p.lag for p in peers
                    ):
                        break
                await asyncio.sleep(0.2)


async def every_ack_in_the_log_once(database_url: str, schema: str, load: Load) -> None:
    """Each acknowledged request id is stored once, and its intent's event is in the log once;
    the log has no compose or release that no client was told about."""
    stored = await fetch(
        database_url, schema, "SELECT domain, actor, request_id FROM trellis_requests"
    )
    stored_ids = Counter((r["domain"], r["actor"], r["request_id"]) for r in stored)
    events = await fetch(
        database_url,
        schema,
        "SELECT domain, type, causation_id, data FROM trellis_events"
        " WHERE type IN ('CompositionRequested', 'CompositionReleased')",
    )
    by_type = {
        verb: Counter((r["domain"], r["causation_id"]) for r in events if r["type"] == kind)
        for verb, kind in (("compose", "CompositionRequested"), ("release", "CompositionReleased"))
    }
    composition_ids = Counter(
        json.loads(r["data"])["composition_id"]
        for r in events
        if r["type"] == "CompositionRequested"
    )
    for verb in ("compose", "release"):
        acked = Counter((d, rid) for d, _, v, rid, _ in load.acked if v == verb)
        assert by_type[verb] == acked, verb  # each once; nothing unacknowledged
    for domain, tenant, _, rid, _ in load.acked:
        assert stored_ids[(domain, tenant, rid)] == 1, rid
    composed = [reply["composition_id"] for _, _, v, _, reply in load.acked if v == "compose"]
    assert Counter(composed) == composition_ids and max(composition_ids.values()) == 1


async def stream_contents(js: JetStreamContext, count: int) -> list[Envelope]:
    """The stream's messages in stream order, once it holds `count` (polled, with a deadline)."""
    async with asyncio.timeout(CATCH_UP_S):
        while True:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                if (await stream_info(js, STREAM)).state.messages >= count:
                    break
            await asyncio.sleep(0.2)
    info = await js.stream_info(STREAM)
    sub = await js.subscribe(f"{PREFIX}.events.>", ordered_consumer=True)
    try:
        messages = [await sub.next_msg(timeout=5) for _ in range(int(info.state.messages))]
    finally:
        await sub.unsubscribe()
    envelopes = [msgspec.json.decode(m.data, type=Envelope) for m in messages]
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [e.id for e in envelopes]
    return envelopes


def kv_of(state: DomainState | None) -> dict[str, dict[str, Any]]:
    """What the bucket should hold for a domain with no live composition (positions aside)."""
    assert state is not None
    out: dict[str, dict[str, Any]] = {}
    for node_id, node in state.nodes.items():
        if node.spec.kind == "device":
            entry: Any = device_entry(state, node, 0)
        elif node.spec.kind == "host":
            entry = host_entry(state, node, 0)
        else:
            continue
        kind = node.spec.kind
        out[f"{state.domain}.{kind}.{node_id}"] = without_position(msgspec.to_builtins(entry))
    return out


def without_position(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if k != "position"}


async def bucket_holds(js: JetStreamContext, expected: dict[str, dict[str, Any]]) -> None:
    """Until the bucket holds exactly `expected` (polled, with a deadline)."""
    kv = await js.key_value(bucket_name(PREFIX))
    seen: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CATCH_UP_S):
            while seen != expected:
                seen = {}
                with contextlib.suppress(nats.errors.Error):
                    for key in await kv.keys():
                        entry = await kv.get(key)
                        seen[key] = without_position(msgspec.json.decode(entry.value or b"{}"))
                await asyncio.sleep(0.2)
    assert seen == expected
