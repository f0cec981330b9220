"""examples/scheduler.py, run as a process of its own against a real engine (issue 13 item 2).

It talks to the engine only through NATS: its compositions must appear in the engine, its
local view of free devices (from the KV bucket) must converge to the engine's `free` query, and
a composition the engine cannot repair (a fault on a held device with no spare) must be
released and its demand placed again once the device is healthy.
"""

from __future__ import annotations

import ast
import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from fabrics import expect_ok
from harness import Harness, serving

from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.embedded.process import free_port
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import StreamLimits, ensure_bucket, ensure_stream

REPO = Path(__file__).resolve().parents[2]
SCHEDULER = REPO / "examples" / "scheduler.py"
FABRIC = REPO / "examples" / "fabric.json"
DOMAIN = "hall-1"
TENANT = "acme"
WITHIN_S = 60.0  # a bound on waiting for the scheduler, so a broken one fails, not hangs
HOUR = 3600.0
DEMAND = [
    {"at": 0, "gpus": 1, "model": "H100", "seconds": HOUR},
    {"at": 0, "gpus": 2, "model": "H200", "seconds": HOUR},  # every H200: no spare
    {"at": 0, "memory_gib": 512, "seconds": HOUR},
    {"at": 0, "gpus": 1, "model": "A100", "memory_gib": 256, "seconds": HOUR},
    {"at": 0, "gpus": 1, "model": "B200", "max_hops": 1, "seconds": HOUR},  # no path that short
]


class SchedulerProcess:
    """The example scheduler in a subprocess: its JSON-lines log and its view dumps."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path, dump: Path) -> None:
        self.proc = proc
        self.log = log
        self.dump = dump

    def lines(self) -> list[dict[str, Any]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    async def until(self, what: str, test: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first log line of event `what` that passes `test`, waiting for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN_S
        while loop.time() < deadline:
            for line in self.lines():
                if line["event"] == what and test(line):
                    return line
            assert self.proc.returncode is None, self.log.read_text()
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {what!r} line in:\n{self.log.read_text()}")

    async def view(self) -> dict[str, Any]:
        """Its local view, as it dumps it on SIGUSR1."""
        self.dump.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN_S
        while not self.dump.exists():
            assert loop.time() < deadline and self.proc.returncode is None, self.log.read_text()
            await asyncio.sleep(0.02)
        data: dict[str, Any] = json.loads(self.dump.read_text())
        return data


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        topology = {"request_id": "topo-example", **json.loads(FABRIC.read_text())}
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", topology))
        await harness.relayed(DOMAIN)
        yield harness


@pytest_asyncio.fixture
async def scheduler(
    h: Harness, nats_url: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[SchedulerProcess]:
    demand = tmp_path / "demand.jsonl"
    demand.write_text("".join(json.dumps(d) + "\n" for d in DEMAND))
    log, dump = tmp_path / "scheduler.log", tmp_path / "view.json"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCHEDULER), "--nats", nats_url, "--prefix", subject_prefix,
            "--domain", DOMAIN, "--tenant", TENANT, "--demand", str(demand),
            "--duration", str(HOUR), "--dump", str(dump), "--retry-seconds", "0.2",
            stdout=out, stderr=out,
        )  # fmt: skip
    running = SchedulerProcess(proc, log, dump)
    try:
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def engine_view(free: dict[str, Any]) -> tuple[dict[str, list[str]], dict[str, float]]:
    """The `free` query's answer in the shape of the scheduler's dump."""
    gpus: dict[str, list[str]] = {}
    memory: dict[str, float] = {}
    for device in free["devices"]:
        if device["device_kind"] == "gpu":
            gpus.setdefault(device.get("model") or "", []).append(device["id"])
        elif device["device_kind"] == "memory":
            memory[device["id"]] = device["free_gib"]
    return {m: sorted(ids) for m, ids in gpus.items()}, memory


async def converges(h: Harness, scheduler: SchedulerProcess) -> dict[str, Any]:
    """Until the scheduler's view equals the engine's `free` answer (asserted); its view."""
    await h.relayed(DOMAIN)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    while True:
        view = await scheduler.view()
        engine = engine_view(expect_ok(await h.client.query(DOMAIN, "free", {})))
        if (view["free_gpus"], view["free_memory_gib"]) == engine or loop.time() > deadline:
            assert (view["free_gpus"], view["free_memory_gib"]) == engine
            return view
        await asyncio.sleep(0.1)


async def tenant_compositions(h: Harness) -> dict[str, list[str]]:
    """The tenant's live compositions in the engine, with their devices."""
    rows = expect_ok(await h.client.query(DOMAIN, "connections", {"tenant": TENANT}))
    out: dict[str, list[str]] = {}
    for row in rows["connections"]:
        out.setdefault(row["composition_id"], []).append(row["device"])
    return {cid: sorted(devices) for cid, devices in out.items()}


