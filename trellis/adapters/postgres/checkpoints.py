"""Signed Merkle checkpoints in Postgres: the AuditTrail port, and the checkpointer sink.

`PostgresAuditTrail` keeps each domain's RFC 9162 tree (engine/core/merkle.py) in memory, grown from
the `hash` column of `trellis_events` in version order, and
- records checkpoints in `trellis_checkpoints` (schema/010): the signed C2SP note of the
  tree's root at a size (engine/core/checkpoints.py), then hands each to `publish` (the JetStream
  stream TRELLIS_CHECKPOINTS, adapters/nats/checkpoints.py);
- as a log follower's sink (engine/service/follower.py), records one every `every` events: for sizes
  N, 2N, 3N... as the domain's log passes them, in the transaction that moves the sink's
  follower checkpoint, and publishes them before that commits (a failed publication rolls the
  step back and the follower retries; Ed25519 signatures are deterministic, so a checkpoint
  published twice is the same message, and its message id `<domain>/<size>` lets JetStream
  drop the copy);
- answers the `proof`, `consistency` and `checkpoint-key` queries.

A tree is read once per process and domain and then only grows (about a second for a million
events, 64 bytes of memory per event); proofs then cost microseconds. Each use first confirms
that the log still holds the tree's last leaf, and reads the tree again when it does not (a
tail lost in a failover and written anew). The roots come from the log as the database holds it
now: a row altered after a checkpoint was signed gives proofs against a root no signed
checkpoint has, which is what an auditor's offline check catches.

A checkpoint already stored at a size (another engine's, or one recorded earlier) is answered
and published only when it states the log's root and its note holds: signed by the deployment's
key, or, signed by another key only (an earlier deployment key), then signed by this key too.
Any other row (forged by whoever can insert into the table, or signed over events the log no
longer holds) is logged as an error and neither published nor answered: that size gets no
checkpoint. Nor is a new size signed while the latest checkpoint stored below it states
another root than the log's at its size: the log is then no extension of what was signed
before (a rewrite), and signing would vouch for it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence

import asyncpg
import msgspec

from trellis.engine.core.actors import OPERATOR
from trellis.engine.core.checkpoints import Checkpoint, NoteError, Signer, origin_of, signers_of
from trellis.engine.core.errors import IntentRejected, StoreUnavailable
from trellis.engine.core.intents import CheckpointKeyQuery, ConsistencyQuery, ProofQuery
from trellis.engine.core.merkle import MerkleTree, leaf_hash
from trellis.engine.core.records import RecordedEvent, format_time
from trellis.engine.core.results import (
    CheckpointKeyResult,
    CheckpointResult,
    ConsistencyResult,
    ProofResult,
)
from trellis.engine.service.follower import Progress
from trellis.projections import follower_checkpoints

log = logging.getLogger("trellis.checkpoints")

SINK_NAME = "checkpoints"
DEFAULT_EVERY = 1000
_PAGE = 10_000

#: publish(domain, size, note): put a recorded checkpoint where auditors and witnesses see it.
Publish = Callable[[str, int, str], Awaitable[None]]

_INSERT = """
INSERT INTO trellis_checkpoints (domain, size, root, note) VALUES ($1, $2, $3, $4)
    ON CONFLICT (domain, size) DO NOTHING
"""
_READ = "SELECT size, root, recorded_at, note FROM trellis_checkpoints WHERE domain = $1"
_ONE = _READ + " AND size = $2"
_LATEST = _READ + " AND size <= $2 ORDER BY size DESC LIMIT 1"
# From the last version a tree holds ($2; 0: none), to confirm the log still has it, on.
_HASHES = """
SELECT version, hash FROM trellis_events
 WHERE domain = $1 AND version >= $2 AND version <= $3 ORDER BY version LIMIT $4
