"""`trellis verify`'s stream check against messages published into TRELLIS_EVENTS by someone
other than the relay (plain mode lets anyone): a byte-for-byte copy of an earlier event, a
forged event past the log's head, a forged event that does not chain; each is a finding naming
the stream sequence and the version. A foreign message stays a count, and a clean run has no
finding."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric
from harness import Harness, cli_env, run_cli, serving
from lost_tail import lose_tail
from nats.aio.client import Client as NATS

from trellis.adapters.entrypoints.audit_verify import verify
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import Envelope, encode_envelope, stream_name
from trellis.engine.core.records import format_time

HALL = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    # Quiet followers look at their checkpoints every 0.2 s, not every 5 (a lost tail).
    quick = {"poll_interval": 0.2}
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, follow_options=quick
    ) as harness:
        yield harness


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    conn = await connect_nats(nats_url, name="test-stream-forger")
    yield conn
    await conn.close()


async def settled(h: Harness) -> None:
    await h.fabric_idle(HALL)
    await h.projected(HALL)
    await h.relayed(HALL)


async def compose(h: Harness, device: dict[str, Any]) -> None:
    expect_ok(
        await h.client.intent(HALL, "acme", "compose", {"host": "host-01", "devices": [device]})
    )
    await settled(h)


async def stream_findings(nats_url: str, database_url: str, schema: str, prefix: str) -> Any:
    report = await verify(database_url, schema=schema, nats_url=nats_url, prefix=prefix)
    found = [f for f in report["domains"][HALL]["findings"] if f["check"] == "stream"]
    return report, found


async def publish_copy(nc: NATS, prefix: str, seq: int) -> int:
    """The message at `seq` again, its body byte for byte and its Nats-Msg-Id, once the
    server's duplicate window has passed (anyone may shrink it in plain mode); its sequence."""
    js = nc.jetstream()
    msg = await js.get_msg(stream_name(prefix), seq)
    # Its id; not the relay's atomic-batch headers, which the server would act on.
    headers = {"Nats-Msg-Id": (msg.headers or {})["Nats-Msg-Id"]}
    for _ in range(20):
        config = (await js.stream_info(stream_name(prefix))).config
        config.duplicate_window = 0.2
        await js.update_stream(config)
        await asyncio.sleep(0.5)
        ack = await js.publish(msg.subject or "", msg.data or b"", headers=headers)
        if not ack.duplicate:
            return int(ack.seq)
    raise AssertionError("the copy was taken for a duplicate every time")


def forged(last: Envelope, version: int, prev_hash: str) -> Envelope:
    """A well-formed CompositionReleased at `version`: its own hash is right."""
    now = datetime.now(UTC)
    event = Envelope(
        id=str(uuid.uuid4()),
        domain=HALL,
        version=version,
        position=last.position + 1,
        type="CompositionReleased",
        schema_version=1,
        recorded_at=format_time(now),
        actor="acme",
        causation_id="forged",
        correlation_id="forged",
        data=msgspec.Raw(b'{"type":"CompositionReleased","composition_id":"c-0"}'),
        prev_hash=prev_hash,
        hash="",
    )
    event.hash = event.computed_hash(datetime.fromisoformat(event.recorded_at))
    return event


async def publish(nc: NATS, prefix: str, event: Envelope) -> int:
    subject = f"{prefix}.events.{HALL}.{event.type}"
    ack = await nc.jetstream().publish(
        subject, encode_envelope(event), headers={"Nats-Msg-Id": event.id}
    )
    return int(ack.seq)


async def last_event(nc: NATS, prefix: str) -> Envelope:
    msg = await nc.jetstream().get_last_msg(stream_name(prefix), f"{prefix}.events.{HALL}.*")
    return msgspec.json.decode(msg.data or b"", type=Envelope)


