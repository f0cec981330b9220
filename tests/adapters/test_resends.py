"""Request ids: a resend returns the first answer, a reused id with another body is a conflict.

ARCHITECTURE §3/§6: the reply is stored with the events in one append, keyed by
(domain, actor, request_id), and a resend is answered from it without writing anything. The
writer's behaviour, on the in-memory log; the PostgreSQL key is tests/integration/
test_request_ids.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from integration.fabrics import expect_error, expect_ok, fabric, gpu
from memory_rig import CountingLog, Rig, in_memory

from trellis.engine.core.errors import StoreUnavailable
from trellis.engine.core.records import RecordedEvent
from trellis.engine.service.ports import Appended

DOMAIN = "hall-1"


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    async with in_memory() as r:
        yield r


async def imported(rig: Rig) -> dict[str, Any]:
    reply = await rig.client.admin(
        DOMAIN, "import-topology", {"request_id": "import-1", **fabric()}
    )
    expect_ok(reply)
    return reply


async def test_resending_a_request_id_with_the_same_body_returns_the_stored_reply_replayed(
    rig: Rig,
) -> None:
    # Given: a drain answered first, then another intent that moved the domain's head on.
    first_import = await imported(rig)
    body = {"request_id": "drain-sw", "id": "sw-1", "reason": "maintenance"}
    first = await rig.client.admin(DOMAIN, "drain", body)
    assert first["replayed"] is False
    expect_ok(await rig.client.admin(DOMAIN, "drain", {"id": "gpu-01"}))
    counts = rig.log.counts()

    # When: both are resent, one of them with another key order and spacing.
    again = await rig.client.admin(DOMAIN, "drain", body)
    spaced = b'{ "reason" : "maintenance", "id" : "sw-1", "request_id" : "drain-sw" }'
    respaced = await rig.client.raw(f"admin.{DOMAIN}.drain", spaced)
    import_again = await rig.client.admin(
        DOMAIN, "import-topology", {"request_id": "import-1", **fabric()}
    )

    # Then: the first answers, word for word, marked replayed; nothing new in the log.
    assert again == {**first, "replayed": True}
    assert respaced == again
    assert import_again == {**first_import, "replayed": True}
    assert again["position"] == first["position"] < (await rig.log.head(DOMAIN)).position
    assert rig.log.counts() == counts


async def test_rejects_a_request_id_reused_with_a_different_body_as_conflict(rig: Rig) -> None:
    await imported(rig)
    expect_ok(await rig.client.admin(DOMAIN, "drain", {"request_id": "r-1", "id": "sw-1"}))
    counts = rig.log.counts()

    other_body = await rig.client.admin(DOMAIN, "drain", {"request_id": "r-1", "id": "gpu-01"})
    other_verb = await rig.client.admin(DOMAIN, "undrain", {"request_id": "r-1", "id": "sw-1"})

    for reply in (other_body, other_verb):
        assert expect_error(reply, "conflict")["details"] == {"request_id": "r-1"}
    assert rig.log.counts() == counts
    topo = expect_ok(await rig.client.query(DOMAIN, "topology"))
    drained = {n["id"] for n in topo["nodes"] if n["drained"]}
    assert drained == {"sw-1"}


async def test_two_requests_with_the_same_request_id_in_flight_together_make_one_event(
    rig: Rig,
) -> None:
    await imported(rig)

    for round_ in range(8):
        rid = f"twin-{round_}"
        body = {"request_id": rid, "node": gpu(f"gpu-t{round_}")}

        a, b = await asyncio.gather(
            rig.client.admin(DOMAIN, "add-node", body), rig.client.admin(DOMAIN, "add-node", body)
        )

        assert expect_ok(a) == expect_ok(b)
        assert a["position"] == b["position"]
        assert sorted([a["replayed"], b["replayed"]]) == [False, True]
        assert [e.causation_id for e in rig.log.all_events()].count(rid) == 1
    assert rig.log.event_types(DOMAIN) == [
        "TopologyImported",
        *["NodeAdded"] * 8,
    ]
    assert rig.log.counts() == (9, 9)


async def test_racing_bodies_under_one_request_id_leave_one_winner_and_conflicts(rig: Rig) -> None:
    await imported(rig)
    same = {"request_id": "race", "node": gpu("gpu-a")}
    other = {"request_id": "race", "node": gpu("gpu-b")}

    replies = await asyncio.gather(
        *(rig.client.admin(DOMAIN, "add-node", b) for b in (same, other, same, other))
    )

    firsts = [r for r in replies if r["ok"] and not r["replayed"]]
    assert len(firsts) == 1
    winner = firsts[0]["result"]["component"]
    for body, reply in zip((same, other, same, other), replies, strict=True):
        if body["node"]["id"] == winner:
            assert reply == {**firsts[0], "replayed": reply["replayed"]}
        else:
            expect_error(reply, "conflict")
    assert rig.log.event_types(DOMAIN) == ["TopologyImported", "NodeAdded"]


class StandbyAway(CountingLog):
    """A primary whose synchronous standby is away: a commit is made, but its wait for the
    standby never ends (StoreUnavailable once given up); `failover` promotes a standby that
    has only what was committed before it went away."""

    def __init__(self) -> None:
        super().__init__()
        self.away = False
        self.barriers = 0
        self._standby_had: tuple[list[RecordedEvent], dict[str, dict[Any, Any]]] = ([], {})

    def standby_leaves(self) -> None:
        self.away = True
        self._standby_had = (list(self._log), {d: dict(r) for d, r in self._replies.items()})

    def failover(self) -> None:
        self.away = False
        self._log, replies_ = self._standby_had
        self._replies = {d: dict(r) for d, r in replies_.items()}
        self._domains = {}
        for event in self._log:
            self._domains.setdefault(event.domain, []).append(event)

    async def append(self, *args: Any, **kwargs: Any) -> Appended:
        appended = await super().append(*args, **kwargs)
        if self.away:  # committed on the primary alone
            raise StoreUnavailable("TimeoutError: canceling wait for synchronous replication")
        return appended

    async def barrier(self) -> None:
        self.barriers += 1
        if self.away:
            raise StoreUnavailable("TimeoutError: canceling wait for synchronous replication")


async def test_a_resend_is_answered_from_the_log_only_once_a_commit_waited_for_the_standby() -> (
    None
):
    # ARCHITECTURE §6 / docs/deployment.md: a commit whose wait for the standby was cancelled
    # is on the primary alone; answering a resend from it would acknowledge an intent the
    # standby may never have. The engine first commits something of its own that waits.
    log = StandbyAway()
    async with in_memory(log=log) as rig:
        await imported(rig)
        body = {"request_id": "drain-sw", "id": "sw-1", "reason": "maintenance"}
        first = await rig.client.admin(DOMAIN, "drain", body)
        assert log.barriers == 0  # a commit covers itself

        log.standby_leaves()
        refused = await rig.client.admin(DOMAIN, "drain", body)
        assert expect_error(refused, "unavailable")
        log.away = False
        again = await rig.client.admin(DOMAIN, "drain", body)
        assert again == {**first, "replayed": True}
        assert log.barriers == 2


async def test_a_writer_that_folded_what_a_failover_lost_reads_the_domain_again() -> None:
    # A release committed on the primary alone; the writer read it back (a resend, refused
    # while the standby is away); the standby is promoted without it. The writer must not go
    # on from what it folded: the resend is decided again on the log as it stands.
    log = StandbyAway()
    async with in_memory(log=log) as rig:
        await imported(rig)
        compose = {"request_id": "c-1", "host": "host-01", "devices": [{"kind": "gpu"}]}
        cid = expect_ok(await rig.client.intent(DOMAIN, "acme", "compose", compose))
        release = {"request_id": "r-1", "composition_id": cid["composition_id"]}

        log.standby_leaves()
        expect_error(await rig.client.intent(DOMAIN, "acme", "release", release), "unavailable")
        expect_error(await rig.client.intent(DOMAIN, "acme", "release", release), "unavailable")
        log.failover()
        released = await rig.client.intent(DOMAIN, "acme", "release", release)

        assert expect_ok(released)["state"] == "released"
        assert log.event_types(DOMAIN).count("CompositionReleased") == 1


async def test_a_new_request_costs_no_look_up_and_a_resend_still_gets_its_first_answer(
    rig: Rig,
) -> None:
    """The writer takes a batch as new and lets the log's unique request ids catch a resend:
    a commit of new requests makes no look-up round trip, and a resend (which would compose a
    second GPU if decided again) is refused by the log, looked up and answered as first."""
    await imported(rig)
    compose = {"request_id": "c-1", "host": "host-01", "devices": [{"kind": "gpu"}]}
    looked = rig.log.look_ups
    first = await rig.client.intent(DOMAIN, "acme", "compose", compose)
    assert rig.log.look_ups == looked  # the commit of a new request looked nothing up
    counts = rig.log.counts()

    again = await rig.client.intent(DOMAIN, "acme", "compose", compose)

    assert again == {**first, "replayed": True}
    assert rig.log.counts() == counts and rig.log.look_ups > looked


async def test_a_resend_to_the_next_writer_is_caught_by_the_log_and_answered_as_first() -> None:
    """A writer that did not commit a request decides it as new: the log's unique request id
    refuses the append (nothing is written), and the retry answers from the stored reply."""
    log = CountingLog()
    compose = {"request_id": "c-1", "host": "host-01", "devices": [{"kind": "gpu"}]}
    async with in_memory(log=log) as first_engine:
        await imported(first_engine)
        first = await first_engine.client.intent(DOMAIN, "acme", "compose", compose)
    counts, appends = log.counts(), log.appends

    async with in_memory(log=log) as next_engine:
        again = await next_engine.client.intent(DOMAIN, "acme", "compose", compose)

    assert again == {**first, "replayed": True}
    assert log.counts() == counts and log.appends == appends  # the refused append wrote nothing
