"""`trellis demo economics`, tiny, end to end on a real engine (issue 13 item 4).

Both runs go through NATS to a real engine on real Postgres. The figures the demo prints must
equal what an independent fold of the log's typed events gives (who held what from when to
when, at what price; which requests were composed and which refused), and pooled composition
must serve at least as many requests as fixed boxes on demand that overloads the boxes.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest_asyncio
from harness import Harness, serving

from trellis.adapters.entrypoints.economics import demo, plots
from trellis.adapters.entrypoints.economics.data import read_hall
from trellis.adapters.entrypoints.economics.figures import comparison
from trellis.adapters.entrypoints.economics.runs import Plan, demand
from trellis.adapters.nats.client import TrellisClient
from trellis.engine.core.events import (
    CompositionActivated,
    CompositionFailed,
    CompositionImpaired,
    CompositionRejected,
    CompositionReleased,
    CompositionRequested,
    DeviceReplaced,
    DevicesReserved,
    LeaseExpired,
    PathRerouted,
)

# 40 requests in 10 s, each holding hardware for 2-7 s pooled, 3 s a box: more than the hall's
# 16 boxes at once.
PLAN = Plan(seconds=10.0, requests=40)


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


class Folded:
    """What the log says, folded here without the demo's code or the history projection."""

    def __init__(self, records: list[Any], hall: dict[str, Any]) -> None:
        # A pool's price is for all of it: a slice pays its GiB's share.
        self.pool_gib = {n["id"]: n.get("capacity_gib") for n in hall["nodes"]}
        self.open: dict[tuple[str, str], tuple[datetime, str, float]] = {}
        self.held: list[tuple[str, float, float]] = []  # kind, seconds, dollars
        self.phases: dict[int, set[str]] = {}
        self.first_refusal: dict[int, str] = {}
        self.impaired: set[str] = set()
        self.released: set[str] = set()  # by a release intent, not by its lease
        self.moved: set[str] = set()
        self.repaired: set[str] = set()
        self.recovered: set[str] = set()
        self.scheduler = ""
        for record in records:
            self._fold(record.recorded_at, record.event())

    def _fold(self, at: datetime, event: Any) -> None:
        match event:
            case CompositionRequested(request=request):
                self.scheduler = request.labels["scheduler"]
                self.phases.setdefault(self._request(request.labels), set()).add(
                    request.labels["demand"]
                )
            case CompositionRejected(request=request, code=code, details=details):
                assert request is not None
                kind = request.devices[details["entry"]].kind
                self.first_refusal.setdefault(self._request(request.labels), f"{code} ({kind})")
            case DevicesReserved(composition_id=cid, devices=bindings):
                for b in bindings:
                    self.open[(cid, b.device)] = (at, b.kind, self._price(b))
            case DeviceReplaced(composition_id=cid, old_device=old, binding=b):
                self._end(at, cid, old)
                self.moved.add(cid)
                self.open[(cid, b.device)] = (at, b.kind, self._price(b))
            case CompositionReleased(composition_id=cid, reason=reason):
                if reason != "lease expired":
                    self.released.add(cid)
                self._end(at, cid, None)
            case LeaseExpired(composition_id=cid):
                self._end(at, cid, None)
            case CompositionFailed(composition_id=cid):
                self._end(at, cid, None)
            case CompositionImpaired(composition_id=cid):
                self.impaired.add(cid)
            case PathRerouted(composition_id=cid):
                self.moved.add(cid)
            case CompositionActivated(composition_id=cid) if cid in self.impaired:
                (self.repaired if cid in self.moved else self.recovered).add(cid)
            case _:
                pass

    def _price(self, binding: Any) -> float:
        price: float = binding.cost_per_hour or 0.0
        whole = self.pool_gib.get(binding.device)
        return price * binding.capacity_gib / whole if binding.capacity_gib and whole else price

    def _request(self, labels: dict[str, str]) -> int:
        number = int(labels["demand"])
        return number if labels["scheduler"] == "fixed-pods" else number // 2

    def _end(self, at: datetime, cid: str, device: str | None) -> None:
        for key in [k for k in self.open if k[0] == cid and device in (None, k[1])]:
            start, kind, price = self.open.pop(key)
            seconds = (at - start).total_seconds()
            self.held.append((kind, seconds, seconds / 3600 * price))

    def served_requests(self) -> set[int]:
        whole = 1 if self.scheduler == "fixed-pods" else 2
        return {r for r, p in self.phases.items() if len(p) == whole}

    def served(self) -> int:
        return len(self.served_requests())

    def refused(self) -> Counter[str]:
        served = self.served_requests()
        return Counter(why for r, why in self.first_refusal.items() if r not in served)


