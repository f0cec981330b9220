"""Signed Merkle checkpoints with a real engine (issue 10 item 4; ARCHITECTURE §6).

An auditor asks the engine over NATS for checkpoints, an inclusion proof and a consistency
proof, then checks them offline with nothing but the verifier key (`trellis verify
--checkpoint --proof`); the checkpoints reach the stream TRELLIS_CHECKPOINTS; the engine makes
one by itself every N events; the table keeps them append-only; bad input gets typed errors.
"""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, fabric
from harness import Harness, cli_env, engine_at, serving
from harness import run_cli as trellis

from trellis.adapters.bootstrap import checkpoint_key_path, checkpoint_signer
from trellis.adapters.checkpoint_key import KeyFileError, load_or_create, public_key_path
from trellis.adapters.entrypoints import cli
from trellis.adapters.entrypoints.audit_proofs import ProofRejected, check
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.nats.jetstream import Envelope, checkpoint_stream_name
from trellis.adapters.settings import Settings, SettingsError
from trellis.engine.core.checkpoints import Signer, Verifier, open_checkpoint
from trellis.engine.core.records import RecordedEvent

HALL = "hall-1"
QUICK = {"poll_interval": 0.2, "max_backoff": 0.5}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


async def compose_and_release(h: Harness, tenant: str = "acme", times: int = 1) -> None:
    for _ in range(times):
        body = {"host": "host-01", "devices": [{"kind": "gpu"}]}
        composed = expect_ok(await h.client.intent(HALL, tenant, "compose", body))
        cid = composed["composition_id"]
        expect_ok(await h.client.intent(HALL, tenant, "release", {"composition_id": cid}))


async def events(h: Harness) -> list[RecordedEvent]:
    return [r async for r in h.store.read(HALL)]


async def checkpoint(h: Harness) -> dict[str, Any]:
    result: dict[str, Any] = expect_ok(await h.client.admin(HALL, "checkpoint", {}))
    return result


async def stream_notes(nats_url: str, prefix: str) -> list[tuple[dict[str, str], str]]:
    """Every message of the checkpoint stream: its headers and its body."""
    nc = await connect_nats(nats_url, name="test-witness")
    try:
        js = nc.jetstream()
        stream = checkpoint_stream_name(prefix)
        last = (await js.stream_info(stream)).state.last_seq
        messages = [await js.get_msg(stream, seq) for seq in range(1, last + 1)]
        return [(dict(m.headers or {}), (m.data or b"").decode()) for m in messages]
    finally:
        await nc.close()


