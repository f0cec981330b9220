"""Snapshots of a domain's folds: where a fold may start instead of the log's first event.

A snapshot is a fold as of one event, named by that event's version, position and chain hash,
kept outside the log (it is disposable: the log alone is the record). Before one is used, the
store checks that the log still holds that event with that hash (engine.service.ports.SnapshotStore),
and the reader checks its `format`: a fingerprint of the encoding, so a snapshot written by
code whose Structs differ is ignored rather than misread. A snapshot that fails either check,
or does not decode, is skipped with a warning and the fold starts from an older one (or from
the beginning).

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

from trellis.engine.service.follower import DomainLog
from trellis.engine.service.ports import Snapshot, SnapshotStore
from trellis.engine.core.records import Head
from trellis.engine.core.state import DomainState, evolve

log = logging.getLogger(__name__)

T = TypeVar("T")


def fingerprint(kind: str, schema: object) -> str:
    """A format name that changes whenever the encoded types do."""
    text = msgspec.json.encode(schema)
    return f"{kind}-{hashlib.sha256(text).hexdigest()[:16]}"


STATE_FORMAT = fingerprint("state", msgspec.json.schema(DomainState))
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


async def first_usable(
    candidates: AsyncIterator[Snapshot], format: str, decode: Callable[[Snapshot], T]
) -> tuple[Snapshot, T] | None:
    """The newest candidate of `format` that decodes; each one skipped is logged."""
    async for snapshot in candidates:
        where = f"snapshot of {snapshot.domain} at version {snapshot.version}"
        if snapshot.format != format:
            log.warning("%s ignored: format %s, this code reads %s", where, snapshot.format, format)
            continue
        try:
            return snapshot, decode(snapshot)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError) as exc:
            log.warning("%s ignored: it does not decode (%s)", where, exc)
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
