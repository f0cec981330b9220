"""`make demo`: start the engine, import the example fabric, serve a scripted session over NATS.

Everything goes through the wire contract, as any client would send it; the log is read back
at the end to show what was recorded and that its hash chain holds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from trellis.adapters.bootstrap import running_engine
from trellis.adapters.embedded.process import DataDirInUse, default_data_dir
from trellis.adapters.endpoints import running_engine_pid
from trellis.adapters.entrypoints.render import (
    blast_radius_table,
    compose_summary,
    connections_table,
    counted,
    error_text,
    free_table,
    import_summary,
    release_summary,
    table,
    topology_tables,
    why_text,
)
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.settings import Settings, redacted
from trellis.engine.core.records import verify_chain
from trellis.engine.service.ports import FabricDriver

# The package `trellis.examples` is the repository's examples/ (setup.py maps it), in a
# checkout and in a wheel alike.
EXAMPLE = Path(str(resources.files("trellis.examples"))) / "fabric.json"


def say(text: str) -> None:
    print(f"\n== {text}")


def shown(reply: dict[str, Any], render: Any) -> str:
    """A reply as a person reads it: the rendered result, or the error with its funnel."""
    return render(reply["result"], reply) if reply["ok"] else error_text(reply["error"])


def outcome(reply: dict[str, Any]) -> str:
    if reply["ok"]:
        tag = " (replayed)" if reply.get("replayed") else ""
        return f"ok at position {reply['position']}{tag}: {json.dumps(reply['result'])}"
    err = reply["error"]
    return f"{err['code']}: {err['message']}"


async def session(client: TrellisClient, domain: str) -> None:
    fabric = json.loads(EXAMPLE.read_text())
    say(f"import {EXAMPLE.name} into domain {domain}")
    first = {**fabric, "request_id": "demo-import-1", "reason": "initial fabric"}
    reply = await client.admin(domain, "import-topology", first)
    print(import_summary(reply["result"], reply))

    say("resend the same request (a client retry): the stored answer, nothing written")
    reply = await client.admin(domain, "import-topology", first)
    print(import_summary(reply["result"], reply).splitlines()[0])

    say("import the same fabric again under a new request_id: idempotent by content")
    reply = await client.admin(domain, "import-topology", {**fabric, "reason": "re-sync"})
    print(import_summary(reply["result"], reply))

    say("reuse that request_id for a different body: refused")
    print(outcome(await client.admin(domain, "import-topology", {"request_id": "demo-import-1"})))

    say("add a GPU to the pool rack, and its cable")
    gpu = {
        "id": "gpu-100",
        "kind": "device",
        "device_kind": "gpu",
        "vendor": "nvidia",
        "model": "B200",
        "generation": 10,
        "memory_gib": 192,
        "labels": {"rack": "pool"},
    }
    print(outcome(await client.admin(domain, "add-node", {"node": gpu, "reason": "new delivery"})))
    cable = {"id": "l-100", "a": "sw-pool", "b": "gpu-100", "capacity_gbps": 128, "latency_ns": 40}
    print(outcome(await client.admin(domain, "add-link", {"link": cable})))

    say("drain rack r2's switch for maintenance; telemetry reports a failed cable")
    print(outcome(await client.admin(domain, "drain", {"id": "sw-r2", "reason": "firmware"})))
    fault = {"component": "l-019", "state": "failed", "detail": "CRC errors"}
    print(outcome(await client.admin(domain, "report-fault", fault)))

    say("bad input is refused with a typed error and writes nothing")
    print(outcome(await client.admin(domain, "drain", {"id": "sw-r1", "colour": "red"})))
    print(outcome(await client.admin(domain, "drain", {"id": "no such.id"})))
    print(outcome(await client.admin("nowhere", "drain", {"id": "sw-r1"})))
    print(outcome(await client.raw(f"admin.{domain}.drain", b"{not json")))

    say("firmware done: undrain sw-r2")
    print(outcome(await client.admin(domain, "undrain", {"id": "sw-r2"})))

    say("the fabric now (trellis topology show)")
    reply = await client.query(domain, "topology")
    print(topology_tables(reply["result"], reply))

    say("a burst of 20 concurrent intents: decided in order, committed together")
    t0 = time.perf_counter()
    burst = await asyncio.gather(
        *(
            client.admin(domain, "add-node", {"node": {"id": f"host-9{i:02d}", "kind": "host"}})
            for i in range(20)
        )
    )
    ms = (time.perf_counter() - t0) * 1000
    positions = sorted(r["position"] for r in burst if r["ok"])
    print(f"{len(positions)} ok in {ms:.1f} ms, positions {positions[0]}..{positions[-1]}")


async def compositions(client: TrellisClient, domain: str, fabric: FabricDriver) -> None:
    """A realistic mix over NATS: GPUs of several generations, memory slices, NICs; a refusal
    explained; a fault that impairs; and the answer to "what is connected to what, and why"."""
    say("acme composes a decode node: 2 GPUs (H100/H200), a 512 GiB CXL slice, a NIC")
    decode = {
        "host": "host-01",
        "devices": [
            {"kind": "gpu", "count": 2, "models": ["H100", "H200"], "bandwidth_gbps": 32},
            {"kind": "memory", "capacity_gib": 512, "bandwidth_gbps": 64},
            {"kind": "nic", "bandwidth_gbps": 16},
        ],
        "constraints": {"max_hops": 6, "max_latency_ns": 2000},
        "lease_seconds": 3600,
        "labels": {"workload": "decode", "model": "llama-70b"},
        "reason": "decode pool scale-up for the evening peak",
    }
    reply = await client.intent(domain, "acme", "compose", decode)
    print(shown(reply, compose_summary))
    acme_decode = reply["result"]["composition_id"]

    say("acme wants a pool GPU within 2 hops: no such path, and the nearest miss")
    near = {
        "host": "host-03",
        "devices": [{"kind": "gpu"}],
        "constraints": {"max_hops": 2, "labels": {"rack": "pool"}},
    }
    print(shown(await client.intent(domain, "acme", "compose", near), compose_summary))

    say("globex takes 2 GPUs on any rack-r2 host, isolated: no PCIe switch shared with others")
    training = {
        "host_selector": {"labels": {"rack": "r2"}},
        "devices": [{"kind": "gpu", "count": 2, "models": ["MI300X", "H200"]}],
        "constraints": {"isolation": "exclusive"},
        "reason": "fine-tuning run 42",
    }
    reply = await client.intent(domain, "globex", "compose", training)
    print(shown(reply, compose_summary))
    globex = reply["result"]["composition_id"]

    say("acme would like a rack-r2 GPU too: that switch is globex's alone now")
    poach = {
        "host": "host-04",
        "devices": [{"kind": "gpu"}],
        "constraints": {"labels": {"rack": "r2"}},
    }
    print(shown(await client.intent(domain, "acme", "compose", poach), compose_summary))

    say("acme asks for more than the pool holds: refused, with the why-not funnel")
    greedy = {"host": "host-02", "devices": [{"kind": "gpu", "count": 6, "models": ["B200"]}]}
    print(shown(await client.intent(domain, "acme", "compose", greedy), compose_summary))

    say("before maintenance: what would a failure of sw-pool hit?")
    reply = await client.query(domain, "blast-radius", {"id": "sw-pool"})
    print(shown(reply, blast_radius_table))

    say("telemetry: the uplink l-021 from sw-pool to the OCS fails; the engine reroutes")
    fault = {"component": "l-021", "state": "failed", "detail": "laser bias out of range"}
    print(outcome(await client.admin(domain, "report-fault", fault)))

    say("what is connected to what, and why (trellis connections)")
    print(shown(await client.query(domain, "connections"), connections_table))

    for target in ("gpu-002", "host-01", acme_decode):
        say(f"why {target}?")
        print(shown(await client.query(domain, "why", {"id": target}), why_text))

    say("globex is done: release returns every device, slice and circuit")
    reply = await client.intent(domain, "globex", "release", {"composition_id": globex})
    print(shown(reply, release_summary))
    print(shown(await client.query(domain, "free", {"kind": "gpu"}), free_table))

    if isinstance(fabric, SimulatedFabric):
        say("the fabric controller refuses the next bind: the saga undoes what it programmed")
        fabric.fail_next("bind", applied=True)  # it even took effect, then the answer was lost
        retry = {"host": "host-03", "devices": [{"kind": "gpu"}], "reason": "batch job"}
        print(shown(await client.intent(domain, "acme", "compose", retry), compose_summary))
        print(await hardware_check(fabric, client, domain))

    say("a short lease: 2 seconds, then the engine's lease keeper ends it")
    short = {"host": "host-02", "devices": [{"kind": "nvme"}], "lease_seconds": 2}
    reply = await client.intent(domain, "initech", "compose", short)
    print(shown(reply, compose_summary))
    await asyncio.sleep(3.5)
    cid = reply["result"]["composition_id"]
    reply = await client.query(domain, "composition", {"id": cid})
    print(f"composition {cid} is now {reply['result']['state']}")
    print(shown(await client.query(domain, "why", {"id": cid}), why_text))


async def hardware_check(fabric: FabricDriver, client: TrellisClient, domain: str) -> str:
    """What the (simulated) hardware holds, against what the log says it should."""
    held = await fabric.snapshot(domain)
    topology = (await client.query(domain, "topology"))["result"]
    rows = (await client.query(domain, "connections"))["result"]["connections"]
    logged_circuits = sorted((c["ocs"], c["a_port"], c["b_port"]) for c in topology["circuits"])
    logged_bindings = sorted((r["device"], r["composition_id"]) for r in rows)
    agree = logged_circuits == sorted((c.ocs, c.a_port, c.b_port) for c in held.circuits) and (
        logged_bindings == sorted((b.device, b.composition_id) for b in held.bindings)
    )
    verdict = "agrees with the log" if agree else "DIFFERS from the log"
    held_now = f"{counted(held.circuits, 'circuit')}, {counted(held.bindings, 'binding')}"
    return f"hardware: {held_now}; {verdict}"


async def show_log(running: Any, domain: str) -> None:
    events = [ev async for ev in running.store.read(domain)]
    say(f"the log of {domain}: {len(events)} events")
    rows = [
        [ev.position, ev.version, ev.type, ev.actor, ev.causation_id[:16], ev.hash[:12]]
        for ev in events[:8]
    ]
    print(table(["position", "version", "type", "actor", "request_id", "hash"], rows))
    if len(events) > 8:
        print(f"... and {len(events) - 8} more")
    broken = verify_chain(events)
    print("hash chain: " + ("intact" if broken is None else f"BROKEN at version {broken}"))


async def main() -> None:
    settings = Settings.from_env()
    domain = time.strftime("demo-%Y%m%d-%H%M%S")
    async with running_engine(settings) as running:
        nats, postgres = redacted(running.nats_url), redacted(running.database_url)
        print(f"engine up: NATS {nats}, Postgres {postgres}")
        async with TrellisClient.connected(
            running.nats_url, prefix=running.subject_prefix, name="trellis-demo"
        ) as client:
            await session(client, domain)
            await compositions(client, domain, running.fabric)
        await show_log(running, domain)
    print("\nengine stopped; the log stays in Postgres: run `make demo` again for a new domain.")


def engine_running_there(settings: Settings) -> str | None:
    """Why the demo cannot start its embedded servers, said as `trellis demo economics` says
    it: an engine (`trellis up`, another demo) already runs on the same data dir."""
    if settings.nats_url and settings.database_url:  # servers of your own: no data dir to share
        return None
    pid = running_engine_pid(settings)
    if pid is None:
        return None
    return f"an engine already runs on {settings.data_dir or default_data_dir()} (pid {pid})"


def run() -> int:
    """The demo; 1 with one line when the data dir is another engine's (not a traceback)."""
    settings = Settings.from_env()
    hint = "stop it first, or give this one its own TRELLIS_DATA_DIR"
    refused = engine_running_there(settings)
    if refused is None:
        try:
            asyncio.run(main())
        except DataDirInUse as exc:  # one starting there, not serving yet
            refused, hint = str(exc), ""
    if refused is not None:
        print(f"demo: {refused}" + (f" ({hint})" if hint else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
