"""Observability over real NATS and Postgres: the engine as a NATS micro service ($SRV.PING,
INFO and STATS find it and count its requests), and its Prometheus metrics and health check,
scraped over real HTTP after real requests.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import re
import signal
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from engines import Fleet
from fabrics import expect_error, expect_ok, fabric, fetch
from harness import Harness, cli_env, run_cli, serving
from isolation import Database, create_schema, unique_schema_name
from prometheus_client.parser import text_string_to_metric_families

from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.embedded.postgres_server import (
    PG_ENGINE_ROLE,
    PG_OWNER_ROLE,
    EmbeddedPostgres,
)
from trellis.adapters.nats.micro import SERVICE_NAME, package_version
from trellis.engine.core.lag import LagTracker

DOMAIN = "hall-1"
H100 = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["H100"]}]}
H100_AND_MEMORY = {
    "host": "host-01",
    "devices": [{"kind": "gpu", "models": ["H100"]}, {"kind": "memory", "capacity_gib": 512}],
}
LOOPBACK_ANY_PORT = ("127.0.0.1", 0)


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, metrics_at=LOOPBACK_ANY_PORT
    ) as harness:
        yield harness


async def srv(h: Harness, verb: str) -> dict[str, Any]:
    """The engine's answer to `$SRV.<verb>.trellis-engine.<its id>`."""
    msg = await h.client.nc.request(f"$SRV.{verb}.{SERVICE_NAME}.{h.service_id}", b"", timeout=5)
    answer: dict[str, Any] = json.loads(msg.data)
    return answer


async def pings_of_everyone(h: Harness, ours: str) -> dict[str, Any]:
    """Ask `$SRV.PING` (every micro service on this NATS answers) until the instance `ours`
    has; its answer."""
    nc = h.client.nc
    inbox = nc.new_inbox()
    found: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def on_pong(msg: Any) -> None:
        pong = json.loads(msg.data)
        if pong.get("id") == ours and not found.done():
            found.set_result(pong)

    sub = await nc.subscribe(inbox, cb=on_pong)
    try:
        await nc.publish("$SRV.PING", b"", reply=inbox)
        return await asyncio.wait_for(found, 5)
    finally:
        await sub.unsubscribe()


def scrape(h: Harness) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample on the engine's /metrics page: (name, labels) -> value."""
    assert h.metrics_url is not None
    with urllib.request.urlopen(f"{h.metrics_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str):
    """One sample's value; None when the page has no such sample."""
    return samples.get((name, frozenset(labels.items())))


async def scraped(h: Harness) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return await asyncio.to_thread(scrape, h)


def health(url: str, path: str = "/healthz") -> tuple[int, dict[str, Any]]:
    """The status and JSON body of GET /healthz (or `path`)."""
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def endpoint(stats_or_info: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [e for e in stats_or_info["endpoints"] if e["name"] == name]
    return found


async def test_nats_micro_discovery_finds_the_engine_and_its_endpoints(h: Harness) -> None:
    prefix = h.client.prefix
    # PING, to everyone and to this instance: the service, its version and what it serves.
    pong = await pings_of_everyone(h, h.service_id)
    assert pong == await srv(h, "PING")
    assert pong["type"] == "io.nats.micro.v1.ping_response"
    assert (pong["name"], pong["version"]) == (SERVICE_NAME, package_version())
    assert pong["version"] == importlib.metadata.version("trellis-fabric")  # installed, known
    assert pong["metadata"] == {
        "engine": h.engine.identity,
        "subject_prefix": prefix,
        "domains": "*",
    }

    # INFO: the endpoints are the intake's subjects, in the queue group engines fail over by.
    info = await srv(h, "INFO")
    assert info["type"] == "io.nats.micro.v1.info_response"
    subjects = {e["name"]: (e["subject"], e["queue_group"]) for e in info["endpoints"]}
    assert subjects == {
        "intent": (f"{prefix}.intent.*.*.*", "trellis-engine"),
        "admin": (f"{prefix}.admin.*.*", "trellis-engine"),
        "query": (f"{prefix}.query.*.*", "trellis-engine"),
        "view": (f"{prefix}.view.*.*.*", "trellis-engine"),
        "forwarded": (f"{prefix}.engine.{h.engine.identity}.>", ""),
    }


async def test_nats_micro_stats_count_requests_errors_and_time(h: Harness) -> None:
    before = await srv(h, "STATS")
    # Only the harness's readiness query so far (tests/integration/harness.py: `answering`).
    start = {e["name"]: (e["num_requests"], e["num_errors"]) for e in before["endpoints"]}
    assert {name: n for name, (n, _) in start.items()} == {
        "intent": 0, "admin": 0, "query": 1, "view": 0, "forwarded": 0
    }, before  # fmt: skip

    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100))
    taken = expect_error(await h.client.intent(DOMAIN, "acme", "compose", H100), "no_capacity")
    expect_ok(await h.client.query(DOMAIN, "free"))
    expect_error(await h.client.view(DOMAIN, "acme", "nonsense"), "invalid")

    stats = await srv(h, "STATS")
    assert stats["type"] == "io.nats.micro.v1.stats_response"
    # Which domains the engine writes now (`trellis engines` gathers them from every engine).
    assert before["metadata"]["writes"] == "" and before["metadata"]["writes_count"] == "0"
    assert stats["metadata"]["writes"] == DOMAIN and stats["metadata"]["writes_count"] == "1"
    intent, admin = endpoint(stats, "intent"), endpoint(stats, "admin")
    query, view = endpoint(stats, "query"), endpoint(stats, "view")
    counts = {
        e["name"]: (e["num_requests"] - start[e["name"]][0], e["num_errors"] - start[e["name"]][1])
        for e in stats["endpoints"]
    }
    assert counts == {
        "intent": (2, 1),
        "admin": (1, 0),
        "query": (1, 0),
        "view": (1, 1),
        "forwarded": (0, 0),
    }
    assert intent["last_error"] == f"no_capacity: {taken['message']}"
    assert view["last_error"].startswith("invalid: ")
    assert admin["last_error"] == ""
    for e in (intent, admin, query, view):
        assert e["processing_time"] > 0, e
        assert e["average_processing_time"] == e["processing_time"] // e["num_requests"], e


