"""`trellis verify` over a real engine's log, projections and KV bucket, then over damaged ones.

A scripted run (composes of several kinds, an exclusive one, a fault and its repair, a
recovery, a lease that expires, releases, a re-import that changes the fabric) must verify
clean, with exit 0. Then each kind of damage is done the way an operator at a SQL prompt (or
with NATS access) would do it, and verify must name it exactly: an event row changed as a
superuser with triggers off (its position), a projection row changed (its table and key), a KV
value changed or deleted (its key), and a log forged with valid hashes that gives one device
to two compositions (only the invariant audit can tell; it names the first position).
"""

from __future__ import annotations

import base64
import copy
import json
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok
from harness import Harness, ManualClock, cli_env, run_cli, serving, undecodable_event
from isolation import Database
from nats.js import JetStreamContext

from trellis.adapters.entrypoints import audit_verify
from trellis.adapters.entrypoints.audit_verify import verify
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import bucket_name
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.checkpoints import Checkpoint, Signer, origin_of
from trellis.engine.core.events import (
    CompositionRequested,
    DeviceBinding,
    DevicesReserved,
    TopologyImported,
)
from trellis.engine.core.intents import Compose
from trellis.engine.core.merkle import MerkleTree, leaf_hash
from trellis.engine.core.model import LinkSpec, NodeSpec
from trellis.engine.core.records import Head, PendingEvent, RecordedEvent, hash_of

HALL = "hall-1"
OTHER = "hall-2"
FABRIC = json.loads((Path(__file__).parents[2] / "examples" / "fabric.json").read_text())


@pytest_asyncio.fixture
async def clock() -> ManualClock:
    return ManualClock(datetime.now(UTC))


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, clock: ManualClock
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix, clock=clock) as harness:
        yield harness


