"""The storage ports' contract, one suite for every implementation.

`EventStoreContract`, `LeaseStoreContract` and `SnapshotStoreContract` hold the tests; a test
module binds them to an implementation by subclassing them with a `stores` fixture that gives a
`Stores` (tests/adapters/test_memory_stores.py: the in-memory doubles, in milliseconds;
tests/integration/test_postgres_stores.py: PostgreSQL, in a schema of the test's own). So the
doubles the fast service tests run on keep exactly the rules the real log keeps.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import pytest

from trellis.engine.core import replies
from trellis.engine.core.errors import ConcurrencyConflict, EventRefused, WriterFenced
from trellis.engine.core.records import GENESIS_HASH, Head, PendingEvent, hash_of
from trellis.engine.service.ports import (
    EventStore,
    LeaseStore,
    PendingReply,
    Snapshot,
    SnapshotStore,
)

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SHORT_LEASE_S = 0.2  # long enough to append under, short enough to wait out


class Stores(NamedTuple):
    """One implementation's stores, sharing one database (the log checks the leases)."""

    log: Any  # EventStore, plus read_all
    leases: LeaseStore
    snapshots: SnapshotStore


def pending(
    n: int = 1, *, at: datetime = T0, actor: str = "acme", cause: str = "r-1"
) -> list[PendingEvent]:
    return [
        PendingEvent(
            id=str(uuid.uuid4()),
            type="ComponentDrained",
            schema_version=1,
            actor=actor,
            causation_id=cause,
            correlation_id=cause,
            recorded_at=at + timedelta(seconds=i),
            data=b'{"component":"sw-1"}',
        )
        for i in range(n)
    ]


def answer(request_id: str, *, event_index: int | None = 0, actor: str = "acme") -> PendingReply:
    return PendingReply(
        actor=actor,
        request_id=request_id,
        verb="drain",
        body_hash="h-" + request_id,
        ok=True,
        body=b'{"done":true}',
        event_index=event_index,
    )


async def events_of(log: EventStore, domain: str, **kwargs: Any) -> list[Any]:
    return [e async for e in log.read(domain, **kwargs)]


