"""Snapshots of a domain's folds: where a fold may start instead of the log's first event.

A snapshot is a fold as of one event, named by that event's version, position and chain hash,
kept outside the log (it is disposable: the log alone is the record). Before one is used, the
store checks that the log still holds that event with that hash
(engine.service.ports.SnapshotStore) and that the snapshot is sealed by the deployment's key, and
the reader checks its `format`: a fingerprint of the encoding, so a snapshot written by code
whose Structs differ is ignored rather than misread. A snapshot that fails a check, or does not
decode, is skipped with a warning (once per snapshot) and the fold starts from an older one (or
from the beginning).

The seal: whoever may write the database may rewrite a body so that it still decodes, and a
digest beside it too, so nothing in the database alone proves a snapshot is the engine's own. The
writer signs, with the checkpoint key (a file outside the database, adapters/checkpoint_key.py),
a note naming the snapshot's domain, kind, version, position, chain hash, format and the SHA-256
of its body; the store keeps the signature beside the body and checks it with the public half
before it hands the snapshot on. The note's first line is no checkpoint origin (`trellis/<d>`)
and its second no tree size, so a seal can never pass for a checkpoint, nor one for a seal.

Two kinds: `state`, the engine's DomainState (engine start, past `topology`, `free`,
`blast-radius`, `quotas`), and `read_models`, the projections' live rows (projections/past.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import TypeVar

import msgspec

from trellis.engine.core.checkpoints import NoteError, Signer, Verifier
from trellis.engine.core.records import Head
from trellis.engine.core.state import DomainState, evolve
from trellis.engine.service.follower import DomainLog
from trellis.engine.service.ports import Snapshot, SnapshotStore

log = logging.getLogger(__name__)

T = TypeVar("T")


def fingerprint(kind: str, schema: object) -> str:
    """A format name that changes whenever the encoded types do."""
    text = msgspec.json.encode(schema)
    return f"{kind}-{hashlib.sha256(text).hexdigest()[:16]}"


# Bump when evolve() changes what a state means (a snapshot of the old meaning would then be
# folded on as if it were new): 1, a partial repair stops naming what it moved off.
STATE_REVISION = 1
STATE_FORMAT = fingerprint("state", [STATE_REVISION, msgspec.json.schema(DomainState)])
_decode_state = msgspec.msgpack.Decoder(DomainState).decode


def of_state(state: DomainState, head: Head, recorded_at: datetime) -> Snapshot:
    return Snapshot(
        domain=state.domain,
        kind="state",
        version=head.version,
        position=head.position,
        hash=head.hash,
        recorded_at=recorded_at,
        format=STATE_FORMAT,
        body=msgspec.msgpack.encode(state),
    )


def state_of(snapshot: Snapshot) -> DomainState:
    """Raises msgspec.DecodeError (or ValidationError) for a body that is not a state."""
    return _decode_state(snapshot.body)


_SEAL = "trellis snapshot v1"


def _sealed_text(snapshot: Snapshot) -> str:
    body = hashlib.sha256(snapshot.body).hexdigest()
    return (
        f"{_SEAL}\ndomain {snapshot.domain}\nkind {snapshot.kind}\nversion {snapshot.version}\n"
        f"position {snapshot.position}\nhash {snapshot.hash}\nformat {snapshot.format}\n"
        f"body {body}\n"
    )


def seal(signer: Signer, snapshot: Snapshot) -> str:
    """The signature line(s) that vouch for `snapshot`, to keep beside its body."""
    text = _sealed_text(snapshot)
    return signer.sign(text)[len(text) + 1 :]


def is_sealed(verifier: Verifier, snapshot: Snapshot, signature: str | None) -> bool:
    """Whether `signature` is `verifier`'s seal of exactly this snapshot."""
    if not signature:
        return False
    try:
        verifier.open(f"{_sealed_text(snapshot)}\n{signature}")
    except NoteError:
        return False
    return True


_warned: set[tuple[str, str, int, str, str]] = set()


def skipped(domain: str, kind: str, version: int, hash: str, why: str) -> None:
    """Warn that a snapshot is not used, once per snapshot and reason: every past query
    passes the same ones."""
    if (said := (domain, kind, version, hash, why)) in _warned:
        return
    if len(_warned) >= 10_000:  # bounded; at worst a warning is said again
        _warned.clear()
    _warned.add(said)
    log.warning("%s snapshot of %s at version %d ignored: %s", kind, domain, version, why)


async def first_usable(
    candidates: AsyncIterator[Snapshot], format: str, decode: Callable[[Snapshot], T]
) -> tuple[Snapshot, T] | None:
    """The newest candidate of `format` that decodes; each one skipped is logged."""
    async for s in candidates:
        if s.format != format:
            why = f"format {s.format}, this code reads {format}"
            skipped(s.domain, s.kind, s.version, s.hash, why)
            continue
        try:
            return s, decode(s)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError) as exc:
            skipped(s.domain, s.kind, s.version, s.hash, f"it does not decode ({exc})")
    return None


async def state_at(
    log: DomainLog, store: SnapshotStore | None, domain: str, head: Head
) -> DomainState:
    """The domain's state right after its event `head`, folded from the newest usable state
    snapshot at or before it (or from the first event)."""
    state, after = DomainState(domain=domain), 0
    if store is not None:
        candidates = store.candidates(domain, "state", at_most_version=head.version)
        found = await first_usable(candidates, STATE_FORMAT, state_of)
        if found is not None:
            state, after = found[1], found[0].version
    async for recorded in log.read(domain, after_version=after, limit=head.version - after):
        state = evolve(state, recorded.event())
    return state