async def test_the_example_scheduler_places_demand_and_its_view_converges_to_the_engine(
    h: Harness, scheduler: SchedulerProcess
) -> None:
    placed = [
        await scheduler.until("placed", lambda line, n=n: line["demand"] == n) for n in range(4)
    ]
    refused = await scheduler.until("refused", lambda line: line["demand"] == 4)

    assert refused["code"] == "no_path" and refused["funnel"], refused
    engine = await tenant_compositions(h)
    assert engine == {p["composition_id"]: sorted(p["devices"]) for p in placed}
    view = await converges(h, scheduler)
    assert view["held"] == {p["composition_id"]: p["demand"] for p in placed}
    assert "H200" not in view["free_gpus"]  # the scheduler holds both

    # Both H200 are in one composition: a failed one cannot be replaced, so it stays impaired.
    h200 = placed[1]
    fault = {"component": h200["devices"][0], "state": "failed", "detail": "xid 79"}
    expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))

    seen = await scheduler.until(
        "event", lambda line: line["type"] == "CompositionImpaired" and line["ours"]
    )
    assert seen["composition_id"] == h200["composition_id"]
    assert seen["component"] == h200["devices"][0]
    await scheduler.until("released", lambda line: line["why"] == "impaired")
    # Once its view holds the release: the one healthy H200 is not enough, so it waits.
    await scheduler.until(
        "waiting", lambda line: line["demand"] == 1 and line["why"] == "1 free H200 GPUs, 2 needed"
    )
    old = expect_ok(await h.client.query(DOMAIN, "composition", {"id": h200["composition_id"]}))
    assert old["state"] == "released"
    await converges(h, scheduler)

    healed = {"component": h200["devices"][0], "state": "healthy"}
    expect_ok(await h.client.admin(DOMAIN, "report-fault", healed))
    again = await scheduler.until(
        "placed",
        lambda line: line["demand"] == 1 and line["composition_id"] != h200["composition_id"],
    )
    assert sorted(again["devices"]) == sorted(h200["devices"])
    assert again["composition_id"] in await tenant_compositions(h)
    await converges(h, scheduler)

    scheduler.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(scheduler.proc.wait(), WITHIN_S) == 0
    assert await tenant_compositions(h) == {}
    final = json.loads(scheduler.dump.read_text())
    assert final["held"] == {}


async def test_with_once_it_runs_its_demand_through_and_exits(
    h: Harness, nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    demand = tmp_path / "demand.jsonl"
    short = [
        {"at": 0, "gpus": 1, "model": "H100", "seconds": 0.5},
        {"at": 0.2, "memory_gib": 128, "seconds": 0.5},
    ]
    demand.write_text("".join(json.dumps(d) + "\n" for d in short))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCHEDULER), "--nats", nats_url, "--prefix", subject_prefix,
        "--domain", DOMAIN, "--tenant", TENANT, "--demand", str(demand), "--once",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), WITHIN_S)

    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in err.decode().splitlines()]
    released = [line for line in lines if line["event"] == "released"]
    assert [line["why"] for line in released] == ["done", "done"], lines
    history = expect_ok(await h.client.query(DOMAIN, "history", {"tenant": TENANT}))
    held = {(i["composition_id"], i["device"]) for i in history["intervals"] if i["end"]}
    placed = {(line["composition_id"], d) for line in lines if line["event"] == "placed"
              for d in line["devices"]}  # fmt: skip
    assert held == placed and len(placed) == 2
    assert await tenant_compositions(h) == {}


def test_the_example_scheduler_imports_nothing_from_trellis() -> None:
    tree = ast.parse(SCHEDULER.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            imported.add((node.module or "").split(".")[0])

    outside = imported - set(sys.stdlib_module_names) - {"__future__"}
    assert outside == {"nats", "msgspec"}


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"at": 0, "gpus": 1, "modle": "H100"}', "unknown field `modle`"),
        ('{"at": -1, "gpus": 1}', "must be >= 0"),
        ('{"at": 0, "seconds": 5}', "asks for neither gpus nor memory_gib"),
        ("not json", "demand.jsonl:1"),
    ],
)
def test_a_bad_demand_file_is_one_line_and_exit_2_before_any_connection(
    tmp_path: Path, line: str, says: str
) -> None:
    demand = tmp_path / "demand.jsonl"
    demand.write_text(line + "\n")
    done = subprocess.run(
        [sys.executable, str(SCHEDULER), "--nats", "nats://127.0.0.1:1", "--domain", DOMAIN,
         "--tenant", TENANT, "--demand", str(demand), "--once"],
        capture_output=True, text=True, timeout=WITHIN_S,
    )  # fmt: skip

    assert done.returncode == 2, done
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_no_nats_is_one_line_and_exit_3(tmp_path: Path) -> None:
    demand = tmp_path / "demand.jsonl"
    demand.write_text(json.dumps(DEMAND[0]) + "\n")
    done = subprocess.run(
        [sys.executable, str(SCHEDULER), "--nats", "nats://127.0.0.1:1", "--domain", DOMAIN,
         "--tenant", TENANT, "--demand", str(demand), "--once"],
        capture_output=True, text=True, timeout=WITHIN_S,
    )  # fmt: skip

    assert done.returncode == 3, done
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("scheduler: cannot reach NATS")


async def test_once_connected_it_waits_out_nats_going_away_however_long(tmp_path: Path) -> None:
    """An engine's restart takes its embedded nats-server away for several seconds: after five
    failed reconnects the scheduler's connection closed for good, and it placed nothing again
    and never exited. It waits NATS out now, and says so."""
    port = free_port()
    server = EmbeddedNats(tmp_path / "nats", port)
    server.start()
    try:
        nc = await connect_nats(server.url)
        await ensure_stream(nc.jetstream(), "trellis", StreamLimits())
        await ensure_bucket(nc.jetstream(), "trellis")
        await nc.close()
        log = tmp_path / "scheduler.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(SCHEDULER), "--nats", server.url, "--domain", DOMAIN,
                "--tenant", TENANT, "--duration", str(HOUR), stdout=out, stderr=out,
            )  # fmt: skip
        running = SchedulerProcess(proc, log, tmp_path / "unused.json")
        try:
            await running.until("started", lambda line: True)
            server.stop()
            await running.until("nats_disconnected", lambda line: True)
            # Longer than its five reconnects a second apart took to give up.
            await asyncio.sleep(7)
            server = EmbeddedNats(tmp_path / "nats", port)
            server.start()
            await running.until("nats_reconnected", lambda line: True)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        server.stop()
