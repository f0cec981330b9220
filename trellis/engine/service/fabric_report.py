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
import time
from collections.abc import Callable

from trellis.engine.core.errors import FabricError, IntentRejected
from trellis.engine.core.fabric import FabricSnapshot
from trellis.engine.core.fabric_plan import reconcile
from trellis.engine.core.results import FabricReport
from trellis.engine.core.state import DomainState
from trellis.engine.service.ports import FabricDriver

# At most this long to read the hardware (less when the saga deadline is shorter), so the
# answer comes before a client's usual 10 s timeout.
READ_DEADLINE_S = 5.0
# A read that ended after its caller gave up answers the next caller within this long.
UNCLAIMED_S = 30.0


class Reads:
    """Reads of each domain's hardware that run on after their caller gave up: a slow fabric
    manager's read (a probe's took 8 s at 0.7 s an answer, so every `fabric check` gave up at
    5 s and none could ever answer) then answers the next caller, when it ended in the last
    UNCLAIMED_S. A read its caller took is not kept: the next caller reads again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._abandoned: set[asyncio.Future[FabricSnapshot]] = set()
        self._unclaimed: dict[str, tuple[float, FabricSnapshot]] = {}

    async def read(self, domain: str, fabric: FabricDriver, deadline: float) -> FabricSnapshot:
        """The domain's hardware now, or as a read whose caller gave up found it.

        Raises:
            FabricError: the read failed.
            TimeoutError: no answer within `deadline` (the read runs on).
        """
        unclaimed = self._unclaimed.pop(domain, None)
        if unclaimed is not None and self._clock() - unclaimed[0] <= UNCLAIMED_S:
            return unclaimed[1]
        running = asyncio.ensure_future(fabric.snapshot(domain))
        try:
            return await asyncio.wait_for(asyncio.shield(running), deadline)
        except TimeoutError:
            self._abandoned.add(running)  # held: a task nobody holds may be collected
            running.add_done_callback(lambda done: self._ended(domain, done))
            raise

    def _ended(self, domain: str, done: asyncio.Future[FabricSnapshot]) -> None:
        self._abandoned.discard(done)
        if done.cancelled() or done.exception() is not None:
            return  # nobody waits for it; the next caller reads again
        self._unclaimed[domain] = (self._clock(), done.result())


async def report(
    domain: str,
    fabric: FabricDriver,
    state: Callable[[], DomainState],
    *,
    settling: Callable[[], bool],
    deadline: float,
    reads: Reads,
) -> FabricReport:
    """Read the domain's hardware through `fabric`, then the writer's `state` (in that order,
    as reconcile requires), and compare them.

    Raises:
        IntentRejected: `unavailable` when the driver fails or does not answer within
            `deadline` seconds; nothing changed, ask again.
    """
    try:
        # A read, not a writer's change: no fence (the driver's "a tool's call").
        snapshot = await reads.read(domain, fabric, deadline)
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
