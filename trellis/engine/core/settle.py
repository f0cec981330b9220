"""Settling a pending composition once the fabric saga is done with it (pure, like decide.py).

Compose reserves; the saga (engine.service.saga) programs the fabric; then exactly one of these is
decided under the request id `settle_request_id(composition_id)`: establish (the fabric holds
it) or fail (the fabric could not, and what it programmed is undone).
"""

from __future__ import annotations

from functools import reduce

from trellis.engine.core.compose import circuit_teardown, devices_of
from trellis.engine.core.context import Decision
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CompositionActivated,
    CompositionFailed,
    CompositionImpaired,
    Event,
    PathEstablished,
)
from trellis.engine.core.intents import EstablishComposition, FailComposition
from trellis.engine.core.repair import broken, repair
from trellis.engine.core.results import ComposeResult
from trellis.engine.core.state import Composition, DomainState, evolve


def establish(state: DomainState, intent: EstablishComposition) -> Decision:
    """The fabric holds the composition: PathEstablished for each device, then active. A part
    of its paths that failed while the fabric was being programmed impairs it at once, and the
    usual repair follows."""
    composition = _pending(state, intent.composition_id)
    cid = composition.id
    events: list[Event] = [
        *(
            PathEstablished(composition_id=cid, device=b.device, path=b.path)
            for b in composition.bindings
        ),
        CompositionActivated(composition_id=cid),
    ]
    after = reduce(evolve, events, state)
    down = sorted({part for b in composition.bindings for part in broken(after, b)})
    for part in down:
        impaired = CompositionImpaired(composition_id=cid, component=part, reason=f"{part} is down")
        after = evolve(after, impaired)
        events.append(impaired)
    if down:
        mended = repair(after, after.compositions[cid], f"{', '.join(down)} down at activation")
        after = reduce(evolve, mended, after)
        events += mended
    final = after.compositions[cid]
    result = ComposeResult(
        composition_id=cid,
        host=final.host,
        state=final.state,
        expires_at=final.expires_at,
        devices=devices_of(final.bindings),
    )
    return Decision(events, result)


def fail(state: DomainState, intent: FailComposition) -> Decision:
    """The fabric could not program the composition: everything it reserved goes back (the
    saga has already undone what it programmed) and the client hears what failed."""
    composition = _pending(state, intent.composition_id)
    what = f"{intent.step} {intent.target}".strip()
    reason = (
        f"fabric failed at {what}: {intent.error}" if intent.error else f"fabric failed at {what}"
    )
    events: list[Event] = [CompositionFailed(composition_id=composition.id, reason=reason)]
    events += circuit_teardown(state, composition, "composition failed")
    details = {
        "composition_id": composition.id,
        "step": intent.step,
        "target": intent.target,
        "component": intent.component,
        "error": intent.error,
    }
    message = (
        f"composition {composition.id} failed and was rolled back: {reason}; nothing is held, "
        "compose again with a new request_id"
    )
    return Decision(events, error=IntentRejected("failed", message, details))


def _pending(state: DomainState, cid: str) -> Composition:
    composition = state.compositions.get(cid)
    if composition is None or composition.state != "pending":
        raise IntentRejected("conflict", f"composition {cid!r} is not pending", {"id": cid})
    return composition