async def test_a_copied_and_a_forged_event_in_the_stream_are_findings_with_exit_1(
    h: Harness,
    nc: NATS,
    tmp_path: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await compose(h, {"kind": "gpu"})
    report, found = await stream_findings(nats_url, database_url, pg_schema, subject_prefix)
    assert report["ok"] and found == []

    js = nc.jetstream()
    first = await js.get_msg(stream_name(subject_prefix), 1)
    copied = msgspec.json.decode(first.data or b"", type=Envelope)
    last = await last_event(nc, subject_prefix)  # the log's head, as the stream carries it
    copy_seq = await publish_copy(nc, subject_prefix, 1)
    await publish(nc, subject_prefix, msgspec.structs.replace(copied, id=str(uuid.uuid4())))
    beyond = forged(last, last.version + 1, last.hash)
    beyond_seq = await publish(nc, subject_prefix, beyond)

    env = cli_env(tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix)
    code, out, _ = await run_cli(env, "verify", "--domain", HALL, timeout=120)
    assert code == 1, out
    report, found = await stream_findings(nats_url, database_url, pg_schema, subject_prefix)
    assert not report["ok"]
    by_seq = {f["details"]["seq"]: f for f in found}
    assert set(by_seq) == {copy_seq, beyond_seq}, found
    assert by_seq[copy_seq]["version"] == copied.version == 1
    assert "second copy" in by_seq[copy_seq]["message"]
    assert by_seq[beyond_seq]["version"] == last.version + 1
    assert f"the log ends at version {last.version}" in by_seq[beyond_seq]["message"]
    assert f"FINDING stream: seq {copy_seq} of the stream" in out
    # The copy under another id fails its own hash: no event of the log's form, counted.
    assert report["checks"]["stream"]["foreign"] == 1


async def test_a_forged_event_that_does_not_chain_is_a_finding_even_once_written_over(
    h: Harness, nc: NATS, nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await compose(h, {"kind": "gpu"})
    last = await last_event(nc, subject_prefix)
    seq = await publish(nc, subject_prefix, forged(last, last.version + 1, last.prev_hash))
    await compose(h, {"kind": "nic"})  # the engine writes that version for real

    _, found = await stream_findings(nats_url, database_url, pg_schema, subject_prefix)
    assert [(f["details"]["seq"], f["version"]) for f in found] == [(seq, last.version + 1)]
    assert "does not chain" in found[0]["message"]


async def test_a_forged_event_chained_and_written_over_looks_like_a_lost_tail_and_is_said(
    h: Harness,
    nc: NATS,
    tmp_path: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    """Exactly what a failover that lost the log's tail leaves (docs/deployment.md §3): no
    finding, but the report names it, since only secure mode keeps forgers out."""
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await compose(h, {"kind": "gpu"})
    last = await last_event(nc, subject_prefix)
    seq = await publish(nc, subject_prefix, forged(last, last.version + 1, last.hash))
    await compose(h, {"kind": "nic"})

    report, found = await stream_findings(nats_url, database_url, pg_schema, subject_prefix)
    assert found == [] and report["ok"]
    rewritten = report["checks"]["stream"]["rewritten"][HALL]
    assert rewritten == [{"seq": seq, "version": last.version + 1}]
    env = cli_env(tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix)
    code, out, _ = await run_cli(env, "verify", "--domain", HALL, timeout=120)
    assert code == 0
    said = f"1 event the log wrote again after a lost tail (seq {seq} version {last.version + 1})"
    assert said in out


@pytest.mark.parametrize("restored", [False, True], ids=["failover", "restored-backup"])
async def test_the_events_a_lost_tail_left_in_the_stream_are_no_finding(
    h: Harness,
    nc: NATS,
    owner_url: str,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    restored: bool,
) -> None:
    """docs/deployment.md §3: the stream keeps the lost events, the relay publishes the log's
    own at those versions after them. Counted in the report, not a finding."""
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await settled(h)
    kept = len([r async for r in h.store.read(HALL)])
    await compose(h, {"kind": "nic"})
    await compose(h, {"kind": "gpu"})
    lost = len([r async for r in h.store.read(HALL)]) - kept
    await lose_tail(
        owner_url, pg_schema, HALL, kept, relay_checkpoint=restored, reuse_positions=restored
    )
    await compose(h, {"kind": "gpu"})  # written at the lost versions
    log = [r async for r in h.store.read(HALL)]
    for _ in range(100):  # the relay's progress is a position: wait on the stream's end
        if (await last_event(nc, subject_prefix)).id == log[-1].id:
            break
        await asyncio.sleep(0.1)

    report, found = await stream_findings(nats_url, database_url, pg_schema, subject_prefix)
    assert found == []
    rewritten = report["checks"]["stream"]["rewritten"][HALL]
    assert [r["version"] for r in rewritten] == list(range(kept + 1, kept + lost + 1))
