"""Domains spread over engines and move when engines come and go (issue 25 item 3), on the
in-memory log and leases: 3 engines, 24 domains under load; a fourth joins, one stops. Balance
within one, no acknowledged compose lost or recorded twice, never two writers of a domain."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from integration.fabrics import expect_ok, fabric
from memory_rig import CountingLog

from trellis.adapters.clock import SystemClock
from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.memory import MemoryLeases, MemorySnapshots
from trellis.engine.core.errors import ServedElsewhere
from trellis.engine.service.router import Engine

TTL = 1.0  # a tick is a third of it; an engine is worth handing to after two
DOMAINS = [f"hall-{i:02}" for i in range(24)]
NIC = {"host": "host-01", "devices": [{"kind": "nic"}]}


class Cluster:
    """Engines on one log, one lease store and one fabric; requests land on any engine and
    are forwarded to the domain's writer, as the NATS intake does."""

    def __init__(self) -> None:
        self.leases = MemoryLeases()
        self.log = CountingLog(self.leases)
        self.fabric = SimulatedFabric()
        self.engines: dict[str, Engine] = {}
        self.two_writers: list[str] = []

    async def add(self) -> Engine:
        engine = Engine(
            self.log,
            SystemClock(),
            self.fabric,
            leases=self.leases,
            lease_ttl=TTL,
            snapshots=MemorySnapshots(self.log),
        )
        await engine.start(lease_tick_seconds=None)
        self.engines[engine.identity] = engine
        return engine

    async def stop(self, engine: Engine) -> None:
        del self.engines[engine.identity]
        await engine.close()

    async def ask(self, family: str, domain: str, tenant: str | None, verb: str, body: Any) -> Any:
        data = msgspec.json.encode(body)
        answer: Any = None
        for attempt in range(100):
            landed = list(self.engines.values())[attempt % len(self.engines)]
            # As the intake: an engine that does not write the domain forwards the request.
            writer = self.engines.get(landed.route(domain) or landed.identity)
            try:
                if writer is None:  # forwarded to an engine that stopped: resend
                    raise ServedElsewhere(domain, "gone")
                reply = await writer.handle(
                    family,  # type: ignore[arg-type]
                    domain,
                    tenant,
                    verb,
                    data,
                    forwarded=writer is not landed,
                )
            except ServedElsewhere:
                await asyncio.sleep(0.05)
                continue
            answer = msgspec.json.decode(reply)
            if answer["ok"] or answer["error"]["code"] != "unavailable":
                return answer
            await asyncio.sleep(0.05)  # a handover in progress: resend, as the contract says
        raise AssertionError(f"{verb} on {domain} never answered: {answer}")

    def loads(self) -> list[int]:
        held = Counter(d for e in self.engines.values() for d in e.domains)
        doubled = [d for d, n in held.items() if n > 1]
        self.two_writers.extend(doubled)
        return sorted(len(e.domains) for e in self.engines.values())

    async def until_balanced(self, each: list[int], seconds: float = 30) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while self.loads() != each:
            assert asyncio.get_running_loop().time() < deadline, self.loads()
            await asyncio.sleep(0.1)


async def load(cluster: Cluster, client: int, acked: list[str], stop: asyncio.Event) -> None:
    """Composes and releases, round-robin over the domains, until told to stop."""
    i = 0
    while not stop.is_set():
        domain = DOMAINS[i % len(DOMAINS)]
        rid = f"c-{client}-{i}"
        answer = await cluster.ask("intent", domain, "acme", "compose", {"request_id": rid, **NIC})
        if answer["ok"]:
            acked.append(rid)
            cid = answer["result"]["composition_id"]
            body = {"request_id": f"r-{client}-{i}", "composition_id": cid}
            expect_ok(await cluster.ask("intent", domain, "acme", "release", body))
        i += 1


@pytest.mark.slow
async def test_domains_spread_over_engines_and_move_as_engines_join_and_stop() -> None:
    cluster = Cluster()
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(3):
            engine = await cluster.add()
            stack.push_async_callback(_close_unless_stopped(cluster, engine))
        for domain in DOMAINS:
            body = {"request_id": f"import-{domain}", **fabric()}
            answer = await cluster.ask("admin", domain, None, "import-topology", body)
            expect_ok(answer)
        await cluster.until_balanced([8, 8, 8])

        acked: list[str] = []
        stop = asyncio.Event()
        clients = [asyncio.create_task(load(cluster, c, acked, stop)) for c in range(4)]
        try:
            fourth = await cluster.add()
            stack.push_async_callback(_close_unless_stopped(cluster, fourth))
            await cluster.until_balanced([6, 6, 6, 6])
            await cluster.stop(next(iter(cluster.engines.values())))
            await cluster.until_balanced([8, 8, 8])
        finally:
            stop.set()
            await asyncio.gather(*clients)

    assert cluster.two_writers == []
    assert len(acked) > 20
    recorded = Counter(
        e.causation_id for e in cluster.log.all_events() if e.type == "CompositionRequested"
    )
    assert all(recorded[rid] == 1 for rid in acked), [r for r in acked if recorded[r] != 1]
    assert sum(recorded.values()) == len(acked)


def _close_unless_stopped(cluster: Cluster, engine: Engine) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        if engine.identity in cluster.engines:
            await cluster.stop(engine)

    return close