async def test_trellis_engines_lists_each_engine_and_the_domains_it_writes(
    h: Harness, tmp_path: Path, nats_url: str, database_url: str, pg_schema: str
) -> None:
    env = cli_env(tmp_path, nats_url, database_url, pg_schema, h.client.prefix)
    code, out, err = await run_cli(env, "engines", "-o", "json")
    assert code == 0, err
    assert json.loads(out) == [{"engine": h.engine.identity, "writes": [], "serves": ["*"]}]
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    code, out, err = await run_cli(env, "engines")
    assert code == 0, err
    # Headers that say what each column holds, with the rule under them, as every table has.
    header, rule, row = out.splitlines()
    assert header.split() == ["engine", "writes", "serves"] and set(rule) == {"-", " "}, out
    assert row.split() == [h.engine.identity, DOMAIN, "*"], out


async def test_metrics_follow_a_compose_a_rejected_compose_and_a_release(h: Harness) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    before = await scraped(h)
    assert sample(before, "trellis_devices_used", domain=DOMAIN, kind="gpu", model="H100") == 0
    assert sample(before, "trellis_devices_free", domain=DOMAIN, kind="gpu", model="H100") == 1
    assert sample(before, "trellis_device_utilization", domain=DOMAIN, kind="gpu") == 0
    ok_import = {"family": "admin", "verb": "import-topology", "code": "ok"}
    assert sample(before, "trellis_intents_total", **ok_import) == 1

    # A compose (an H100 and 512 of mem-01's 2048 GiB), then one that finds no H100 left.
    composed = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100_AND_MEMORY))
    expect_error(await h.client.intent(DOMAIN, "acme", "compose", H100), "no_capacity")
    during = await scraped(h)
    compose = {"family": "intent", "verb": "compose"}
    assert sample(during, "trellis_intents_total", **compose, code="ok") == 1
    assert sample(during, "trellis_intents_total", **compose, code="no_capacity") == 1
    assert sample(during, "trellis_reply_seconds_count", **compose) == 2
    for kind, model, used, free in (("gpu", "H100", 1, 0), ("gpu", "A100", 0, 1)):
        labels = {"domain": DOMAIN, "kind": kind, "model": model}
        assert sample(during, "trellis_devices_used", **labels) == used, (kind, model)
        assert sample(during, "trellis_devices_free", **labels) == free, (kind, model)
    memory = {"domain": DOMAIN, "kind": "memory", "model": ""}
    assert sample(during, "trellis_devices_used", **memory) == 1
    assert sample(during, "trellis_devices_free", **memory) == 1  # 1536 GiB left
    assert sample(during, "trellis_device_utilization", domain=DOMAIN, kind="gpu") == 0.5
    assert sample(during, "trellis_device_utilization", domain=DOMAIN, kind="memory") == 0.25
    # Its saga bound the two devices (in one program call) and settled it established.
    assert sample(during, "trellis_saga_outcomes_total", outcome="established") == 1
    ops = "trellis_fabric_operation_seconds_count"
    assert sample(during, ops, operation="program", outcome="ok") == 1
    assert sample(during, ops, operation="snapshot", outcome="ok")
    # Every request the writer took was decided, and committed in some group commit.
    assert sample(during, "trellis_decide_seconds_count", verb="compose") == 2
    commits = sample(during, "trellis_commit_seconds_count")
    batched = sample(during, "trellis_group_commit_requests_sum")
    assert commits is not None and commits >= 1
    assert sample(during, "trellis_group_commit_requests_count") == commits
    # import-topology, two composes and the saga's settlement: four requests in the batches.
    assert batched == 4

    # The relay stops: its lag is the distance from the log's end to where it stopped.
    await h.relayed(DOMAIN)
    relay = h.followers.of("relay", DOMAIN)
    assert relay is not None
    await relay.stop()
    release = {"composition_id": composed["composition_id"]}
    expect_ok(await h.client.intent(DOMAIN, "acme", "release", release))
    head = await h.projected(DOMAIN)
    after = await scraped(h)
    assert sample(after, "trellis_intents_total", family="intent", verb="release", code="ok") == 1
    assert sample(after, "trellis_devices_used", domain=DOMAIN, kind="gpu", model="H100") == 0
    assert sample(after, "trellis_device_utilization", domain=DOMAIN, kind="memory") == 0
    assert sample(after, "trellis_projection_lag_positions", domain=DOMAIN) == 0
    lag = sample(after, "trellis_relay_lag_positions", domain=DOMAIN)
    assert lag == head - relay.position and lag > 0


