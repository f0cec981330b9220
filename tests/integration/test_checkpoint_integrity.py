"""The checkpointer signs only what the log holds, and stands behind no stored row it did not sign
over the log (adapters/postgres/checkpoints.py).

- A tail the log lost (a failover to a standby without the last commits) and written anew at
  the same versions is not signed with the leaves the checkpointer read before.
- A row in `trellis_checkpoints` whose root is not the log's, or whose note does not hold, is
  neither published nor answered, whoever put it there.
- A row signed by an earlier key only, with the log's root, is answered signed by this key too.
- A key made by a start whose log holds checkpoints signed by other keys is refused, unless
  TRELLIS_NEW_CHECKPOINT_KEY allows it.
- A row in `trellis_checkpoints` whose root is not the log's, or whose note does not hold, is
  neither published nor answered, whoever put it there.
- A row signed by an earlier key only, with the log's root, is answered signed by this key too.
- A key made by a start whose log holds checkpoints signed by other keys is refused, unless
  TRELLIS_NEW_CHECKPOINT_KEY allows it.
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import pytest
import pytest_asyncio
from lost_tail import lose_tail
from store_contract import T0, pending

from trellis.adapters.checkpoint_key import (
    KEY_FILE,
    NEW_KEY_ENV,
    KeyFileError,
    judge_new_key,
    load_or_create,
    public_key_path,
)
from trellis.adapters.postgres.checkpoints import PostgresAuditTrail
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.engine.core.checkpoints import Checkpoint, Signer, open_checkpoint, origin_of
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import ConsistencyQuery, ProofQuery
from trellis.engine.core.merkle import MerkleTree, leaf_hash
from trellis.engine.core.records import RecordedEvent
from trellis.engine.core.results import ConsistencyResult, ProofResult

DOMAIN = "hall-1"
FORGED_ROOT = "A" * 43 + "="


@pytest_asyncio.fixture
async def store(database_url: str, pg_schema: str) -> AsyncIterator[PostgresEventStore]:
    log = await PostgresEventStore.open(database_url, schema=pg_schema)
    yield log
    await log.close()


Lose = Callable[..., Awaitable[None]]  # (keep, **what else the standby lacked)


@pytest.fixture
def lose(owner_url: str, pg_schema: str) -> Lose:
    """Leave the domain's log at a version, as a promoted standby that lacked the rest."""
    return lambda keep, **lost: lose_tail(owner_url, pg_schema, DOMAIN, keep, **lost)


class Published(list[tuple[str, int, str]]):
    async def __call__(self, domain: str, size: int, note: str) -> None:
        self.append((domain, size, note))


def trail_of(
    store: PostgresEventStore, signer: Signer, published: Published, every: int = 1000
) -> PostgresAuditTrail:
    return PostgresAuditTrail(store._pool, signer, every=every, publish=published)


async def grown_to(store: PostgresEventStore, version: int, hours: int = 0) -> list[RecordedEvent]:
    """The domain's log, `version` events long: events appended after its head."""
    head = await store.head(DOMAIN)
    batch = pending(version - head.version, at=T0 + timedelta(hours=hours))
    await store.append(DOMAIN, head, batch, [])
    return [e async for e in store.read(DOMAIN)]


def root_of(log: list[RecordedEvent], size: int) -> str:
    tree = MerkleTree(leaf_hash(bytes.fromhex(e.hash)) for e in log[:size])
    return base64.b64encode(tree.root()).decode()