class EventStoreContract:
    """The log: versions, positions and hashes, all-or-nothing appends, request ids, time."""

    async def test_a_new_domain_has_the_genesis_head_and_no_events(self, stores: Stores) -> None:
        assert await stores.log.head("d1") == Head(0, 0, GENESIS_HASH)
        assert await events_of(stores.log, "d1") == []
        assert "d1" not in await stores.log.domains()

    async def test_the_last_position_is_the_highest_any_domain_was_given(
        self, stores: Stores
    ) -> None:
        assert await stores.log.last_position() == 0
        first = await stores.log.append("d1", Head(), pending(2), [])
        second = await stores.log.append("d2", Head(), pending(1), [])
        assert await stores.log.last_position() == second.head.position
        assert second.head.position > first.head.position

    async def test_a_barrier_records_nothing(self, stores: Stores) -> None:
        # What it waits for (the synchronous standby) is tests/chaos/test_primary_loss.py's.
        appended = await stores.log.append("d1", Head(), pending(1), [])
        await stores.log.barrier()
        assert await stores.log.head("d1") == appended.head
        assert await events_of(stores.log, "d1") == appended.events

    async def test_an_append_numbers_chains_and_returns_the_events(self, stores: Stores) -> None:
        batch = pending(3)
        appended = await stores.log.append("d1", Head(), batch, [])
        assert [e.version for e in appended.events] == [1, 2, 3]
        positions = [e.position for e in appended.events]
        assert positions == sorted(positions) and len(set(positions)) == 3
        prev = GENESIS_HASH
        for version, (sent, got) in enumerate(zip(batch, appended.events, strict=True), 1):
            assert (got.id, got.data, got.prev_hash) == (sent.id, sent.data, prev)
            assert got.hash == hash_of(sent, prev, "d1", version)
            prev = got.hash
        last = appended.events[-1]
        assert appended.head == Head(3, last.position, last.hash)
        assert await stores.log.head("d1") == appended.head
        assert await events_of(stores.log, "d1") == appended.events
        assert await events_of(stores.log, "d1", after_version=1, limit=1) == appended.events[1:2]
        assert await stores.log.domains() == ["d1"]

    async def test_an_append_after_a_stale_head_is_a_conflict_and_writes_nothing(
        self, stores: Stores
    ) -> None:
        first = await stores.log.append("d1", Head(), pending(2), [])
        later = T0 + timedelta(hours=1)  # in time order: only the head is wrong
        with pytest.raises(ConcurrencyConflict):
            await stores.log.append("d1", Head(), pending(1, at=later), [answer("r-2")])
        stale = first.events[0]
        with pytest.raises(ConcurrencyConflict):
            await stores.log.append(
                "d1", Head(stale.version, stale.position, stale.hash), pending(1, at=later), []
            )
        assert await stores.log.head("d1") == first.head
        assert await stores.log.find_replies("d1", [("acme", "r-2")]) == {}

    async def test_of_two_appends_after_one_head_exactly_one_commits(self, stores: Stores) -> None:
        outcomes = await asyncio.gather(
            stores.log.append("d1", Head(), pending(1, cause="a"), [answer("a")]),
            stores.log.append("d1", Head(), pending(1, cause="b"), [answer("b")]),
            return_exceptions=True,
        )
        assert sorted(type(o).__name__ for o in outcomes) == ["Appended", "ConcurrencyConflict"]
        assert len(await events_of(stores.log, "d1")) == 1

    async def test_an_answer_is_stored_once_with_the_position_of_its_event(
        self, stores: Stores
    ) -> None:
        before = await stores.log.append("d1", Head(), pending(1), [])
        appended = await stores.log.append(
            "d1",
            before.head,
            pending(2, at=T0 + timedelta(minutes=1)),
            [answer("r-1", event_index=1)],
        )
        found = await stores.log.find_replies("d1", [("acme", "r-1"), ("acme", "other")])
        assert list(found) == [("acme", "r-1")]
        stored = found[("acme", "r-1")]
        assert stored == appended.replies[0]
        ok = replies.decode_ok(stored.reply)
        assert ok is not None and ok.replayed is False
        assert ok.position == appended.events[1].position
        with pytest.raises(ConcurrencyConflict):  # the same request id again
            await stores.log.append(
                "d1", appended.head, pending(1, at=T0 + timedelta(hours=1)), [answer("r-1")]
            )
        assert await stores.log.head("d1") == appended.head

    async def test_an_answer_without_events_carries_the_head_it_followed(
        self, stores: Stores
    ) -> None:
        first = await stores.log.append("d1", Head(), pending(1), [])
        appended = await stores.log.append("d1", first.head, [], [answer("noop", event_index=None)])
        assert appended.events == [] and appended.head == first.head
        ok = replies.decode_ok(appended.replies[0].reply)
        assert ok is not None and ok.position == first.head.position

    async def test_request_ids_are_per_domain_and_actor(self, stores: Stores) -> None:
        await stores.log.append("d1", Head(), pending(1), [answer("r-1")])
        await stores.log.append("d2", Head(), pending(1), [answer("r-1")])
        await stores.log.append(
            "d1",
            await stores.log.head("d1"),
            pending(1, at=T0 + timedelta(hours=1)),
            [answer("r-1", actor="globex")],
        )
        assert len(await stores.log.find_replies("d1", [("acme", "r-1"), ("globex", "r-1")])) == 2

    async def test_an_event_recorded_before_its_predecessor_is_refused_whole(
        self, stores: Stores
    ) -> None:
        first = await stores.log.append("d1", Head(), pending(1, at=T0), [])
        with pytest.raises(EventRefused):
            await stores.log.append(
                "d1", first.head, pending(1, at=T0 - timedelta(seconds=1)), [answer("late")]
            )
        assert await stores.log.head("d1") == first.head
        assert await stores.log.find_replies("d1", [("acme", "late")]) == {}

    async def test_a_moment_locates_the_last_event_at_or_before_it(self, stores: Stores) -> None:
        appended = await stores.log.append("d1", Head(), pending(3, at=T0), [])
        second = appended.events[1]
        located = await stores.log.locate("d1", T0 + timedelta(seconds=1, milliseconds=500))
        assert located == (Head(2, second.position, second.hash), second.recorded_at)
        by_position = await stores.log.locate("d1", second.position)
        assert by_position is not None and by_position[0].version == 2
        assert await stores.log.locate("d1", T0 - timedelta(days=1)) is None

    async def test_every_domain_reads_back_in_global_position_order(self, stores: Stores) -> None:
        a = await stores.log.append("d1", Head(), pending(2), [])
        b = await stores.log.append("d2", Head(), pending(1), [])
        c = await stores.log.append("d1", a.head, pending(1, at=T0 + timedelta(hours=1)), [])
        everything = [e async for e in stores.log.read_all(a.events[0].position - 1)]
        assert everything == [*a.events, *b.events, *c.events]
        after = [e async for e in stores.log.read_all(b.events[0].position)]
        assert after == c.events

    async def test_under_a_lease_only_its_epoch_appends(self, stores: Stores) -> None:
        epoch = await stores.leases.acquire("d1", "e-1", 30)
        assert epoch == 1
        first = await stores.log.append("d1", Head(), pending(1), [], fence=epoch)
        for stale in (None, epoch + 1):
            with pytest.raises(WriterFenced):
                await stores.log.append(
                    "d1", first.head, pending(1, at=T0 + timedelta(hours=1)), [], fence=stale
                )
            with pytest.raises(WriterFenced):  # a stored answer alone is fenced alike
                await stores.log.append(
                    "d1", first.head, [], [answer("noop", event_index=None)], fence=stale
                )
        assert await stores.log.head("d1") == first.head

    async def test_a_writer_woken_after_a_takeover_is_fenced_whatever_its_events_times(
        self, stores: Stores
    ) -> None:
        # Its successor's events came later than the ones it decided before its pause: it
        # must hear "fenced" (and resend elsewhere), never that its events are refused.
        old = await stores.leases.acquire("d1", "e-1", SHORT_LEASE_S)
        first = await stores.log.append("d1", Head(), pending(1), [], fence=old)
        await asyncio.sleep(SHORT_LEASE_S * 1.5)
        new = await stores.leases.acquire("d1", "e-2", 30)
        assert new is not None and old is not None and new > old
        later = pending(1, at=T0 + timedelta(hours=2))
        await stores.log.append("d1", first.head, later, [], fence=new)
        with pytest.raises(WriterFenced):
            await stores.log.append(
                "d1", first.head, pending(1, at=T0 + timedelta(hours=1)), [], fence=old
            )

    async def test_a_lease_run_out_fences_its_writer(self, stores: Stores) -> None:
        epoch = await stores.leases.acquire("d1", "e-1", SHORT_LEASE_S)
        await asyncio.sleep(SHORT_LEASE_S * 1.5)
        with pytest.raises(WriterFenced):
            await stores.log.append("d1", Head(), pending(1), [], fence=epoch)
        assert await stores.log.head("d1") == Head()