async def test_the_economics_figures_are_the_logs_and_pooling_serves_more(
    h: Harness, nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    async with TrellisClient.connected(
        nats_url, prefix=subject_prefix, name="test-economics"
    ) as client:
        outcome = await demo.economics(client, h.store, PLAN)
    pooled, fixed = outcome.figures["pooled"], outcome.figures["fixed"]
    hall = read_hall()
    for figures, scheduler in ((pooled, "pooled"), (fixed, "fixed")):
        domain = next(d for d in await h.store.domains() if d.startswith(f"econ-{scheduler}-"))
        folded = Folded([r async for r in h.store.read(domain)], hall)
        assert not folded.open, "every lease has run out"
        assert figures.served == folded.served()
        assert figures.refused == folded.refused()
        assert figures.served + sum(figures.refused.values()) == PLAN.requests
        gpu_seconds = sum(s for kind, s, _ in folded.held if kind == "gpu")
        assert math.isclose(figures.gpu_seconds, gpu_seconds, rel_tol=1e-9)
        assert math.isclose(figures.billed, sum(d for _, _, d in folded.held), rel_tol=1e-9)
        for kind, dollars in figures.billed_by_kind.items():  # held never costs more than all
            assert dollars <= figures.hall_cost_by_kind[kind], kind
        # The seeds' units: GPU-hours held, and tokens of the trace requests the log served.
        assert math.isclose(figures.gpu_hours, gpu_seconds / 3600, rel_tol=1e-9)
        served = folded.served_requests()
        assert figures.tokens_served == sum(
            r.context_tokens + r.generated_tokens for r in demand(PLAN) if r.number in served
        )
        assert figures.billed_per_million_tokens is not None
        assert set(figures.ttft_ms) == set(figures.tpot_ms) == {"p50"}  # 40 tell no p99
        assert figures.impaired == len(folded.impaired)
        assert figures.repaired == len(folded.repaired)
        assert figures.recovered == len(folded.recovered - folded.repaired)
        gpus = sum(n.get("device_kind") == "gpu" for n in hall["nodes"])
        assert max(figures.gpus_held_share) <= 1.0
        # Sampled at most a second apart, the share held integrates to the GPU-seconds held,
        # each interval's two ends off by at most a sample each.
        gpu_intervals = sum(kind == "gpu" for kind, _, _ in folded.held)
        assert abs(sum(figures.gpus_held_share) * gpus - gpu_seconds) <= 2 * gpu_intervals
        if scheduler == "pooled":
            # The example scheduler's policy releases what the engine could not repair; the
            # fixed run releases nothing (its leases end it).
            assert folded.impaired - folded.repaired <= folded.released
        else:
            assert not folded.released
    assert fixed.served < PLAN.requests, "the demand overloads the boxes"
    assert pooled.served >= fixed.served
    assert fixed.idle_gpu_seconds > pooled.idle_gpu_seconds
    table = comparison(pooled, fixed)
    assert "served" in table and str(pooled.served) in table

    # The storm cut the busiest GPU tray off in each run; `why` was asked about it just before
    # (what it carried: the repairs that come with the fault may leave it carrying nothing)
    # and then.
    for run in outcome.runs.values():
        tray = run.struck[0]
        assert tray.startswith("tray-"), run.struck
        before, during = run.whys[:2]
        assert (before.id, before.moment, during.id) == (tray, "before the fault", tray)
        assert "carries the paths" in before.text and "ComponentFaulted" not in before.chain
        assert "ComponentFaulted" in during.chain, during
    # Pooled compositions on the tray get GPUs from another tray; a fixed box has no other.
    assert pooled.impaired >= 1 and pooled.repaired >= 1
    assert fixed.impaired >= 1 and fixed.repaired == 0

    text = demo.report(outcome, PLAN)
    assert table in text and f"why {outcome.runs['fixed'].struck[0]}" in text
    written = demo.write(outcome, PLAN, tmp_path, text)
    assert plots.available(), "the dev install carries the demo extra"
    assert {p.name for p in written} == {
        "report.txt",
        "figures.json",
        "utilization.png",
        "latency.png",
        "refusals.png",
    }
    for png in (p for p in written if p.suffix == ".png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    record = json.loads((tmp_path / "figures.json").read_text())
    assert record["runs"]["pooled"]["figures"]["served"] == pooled.served
