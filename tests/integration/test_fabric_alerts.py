"""What an on-call alert reads about fabric faults, scraped from a real engine's /metrics:
live compositions by state (`trellis_compositions`) and the components that carry no paths
(`trellis_components_unusable`). /healthz stays 200 through fabric faults (the engine serves),
so these gauges are what an alert on them reads (docs/operations.md: Metrics and health).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio
from fabrics import expect_ok, fabric
from harness import Harness, serving
from test_observability import health, sample, scraped

DOMAIN = "hall-1"
H100 = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["H100"]}]}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, metrics_at=("127.0.0.1", 0)
    ) as harness:
        yield harness


def compositions(samples: dict, state: str) -> float | None:
    return sample(samples, "trellis_compositions", domain=DOMAIN, state=state)


def unusable(samples: dict, kind: str, state: str) -> float | None:
    return sample(samples, "trellis_components_unusable", domain=DOMAIN, kind=kind, state=state)


async def test_a_fault_on_a_used_link_shows_an_impaired_composition_and_a_failed_link(
    h: Harness,
) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
    before = await scraped(h)
    # Every live state and every (kind, state) of the domain is there at 0 before any fault.
    assert [compositions(before, s) for s in ("pending", "active", "impaired")] == [0, 0, 0]
    for kind in ("host", "switch", "ocs", "link", "gpu", "memory", "nic", "nvme"):
        for state in ("failed", "degraded", "drained"):
            assert unusable(before, kind, state) == 0, (kind, state)

    cid = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100))["composition_id"]
    assert compositions(await scraped(h), "active") == 1

    # gpu-01 is reached over l-gpu-01 only: its failure impairs the composition.
    fault = {"component": "l-gpu-01", "state": "failed", "detail": "los"}
    assert expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))["impaired"] == [cid]
    expect_ok(await h.client.admin(DOMAIN, "drain", {"id": "nic-01"}))
    expect_ok(
        await h.client.admin(DOMAIN, "report-fault", {"component": "sw-1", "state": "degraded"})
    )
    during = await scraped(h)
    assert compositions(during, "impaired") == 1 and compositions(during, "active") == 0
    assert unusable(during, "link", "failed") == 1
    assert unusable(during, "switch", "degraded") == 1
    assert unusable(during, "nic", "drained") == 1
    assert unusable(during, "gpu", "failed") == 0
    # Fabric faults are no engine fault: /healthz stays 200 (the gauges are what to alert on).
    assert h.metrics_url is not None
    assert (await asyncio.to_thread(health, h.metrics_url))[0] == 200

    # Healed: the link and the switch recover, the nic is undrained; the repair makes the
    # composition active again.
    for component in ("l-gpu-01", "sw-1"):
        healed = {"component": component, "state": "healthy"}
        expect_ok(await h.client.admin(DOMAIN, "report-fault", healed))
    expect_ok(await h.client.admin(DOMAIN, "undrain", {"id": "nic-01"}))
    after = await scraped(h)
    for kind, state in (("link", "failed"), ("switch", "degraded"), ("nic", "drained")):
        assert unusable(after, kind, state) == 0, (kind, state)
    deadline = asyncio.get_running_loop().time() + 15
    while compositions(after, "impaired") != 0:
        assert asyncio.get_running_loop().time() < deadline, "still impaired after healing"
        await asyncio.sleep(0.2)
        after = await scraped(h)
    assert compositions(after, "active") == 1

    expect_ok(await h.client.intent(DOMAIN, "acme", "release", {"composition_id": cid}))
    gone = await scraped(h)
    assert [compositions(gone, s) for s in ("pending", "active", "impaired")] == [0, 0, 0]