async def test_metrics_tell_which_domains_this_engine_writes_and_when_one_changed_hands(
    h: Harness, database_url: str, pg_schema: str
) -> None:
    """The fleet probe paused and killed engines: the survivors' /metrics said nothing of the
    domains they took or lost (only the logs did)."""
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    first = h.engine.fence(DOMAIN)
    before = await scraped(h)
    assert sample(before, "trellis_domains_written") == 1
    assert sample(before, "trellis_writer_epoch", domain=DOMAIN) == first
    assert sample(before, "trellis_domains_taken_total") == 1

    # The lease runs out in the store (as after a pause): the engine drops the domain and
    # takes it again under a newer epoch.
    await fetch(
        database_url,
        pg_schema,
        "UPDATE trellis_writer_leases SET expires_at = clock_timestamp() WHERE domain = $1",
        DOMAIN,
    )
    deadline = asyncio.get_running_loop().time() + 15
    while not ((h.engine.fence(DOMAIN) or 0) > (first or 0) and DOMAIN in h.engine.domains):
        assert asyncio.get_running_loop().time() < deadline, "the domain was not taken again"
        await asyncio.sleep(0.05)
    after = await scraped(h)
    assert sample(after, "trellis_writer_epoch", domain=DOMAIN) == h.engine.fence(DOMAIN)
    assert sample(after, "trellis_domains_taken_total") == 2
    reasons = ("lease_lost", "lease_ran_out", "handed_over", "fenced")
    dropped = {r: sample(after, "trellis_domains_dropped_total", reason=r) for r in reasons}
    assert sum(n or 0 for n in dropped.values()) == 1, dropped


async def test_metrics_count_unknown_verbs_under_one_label(h: Harness) -> None:
    for verb in ("frobnicate", "defenestrate"):
        expect_error(await h.client.raw(f"intent.{DOMAIN}.acme.{verb}", b"{}"), "invalid")
    samples = await scraped(h)
    other = {"family": "intent", "verb": "other", "code": "invalid"}
    assert sample(samples, "trellis_intents_total", **other) == 2
    assert not [k for k in samples if ("verb", "frobnicate") in k[1]]