class LeaseStoreContract:
    """Writer leases: one holder at a time, a new epoch per take, renewals only while held."""

    async def test_a_free_lease_is_taken_once(self, stores: Stores) -> None:
        assert await stores.leases.acquire("d1", "e-1", 30) == 1
        assert await stores.leases.acquire("d1", "e-2", 30) is None
        holders = await stores.leases.holders()
        assert [(h.domain, h.engine, h.epoch) for h in holders] == [("d1", "e-1", 1)]

    async def test_a_lease_run_out_is_taken_under_the_next_epoch_and_not_renewed(
        self, stores: Stores
    ) -> None:
        await stores.leases.acquire("d1", "e-1", SHORT_LEASE_S)
        await asyncio.sleep(SHORT_LEASE_S * 1.5)
        assert await stores.leases.holders() == []
        assert await stores.leases.renew("e-1", ["d1"], 30) == {}
        assert await stores.leases.acquire("d1", "e-2", 30) == 2
        assert await stores.leases.renew("e-1", ["d1"], 30) == {}
        assert await stores.leases.renew("e-2", ["d1", "other"], 30) == {"d1": 2}

    async def test_a_lease_is_taken_under_at_least_the_epoch_asked_for(
        self, stores: Stores
    ) -> None:
        # A fabric manager saw epoch 7 of an older log: the first lease is drawn at 8.
        assert await stores.leases.acquire("d1", "e-1", 30, at_least=8) == 8
        await stores.leases.release("d1", "e-1", 8)
        assert await stores.leases.acquire("d1", "e-2", 30, at_least=3) == 9  # never back
        await stores.leases.release("d1", "e-2", 9)
        assert await stores.leases.acquire("d1", "e-1", 30, at_least=12) == 12

    async def test_a_released_lease_is_free_at_once_and_only_its_holder_releases(
        self, stores: Stores
    ) -> None:
        epoch = await stores.leases.acquire("d1", "e-1", 30)
        assert epoch is not None
        await stores.leases.release("d1", "e-2", epoch)  # not the holder: nothing changes
        await stores.leases.release("d1", "e-1", epoch + 1)  # not the epoch: nothing changes
        assert len(await stores.leases.holders()) == 1
        await stores.leases.release("d1", "e-1", epoch)
        assert await stores.leases.holders() == []
        assert await stores.leases.acquire("d1", "e-2", 30) == epoch + 1

    async def test_heartbeats_name_the_live_engines_that_serve_every_domain(
        self, stores: Stores
    ) -> None:
        await stores.leases.heartbeat("e-2", "two", 30)
        await stores.leases.heartbeat("e-3", "three", 30, serves_all=False)
        assert await stores.leases.heartbeat("e-1", "one", 30) == ["e-1", "e-2"]
        await stores.leases.leave("e-2")
        assert await stores.leases.heartbeat("e-1", "one", 30) == ["e-1"]
        await asyncio.sleep(SHORT_LEASE_S * 1.5)
        assert await stores.leases.heartbeat("e-4", "four", SHORT_LEASE_S) == ["e-4"]