async def test_a_tail_lost_and_written_anew_is_signed_as_the_log_holds_it(
    store: PostgresEventStore, lose: Lose, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: checkpoints of 10 and 17 events, then the log loses 16 and 17 in a failover (and
    # with them the checkpoint of 17, committed after them) and the writer writes 16 to 19
    # anew. The checkpointer read the 17 before.
    signer, published = Signer.generate(), Published()
    trail = trail_of(store, signer, published)
    await grown_to(store, 17)
    await trail.checkpoint(DOMAIN, 10)
    await trail.checkpoint(DOMAIN, 17)
    await lose(15, signed_checkpoints=True)
    log = await grown_to(store, 19, hours=1)

    # When: the checkpoint of 19 is asked for.
    with caplog.at_level(logging.WARNING, logger="trellis.checkpoints"):
        signed = await trail.checkpoint(DOMAIN, 19)

    # Then: it signs the log's 19 events, not the 17 it read before with two new ones.
    assert signed.root == root_of(log, 19)
    assert open_checkpoint(signed.note, signer.verifier).root == base64.b64decode(root_of(log, 19))
    assert published[-1] == (DOMAIN, 19, signed.note)
    assert "no longer holds the 17 events" in caplog.text
    # Proofs come from the log as it is too; the lost 17 has no checkpoint of this log.
    proof = await trail.answer(DOMAIN, ConsistencyQuery(from_size=10, to_size=19), head=19)
    assert isinstance(proof, ConsistencyResult)
    assert (proof.from_root, proof.to_root) == (root_of(log, 10), root_of(log, 19))
    # A tree that only lost its tail (nothing written anew yet) is read again as well.
    await lose(18)
    with pytest.raises(IntentRejected) as short:
        await trail.answer(DOMAIN, ConsistencyQuery(from_size=10, to_size=19), head=19)
    assert short.value.code == "unavailable"
    assert (await trail.checkpoint(DOMAIN, 18)).root == root_of(log, 18)


async def forge(store: PostgresEventStore, size: int, root: str, note: str) -> None:
    """Whoever holds the engine's role inserts a checkpoint the engine did not sign."""
    await store._pool.execute(
        "INSERT INTO trellis_checkpoints (domain, size, root, note) VALUES ($1, $2, $3, $4)",
        DOMAIN, size, root, note,
    )  # fmt: skip


def broken_signature(note: str) -> str:
    text, _, signature = note.rstrip("\n").rpartition(" ")
    flipped = "B" if signature[8] == "A" else "A"  # in the signature, past the key hash
    return f"{text} {signature[:8]}{flipped}{signature[9:]}\n"


async def test_a_checkpoint_forged_ahead_of_the_log_is_neither_published_nor_answered(
    store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: a checkpoint of 30 events in the table before the log has 30 events.
    forged = f"trellis/{DOMAIN}\n30\n{FORGED_ROOT}\n\n\u2014 forged junk\n"
    await forge(store, 30, FORGED_ROOT, forged)
    signer, published = Signer.generate(), Published()
    trail = trail_of(store, signer, published, every=10)

    # When: the log passes 30 events and the checkpointer follows it, and an operator asks.
    log = await grown_to(store, 30)
    await trail.resume(DOMAIN)
    with caplog.at_level(logging.ERROR, logger="trellis.checkpoints"):
        await trail.apply(DOMAIN, log)
        with pytest.raises(IntentRejected) as asked:
            await trail.checkpoint(DOMAIN, 30)

    # Then: 10 and 20 are published, signed; the forged 30 is not, and the request is refused.
    assert [(size, note == forged) for _, size, note in published] == [(10, False), (20, False)]
    for _, size, note in published:
        assert open_checkpoint(note, signer.verifier).size == size
    assert asked.value.code == "conflict"
    assert asked.value.details == {"domain": DOMAIN, "size": 30}
    assert f"domain {DOMAIN}: the stored checkpoint of 30 events is neither" in caplog.text
    assert "is not the log's" in caplog.text


def checkpoint_of(log: list[RecordedEvent], size: int, root: str | None = None) -> Checkpoint:
    root = root or root_of(log, size)
    return Checkpoint(origin=origin_of(DOMAIN), size=size, root=base64.b64decode(root))


@pytest.mark.parametrize("forgery", ["another root in the note", "a broken signature"])
async def test_a_stored_note_that_does_not_hold_is_not_answered(
    store: PostgresEventStore, forgery: str
) -> None:
    # Given: a row with the log's root in its column, and a note that does not hold.
    signer, published = Signer.generate(), Published()
    log = await grown_to(store, 12)
    if forgery == "another root in the note":
        note = signer.checkpoint(checkpoint_of(log, 12, root=FORGED_ROOT))
    else:
        note = broken_signature(signer.checkpoint(checkpoint_of(log, 12)))
    await forge(store, 12, root_of(log, 12), note)

    # When: the operator asks for the checkpoint of 12.
    with pytest.raises(IntentRejected) as asked:
        await trail_of(store, signer, published).checkpoint(DOMAIN, 12)

    # Then: refused, and nothing is published.
    assert asked.value.code == "conflict"
    assert published == []


async def test_a_proof_carries_a_stored_note_only_when_it_holds(
    store: PostgresEventStore,
) -> None:
    # Given: the deployment's checkpoint of 10, and a forged one of 12 (another root signed).
    signer = Signer.generate()
    trail = trail_of(store, signer, Published())
    log = await grown_to(store, 12)
    await trail.checkpoint(DOMAIN, 10)
    await forge(store, 12, root_of(log, 12), signer.checkpoint(checkpoint_of(log, 12, FORGED_ROOT)))

    async def proof(size: int | None) -> ProofResult:
        query = ProofQuery(event_id=log[0].id, size=size)
        answer = await trail.answer(DOMAIN, query, head=12)
        assert isinstance(answer, ProofResult)
        return answer

    # Then: against 12 (asked for, or the latest) the proof is the log's, with no note.
    for size in (12, None):
        forged = await proof(size)
        assert (forged.tree_size, forged.root, forged.checkpoint) == (12, root_of(log, 12), None)
    # Against 10, the deployment's own note goes with it.
    signed = await proof(10)
    assert signed.checkpoint is not None
    assert open_checkpoint(signed.checkpoint, signer.verifier).size == 10


async def test_a_checkpoint_signed_by_an_earlier_key_is_answered_signed_by_this_one_too(
    store: PostgresEventStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: a checkpoint of 10 signed by the deployment's earlier key.
    earlier, now, published = Signer.generate(), Signer.generate(), Published()
    log = await grown_to(store, 12)
    first = await trail_of(store, earlier, Published()).checkpoint(DOMAIN, 10)

    # When: an engine with the new key is asked for it (the log stood still at 10, say).
    with caplog.at_level(logging.WARNING, logger="trellis.checkpoints"):
        again = await trail_of(store, now, published).checkpoint(DOMAIN, 10)

    # Then: the same checkpoint, its note signed by both keys; the stored row as it was.
    assert (again.root, again.recorded_at) == (first.root, first.recorded_at)
    for key in (earlier, now):
        assert open_checkpoint(again.note, key.verifier) == checkpoint_of(log, 10)
    assert again.note.startswith(first.note)
    assert published == [(DOMAIN, 10, again.note)]
    assert f"carries no signature by {now.verifier.key()}" in caplog.text
    stored = await store._pool.fetchval("SELECT note FROM trellis_checkpoints WHERE size = 10")
    assert stored == first.note


async def test_a_checkpoint_of_a_lost_tail_is_not_answered_for_the_log_written_anew(
    store: PostgresEventStore, lose: Lose
) -> None:
    # Given: a checkpoint of 17, then the log loses 16 and 17 and is written anew to 19.
    signer, published = Signer.generate(), Published()
    trail = trail_of(store, signer, published)
    await grown_to(store, 17)
    await trail.checkpoint(DOMAIN, 17)
    await lose(15)
    await grown_to(store, 19, hours=1)

    # When: the checkpoint of 17 is asked for again.
    with pytest.raises(IntentRejected) as asked:
        await trail.checkpoint(DOMAIN, 17)

    # Then: the note of the lost log is not answered nor published again for this one.
    assert asked.value.code == "conflict"
    assert [size for _, size, _ in published] == [17]


async def test_a_new_key_on_a_log_signed_by_another_is_refused_unless_allowed(
    store: PostgresEventStore, tmp_path: Path
) -> None:
    # Given: a log with checkpoints signed by the deployment's key, cosigned once by another.
    deployment, witness = Signer.generate(), Signer.generate("witness")
    trail = trail_of(store, deployment, Published())
    log = await grown_to(store, 12)
    await trail.checkpoint(DOMAIN, 10)
    cosigned = witness.sign(checkpoint_of(log, 11).body())
    cosigned += deployment.checkpoint(checkpoint_of(log, 11)).rpartition("\n\n")[2]
    await forge(store, 11, root_of(log, 11), cosigned)
    # A start whose key file is missing makes a new one.
    path = tmp_path / KEY_FILE
    new = load_or_create(path)
    signed = await trail_of(store, new, Published()).signers()
    key_id = f"trellis+{deployment.verifier.key_hash.hex()}"
    assert signed == {key_id: 2, f"witness+{witness.verifier.key_hash.hex()}": 1}

    # When/Then: not allowed, the start is refused and the key it made is gone, so the next
    # start judges again; allowed, it is said.
    with pytest.raises(KeyFileError, match=re.escape(f"signed by other keys, {key_id} (2), ")):
        judge_new_key(path, new, signed, allowed=False)
    assert not path.exists() and not public_key_path(path).exists()
    warning = judge_new_key(path, new, signed, allowed=True)
    assert warning is not None and f"{NEW_KEY_ENV})" in warning and key_id in warning
    # A log that holds no checkpoint, or only the key's own: nothing to say.
    assert judge_new_key(path, new, {}, allowed=False) is None
    own = {f"trellis+{new.verifier.key_hash.hex()}": 4}
    assert judge_new_key(path, new, own, allowed=False) is None