async def test_health_is_200_while_serving(h: Harness) -> None:
    assert h.metrics_url is not None and h.metrics_url.startswith("http://127.0.0.1:")
    status, body = await asyncio.to_thread(health, h.metrics_url)
    assert (status, body) == (
        200,
        {"status": "ok", "checks": dict.fromkeys(CHECKS, True), "problems": [], "domains": {}},
    )


CHECKS = ("intake", "nats", "store", "leases", "followers", "fabric")  # fabric: the sim answers


async def until_health(url: str, wanted: int, timeout: float = 15.0) -> dict[str, Any]:
    """Poll /healthz until it answers `wanted`; its body."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status, body = await asyncio.to_thread(health, url)
        if status == wanted:
            return body
        assert asyncio.get_running_loop().time() < deadline, (status, body)
        await asyncio.sleep(0.2)


async def test_health_shows_each_domains_head_and_where_each_follower_is(h: Harness) -> None:
    assert h.metrics_url is not None
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100_AND_MEMORY))
    head = await h.store.head(DOMAIN)
    await h.projected(DOMAIN)
    await h.relayed(DOMAIN)
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # sampled every second
        body = await until_health(h.metrics_url, 200)
        parts = body["domains"].get(DOMAIN, {}).get("parts", {})
        if parts and all(p["version"] == head.version for p in parts.values()):
            break
        assert asyncio.get_running_loop().time() < deadline, body
        await asyncio.sleep(0.2)
    assert body["domains"][DOMAIN]["head"] == {"version": head.version, "position": head.position}
    assert {"relay", "connections", "compositions", "devices"} <= set(parts)
    for part in parts.values():
        assert (part["position"], part["behind"], part["ok"]) == (head.position, 0, True)


async def test_health_fails_naming_the_domain_and_part_while_the_relay_stalls(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        metrics_at=LOOPBACK_ANY_PORT,
        health=LagTracker(stall_s=1.0, max_behind=10_000),
    ) as h:
        assert h.metrics_url is not None
        expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
        await h.relayed(DOMAIN)
        relay = h.followers.of("relay", DOMAIN)
        assert relay is not None
        await relay.stop()  # stuck, as a relay the stream refuses is
        expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100_AND_MEMORY))

        body = await until_health(h.metrics_url, 503)
        assert body["checks"]["followers"] is False
        (problem,) = body["problems"]
        assert problem.startswith(f"relay of domain {DOMAIN}: not moved for")
        assert body["domains"][DOMAIN]["parts"]["relay"]["ok"] is False
        assert body["domains"][DOMAIN]["parts"]["connections"]["ok"] is True
        samples = await scraped(h)
        assert sample(samples, "trellis_follower_stalled", domain=DOMAIN, part="relay") == 1.0
        assert sample(samples, "trellis_follower_stalled", domain=DOMAIN, part="devices") == 0.0

        relay.start()  # it moves again: healthy again
        await until_health(h.metrics_url, 200)


async def test_health_is_503_while_the_store_takes_no_writes(
    nats_url: str,
    database_url: str,
    owner_url: str,
    pg_schema: str,
    subject_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full disk (or a synchronous standby gone) leaves Postgres answering reads and taking
    no writes: every intent was `unavailable` while /healthz stayed 200. The writer lease
    ticks write, so their failing for a lease time fails the health check, naming it. The log
    tells the streak once, not once a tick, and says when it ends."""
    caplog.set_level(logging.WARNING, logger="trellis.engine.service.custody")
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, metrics_at=LOOPBACK_ANY_PORT
    ) as h:
        assert h.metrics_url is not None
        await until_health(h.metrics_url, 200)
        owner = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
        try:
            await owner.execute(DISK_FULL)
            body = await until_health(h.metrics_url, 503)
            assert body["checks"]["leases"] is False and body["checks"]["store"] is True
            (problem,) = body["problems"]
            assert problem.startswith("writer leases: every tick failed for"), problem
            assert "could not extend file" in problem, problem
            await owner.execute("DROP TRIGGER disk_full ON trellis_engines")
            await until_health(h.metrics_url, 200)
        finally:
            await owner.close()
    # The streak is told once (its ticks failed the same way throughout), and its end.
    said = [r.getMessage() for r in caplog.records]
    failed = [m for m in said if m.startswith("writer lease tick failed")]
    assert len(failed) == 1 and "could not extend file" in failed[0], said
    assert any(m.startswith("writer lease ticks succeed again after") for m in said), said


