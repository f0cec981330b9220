"""Placement's cached path core follows the domain state by difference (placement._Core.sync).

Given a fabric and a run of composes, releases and faults (with circuits, slices, bandwidth,
tenants and exclusive holds), when the cached core is synced to each state in turn, or back
to an earlier one, then its live conditions are exactly those of a core built afresh from
that state. The reference twin of the live conditions is used, so they can be read.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from fabric_builder import FabricBuilder, apply, run

import trellis.engine.core.placement as placement
import trellis.ext._live_py as live_py
import trellis.ext._paths_py as paths_py
from trellis.engine.core.intents import Compose, Release, ReportFault
from trellis.engine.core.state import DomainState

TENANTS = ("t", "u", "v")


@pytest.fixture
def reference_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Placement on the reference twins, with a cache of its own."""
    monkeypatch.setattr(placement, "Fabric", paths_py.Fabric)
    monkeypatch.setattr(placement, "LiveConditions", live_py.LiveConditions)
    for name in ("best_costs", "reachable", "census"):
        monkeypatch.setattr(placement, name, getattr(paths_py, name))
    monkeypatch.setattr(placement, "best_devices", live_py.best_devices)
    monkeypatch.setattr(placement, "_CORES", {})


def fabric() -> FabricBuilder:
    b = FabricBuilder()
    for h in ("h1", "h2"):
        b.host(h)
    b.switch("s1").switch("s2").ocs("o1", ports=12)
    b.chain("h1", "s1", gbps=100).chain("h2", "s1", gbps=100).chain("s1", "s2", gbps=100)
    b.link("h2", "o1", gbps=100).link("s2", "o1", gbps=100)
    for i in range(6):
        b.gpu(f"g{i}", generation=9)
        b.link(f"g{i}", "s2" if i % 2 else "s1", gbps=100)
    for i in range(3):
        b.memory(f"m{i}", 64.0)
        b.link(f"m{i}", "o1", gbps=100)
    b.nic("n1").link("n1", "s2", gbps=100)
    return b


def seen(live: live_py.LiveConditions) -> dict[str, Any]:
    """What the search reads of live conditions; an entry at zero or empty is no entry."""
    return {
        "unusable": set(live.unusable),
        "reserved": {k: v for k, v in live.reserved_gbps.items() if v},
        "circuits": dict(live.circuits),
        "users": {k: v for k, v in live.switch_tenants.items() if v},
        "holders": {k: v for k, v in live.exclusive_tenants.items() if v},
        "taken": set(live.taken),
        "sliced": {k: v for k, v in live.sliced_gib.items() if v},
    }


def step(state: DomainState, rng: random.Random, n: int) -> DomainState:
    live = [cid for cid, c in state.compositions.items() if c.state != "released"]
    choice = rng.random()
    intent: msgspec.Struct
    actor = rng.choice(TENANTS)
    if choice < 0.25 and live:
        cid = rng.choice(live)
        actor = state.compositions[cid].tenant
        intent = Release(request_id=f"r{n}", composition_id=cid)
    elif choice < 0.35:
        component = rng.choice([*state.nodes, *state.links])
        intent = ReportFault(
            request_id=f"r{n}", component=component, state=rng.choice(["failed", "healthy"])
        )
        actor = "operator"
    else:
        kind = rng.choice(["gpu", "gpu", "memory", "nic"])
        entry: dict[str, Any] = {
            "kind": kind,
            "count": rng.choice([1, 1, 2]),
            "bandwidth_gbps": rng.choice([0.0, 20.0, 40.0]),
        }
        if kind == "memory":
            entry["capacity_gib"] = 16.0
        body = {
            "request_id": f"r{n}",
            "host": rng.choice(["h1", "h2"]),
            "devices": [entry],
            "constraints": {"isolation": rng.choice(["shared", "shared", "exclusive"])},
        }
        intent = msgspec.convert(body, Compose)
    events, _ = run(state, intent, actor)
    return apply(state, events)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.usefixtures("reference_core")
def test_a_synced_core_has_the_live_conditions_of_a_fresh_one(seed: int) -> None:
    rng = random.Random(seed)
    state = fabric().state()
    history = [state]
    core = placement._Core(state)
    for n in range(40):
        state = step(state, rng, n)
        history.append(state)
        # Now and then back to an earlier state (a scratch state thrown away), and forth.
        target = rng.choice(history) if rng.random() < 0.2 else state
        for s in (target, state):
            assert core.sync(s)
            assert seen(core.live) == seen(placement._Core(s).live), n
