"""The `fabric` query (`<prefix>.query.<domain>.fabric`): what a domain's hardware holds, as
the engine's own fabric driver reports it, and how that differs from what the log says.

The engine that writes the domain answers it (a request reaching another engine is forwarded
to the writer), so an operator on any host, with any data dir, sees the hardware that engine
drives. The differences are `engine.core.fabric_plan.reconcile` of the driver's snapshot against
the writer's state: exactly what the domain's FabricSync would change next. The hardware keeps
no history, so the query answers for now only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from trellis.engine.core.errors import FabricError, IntentRejected
from trellis.engine.core.fabric_plan import reconcile
from trellis.engine.core.results import FabricReport
from trellis.engine.core.state import DomainState
from trellis.engine.service.ports import FabricDriver

# At most this long to read the hardware (less when the saga deadline is shorter), so the
# answer comes before a client's usual 10 s timeout.
READ_DEADLINE_S = 5.0


async def report(
    domain: str,
    fabric: FabricDriver,
    state: Callable[[], DomainState],
    *,
    settling: Callable[[], bool],
    deadline: float,
) -> FabricReport:
    """Read the domain's hardware through `fabric`, then the writer's `state` (in that order,
    as reconcile requires), and compare them.

    Raises:
        IntentRejected: `unavailable` when the driver fails or does not answer within
            `deadline` seconds; nothing changed, ask again.
    """
    try:
        # A read, not a writer's change: no fence (the driver's "a tool's call").
        snapshot = await asyncio.wait_for(fabric.snapshot(domain), deadline)
    except FabricError as exc:
        raise IntentRejected(
            "unavailable",
            f"the fabric of domain {domain!r} could not be read: {exc}",
            {"domain": domain, "step": "snapshot", "component": exc.component},
        ) from None
    except TimeoutError:
        raise IntentRejected(
            "unavailable",
            f"the fabric of domain {domain!r} did not answer within {deadline:g} s",
            {"domain": domain, "step": "snapshot"},
        ) from None
    plan = reconcile(snapshot, state())
    return FabricReport(
        domain=domain,
        circuits=snapshot.circuits,
        bindings=snapshot.bindings,
        in_step=plan.in_step,
        settling=settling(),
        differences=plan,
        findings=snapshot.findings,
    )