"""
_NOTES = "SELECT note FROM trellis_checkpoints"
_EVENT = "SELECT version, actor FROM trellis_events WHERE domain = $1 AND id = $2"


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """A database that is away is `unavailable` (resend), never a crash of the query."""
    try:
        yield
    except (OSError, TimeoutError, asyncpg.InterfaceError) as exc:
        raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
    except asyncpg.PostgresError as exc:
        if exc.sqlstate and exc.sqlstate[:2] in ("08", "53", "57", "58"):
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        raise


class PostgresAuditTrail:
    """Checkpoints and proofs of the log in the pool's schema (engine.service.ports.AuditTrail, and
    an engine.service.follower.Sink).

    Args:
        pool: asyncpg pool whose search_path holds the log (migrations applied).
        signer: the deployment's checkpoint key (adapters/checkpoint_key.py).
        every: a checkpoint each time a domain's log reaches a multiple of this many events.
        publish: where recorded checkpoints go; None: they are only recorded.
        follower: the name of the sink's follower checkpoint (one per publication target).
    """

    name = SINK_NAME
    # Not woken by every commit (engine.service.follower.Followers): a checkpoint falls due only
    # every so many events, and reading each commit's events for it cost the appends.
    poll_every = 1.0

    def __init__(
        self,
        pool: asyncpg.Pool,
        signer: Signer,
        *,
        every: int = DEFAULT_EVERY,
        publish: Publish | None = None,
        follower: str = SINK_NAME,
    ):
        if every < 1:
            raise ValueError(f"a checkpoint every {every} events is not a period")
        self._pool = pool
        self._signer = signer
        self._every = every
        self._publish = publish
        self._follower = follower
        self._trees: dict[str, MerkleTree] = {}
        self._growing: dict[str, asyncio.Lock] = {}

    @property
    def verifier_key(self) -> str:
        return self._signer.verifier.key()

    # ---- the AuditTrail port ----

    async def answer(
        self, domain: str, query: msgspec.Struct, *, head: int, viewer: str | None = None
    ) -> ProofResult | ConsistencyResult | CheckpointKeyResult:
        with _reachable():
            match query:
                case ProofQuery(event_id=event_id, size=size):
                    return await self._proof(domain, str(event_id), size, head, viewer)
                case ConsistencyQuery(from_size=old, to_size=new):
                    return await self._consistency(domain, old, new, head)
                case CheckpointKeyQuery():
                    return CheckpointKeyResult(verifier_key=self.verifier_key)
        raise IntentRejected("invalid", "not a query of the audit trail")

    async def checkpoint(self, domain: str, size: int) -> CheckpointResult:
        if size < 1:
            raise IntentRejected("not_found", f"domain {domain!r} has no events to checkpoint")
        with _reachable():
            async with self._pool.acquire() as conn:
                row, note = await self._record(conn, domain, size)
        if note is None:
            raise IntentRejected(
                "conflict",
                f"a checkpoint of {domain!r} stored in the database contradicts the log of "
                f"{size} events: either the stored one at that size is not one this deployment "
                "signed over its log, or an earlier one no longer matches the log, which this "
                "deployment then signs no more (the engine's log says which; `trellis verify` "
                "checks every stored note and names rewritten events)",
                {"domain": domain, "size": size},
            )
        try:
            await self._announce(domain, size, note)
        except Exception as exc:
            raise IntentRejected(
                "unavailable",
                f"checkpoint {size} of {domain!r} is recorded but could not be published "
                f"({exc}); ask again to publish it",
                {"domain": domain, "size": size},
            ) from exc
        return CheckpointResult(
            domain=domain,
            size=row["size"],
            root=row["root"],
            recorded_at=format_time(row["recorded_at"]),
            note=note,
        )

    async def signers(self) -> dict[str, int]:
        """The key ids (`<name>+<key hash>`) whose signatures the stored checkpoints carry, each
        with how many it signs: what a new key would replace (adapters/checkpoint_key.py)."""
        with _reachable():
            notes = await self._pool.fetch(_NOTES)
        signed: dict[str, int] = {}
        for row in notes:
            for key_id in signers_of(row["note"]):
                signed[key_id] = signed.get(key_id, 0) + 1
        return signed

    # ---- the Sink protocol ----

    async def resume(self, domain: str) -> tuple[int, Progress]:
        async with self._pool.acquire() as conn:
            await conn.execute(follower_checkpoints.ENSURE, self._follower, domain)
            row = await conn.fetchrow(follower_checkpoints.READ, self._follower, domain)
        progress = Progress(row["version"], row["position"])
        return progress.version, progress

    async def apply(self, domain: str, records: Sequence[RecordedEvent]) -> Progress:
        """Record (and publish) the checkpoint of every multiple of `every` the batch reaches."""
        last = records[-1]
        if last.version // self._every == (records[0].version - 1) // self._every:
            # No checkpoint falls in this batch: no commit either (a commit per batch was a
            # third of an append's cost). The stored progress stays behind; a restart re-reads
            # fewer than `every` events and records what they reach.
            return Progress(last.version, last.position)
        async with self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(follower_checkpoints.LOCK, self._follower, domain)
            done = Progress(row["version"], row["position"])
            if done.version >= last.version:
                return done  # another engine's follower got here first
            first = (done.version // self._every + 1) * self._every
            for size in range(first, last.version + 1, self._every):
                _, note = await self._record(conn, domain, size)
                if note is not None:
                    await self._announce(domain, size, note)
            await conn.execute(
                follower_checkpoints.SAVE, self._follower, domain, last.version, last.position
            )
        return Progress(last.version, last.position)

    async def refresh(self, domain: str) -> None:
        """Nothing outside the log changes what a checkpoint says."""

    # ---- internals ----

    async def _record(
        self, conn: asyncpg.Connection, domain: str, size: int
    ) -> tuple[asyncpg.Record, str | None]:
        """The checkpoint of `size` as stored (signed and inserted now, or recorded before), and
        the note to publish and answer for it; None when the stored row is not one this
        deployment can stand behind (logged as an error)."""
        tree = await self._tree(conn, domain, size)
        checkpoint = Checkpoint(origin=origin_of(domain), size=size, root=tree.root(size))
        row = await conn.fetchrow(_ONE, domain, size)
        if row is None:
            earlier = await conn.fetchrow(_LATEST, domain, size)
            if earlier is not None and earlier["root"] != _b64(tree.root(earlier["size"])):
                # The log is no extension of what was signed before: signing it would vouch
                # for a history that contradicts the deployment's own earlier statement.
                log.error(
                    "domain %s: no checkpoint of %d events is signed: the stored checkpoint of "
                    "%d events has root %s, and the log's first %d events now have root %s. "
                    "The log was rewritten (or lost a tail a checkpoint covered); `trellis "
                    "verify` names the events",
                    domain,
                    size,
                    earlier["size"],
                    earlier["root"],
                    earlier["size"],
                    _b64(tree.root(earlier["size"])),
                )
                return earlier, None
            note = self._signer.checkpoint(checkpoint)
            root = _b64(checkpoint.root)
            await conn.execute(_INSERT, domain, size, root, note)
            row = await conn.fetchrow(_ONE, domain, size)  # another engine's, if it was first
            log.info("domain %s: checkpoint of %d events, root %s", domain, size, root)
        try:
            return row, self._vouched(domain, checkpoint, row)
        except NoteError as exc:
            log.error(
                "domain %s: the stored checkpoint of %d events is neither published nor "
                "answered: %s. Whoever can insert into trellis_checkpoints forged it, or the "
                "log no longer holds the events it signed (a tail lost in a failover, or a "
                "rewrite); `trellis verify` checks every stored note",
                domain,
                size,
                exc,
            )
            return row, None

    def _vouched(self, domain: str, checkpoint: Checkpoint, row: asyncpg.Record) -> str:
        """The stored note of `checkpoint` as this deployment publishes it.

        Raises:
            NoteError: the row's root is not the log's, its note states another checkpoint, or
                the note does not hold.
        """
        root = _b64(checkpoint.root)
        if row["root"] != root:
            raise NoteError(f"its root {row['root']} is not the log's, {root}")
        note: str = row["note"]
        body = checkpoint.body()
        if note[: note.rfind("\n\n") + 1] != body:
            raise NoteError(f"its note does not state the log's root {root} of that size")
        verifier = self._signer.verifier
        with contextlib.suppress(NoteError):
            verifier.open(note)
            return note
        # No signature by this key: an earlier key's (the key was replaced), or anybody's. It
        # states the log's root, so this key signs it as well; the other lines are kept for
        # whoever holds their keys. A bad signature by this key still fails below.
        cosigned = note + self._signer.checkpoint(checkpoint)[len(body) + 1 :]
        verifier.open(cosigned)
        log.warning(
            "domain %s: the stored checkpoint of %d events carries no signature by %s; "
            "published with one added",
            domain,
            checkpoint.size,
            verifier.key(),
        )
        return cosigned

    async def _announce(self, domain: str, size: int, note: str) -> None:
        if self._publish is not None:
            await self._publish(domain, size, note)

    async def _tree(self, conn: asyncpg.Connection, domain: str, size: int) -> MerkleTree:
        """The domain's tree with at least `size` leaves, read from the log where it lacks them.

        The tree kept from earlier reads is confirmed against the log first: its last leaf must
        still be the log's event at that version (the chain makes that event's hash stand for
        every one before it). A tail the log lost (a failover to a standby without the last
        commits) and wrote again at the same versions would otherwise be signed with the old
        leaves; then the tree is read again from the log.

        Raises:
            IntentRejected: `unavailable` when the log has fewer events than `size`.
        """
        lock = self._growing.setdefault(domain, asyncio.Lock())
        async with lock:
            tree = self._trees.get(domain) or MerkleTree()
            while True:
                held = tree.size
                rows = await conn.fetch(_HASHES, domain, held, max(held, size), _PAGE)
                if held:
                    if (
                        not rows
                        or rows[0]["version"] != held
                        or _leaf(rows[0]) != tree.leaf(held - 1)
                    ):
                        log.warning(
                            "domain %s: the log no longer holds the %d events its Merkle tree was "
                            "read from (a tail lost in a failover, or rewritten): reading it again",
                            domain,
                            held,
                        )
                        tree = MerkleTree()
                        continue
                    rows = rows[1:]
                for row in rows:
                    if row["version"] != tree.size + 1:
                        break  # a gap in the log: damage; nothing past it is a leaf
                    tree.append(_leaf(row))
                if tree.size >= size or tree.size == held:
                    break
            self._trees[domain] = tree
            if tree.size < size:
                raise IntentRejected(
                    "unavailable",
                    f"the log of {domain!r} holds {tree.size} consecutive events, not {size}",
                    {"domain": domain, "size": size},
                )
            return tree

    async def _proof(
        self, domain: str, event_id: str, size: int | None, head: int, viewer: str | None
    ) -> ProofResult:
        async with self._pool.acquire() as conn:
            event = await conn.fetchrow(_EVENT, domain, event_id)
            # A tenant's view proves the tenant's own events and the operator's (the shared
            # fabric); anyone else's is answered as an unknown event would be.
            hidden = (
                viewer is not None
                and event is not None
                and event["actor"] not in (viewer, OPERATOR)
            )
            if event is None or hidden:
                raise IntentRejected(
                    "not_found", f"no event {event_id} in domain {domain!r}", {"id": event_id}
                )
            if size is None:
                latest = await conn.fetchrow(_LATEST, domain, head)
                if latest is None:
                    raise IntentRejected(
                        "not_found",
                        f"domain {domain!r} has no checkpoint yet: `trellis checkpoint` makes "
                        "one, or ask with `size`",
                        {"domain": domain},
                    )
                size, stored = latest["size"], latest
            else:
                _within(domain, size, head, "size")
                stored = await conn.fetchrow(_ONE, domain, size)
            index = event["version"] - 1
            if index >= size:
                raise IntentRejected(
                    "conflict",
                    f"event {event_id} is leaf {index} of {domain!r}, beyond the tree of {size} "
                    f"events; ask with a size above {index} or after the next checkpoint",
                    {"leaf_index": index, "tree_size": size},
                )
            tree = await self._tree(conn, domain, size)
        note = None
        if stored is not None:  # the stored note goes with the proof only if it is vouched for
            checkpoint = Checkpoint(origin=origin_of(domain), size=size, root=tree.root(size))
            try:
                note = self._vouched(domain, checkpoint, stored)
            except NoteError as exc:
                log.error(
                    "domain %s: a proof against %d events goes without the stored note: %s",
                    domain,
                    size,
                    exc,
                )
        return ProofResult(
            leaf_index=index,
            tree_size=size,
            root=_b64(tree.root(size)),
            path=[_b64(h) for h in tree.inclusion_path(index, size)],
            checkpoint=note,
        )

    async def _consistency(self, domain: str, old: int, new: int, head: int) -> ConsistencyResult:
        _within(domain, new, head, "to_size")
        if old > new:
            raise IntentRejected(
                "invalid",
                f"from_size {old} is beyond to_size {new}: a log only grows",
                {"from_size": old, "to_size": new},
            )
        async with self._pool.acquire() as conn:
            tree = await self._tree(conn, domain, new)
        return ConsistencyResult(
            from_size=old,
            to_size=new,
            from_root=_b64(tree.root(old)),
            to_root=_b64(tree.root(new)),
            path=[_b64(h) for h in tree.consistency_proof(old, new)],
        )


def _within(domain: str, size: int, head: int, field: str) -> None:
    if size > head:
        raise IntentRejected(
            "invalid",
            f"{field} {size} is beyond the log of {domain!r}, which holds {head} events",
            {field: size, "events": head},
        )


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _leaf(row: asyncpg.Record) -> bytes:
    return leaf_hash(bytes.fromhex(row["hash"]))