# Writes to the engines' heartbeat table fail as on a full disk (SQLSTATE 53100).
DISK_FULL = """
CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'could not extend file: No space left on device' USING ERRCODE = '53100';
END $$;
CREATE TRIGGER disk_full BEFORE INSERT OR UPDATE ON trellis_engines
   FOR EACH ROW EXECUTE FUNCTION disk_full();
"""


async def test_health_is_503_while_the_store_is_down(
    nats_url: str, subject_prefix: str, own_postgres: EmbeddedPostgres
) -> None:
    schema = unique_schema_name()
    await create_schema(
        Database(own_postgres.url, own_postgres.owner_url, PG_ENGINE_ROLE, PG_OWNER_ROLE), schema
    )
    async with serving(
        nats_url, own_postgres.url, schema, subject_prefix, metrics_at=LOOPBACK_ANY_PORT
    ) as h:
        assert h.metrics_url is not None
        assert (await asyncio.to_thread(health, h.metrics_url))[0] == 200
        await asyncio.to_thread(own_postgres.stop)
        status, body = await asyncio.to_thread(health, h.metrics_url)
        assert status == 503
        problems = body.pop("problems")
        assert body == {
            "status": "unavailable",
            "checks": {**dict.fromkeys(CHECKS, True), "store": False},
            "domains": {},
        }
        (problem,) = problems  # the check names what it saw, as the others do
        assert problem.startswith("store: a query failed: "), problem
        # Ready no more, but alive: a liveness probe must not restart it for Postgres's outage.
        assert (await asyncio.to_thread(health, h.metrics_url, "/readyz"))[0] == 503
        assert await asyncio.to_thread(health, h.metrics_url, "/livez") == (200, {"status": "ok"})
        await asyncio.to_thread(own_postgres.start)
        assert await until_healthy(h.metrics_url), "still unhealthy after Postgres came back"


async def test_health_is_503_while_the_nats_server_is_hung(
    database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    """A stopped nats-server (as a partition or a server stuck on its disk) keeps the TCP
    connection open, so the client stays "connected" for minutes: /healthz said ok while no
    intent could be served. A ping must come back."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    try:
        async with serving(
            server.url, database_url, pg_schema, subject_prefix, metrics_at=LOOPBACK_ANY_PORT
        ) as h:
            assert h.metrics_url is not None
            await until_health(h.metrics_url, 200)
            pid = int(server.pid_path.read_text())
            os.kill(pid, signal.SIGSTOP)
            try:
                body = await until_health(h.metrics_url, 503)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert body["checks"] == {**dict.fromkeys(CHECKS, True), "nats": False}, body
            (problem,) = body["problems"]
            assert problem == "nats: no answer to a ping within 2 s", problem
            await until_health(h.metrics_url, 200)
            # The check's late answers cost the engine nothing: it serves at once (a check by
            # nats-py's flush(timeout) left a cancelled PONG future whose late PONG ended the
            # client's read loop, and the engine was off NATS for minutes; the re-check probe).
            reply = await h.client.query(DOMAIN, "free", {})
            assert reply["ok"] or reply["error"]["code"] == "not_found", reply
    finally:
        server.stop()


async def until_healthy(url: str, within_s: float = 20.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        if (await asyncio.to_thread(health, url))[0] == 200:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_trellis_up_prints_its_metrics_url_and_serves_it(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    env = cli_env(
        tmp_path / "data",
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        TRELLIS_METRICS_PORT="0",
    )
    fleet = Fleet(env, tmp_path, DOMAIN)
    try:
        engine = await fleet.start_one()
        printed = re.search(
            r"metrics: (http://127\.0\.0\.1:\d+)/metrics \(Prometheus\), health: "
            r"(\1)/healthz\n",
            engine.said(),
        )
        assert printed is not None, engine.said()
        assert (await asyncio.to_thread(health, printed[1]))[0] == 200
    finally:
        await fleet.stop()
    # A port that is none is one usage line, before anything starts.
    code, _, err = await run_cli(env, "up", "--metrics-port", "70000")
    assert code == 2 and err.startswith("trellis: usage: ") and "--metrics-port" in err, err