class SnapshotStoreContract:
    """Snapshots: newest first, at most a version, trusted only when the log agrees."""

    async def _snapshot(self, stores: Stores, version: int, **changes: Any) -> Snapshot:
        event = (await events_of(stores.log, "d1", after_version=version - 1, limit=1))[0]
        fields = {
            "domain": "d1",
            "kind": "state",
            "version": version,
            "position": event.position,
            "hash": event.hash,
            "recorded_at": event.recorded_at,
            "format": "f1",
            "body": f"body-{version}".encode(),
        }
        return Snapshot(**{**fields, **changes})

    async def test_candidates_come_newest_first_up_to_a_version(self, stores: Stores) -> None:
        await stores.log.append("d1", Head(), pending(3), [])
        for version in (1, 2, 3):
            await stores.snapshots.save(await self._snapshot(stores, version))
        got = [s.version async for s in stores.snapshots.candidates("d1", "state")]
        assert got == [3, 2, 1]
        below = stores.snapshots.candidates("d1", "state", at_most_version=2)
        assert [s.version async for s in below] == [2, 1]
        assert [s async for s in stores.snapshots.candidates("d1", "read_models")] == []

    async def test_a_snapshot_the_log_does_not_hold_is_skipped(self, stores: Stores) -> None:
        await stores.log.append("d1", Head(), pending(2), [])
        await stores.snapshots.save(await self._snapshot(stores, 2, hash="0" * 64))
        await stores.snapshots.save(await self._snapshot(stores, 1))
        got = [s async for s in stores.snapshots.candidates("d1", "state")]
        assert [(s.version, s.body) for s in got] == [(1, b"body-1")]
        first = (await events_of(stores.log, "d1"))[0]
        assert got[0].recorded_at == first.recorded_at

    async def test_the_first_snapshot_of_a_version_is_kept(self, stores: Stores) -> None:
        await stores.log.append("d1", Head(), pending(1), [])
        await stores.snapshots.save(await self._snapshot(stores, 1))
        await stores.snapshots.save(await self._snapshot(stores, 1, body=b"second"))
        got = [s.body async for s in stores.snapshots.candidates("d1", "state")]
        assert got == [b"body-1"]