async def test_proofs_from_the_engine_verify_offline_with_only_the_verifier_key(
    h: Harness, nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    # Given: a log with some history and a checkpoint, then more history and another.
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await compose_and_release(h, times=2)
    first = await checkpoint(h)
    await compose_and_release(h, tenant="globex", times=2)
    second = await checkpoint(h)
    log = await events(h)
    assert (first["size"], second["size"]) == (first["size"], len(log))
    assert first["size"] < second["size"]
    key = expect_ok(await h.client.query(HALL, "checkpoint-key"))["verifier_key"]

    # When: the auditor asks for an inclusion proof of an event, and a consistency proof.
    event = log[3]
    proof = expect_ok(await h.client.query(HALL, "proof", {"event_id": event.id}))
    consistency = expect_ok(
        await h.client.query(
            HALL, "consistency", {"from_size": first["size"], "to_size": second["size"]}
        )
    )

    # (Asked as of a past moment, the proof is against the checkpoint there was then.)
    then = log[first["size"] - 1].position
    past = expect_ok(await h.client.query(HALL, "proof", {"event_id": event.id, "at": then}))
    assert (past["tree_size"], past["checkpoint"]) == (first["size"], first["note"])

    # Then: both check out offline with the key and the notes alone.
    assert proof["leaf_index"] == 3 and proof["tree_size"] == second["size"]
    assert proof["checkpoint"] == second["note"]
    assert proof["root"] == second["root"]
    line = check([second["note"]], proof, key, event_hash=event.hash)
    assert line.startswith("ok: ") and "leaf 3" in line
    assert line.endswith(f"signed by {key.split('+')[0]}+{key.split('+')[1]}")
    line = check([first["note"], second["note"]], consistency, key)
    assert line.startswith("ok: ") and f"of {first['size']} events is a prefix" in line
    assert consistency["from_root"] == first["root"]

    # ... and fail for a wrong event, another key, or a root nobody signed.
    with pytest.raises(ProofRejected, match="does not put event hash"):
        check([second["note"]], proof, key, event_hash=log[4].hash)
    with pytest.raises(ProofRejected, match="no signature by"):
        check([second["note"]], proof, Signer.generate().verifier.key(), event_hash=event.hash)
    with pytest.raises(ProofRejected, match="not the signed root"):
        check([second["note"]], {**proof, "root": first["root"]}, key, event_hash=event.hash)
    with pytest.raises(ProofRejected, match="checkpoints are of"):
        check([first["note"]], proof, key, event_hash=event.hash)
    forked = {**consistency, "to_root": first["root"]}
    with pytest.raises(ProofRejected):
        check([first["note"], second["note"]], forked, key)

    # The CLI does the same from files, exit 0 or 1 with one line.
    files = {
        "checkpoint": second["note"],
        "old": first["note"],
        "proof.json": msgspec.json.encode(proof).decode(),
        "consistency.json": msgspec.json.encode(consistency).decode(),
        "key": key + "\n",
        "event.json": msgspec.json.encode(Envelope.of(event)).decode(),
        "other.json": msgspec.json.encode(Envelope.of(log[4])).decode(),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    verify = ["verify", "--checkpoint", str(tmp_path / "checkpoint"), "--key-file"]
    verify.append(str(tmp_path / "key"))
    proof_file = ["--proof", str(tmp_path / "proof.json")]
    assert cli.main([*verify, *proof_file, "--event", str(tmp_path / "event.json")]) == 0
    assert cli.main([*verify, *proof_file, "--event-hash", event.hash]) == 0
    assert cli.main(verify) == 2  # no proof to check: a usage error
    assert cli.main([*verify, *proof_file, "--event", str(tmp_path / "other.json")]) == 1
    both = [*verify, "--checkpoint", str(tmp_path / "old")]
    assert cli.main([*both, "--proof", str(tmp_path / "consistency.json")]) == 0
    wrong_key = ["--key", Signer.generate().verifier.key()]
    assert cli.main([*verify[:-2], *wrong_key, *proof_file, "--event-hash", event.hash]) == 1

    # And both checkpoints reached the stream, as signed notes a witness can check.
    published = await stream_notes(nats_url, subject_prefix)
    assert [note for _, note in published] == [first["note"], second["note"]]
    headers, _ = published[-1]
    assert headers["Nats-Msg-Id"] == f"{HALL}/{second['size']}"
    verifier = Verifier.parse(key)
    assert [open_checkpoint(note, verifier).size for _, note in published] == [
        first["size"],
        second["size"],
    ]


async def test_the_engine_records_and_publishes_a_checkpoint_every_n_events(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        checkpoint_every=5,
        follow_options=QUICK,
    ) as h:
        expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
        while (await h.store.head(HALL)).version < 12:
            await compose_and_release(h)
        head = await h.store.head(HALL)
        assert await h.followers.wait_for("checkpoints", HALL, head.position, 10)
        key = expect_ok(await h.client.query(HALL, "checkpoint-key"))["verifier_key"]
        pool = h.store._pool  # type: ignore[attr-defined]
        rows = await pool.fetch("SELECT size, root, note FROM trellis_checkpoints ORDER BY size")
        sizes = [r["size"] for r in rows]
        assert sizes == list(range(5, head.version + 1, 5))
        verifier = Verifier.parse(key)
        for row in rows:
            signed = open_checkpoint(row["note"], verifier)
            assert (signed.origin, signed.size) == (f"trellis/{HALL}", row["size"])
        published = await stream_notes(nats_url, subject_prefix)
        assert [note for _, note in published] == [r["note"] for r in rows]
        # A proof without a size is against the latest of them.
        log = await events(h)
        proof = expect_ok(await h.client.query(HALL, "proof", {"event_id": log[0].id}))
        assert proof["tree_size"] == sizes[-1]
        assert check([rows[-1]["note"]], proof, key, event_hash=log[0].hash).startswith("ok")


async def test_bad_audit_queries_get_typed_errors_and_views_prove_only_their_own(
    h: Harness,
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", {**fabric(), "request_id": "topo"}))
    # A checkpoint under a request id another admin verb used is refused, as everywhere.
    expect_error(await h.client.admin(HALL, "checkpoint", {"request_id": "topo"}), "conflict")
    await compose_and_release(h, tenant="acme")
    log = await events(h)
    acme_event = next(e for e in log if e.actor == "acme")
    head = len(log)

    # No checkpoint yet: a proof needs a size.
    expect_error(await h.client.query(HALL, "proof", {"event_id": log[0].id}), "not_found")
    sized = expect_ok(await h.client.query(HALL, "proof", {"event_id": log[0].id, "size": head}))
    assert sized["checkpoint"] is None and sized["tree_size"] == head

    await checkpoint(h)
    await compose_and_release(h, tenant="globex")
    log = await events(h)
    globex_event = next(e for e in log if e.actor == "globex")
    unknown = "00000000-0000-4000-8000-00000000abcd"
    bad = {
        "unknown event": ("proof", {"event_id": unknown}, "not_found"),
        "not a uuid": ("proof", {"event_id": "gpu-01"}, "invalid"),
        "size 0": ("proof", {"event_id": log[0].id, "size": 0}, "invalid"),
        "size beyond the log": ("proof", {"event_id": log[0].id, "size": 10_000}, "invalid"),
        "event past the checkpoint": ("proof", {"event_id": globex_event.id}, "conflict"),
        "unknown field": ("proof", {"event_id": log[0].id, "root": "x"}, "invalid"),
        "from beyond to": ("consistency", {"from_size": 3, "to_size": 2}, "invalid"),
        "to beyond the log": ("consistency", {"from_size": 1, "to_size": 10_000}, "invalid"),
        "from 0": ("consistency", {"from_size": 0, "to_size": 2}, "invalid"),
    }
    for what, (verb, body, code) in bad.items():
        reply = await h.client.query(HALL, verb, body)
        assert not reply["ok"] and reply["error"]["code"] == code, (what, reply)
    expect_error(await h.client.query("nowhere", "checkpoint-key"), "not_found")
    expect_error(await h.client.admin("nowhere", "checkpoint", {}), "not_found")

    # A tenant's view proves its own events and the operator's, never another tenant's.
    body = {"event_id": acme_event.id}
    assert expect_ok(await h.client.view(HALL, "acme", "proof", body))["leaf_index"] >= 0
    assert log[0].actor == "operator", log[0]
    topology_event = {"event_id": log[0].id}
    assert expect_ok(await h.client.view(HALL, "globex", "proof", topology_event))
    other = expect_error(await h.client.view(HALL, "globex", "proof", body), "not_found")
    assert other["message"] == f"no event {acme_event.id} in domain {HALL!r}"
    assert expect_ok(await h.client.view(HALL, "globex", "checkpoint-key"))["verifier_key"]


async def test_checkpoints_are_append_only_even_for_the_owner(
    h: Harness, owner_url: str, pg_schema: str
) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await checkpoint(h)
    conn = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    try:
        for statement in (
            "UPDATE trellis_checkpoints SET root = root",
            "DELETE FROM trellis_checkpoints",
            "TRUNCATE trellis_checkpoints",
        ):
            with pytest.raises(asyncpg.PostgresError, match="append-only"):
                await conn.execute(statement)
        assert await conn.fetchval("SELECT count(*) FROM trellis_checkpoints") == 1
    finally:
        await conn.close()


def test_the_signing_key_is_made_once_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "data" / "checkpoint-key.pem"
    signer = load_or_create(path, make_folder=True)  # the data dir's place: made if missing
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create(path).verifier == signer.verifier  # the same key on every start
    assert public_key_path(path).read_text() == signer.verifier.key() + "\n"
    path.chmod(0o644)
    load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("what", ["a directory", "another file"])
def test_a_key_path_that_is_no_key_is_refused_and_left_as_it_was(tmp_path: Path, what: str) -> None:
    """A TRELLIS_CHECKPOINT_KEY given by mistake (`/etc`, say) was made 0600 before it was
    found to be no key."""
    path = tmp_path / "not-a-key"
    if what == "a directory":
        path.mkdir()
    else:
        path.write_text("notes\n")
    path.chmod(0o755)
    with pytest.raises(KeyFileError):
        load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755


async def test_an_auditor_fetches_and_checks_a_proof_with_the_cli(
    h: Harness,
    tmp_path: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    env = cli_env(
        tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix, TRELLIS_DOMAIN=HALL
    )
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    await compose_and_release(h)
    event = (await events(h))[2]

    code, note, _ = await trellis(env, "checkpoint", "--request-id", "cp-1")
    assert code == 0 and note.startswith(f"trellis/{HALL}\n")
    # The id an `unavailable` names (may_have_been_committed) resends it: answered from the
    # log, one checkpoint, not a second one.
    count = len(await events(h))
    assert await trellis(env, "checkpoint", "--request-id", "cp-1") == (0, note, "")
    assert len(await events(h)) == count
    code, key, _ = await trellis(env, "checkpoint-key")
    assert code == 0 and key.startswith("trellis+")
    code, proof, err = await trellis(env, "proof", event.id)
    assert code == 0 and msgspec.json.decode(proof)["leaf_index"] == 2 and err == "", err
    # At a size no checkpoint was taken at, the root is only the log's word: said so.
    code, other, err = await trellis(env, "proof", event.id, "--size", "3")
    assert code == 0 and msgspec.json.decode(other)["checkpoint"] is None
    assert "no signed checkpoint of 3 events comes with this proof" in err, err
    assert "--key-file KEY --event EVENT" in err, err  # the command it names can succeed
    # A consistency result never carries a checkpoint: its roots are always the log's word.
    code, consistency, err = await trellis(env, "consistency", "1", "3")
    assert code == 0 and msgspec.json.decode(consistency)["to_size"] == 3
    assert err.startswith("(both roots are the log's as it is now;"), err
    for name, text in {"note": note, "key": key, "proof.json": proof}.items():
        (tmp_path / name).write_text(text)

    verify = ["verify", "--checkpoint", str(tmp_path / "note"), "--proof"]
    verify += [str(tmp_path / "proof.json"), "--key-file", str(tmp_path / "key")]
    code, out, err = await trellis(env, *verify, "--event-hash", event.hash)
    assert (code, err) == (0, "") and out.startswith("ok: ") and out.count("\n") == 1
    (tmp_path / "note").write_text(note.replace(f"\n{len(await events(h))}\n", "\n1\n"))
    code, out, err = await trellis(env, *verify, "--event-hash", event.hash)
    assert (
        (code, out) == (1, "") and err.startswith("trellis verify: FAILED") and err.count("\n") == 1
    )

    code, _, err = await trellis(env, "proof", "00000000-0000-4000-8000-000000000000")
    assert code == 1 and "no event" in err


def test_a_named_key_file_in_a_folder_that_is_not_there_is_refused_and_nothing_made(
    tmp_path: Path,
) -> None:
    """A mistyped TRELLIS_CHECKPOINT_KEY made the folder and a new key in it, a key no auditor
    knew; only the data dir's default place is made."""
    mistyped = tmp_path / "kyes" / "deployment.pem"
    named = Settings.from_env({"TRELLIS_CHECKPOINT_KEY": str(mistyped)})
    with pytest.raises(SettingsError, match=f"checkpoint key {mistyped}: there is no folder"):
        checkpoint_signer(named)
    assert not mistyped.parent.exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(KeyFileError, match="no folder"):
        load_or_create(tmp_path / "a-file" / "k.pem")  # nor one behind a file
    default = Settings.from_env({"TRELLIS_DATA_DIR": str(tmp_path / "new" / "data")})
    checkpoint_signer(default)
    assert (tmp_path / "new" / "data" / "checkpoint-key.pem").is_file()


def test_trellis_up_signs_with_the_data_dirs_key_or_the_named_file(tmp_path: Path) -> None:
    settings = Settings.from_env({"TRELLIS_DATA_DIR": str(tmp_path / "data")})
    assert checkpoint_key_path(settings) == tmp_path / "data" / "checkpoint-key.pem"
    signer = checkpoint_signer(settings)
    assert checkpoint_signer(settings).verifier == signer.verifier
    named = Settings.from_env({"TRELLIS_CHECKPOINT_KEY": str(tmp_path / "k.pem")})
    assert checkpoint_key_path(named) == tmp_path / "k.pem"
    assert checkpoint_signer(named).verifier != signer.verifier
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(SettingsError, match="no usable key"):
        checkpoint_signer(Settings.from_env({"TRELLIS_CHECKPOINT_KEY": str(tmp_path / "bad.pem")}))
    with pytest.raises(SettingsError, match="TRELLIS_CHECKPOINT_EVERY"):
        Settings.from_env({"TRELLIS_CHECKPOINT_EVERY": "0"})
    assert Settings.from_env({"TRELLIS_CHECKPOINT_EVERY": "50"}).checkpoint_every == 50


async def test_a_start_that_made_a_new_key_on_a_signed_log_is_refused_unless_allowed(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    servers = (nats_url, database_url, pg_schema, subject_prefix)
    async with serving(*servers, signer=Signer.generate(), checkpoint_every=5) as h:
        expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
        await checkpoint(h)  # the log now holds a note of the deployment's key
    # The key file is gone (a data dir not mounted, say): this start makes a new one.
    key = tmp_path / "checkpoint-key.pem"
    new = load_or_create(key)
    with pytest.raises(SettingsError, match="signed by other keys"):
        async with serving(*servers, signer=new, checkpoint_key=key, new_key=True):
            pass
    assert not key.exists()  # removed, so the next start judges again
    new = load_or_create(key)
    async with engine_at(
        nats_url, database_url, schema=pg_schema, prefix=subject_prefix, signer=new,
        checkpoint_key=key, new_checkpoint_key=True, new_key=True,
    ) as running:  # fmt: skip
        assert running.checkpoint_key_warning is not None
        assert "TRELLIS_NEW_CHECKPOINT_KEY" in running.checkpoint_key_warning


async def test_a_start_with_a_key_that_signs_none_of_the_logs_checkpoints_says_so(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    servers = (nats_url, database_url, pg_schema, subject_prefix)
    deployment = tmp_path / "deployment.pem"
    async with serving(*servers, signer=load_or_create(deployment), checkpoint_every=5) as h:
        expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
        await checkpoint(h)
    # Another deployment's key, given by mistake: said, not refused (it may be meant).
    other = tmp_path / "other.pem"
    kwargs = {"schema": pg_schema, "prefix": subject_prefix}
    async with engine_at(
        nats_url, database_url, signer=load_or_create(other), checkpoint_key=other, **kwargs
    ) as running:
        assert running.checkpoint_key_warning is not None
        assert "signs none of the log's checkpoints" in running.checkpoint_key_warning
    # The deployment's own key: nothing to say.
    async with engine_at(
        nats_url, database_url, signer=load_or_create(deployment), checkpoint_key=deployment,
        **kwargs,
    ) as running:  # fmt: skip
        assert running.checkpoint_key_warning is None
