"""Every query at any past moment answers what it answered live then (ARCHITECTURE §4, §6).

A scripted day (composes, a release, an extension, a drain, faults and repairs, a lease that
expires, a re-import with changes, a last release) runs against a real engine over NATS and
Postgres with a clock the test moves. After each step every query's live answer is recorded
with the log position and the time. Then each query is asked again at each recorded position
and time: from the engine's snapshots, without any (the fold starts at the first event), and
with the newest snapshots damaged, and every answer must be the one recorded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import edited, expect_error, expect_ok
from harness import CountingLog, Harness, ManualClock, serving

from trellis.adapters.postgres.snapshots import PostgresSnapshots
from trellis.engine.core.checkpoints import Signer
from trellis.engine.core.errors import EventRefused
from trellis.engine.core.records import PendingEvent
from trellis.engine.service.writer import DomainWriter

DOMAIN = "hall-1"
FABRIC = json.loads((Path(__file__).parents[2] / "examples" / "fabric.json").read_text())
SNAPSHOT_EVERY = 4
WHY_TARGETS = [
    "host-01", "host-02", "host-03", "sw-r1", "sw-pool", "ocs-1", "gpu-001", "gpu-002",
    "gpu-005", "gpu-011", "gpu-012", "mem-01", "l-001", "l-003",
]  # fmt: skip

Ask = tuple[str, str | None, str, dict[str, Any]]  # (family, tenant, what, body)


@pytest_asyncio.fixture
async def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def signer() -> Signer:
    return Signer.generate()


@pytest_asyncio.fixture
async def h(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    clock: ManualClock,
    signer: Signer,
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        clock=clock,
        snapshot_every=SNAPSHOT_EVERY,
        signer=signer,
    ) as harness:
        yield harness


class Moment(msgspec.Struct, kw_only=True):
    step: str
    position: int
    time: str
    answers: dict[str, Any]  # key of an Ask -> the reply's result, or its error


def asks(compositions: list[str]) -> list[Ask]:
    queries: list[Ask] = [
        ("query", None, "topology", {}),
        ("query", None, "free", {}),
        ("query", None, "free", {"kind": "memory"}),
        ("query", None, "blast-radius", {"id": "sw-pool"}),
        ("query", None, "blast-radius", {"id": "sw-r1"}),
        ("query", None, "quotas", {}),
        ("query", None, "connections", {}),
        ("query", None, "connections", {"tenant": "acme"}),
        ("query", None, "connections", {"host": "host-01"}),
        ("view", "acme", "topology", {}),
        ("view", "acme", "connections", {}),
        ("view", "globex", "why", {"id": "gpu-002"}),
        ("query", None, "history", {}),
        ("query", None, "history", {"tenant": "acme"}),
        ("query", None, "history", {"id": "host-01"}),
        ("view", "globex", "history", {}),
    ]
    queries += [("query", None, "why", {"id": target}) for target in WHY_TARGETS]
    for cid in compositions:
        queries.append(("query", None, "composition", {"id": cid}))
        queries.append(("query", None, "why", {"id": cid}))
    return queries


def key(ask: Ask) -> str:
    family, tenant, what, body = ask
    return f"{family}.{tenant}.{what}.{json.dumps(body, sort_keys=True)}"


async def ask(h: Harness, question: Ask, at: int | str | None = None) -> Any:
    family, tenant, what, body = question
    if at is not None:
        body = {**body, "at": at}
    if family == "view":
        assert tenant is not None
        reply = await h.client.view(DOMAIN, tenant, what, body)
    else:
        reply = await h.client.query(DOMAIN, what, body)
    if reply["ok"]:
        return reply["result"]
    return {"error": reply["error"]["code"], "message": reply["error"]["message"]}


Step = Callable[[], Awaitable[Any]]


async def run_day(h: Harness, clock: ManualClock) -> tuple[list[Moment], list[str]]:
    """The scripted day; the live answers after each step."""
    client = h.client
    cids: list[str] = []

    async def compose(tenant: str, body: dict[str, Any]) -> None:
        cids.append(
            expect_ok(await client.intent(DOMAIN, tenant, "compose", body))["composition_id"]
        )

    async def release(tenant: str, index: int) -> None:
        expect_ok(await client.intent(DOMAIN, tenant, "release", {"composition_id": cids[index]}))

    changed = edited(FABRIC)
    changed["nodes"] = [n for n in changed["nodes"] if n["id"] != "nvme-02"]
    changed["links"] = [lk for lk in changed["links"] if "nvme-02" not in (lk["a"], lk["b"])]
    next(n for n in changed["nodes"] if n["id"] == "gpu-005")["labels"] = {"zone": "eu"}

    steps: list[tuple[str, Step]] = [
        ("import", lambda: client.admin(DOMAIN, "import-topology", FABRIC)),
        (
            "compose acme",
            lambda: compose(
                "acme",
                {
                    "host": "host-01",
                    "devices": [
                        {"kind": "gpu", "count": 2, "bandwidth_gbps": 64},
                        {"kind": "memory", "capacity_gib": 512, "bandwidth_gbps": 64},
                    ],
                    "lease_seconds": 3600,
                    "labels": {"workload": "decode"},
                    "reason": "decode pool scale-up",
                },
            ),
        ),
        (
            "compose globex",
            lambda: compose("globex", {"host": "host-03", "devices": [{"kind": "gpu"}]}),
        ),
        (
            "compose initech",
            lambda: compose(
                "initech",
                {
                    "host": "host-02",
                    "devices": [{"kind": "gpu"}, {"kind": "memory", "capacity_gib": 128}],
                    # Due only in the step "lease expires" (steps are 60 s apart): the
                    # engine's lease keeper must not expire it while a step's answers are
                    # being recorded.
                    "lease_seconds": 600,
                    "reason": "batch job",
                },
            ),
        ),
        ("release globex", lambda: release("globex", 1)),
        (
            "extend acme",
            lambda: client.intent(
                DOMAIN, "acme", "extend", {"composition_id": cids[0], "lease_seconds": 7200}
            ),
        ),
        ("drain", lambda: client.admin(DOMAIN, "drain", {"id": "gpu-012", "reason": "firmware"})),
        (
            "degrade",
            lambda: client.admin(
                DOMAIN,
                "report-fault",
                {"component": "gpu-011", "state": "degraded", "detail": "ecc"},
            ),
        ),
        (
            "fail switch",
            lambda: client.admin(
                DOMAIN, "report-fault", {"component": "sw-pool", "state": "failed", "detail": "psu"}
            ),
        ),
        (
            "repair switch",
            lambda: client.admin(
                DOMAIN, "report-fault", {"component": "sw-pool", "state": "healthy"}
            ),
        ),
        ("lease expires", lambda: _expire(h, clock)),
        ("re-import", lambda: client.admin(DOMAIN, "import-topology", changed)),
        ("release acme", lambda: release("acme", 0)),
    ]
    moments = []
    for name, step in steps:
        clock.advance(60)
        reply = await step()
        if isinstance(reply, dict):
            expect_ok(reply)
        await h.fabric_idle(DOMAIN)
        position = await h.projected(DOMAIN)
        answers = {key(q): await ask(h, q) for q in asks(cids)}
        time = str(msgspec.to_builtins(clock.at))
        moments.append(Moment(step=name, position=position, time=time, answers=answers))
    return moments, cids


async def _expire(h: Harness, clock: ManualClock) -> None:
    clock.advance(300)  # initech's lease of 600 s, composed 420 s before, falls due
    await h.engine.expire_due_leases()


async def asked_again(h: Harness, moments: list[Moment], cids: list[str], by: str) -> list[str]:
    """Every recorded question asked at every recorded moment; what differs."""
    differences = []
    for moment in moments:
        at: int | str = moment.position if by == "position" else moment.time
        for question in asks(cids):
            want = moment.answers.get(key(question))
            got = await ask(h, question, at=at)
            if want is None:  # a composition that did not exist yet then
                if got.get("error") != "not_found":
                    differences.append(f"{moment.step} @{at} {key(question)}: {got}")
            elif got != want:
                differences.append(f"{moment.step} @{at} {key(question)}:\n  {want}\n  {got}")
    return differences


async def test_every_query_at_every_past_moment_answers_what_it_answered_then(
    h: Harness, clock: ManualClock, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    moments, cids = await run_day(h, clock)
    assert len({m.position for m in moments}) == len(moments)
    kinds = {r["kind"]: r["n"] for r in await pool.fetch(
        "SELECT kind, count(*) AS n FROM trellis_snapshots GROUP BY kind"
    )}  # fmt: skip
    assert kinds.get("state", 0) >= 3 and kinds.get("read_models", 0) >= 3, kinds

    # From the snapshots, by position and by time.
    assert await asked_again(h, moments, cids, "position") == []
    assert await asked_again(h, moments, cids, "time") == []

    # Damaged snapshots are skipped with a warning, and older ones (or the log) serve.
    caplog.set_level(logging.WARNING)
    newest = await pool.fetch(
        "SELECT kind, max(version) AS version FROM trellis_snapshots GROUP BY kind"
    )
    for row in newest:
        await pool.execute(
            "UPDATE trellis_snapshots SET body = '\\x00c1c1'::bytea "
            "WHERE kind = $1 AND version = $2",
            row["kind"],
            row["version"],
        )
    second = await pool.fetch(
        "SELECT kind, version FROM trellis_snapshots s WHERE version < "
        "(SELECT max(version) FROM trellis_snapshots t WHERE t.kind = s.kind) "
        "ORDER BY version DESC LIMIT 2"
    )
    for row in second:
        await pool.execute(
            "UPDATE trellis_snapshots SET hash = repeat('f', 64) WHERE kind = $1 AND version = $2",
            row["kind"],
            row["version"],
        )
    assert await asked_again(h, moments[-4:], cids, "position") == []
    assert "its seal does not verify" in caplog.text
    assert "the log does not hold that event" in caplog.text

    # Without any snapshot every fold starts at the first event: the same answers.
    await pool.execute("DELETE FROM trellis_snapshots")
    assert await asked_again(h, moments, cids, "position") == []


async def test_a_moment_before_the_domain_existed_is_not_found(
    h: Harness, clock: ManualClock
) -> None:
    before = str(msgspec.to_builtins(clock.at))
    clock.advance(60)
    expect_ok(await h.client.admin(DOMAIN, "import-topology", FABRIC))
    for what, body in [("topology", {}), ("why", {"id": "gpu-001"}), ("connections", {})]:
        reply = await h.client.query(DOMAIN, what, {**body, "at": before})
        assert "did not exist yet" in expect_error(reply, "not_found")["message"]
    at_import = str(msgspec.to_builtins(clock.at))
    reply = await h.client.query(DOMAIN, "why", {"id": "gpu-001", "at": at_import})
    assert "free" in expect_ok(reply)["text"]


@pytest.mark.parametrize(
    ("what", "body"),
    [
        ("free", {"at": "0001-01-01T00:00:00+14:00"}),
        ("topology", {"at": "9999-12-31T23:59:59-14:00"}),
        ("history", {"since": "0001-01-01T00:00:00+14:00"}),
        ("history", {"until": "9999-12-31T23:59:59-14:00"}),
    ],
)
async def test_a_moment_outside_the_years_of_utc_is_invalid(
    h: Harness, what: str, body: dict[str, str]
) -> None:
    """The store's DataError came back as `unavailable`, "retry", with asyncpg's text."""
    expect_ok(await h.client.admin(DOMAIN, "import-topology", FABRIC))
    error = expect_error(await h.client.query(DOMAIN, what, body), "invalid")
    assert "outside the years 1 to 9999 in UTC" in error["message"], error
    assert "DataError" not in str(error)


async def test_an_engine_starts_from_its_newest_snapshot_with_the_state_a_full_fold_gives(
    h: Harness, clock: ManualClock, pool: asyncpg.Pool, signer: Signer
) -> None:
    await run_day(h, clock)
    head = await h.store.head(DOMAIN)
    live = h.engine.state(DOMAIN)
    full, snapped = CountingLog(h.store), CountingLog(h.store)
    from_log = DomainWriter(DOMAIN, full, clock, 1)  # type: ignore[arg-type]
    from_snapshot = DomainWriter(
        DOMAIN,
        snapped,
        clock,
        1,
        snapshots=PostgresSnapshots(pool, signer),  # type: ignore[arg-type]
    )
    await from_log.catch_up()
    await from_snapshot.catch_up()
    assert from_log.state == from_snapshot.state == live
    assert from_log.head == from_snapshot.head == head
    assert full.read_events == head.version
    assert snapped.read_events < SNAPSHOT_EVERY + 8  # the snapshot's tail only (group commit)


async def test_time_never_goes_back_along_a_domain(h: Harness, clock: ManualClock) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", FABRIC))
    imported = [e async for e in h.store.read(DOMAIN)][-1]
    # The engine's clock goes back (another engine took over, say): events keep the last time.
    clock.advance(-3600)
    expect_ok(await h.client.admin(DOMAIN, "drain", {"id": "gpu-012", "reason": "firmware"}))
    drained = [e async for e in h.store.read(DOMAIN)][-1]
    assert drained.recorded_at == imported.recorded_at
    # And the log itself refuses an event recorded before its predecessor, whoever writes it
    # (under the domain's writer lease: a writer without it is fenced first).
    earlier = PendingEvent(
        id="00000000-0000-4000-8000-0000000000aa",
        type="ComponentUndrained",
        schema_version=1,
        actor="operator",
        causation_id="r-back",
        correlation_id="r-back",
        recorded_at=clock.at,
        data=b'{"component":"gpu-012"}',
    )
    head = await h.store.head(DOMAIN)
    with pytest.raises(
        (EventRefused, asyncpg.PostgresError, Exception), match="before its predecessor"
    ):
        await h.store.append(DOMAIN, head, [earlier], [], fence=h.engine.fence(DOMAIN))
    assert await h.store.head(DOMAIN) == head