@pytest_asyncio.fixture
async def sql(owner_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    """The schema's owner at a SQL prompt."""
    conn = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    yield conn
    await conn.close()


@pytest.fixture
def env(
    tmp_path: Path, nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> dict[str, str]:
    return cli_env(tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix)


async def trellis(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    return await run_cli(env, *args, timeout=120)  # verify replays the whole log


async def compose(h: Harness, tenant: str, body: dict[str, Any], domain: str = HALL) -> str:
    result = expect_ok(await h.client.intent(domain, tenant, "compose", body))
    await h.fabric_idle(domain)
    return str(result["composition_id"])


async def scripted_run(h: Harness, clock: ManualClock) -> None:
    """Given: two halls and a day of composes, faults, repairs, expiries, releases and a
    re-import, settled in the projections and the bucket."""
    admin = h.client.admin
    expect_ok(await admin(HALL, "import-topology", FABRIC))
    expect_ok(await admin(OTHER, "import-topology", FABRIC))
    decode = await compose(
        h,
        "acme",
        {
            "host": "host-01",
            "devices": [
                {"kind": "gpu", "count": 2, "bandwidth_gbps": 32},
                {"kind": "memory", "capacity_gib": 512, "bandwidth_gbps": 32},
            ],
            "lease_seconds": 3600,
            "reason": "decode pool",
        },
    )
    await compose(
        h,
        "globex",
        {
            "host": "host-03",
            "devices": [{"kind": "gpu"}],
            "constraints": {"isolation": "exclusive"},
        },
    )
    batch = await compose(
        h,
        "initech",
        {"host": "host-02", "devices": [{"kind": "gpu"}, {"kind": "memory", "capacity_gib": 64}]},
    )
    short = await compose(h, "acme", {"host": "host-01", "devices": [{"kind": "nic"}]})
    extend = {"composition_id": short, "lease_seconds": 60}
    expect_ok(await h.client.intent(HALL, "acme", "extend", extend))
    await compose(h, "acme", {"host": "host-01", "devices": [{"kind": "gpu"}]}, domain=OTHER)
    # Reservations: one applied, one cancelled, one that expires beside `short`'s lease.
    memory = {"host": "host-02", "devices": [{"kind": "memory", "capacity_gib": 32}]}
    made = expect_ok(await h.client.intent(HALL, "initech", "reserve", {"manifest": memory}))
    applied = {"reservation_id": made["reservation_id"]}
    expect_ok(await h.client.intent(HALL, "initech", "apply", applied))
    nic = {"manifest": {"host_selector": {}, "devices": [{"kind": "nic"}]}, "duration_seconds": 60}
    dropped = expect_ok(await h.client.intent(HALL, "globex", "reserve", nic))
    cancel = {"reservation_id": dropped["reservation_id"]}
    expect_ok(await h.client.intent(HALL, "globex", "cancel-reservation", cancel))
    expect_ok(await h.client.intent(HALL, "globex", "reserve", nic))
    # A fault on a device in use: the composition is impaired and mended by a replacement.
    used = expect_ok(await h.client.query(HALL, "composition", {"id": decode}))["devices"][0]["id"]
    expect_ok(await admin(HALL, "report-fault", {"component": used, "state": "failed"}))
    expect_ok(await admin(HALL, "report-fault", {"component": used, "state": "healthy"}))
    expect_ok(await admin(HALL, "drain", {"id": "gpu-012", "reason": "firmware"}))
    expect_ok(await h.client.intent(HALL, "initech", "release", {"composition_id": batch}))
    clock.advance(120)
    assert len(await h.engine.expire_due_leases()) == 2  # `short`, and globex's reservation
    changed = copy.deepcopy(FABRIC)
    changed["nodes"] = [n for n in changed["nodes"] if n["id"] != "nvme-02"]
    changed["links"] = [lk for lk in changed["links"] if "nvme-02" not in (lk["a"], lk["b"])]
    expect_ok(await admin(HALL, "import-topology", changed))
    await h.fabric_idle(HALL)
    expect_ok(await admin(HALL, "checkpoint", {}))  # a signed Merkle checkpoint of the log
    for domain in (HALL, OTHER):
        await h.projected(domain)
        await h.relayed(domain)


async def verified(
    h: Harness, nats_url: str, database_url: str, schema: str, prefix: str, wait: float = 5.0
) -> Any:
    return await verify(database_url, schema=schema, nats_url=nats_url, prefix=prefix, wait=wait)


def findings(report: dict[str, Any], domain: str = HALL) -> list[dict[str, Any]]:
    return list(report["domains"][domain]["findings"])


# ---- clean ----


async def test_a_scripted_run_verifies_clean_with_exit_0(
    h: Harness, clock: ManualClock, env: dict[str, str]
) -> None:
    await scripted_run(h, clock)
    types = {e.type async for e in h.store.read(HALL)}
    assert {"DeviceReplaced", "LeaseExpired", "CompositionReleased", "PathEstablished"} <= types
    assert {"ReservationMade", "ReservationApplied", "ReservationCancelled"} <= types
    assert "ReservationExpired" in types

    code, out, err = await trellis(env, "verify", "--json")

    report = json.loads(out)
    assert (code, err) == (0, ""), out
    assert report["ok"] is True
    assert {name: c["status"] for name, c in report["checks"].items()} == {
        "chain": "pass",
        "notes": "pass",
        "invariants": "pass",
        "projections": "pass",
        "kv": "pass",
        "stream": "pass",
    }
    for domain in (HALL, OTHER):
        head = await h.store.head(domain)
        assert report["domains"][domain]["head"] == {
            "version": head.version,
            "position": head.position,
            "hash": head.hash,
        }
        assert report["domains"][domain]["findings"] == []
    assert report["checks"]["chain"]["events"] == sum(
        [len([e async for e in h.store.read(d)]) for d in (HALL, OTHER)]
    )

    checkpoint = report["domains"][HALL]["latest_checkpoint"]
    assert checkpoint["size"] == (await h.store.head(HALL)).version  # and its root is the log's
    code, out, _ = await trellis(env, "verify", "--domain", OTHER)
    assert code == 0 and out.startswith(f"{OTHER}: head version ") and HALL not in out
    assert "verified: no findings" in out


async def test_events_committed_while_verify_runs_are_no_finding(
    h: Harness,
    monkeypatch: pytest.MonkeyPatch,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    """Intents flow while verify reads: events committed after it has waited for the followers
    and before it reads the domain's events end the chain later than the head it waited for,
    and the chain is checked against the head read with them, not against the earlier one."""
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    await h.projected(HALL)
    await h.relayed(HALL)
    before = await h.store.head(HALL)
    waited = audit_verify._caught_up

    async def then_an_intent(*args: Any) -> dict[str, tuple[int, int]]:
        applied = await waited(*args)
        expect_ok(await h.client.admin(HALL, "drain", {"id": "gpu-012", "reason": "meanwhile"}))
        return applied

    monkeypatch.setattr(audit_verify, "_caught_up", then_an_intent)

    report = await verify(
        database_url, schema=pg_schema, nats_url=nats_url, prefix=subject_prefix, domain=HALL
    )

    assert report["domains"][HALL]["head"]["version"] > before.version  # the drain is in
    assert findings(report) == [] and report["ok"] is True


async def test_verify_that_cannot_run_is_one_line_exit_2_or_3_for_an_outage(
    h: Harness, env: dict[str, str]
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    code, out, err = await trellis(env, "verify", "--domain", "nowhere")
    assert (code, out) == (2, "") and err == "trellis verify: the log has no domain 'nowhere'\n"

    # A Postgres that does not listen is an outage, as for every command: exit 3, one line.
    dead = {**env, "TRELLIS_DATABASE_URL": "postgresql://127.0.0.1:1/none"}
    code, out, err = await trellis(dead, "verify")
    assert code == 3 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("trellis: unavailable: cannot reach Postgres"), err

    # One that takes the connection and never answers (stopped: SIGSTOP) too: it printed
    # "cannot read the database: " with no reason, exit 2 (the day-2 probe).
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens; never answers
        port = silent.getsockname()[1]
        stalled = {**env, "TRELLIS_DATABASE_URL": f"postgresql://127.0.0.1:{port}/none"}
        code, out, err = await trellis(stalled, "verify")
    assert code == 3 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("trellis: unavailable: Postgres did not answer in time"), err


async def test_without_nats_the_kv_check_is_skipped_not_passed(
    h: Harness, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    await h.projected(HALL)
    report = await verify(
        database_url, schema=pg_schema, nats_url="nats://127.0.0.1:1", prefix=subject_prefix
    )
    assert report["ok"] is True
    assert report["checks"]["kv"]["status"] == "skipped"
    assert "NATS unreachable" in report["checks"]["kv"]["reason"]


# ---- tampering ----


async def test_a_tampered_event_row_is_named_at_its_position(
    h: Harness,
    clock: ManualClock,
    sql: asyncpg.Connection,
    env: dict[str, str],
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    await scripted_run(h, clock)
    row = await sql.fetchrow(
        "SELECT position, version, data::text AS data FROM trellis_events "
        "WHERE domain = $1 AND type = 'DevicesReserved' ORDER BY version LIMIT 1",
        HALL,
    )
    # The owner switches the append-only triggers off for one update, then on again.
    async with sql.transaction():
        await sql.execute("ALTER TABLE trellis_events DISABLE TRIGGER USER")
        await sql.execute(
            "UPDATE trellis_events SET data = $2::json WHERE position = $1",
            row["position"],
            row["data"].replace('"bandwidth_gbps":32', '"bandwidth_gbps":1'),
        )
        await sql.execute("ALTER TABLE trellis_events ENABLE TRIGGER USER")

    report = await verified(h, nats_url, database_url, pg_schema, subject_prefix)

    chain = [f for f in findings(report) if f["check"] == "hash_mismatch"]
    assert [(f["position"], f["version"]) for f in chain] == [(row["position"], row["version"])]
    assert report["ok"] is False and report["checks"]["chain"]["status"] == "fail"
    assert findings(report, OTHER) == []
    code, out, _ = await trellis(env, "verify")
    assert code == 1 and f"(position {row['position']})" in out


async def rewrite_chain(h: Harness, sql: asyncpg.Connection) -> list[RecordedEvent]:
    """A forger changes the first DevicesReserved and recomputes every hash after it, and the
    stream head, with the followers stopped; the log as it is now."""
    for follower in [h.followers.of(s, d) for s in ("projections", "relay") for d in (HALL,)]:
        assert follower is not None
        await follower.stop()
    events = [e async for e in h.store.read(HALL)]
    target = next(e for e in events if e.type == "DevicesReserved")
    prev = events[target.version - 2].hash
    rewritten: list[RecordedEvent] = []
    for e in events[target.version - 1 :]:
        if e.version == target.version:
            e = msgspec.structs.replace(
                e, data=e.data.replace(b'"bandwidth_gbps":32', b'"bandwidth_gbps":1')
            )
        e = msgspec.structs.replace(e, prev_hash=prev, hash=hash_of(e, prev, HALL, e.version))
        rewritten.append(e)
        prev = e.hash
    async with sql.transaction():
        await sql.execute("ALTER TABLE trellis_events DISABLE TRIGGER USER")
        for e in rewritten:
            await sql.execute(
                "UPDATE trellis_events SET data = $2::json, prev_hash = $3, hash = $4 "
                "WHERE position = $1",
                e.position, e.data.decode(), e.prev_hash, e.hash,
            )  # fmt: skip
        await sql.execute("ALTER TABLE trellis_events ENABLE TRIGGER USER")
        await sql.execute("ALTER TABLE trellis_streams DISABLE TRIGGER USER")
        await sql.execute("UPDATE trellis_streams SET hash = $2 WHERE domain = $1", HALL, prev)
        await sql.execute("ALTER TABLE trellis_streams ENABLE TRIGGER USER")
    return [*events[: target.version - 1], *rewritten]


async def test_a_chain_rewritten_consistently_is_caught_by_the_stored_checkpoint(
    h: Harness,
    clock: ManualClock,
    sql: asyncpg.Connection,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    """A forger who changes an event and recomputes every hash after it (and the stream head)
    leaves a chain that checks out; the checkpoint the engine signed before does not."""
    await scripted_run(h, clock)
    log = await rewrite_chain(h, sql)

    report = await verified(h, nats_url, database_url, pg_schema, subject_prefix)

    chain = [f for f in findings(report) if f["check"] not in ("projection", "kv", "stream")]
    size = report["domains"][HALL]["latest_checkpoint"]["size"]
    # The row's root (the chain check) and the signed note's (the notes check) alike.
    assert [(f["check"], f["version"]) for f in chain] == [("checkpoint", size)] * 2
    assert chain[1]["message"].startswith(f"the signed note of {size} events has root")
    assert report["checks"]["notes"]["status"] == "fail"
    # The stream still holds the events as they were: from the changed one on, each carries
    # the id of the log's event at its version, with other content.
    stream = [f for f in findings(report) if f["check"] == "stream"]
    changed = next(e.version for e in log if e.type == "DevicesReserved")
    named = [f["version"] for f in stream if f.get("version")]
    assert named == list(range(changed, log[-1].version + 1))[: len(named)]
    assert all(
        "the log's event id there but other content" in f["message"]
        for f in stream
        if f.get("version")
    ), stream
    assert report["checks"]["chain"]["status"] == "fail"


async def test_the_engine_signs_nothing_more_over_a_log_its_checkpoint_contradicts(
    h: Harness, clock: ManualClock, sql: asyncpg.Connection
) -> None:
    """After a consistent rewrite and one more event, the engine signed a checkpoint of the
    forged log, exit 0, though the one it had signed before no longer matched it (the auditor
    probe): anyone who can write the database got signed checkpoints of a forged history."""
    await scripted_run(h, clock)
    before = await sql.fetch("SELECT size, note FROM trellis_checkpoints WHERE domain = $1", HALL)
    assert before, "the scripted run signs a checkpoint"
    forged = await rewrite_chain(h, sql)
    await h.client.intent(
        HALL, "acme", "compose", {"host": "host-03", "devices": [{"kind": "gpu"}]}
    )
    assert (await h.store.head(HALL)).version > forged[-1].version  # one event more
    refused = expect_error(await h.client.admin(HALL, "checkpoint", {}), "conflict")
    assert "contradicts" in refused["message"], refused
    after = await sql.fetch("SELECT size, note FROM trellis_checkpoints WHERE domain = $1", HALL)
    assert after == before


# ---- the signed notes ----


async def signed_twice(h: Harness) -> tuple[str, list[dict[str, Any]]]:
    """Given: a log with two signed checkpoints, settled; the deployment's verifier key and
    the checkpoints as the engine made them."""
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    gpus = {"host": "host-01", "devices": [{"kind": "gpu", "count": 2, "bandwidth_gbps": 32}]}
    await compose(h, "acme", gpus)
    made = [expect_ok(await h.client.admin(HALL, "checkpoint", {}))]
    await compose(h, "globex", {"host": "host-03", "devices": [{"kind": "gpu"}]})
    made.append(expect_ok(await h.client.admin(HALL, "checkpoint", {})))
    await h.projected(HALL)
    await h.relayed(HALL)
    key = expect_ok(await h.client.query(HALL, "checkpoint-key"))["verifier_key"]
    return str(key), made


async def set_checkpoint(sql: asyncpg.Connection, size: int, column: str, value: str) -> None:
    """The owner changes one column of a stored checkpoint behind its append-only trigger."""
    assert column in ("root", "note")
    async with sql.transaction():
        await sql.execute("ALTER TABLE trellis_checkpoints DISABLE TRIGGER USER")
        await sql.execute(
            f"UPDATE trellis_checkpoints SET {column} = $3 WHERE domain = $1 AND size = $2",
            HALL, size, value,
        )  # fmt: skip
        await sql.execute("ALTER TABLE trellis_checkpoints ENABLE TRIGGER USER")


def broken_signature(note: str) -> str:
    text, _, signature = note.rstrip("\n").rpartition(" ")
    flipped = "B" if signature[8] == "A" else "A"  # in the signature, past the key hash
    return f"{text} {signature[:8]}{flipped}{signature[9:]}\n"


@pytest.mark.parametrize("tamper", ["broken signature", "another size's note", "forgery"])
async def test_a_note_that_is_not_the_rows_or_the_logs_is_a_finding_with_exit_1(
    h: Harness, sql: asyncpg.Connection, env: dict[str, str], tmp_path: Path, tamper: str
) -> None:
    key, (first, second) = await signed_twice(h)
    size = second["size"]
    if tamper == "broken signature":
        await set_checkpoint(sql, size, "note", broken_signature(second["note"]))
        expected = [("checkpoint_note", size, "does not verify with")]
    elif tamper == "another size's note":  # signed by the engine, of the first checkpoint
        await set_checkpoint(sql, size, "note", first["note"])
        expected = [("checkpoint_note", size, f"signed size {first['size']}, root ")]
    else:
        # The whole chain rewritten from an event before both checkpoints, and every row's
        # root set to the new log's: only the notes the engine signed are left as they were.
        forged = await rewrite_chain(h, sql)
        tree = MerkleTree(leaf_hash(bytes.fromhex(e.hash)) for e in forged)
        for made in (first, second):
            root = base64.b64encode(tree.root(made["size"])).decode()
            await set_checkpoint(sql, made["size"], "root", root)
        expected = [
            ("checkpoint_note", first["size"], f"signed root {first['root']}; the row says"),
            ("checkpoint_note", size, f"signed root {second['root']}; the row says"),
            ("checkpoint", first["size"], f"the signed note of {first['size']} events has root"),
            ("checkpoint", size, f"the signed note of {size} events has root"),
        ]
    (tmp_path / "key").write_text(key + "\n")

    code, out, _ = await trellis(env, "verify", "--json", "--key-file", str(tmp_path / "key"))

    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    signed = [f for f in findings(report) if f["check"] in ("checkpoint_note", "checkpoint")]
    assert [(f["check"], f["version"]) for f in signed] == [(c, v) for c, v, _ in expected]
    for finding, (_, _, said) in zip(signed, expected, strict=True):
        assert said in finding["message"], finding["message"]
    notes = report["checks"]["notes"]
    assert (notes["status"], notes["notes"]) == ("fail", 2)
    assert (notes["keys"], notes["key_from"]) == ([key], f"--key-file {tmp_path / 'key'}")
    assert notes["key"] == key  # as reports from before repeatable keys had it
    assert report["checks"]["chain"]["status"] == "pass"  # the rows agree with the log


async def test_the_notes_are_checked_with_the_key_found_or_skipped_without_one(
    h: Harness,
    env: dict[str, str],
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    key, _ = await signed_twice(h)
    signer = "+".join(key.split("+")[:2])

    # Asked of the engine when no key is given and none lies in the data dir.
    code, out, _ = await trellis(env, "verify")
    assert code == 0, out
    assert f"check notes: pass (2 notes, key {signer} from the engine's checkpoint-key query" in out

    # The verifier key beside this data dir's signing key, as `trellis up` writes it.
    public = Path(env["TRELLIS_DATA_DIR"]) / "checkpoint-key.pem.pub"
    public.parent.mkdir(parents=True, exist_ok=True)
    public.write_text(key + "\n")
    code, out, _ = await trellis(env, "verify")
    assert code == 0 and f"check notes: pass (2 notes, key {signer} from {public})" in out

    # Another deployment's key: no note of this one verifies with it.
    other = Signer.generate().verifier.key()
    code, out, _ = await trellis(env, "verify", "--key", other)
    assert code == 1 and out.count("FINDING checkpoint_note:") == 2
    assert f"does not verify with {other}" in out

    # No key anywhere: skipped, with why, never passed.
    report = await verify(
        database_url, schema=pg_schema, nats_url="nats://127.0.0.1:1", prefix=subject_prefix
    )
    notes = report["checks"]["notes"]
    assert (notes["status"], notes["notes"], report["ok"]) == ("skipped", 2, True)
    assert notes["reason"].startswith("no verifier key: cannot ask the engine for it (NATS ")
    assert "check notes: skipped (no verifier key: " in audit_verify.text(report)


async def test_after_a_key_rotation_the_notes_hold_with_both_keys_given(
    h: Harness, sql: asyncpg.Connection, env: dict[str, str], tmp_path: Path
) -> None:
    """A rotation (`trellis up` with a new key, TRELLIS_NEW_CHECKPOINT_KEY=1) leaves the old
    key's notes before the new key's: given both keys, every note holds; given one, the other
    key's notes are named, and a key that is no key is a usage error."""
    new, (first, _) = await signed_twice(h)
    # The first checkpoint as the key before the rotation signed it.
    old = Signer.generate()
    root = base64.b64decode(first["root"])
    checkpoint = Checkpoint(origin=origin_of(HALL), size=first["size"], root=root)
    await set_checkpoint(sql, first["size"], "note", old.checkpoint(checkpoint))
    old_file = tmp_path / "old.vkey"
    old_file.write_text(old.verifier.key() + "\n")

    code, out, err = await trellis(env, "verify", "--key", new, "--key-file", str(old_file))
    assert code == 0, out + err
    signers = ", ".join("+".join(key.split("+")[:2]) for key in (new, old.verifier.key()))
    assert f"check notes: pass (2 notes, keys {signers} from --key, --key-file {old_file})" in out

    code, out, _ = await trellis(env, "verify", "--key", new)
    assert code == 1 and out.count("FINDING checkpoint_note:") == 1
    assert f"checkpoint of {first['size']} events does not verify with {new}: " in out

    code, out, err = await trellis(env, "verify", "--key", new, "--key", "trellis+0+AA==")
    assert (code, out) == (2, "")
    assert err.startswith("trellis verify: --key 'trellis+0+AA==' holds no verifier key: "), err


async def test_two_events_whose_positions_were_swapped_are_named(
    h: Harness,
    sql: asyncpg.Connection,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    """The hash covers no position (ARCHITECTURE §6): rows re-inserted behind the triggers
    with their positions swapped keep every hash and link; only their order tells."""
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    await compose(h, "acme", {"host": "host-01", "devices": [{"kind": "gpu"}]})
    await h.projected(HALL)
    earlier, later = [e async for e in h.store.read(HALL)][1:3]
    positions = [earlier.position, later.position]
    async with sql.transaction():
        await sql.execute("ALTER TABLE trellis_events DISABLE TRIGGER USER")
        rows = await sql.fetch(
            "SELECT * FROM trellis_events WHERE position = ANY($1::bigint[]) ORDER BY position",
            positions,
        )
        await sql.execute(
            "DELETE FROM trellis_events WHERE position = ANY($1::bigint[])", positions
        )
        for row, position in zip(rows, reversed(positions), strict=True):
            values = {**dict(row), "position": position}
            await sql.execute(
                f"INSERT INTO trellis_events ({', '.join(values)}) OVERRIDING SYSTEM VALUE "
                f"VALUES ({', '.join(f'${i}' for i in range(1, len(values) + 1))})",
                *values.values(),
            )
        await sql.execute("ALTER TABLE trellis_events ENABLE TRIGGER USER")

    report = await verified(h, nats_url, database_url, pg_schema, subject_prefix)

    chain = [f for f in findings(report) if f["check"] not in ("projection", "kv", "stream")]
    assert [(f["check"], f["version"], f["position"]) for f in chain] == [
        ("position_order", later.version, earlier.position)
    ]
    assert report["ok"] is False and report["checks"]["chain"]["status"] == "fail"


async def test_a_changed_projection_row_is_named_by_table_and_key(
    h: Harness,
    clock: ManualClock,
    sql: asyncpg.Connection,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    await scripted_run(h, clock)
    for follower in [h.followers.of("projections", d) for d in (HALL, OTHER)]:
        assert follower is not None
        await follower.stop()  # so nothing folds the row back
    await sql.execute(
        "UPDATE proj_devices SET health = 'failed' WHERE domain = $1 AND device = 'gpu-003'", HALL
    )
    await sql.execute("DELETE FROM proj_components WHERE domain = $1 AND id = 'sw-pool'", HALL)

    report = await verified(h, nats_url, database_url, pg_schema, subject_prefix)

    found = [(f["check"], f.get("table"), f.get("key")) for f in findings(report)]
    assert found == [
        ("projection", "proj_devices", "gpu-003"),
        ("projection", "proj_components", "sw-pool"),
    ]
    by_table = {f["table"]: f for f in findings(report)}
    assert by_table["proj_devices"]["details"]["columns"] == ["health"]
    assert "the live table does not" in by_table["proj_components"]["message"]
    assert report["checks"]["projections"]["status"] == "fail"
    assert report["checks"]["chain"]["status"] == "pass"


async def test_a_changed_or_deleted_kv_value_is_named_by_its_key(
    h: Harness,
    clock: ManualClock,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    await scripted_run(h, clock)
    await h.followers.of("relay", HALL).stop()  # type: ignore[union-attr]
    nc = await connect_nats(nats_url, name="test-mallory")
    try:
        js: JetStreamContext = nc.jetstream()
        kv = await js.key_value(bucket_name(subject_prefix))
        key = f"{HALL}.device.gpu-003"
        value = json.loads((await kv.get(key)).value or b"{}")
        await kv.put(key, msgspec.json.encode({**value, "health": "failed"}))
        await kv.delete(f"{HALL}.host.host-02")
    finally:
        await nc.close()

    report = await verified(h, nats_url, database_url, pg_schema, subject_prefix)

    kv_findings = [(f["key"], f.get("details", {}).get("columns")) for f in findings(report)]
    assert kv_findings == [(f"{HALL}.device.gpu-003", ["health"]), (f"{HALL}.host.host-02", None)]
    assert report["checks"]["kv"]["status"] == "fail"


# ---- a forged log ----


def pending(event: Any, n: int) -> PendingEvent:
    return PendingEvent.of(
        event,
        actor="mallory",
        causation_id=f"forged-{n}",
        correlation_id=f"forged-{n}",
        at=datetime(2026, 12, 1, 12, 0, n, tzinfo=UTC),
    )


async def test_a_forged_double_allocation_is_named_by_the_invariant_audit(
    database: Database, pg_schema: str
) -> None:
    """Events with valid hashes, appended through the log's own checks (which look at the
    chain and the content, not at allocations), that give gpu-1 to two compositions."""
    nodes = [
        NodeSpec(id="host-1", kind="host"),
        NodeSpec(id="host-2", kind="host"),
        NodeSpec(id="gpu-1", kind="device", device_kind="gpu"),
    ]
    links = [
        LinkSpec(id="l-1", a="host-1", b="gpu-1", capacity_gbps=100),
        LinkSpec(id="l-2", a="host-2", b="gpu-1", capacity_gbps=100),
    ]

    def requested(cid: str, host: str) -> CompositionRequested:
        return CompositionRequested(
            composition_id=cid,
            tenant="t1",
            host=host,
            request=Compose(request_id=f"r-{cid}", device_ids=["gpu-1"]),
            requested_at=datetime(2026, 12, 1, tzinfo=UTC),
        )

    def reserved(cid: str, host: str, link: str) -> DevicesReserved:
        binding = DeviceBinding(
            device="gpu-1",
            kind="gpu",
            model=None,
            cost_per_hour=None,
            path=[host, "gpu-1"],
            links=[link],
            hops=1,
            latency_ns=0,
        )
        return DevicesReserved(composition_id=cid, devices=[binding])

    forged = [
        TopologyImported(nodes=nodes, links=links),
        requested("c1", "host-1"),
        reserved("c1", "host-1", "l-1"),
        requested("c2", "host-2"),
        reserved("c2", "host-2", "l-2"),
    ]
    store = await PostgresEventStore.open(database.url, schema=pg_schema)
    try:
        appended = await store.append(
            HALL, Head(), [pending(e, n) for n, e in enumerate(forged)], []
        )
    finally:
        await store.close()
    second = appended.events[-1]

    # The latest signed checkpoint is printed beside the head, to anchor both elsewhere (rows
    # as schema/010 holds them; their notes are not checked here, the proof check does that).
    conn = await asyncpg.connect(database.owner_url, server_settings={"search_path": pg_schema})
    try:
        tree = MerkleTree(leaf_hash(bytes.fromhex(e.hash)) for e in appended.events)
        for size in (2, 4):
            root = base64.b64encode(tree.root(size)).decode()
            await conn.execute(
                "INSERT INTO trellis_checkpoints VALUES ($1, $2, $3, now(), $4)",
                HALL, size, root, f"trellis/{HALL}\n{size}\n{root}\n",
            )  # fmt: skip
    finally:
        await conn.close()

    report = await verify(database.url, schema=pg_schema)

    latest = report["domains"][HALL]["latest_checkpoint"]
    assert (latest["size"], latest["root"]) == (4, base64.b64encode(tree.root(4)).decode())
    invariant = [f for f in findings(report) if f["check"] == "device_double_allocation"]
    assert [(f["position"], f["version"]) for f in invariant] == [(second.position, 5)]
    assert invariant[0]["details"]["compositions"] == ["c1", "c2"]
    assert report["checks"]["invariants"]["status"] == "fail"
    assert report["checks"]["chain"]["status"] == "pass"  # the hashes are all valid
    assert report["domains"][HALL]["head"]["position"] == second.position


async def test_an_event_this_build_cannot_read_stops_the_replay_there_and_says_so(
    h: Harness,
    clock: ManualClock,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    await h.projected(HALL)
    head = await h.store.head(HALL)
    later = msgspec.structs.replace(undecodable_event(), recorded_at=clock.now())
    appended = await h.store.append(HALL, head, [later], [], fence=h.engine.fence(HALL))
    future = appended.events[0]

    report = await verified(h, nats_url, database_url, pg_schema, subject_prefix, wait=0.5)

    found = findings(report)
    # Every key of the documented shape, in every finding (null, 0 or {} where it fits not).
    shape = {"check", "domain", "message", "position", "version", "table", "key", "details"}
    assert all(set(f) == shape for f in found), found
    assert [(f["check"], f["position"]) for f in found if f["position"]] == [
        ("replay", future.position)
    ]
    # The projections and the relay stopped before it, and are told as behind, never passed.
    behind = {(f["check"], f["message"].split(" is behind")[0]) for f in found[1:]}
    assert ("kv", "the relay") in behind and ("projections", "projection devices") in behind
    assert report["checks"]["projections"]["status"] == "fail"
    assert report["checks"]["chain"]["status"] == "pass"


async def test_a_stalled_relay_is_a_finding_never_a_pass(
    h: Harness,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    # Given: the relay stopped after the import, and the log went on without it.
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    await h.relayed(HALL)
    relay = h.followers.of("relay", HALL)
    assert relay is not None
    await relay.stop()
    expect_ok(await h.client.admin(HALL, "drain", {"id": "sw-pool"}))
    head = await h.store.head(HALL)
    await h.projected(HALL)

    report = await verified(h, nats_url, database_url, pg_schema, subject_prefix, wait=0.5)

    assert report["ok"] is False
    assert report["checks"]["kv"]["status"] == "fail"
    assert report["checks"]["stream"]["status"] == "fail"
    assert report["checks"]["projections"]["status"] == "pass"  # they are caught up
    messages = {f["check"]: f["message"] for f in findings(report)}
    assert messages["kv"].startswith(f"the relay is behind the log: at version 1 of {head.version}")
    assert messages["stream"].startswith(
        f"the stream carries the log's own events only up to version 1; the log is at "
        f"{head.version}"
    )


async def test_verify_and_export_refuse_a_schema_a_newer_version_migrated(
    h: Harness, sql: asyncpg.Connection, env: dict[str, str], tmp_path: Path
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", FABRIC))
    await sql.execute(
        "INSERT INTO trellis_migrations (version, name, checksum) VALUES (999, 'x.sql', 'x')"
    )
    for command in (["verify"], ["export", "--parquet", str(tmp_path / "out")]):
        code, out, err = await trellis(env, *command)
        assert code == 1 and out == "", (command, out)
        assert "the schema holds migration(s) 999 that this Trellis does not know" in err, err
    assert not (tmp_path / "out").exists()
