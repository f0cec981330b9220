"""No domain can stop another: each domain has its own writer, feed and read models.

An event one domain's log holds that this engine cannot read (written by a newer engine, or
damaged) once stopped the relay and the projections of every domain at that event, and the
engine answered that domain with a bare "internal error". Now the domain in trouble says why,
naming the position, and every other domain is served, fed and projected as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric
from harness import Harness, serving, undecodable_event

TROUBLED, HEALTHY = "hall-a", "hall-b"
QUICK = {"poll_interval": 0.2, "max_backoff": 0.5}
NIC = {"host": "host-01", "devices": [{"kind": "nic"}]}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, follow_options=QUICK
    ) as harness:
        for domain in (TROUBLED, HEALTHY):
            expect_ok(await harness.client.admin(domain, "import-topology", fabric()))
        yield harness


async def poison(h: Harness, domain: str) -> int:
    """Append an event this engine cannot read; its position."""
    future = undecodable_event("00000000-0000-4000-8000-00000000f00d")
    head = await h.store.head(domain)
    appended = await h.store.append(domain, head, [future], [], fence=h.engine.fence(domain))
    for sink in ("projections", "relay"):
        follower = h.followers.of(sink, domain)
        assert follower is not None
        follower.notify()
    return appended.head.position


async def test_an_event_one_domain_cannot_read_holds_up_only_that_domain(h: Harness) -> None:
    expect_ok(await h.client.intent(HEALTHY, "acme", "compose", NIC))
    position = await poison(h, TROUBLED)

    # The troubled domain's followers stop at the event and say why, and so do its writes.
    deadline = asyncio.get_running_loop().time() + 10
    while len(h.followers.failures()) < 2:
        assert asyncio.get_running_loop().time() < deadline, h.followers.failures()
        await asyncio.sleep(0.05)
    failures = h.followers.failures()
    assert {(f.sink, f.domain, f.position) for f in failures} == {
        ("projections", TROUBLED, position),
        ("relay", TROUBLED, position),
    }
    assert all("EventFromTheFuture" in f.cause for f in failures)
    error = expect_error(await h.client.intent(TROUBLED, "acme", "compose", NIC), "unavailable")
    assert error["details"]["position"] == position
    assert "EventFromTheFuture" in error["details"]["cause"]
    assert "internal error" not in error["message"]

    # Every other domain is served, projected and fed as before.
    composed = expect_ok(
        await h.client.intent(
            HEALTHY, "globex", "compose", {"host": "host-01", "devices": [{"kind": "gpu"}]}
        )
    )
    connections = expect_ok(await h.client.query(HEALTHY, "connections", {"tenant": "globex"}))
    assert [c["composition_id"] for c in connections["connections"]] == [composed["composition_id"]]
    await h.projected(HEALTHY)
    await h.relayed(HEALTHY)
    assert {f.domain for f in h.followers.failures()} == {TROUBLED}


async def test_a_request_the_engine_failed_to_serve_names_an_incident_not_the_failure(
    h: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: object, **kwargs: object) -> bytes:
        raise RuntimeError("SELECT secret FROM tenant_b")

    monkeypatch.setattr(h.engine, "handle", broken)
    with caplog.at_level(logging.ERROR, logger="trellis.adapters.nats.intake"):
        error = expect_error(await h.client.query(HEALTHY, "topology"), "unavailable")
    assert "tenant_b" not in str(error), error
    incident = error["details"]["incident"]
    assert error["details"]["error"] == "RuntimeError", error
    (logged,) = [r for r in caplog.records if incident in r.getMessage()]
    assert logged.exc_info is not None and "tenant_b" in str(logged.exc_info[1])
