"""decide(state, intent, context) -> Decision: the pure heart of the engine.

No I/O and no clock reads: time arrives in the Context. A rejection that records nothing is
raised as IntentRejected; everything that changes the world comes back as events. Each family
of intents is decided in its own module: the fabric (engine.core.topology), quotas
(engine.core.quotas), compositions (engine.core.compose), reservations (engine.core.reservations)
and their settlement after the fabric saga (engine.core.settle).
"""

from __future__ import annotations

from functools import reduce

import msgspec

from trellis.engine.core import quotas, reservations, topology
from trellis.engine.core.compose import compose, expire_leases, extend, release
from trellis.engine.core.context import Context, Decision
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import (
    AddLink,
    AddNode,
    Apply,
    CancelReservation,
    ClearQuota,
    Compose,
    Drain,
    EstablishComposition,
    ExpireLeases,
    ExpireReservations,
    Extend,
    FailComposition,
    ImportTopology,
    Intent,
    Release,
    Remove,
    ReportFault,
    Reserve,
    SetQuota,
    Undrain,
)
from trellis.engine.core.repair import in_turn, retry_impaired
from trellis.engine.core.settle import establish, fail
from trellis.engine.core.state import DomainState, evolve

__all__ = ["Context", "Decision", "decide"]

# What these intents free (devices, slices, bandwidth, OCS ports) may mend an impaired
# composition, so some get another try in the same commit, as at a recovery. The reason
# names no composition or reservation: the repaired one may be another tenant's.
_FREEING: dict[type[Intent], str] = {
    Release: "devices freed by a release",
    ExpireLeases: "devices freed by an expired lease",
    FailComposition: "devices freed by a failed compose",
    CancelReservation: "devices freed by a cancelled reservation",
    ExpireReservations: "devices freed by an expired reservation",
}
# How many impaired compositions one such intent tries, in turn (repair.in_turn). A try that
# fails costs a placement: after a spine's fault left 183 of 1,500 impaired on a 4,096-device
# hall, trying them all made every release take 290 ms where it took a tenth of one.
TRIES_PER_FREEING = 2


def decide(state: DomainState, intent: Intent, ctx: Context) -> Decision:
    """Decide what an intent means for the domain.

    Raises:
        IntentRejected: the intent is refused and nothing is recorded.
    """
    if not state.exists and not isinstance(intent, ImportTopology):
        raise IntentRejected(
            "not_found",
            f"domain {ctx.domain!r} does not exist; import a topology first",
            {"domain": ctx.domain},
        )
    decision = _decide(state, intent, ctx)
    freed = _FREEING.get(type(intent))
    if freed is not None and state.impaired and decision.events:
        after = reduce(evolve, decision.events, state)
        tried = in_turn(after, intent.request_id, TRIES_PER_FREEING)
        if mended := retry_impaired(after, freed, among=tried):
            events = [*decision.events, *mended]
            own = len(decision.events)
            decision = msgspec.structs.replace(decision, events=events, engine_from=own)
    return decision


def _decide(state: DomainState, intent: Intent, ctx: Context) -> Decision:
    match intent:
        case ImportTopology():
            return topology.import_topology(state, intent, ctx)
        case AddNode():
            return topology.add_node(state, intent)
        case AddLink():
            return topology.add_link(state, intent)
        case Remove():
            return topology.remove(state, intent)
        case Drain():
            return topology.drain(state, intent)
        case Undrain():
            return topology.undrain(state, intent)
        case ReportFault():
            return topology.report_fault(state, intent)
        case SetQuota():
            return quotas.set_quota(state, intent)
        case ClearQuota():
            return quotas.clear_quota(state, intent)
        case ExpireLeases():
            return expire_leases(state, ctx)
        case EstablishComposition():
            return establish(state, intent)
        case FailComposition():
            return fail(state, intent)
        case Compose():
            return compose(state, intent, ctx)
        case Release():
            return release(state, intent, ctx)
        case Extend():
            return extend(state, intent, ctx)
        case Reserve():
            return reservations.reserve(state, intent, ctx)
        case Apply():
            return reservations.apply(state, intent, ctx)
        case CancelReservation():
            return reservations.cancel(state, intent, ctx)
        case ExpireReservations():
            return reservations.expire_reservations(state, ctx)
    raise IntentRejected("invalid", f"{ctx.verb} is not served by this engine version")
