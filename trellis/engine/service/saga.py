"""The fabric saga: make the hardware of one domain hold what its log says (ARCHITECTURE §8).

A FabricSync runs passes, one at a time, whenever something committed (and once at start):
1. snapshot the hardware, then read the writer's state, in that order (engine.core.fabric_plan);
2. take away what the hardware holds and the log no longer does (released, failed, expired,
   rerouted), bindings before circuits, so ports and devices are free before anything new
   needs them; then program what settled compositions need and the hardware lacks (repairs);
3. start the compose saga of every pending composition that has none running (also when the
   snapshot failed: the saga's own steps then fail and are undone). Sagas run on their own,
   so one slow fabric call holds up nothing else; each, within its deadline, creates its
   circuits and binds its devices. On an error or at the deadline it undoes what
   it may have programmed and settles the composition as failed, otherwise as established.
   Settling is an internal intent under `settle_request_id`, so it is recorded once, one way.
   Passes leave everything of a pending composition alone.
Every driver operation is idempotent and a pass starts from the log, so a pass that failed is
simply run again after a backoff, and an engine that restarts finishes or undoes the sagas a
crash interrupted with its first pass. Nothing here decides: the state says what to do.

A pass is needed only when the hardware may differ from what the sync knows of it. Once a pass
found it in step, a commit that says exactly what the hardware must do is done without one
(`committed`): compositions reserved get their sagas at once, and what a release or an expiry
lets go (its bindings, then the circuits the commit removed) is taken away in one `program`
call, which sagas started after it wait for, so a device or a port is free before it is used
again. A lone release in a quiet moment is held back briefly instead (LINGER_S), for the next
compose saga to make first in its own call: one call and one durable write where there were
two in sequence. Any other commit (a fault, a repair, an import, a failed saga), a failed
call, a writer that caught up with someone else's commits, or a `kick` from outside sends the
domain back to passes until one finds the hardware in step again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, TypeVar

from trellis.engine.core import replies
from trellis.engine.core.compose import unused_circuits
from trellis.engine.core.errors import FabricError, WriterFenced
from trellis.engine.core.events import (
    CircuitCreated,
    CircuitRemoved,
    CompositionActivated,
    CompositionRejected,
    CompositionReleased,
    CompositionRequested,
    DevicesReserved,
    Event,
    LeaseExpired,
    LeaseExtended,
    PathEstablished,
    QuotaCleared,
    QuotaSet,
)
from trellis.engine.core.fabric import (
    FabricBinding,
    FabricChange,
    FabricCircuit,
    FabricSnapshot,
)
from trellis.engine.core.fabric_plan import (
    Reconciliation,
    bindings_of,
    circuits_of,
    reconcile,
)
from trellis.engine.core.intents import EstablishComposition, FailComposition, settle_request_id
from trellis.engine.core.state import Composition, DomainState
from trellis.engine.service.ports import FabricDriver, NoTelemetry, SagaOutcome, Telemetry

log = logging.getLogger(__name__)

Settlement = EstablishComposition | FailComposition
_Item = TypeVar("_Item", FabricBinding, FabricCircuit)
# Hands a settlement to the domain's writer; resolves to the reply the composer should get.
Settle = Callable[[str, Settlement], Awaitable[bytes]]
# How long what a commit let go waits for the next compose saga to carry it (one call, one
# durable write, instead of a call the saga waits for and then its own): about the time a
# client takes to send its next compose and the writer to reserve it. While a reservation is
# being appended when it runs out, it waits on for that commit (FabricSync._linger_over).
LINGER_S = 0.005
# Events whose commit says all the hardware must do (see `FabricSync.committed`): reservations
# (their sagas program them), settlements (their sagas did), releases and expiries (their
# bindings and removed circuits go), and what touches no hardware.
_SAID: frozenset[type[Event]] = frozenset(
    {
        CompositionRequested,
        CompositionRejected,
        CircuitCreated,
        DevicesReserved,
        PathEstablished,
        CompositionActivated,
        LeaseExtended,
        LeaseExpired,
        CompositionReleased,
        CircuitRemoved,
        QuotaSet,
        QuotaCleared,
    }
)


class _Carried(NamedTuple):
    """What the commits before a compose saga let go, made first in the saga's own call;
    `done` resolves once that call ended."""

    changes: list[FabricChange]
    done: asyncio.Future[None]


class FabricSync:
    """The one task that drives one domain's fabric."""

    def __init__(
        self,
        domain: str,
        state: Callable[[], DomainState],
        fabric: FabricDriver,
        settle: Settle,
        *,
        deadline: float,
        max_backoff: float = 5.0,
        fence: int | None = None,
        on_fenced: Callable[[int], None] | None = None,
        telemetry: Telemetry | None = None,
        appending: Callable[[], Sequence[Event]] = tuple,
    ):
        self.domain = domain
        self._appending = appending  # the events of the writer's append in flight
        self._telemetry = telemetry or NoTelemetry()
        self._fence = fence  # every driver call carries the writer epoch it is made under
        self._on_fenced = on_fenced
        self._state = state
        self._fabric = fabric
        self._settle = settle
        self._deadline = deadline
        self._max_backoff = max_backoff
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while the hardware is in step and nothing is due
        self._task: asyncio.Task[None] | None = None
        self._settled: dict[str, asyncio.Future[bytes]] = {}
        self._sagas: dict[str, asyncio.Task[None]] = {}  # composition id -> its running saga
        self.passes = 0  # completed passes, for tests and metrics
        # The state the hardware is known to match (apart from work in flight), while it is in
        # step: the last in-step pass's, then each commit done without a pass. None: a pass is due.
        self._known: DomainState | None = None
        # The state the hardware was last seen in step with (unlike `_known`, a kick leaves
        # it): what a pass changes that the log did not move since is a repair (_say_repairs).
        self._steady: DomainState | None = None
        self._composed_here: set[str] = set()  # compositions whose saga this engine ran
        self._repairs_said: set[str] = set()  # the repairs the last pass logged
        self._letting: set[asyncio.Task[None]] = set()  # let-go calls in flight
        # What the last commits let go and no call has carried yet: the next compose saga
        # takes it along in its own call, else it goes on its own after LINGER_S.
        self._held_back: list[FabricChange] = []
        self._lingering: asyncio.TimerHandle | None = None
        self._carrying: set[asyncio.Future[None]] = set()  # sagas' calls that let go first

    def kick(self) -> None:
        """The hardware may differ from the log: run a pass soon (passes coalesce)."""
        self._let_go_now()
        self._known = None
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"fabric-{self.domain}")

    def committed(self, before: DomainState, after: DomainState, events: Sequence[Event]) -> None:
        """The writer committed `events`, taking the state from `before` to `after`. When the
        hardware was in step with `before` and the events say all it must do, do that now;
        otherwise run a pass."""
        if before is not self._known or any(type(e) not in _SAID for e in events):
            self.kick()
            return
        self._known = self._steady = after
        released = [e.composition_id for e in events if isinstance(e, CompositionReleased)]
        leaving = [before.compositions[cid] for cid in released]
        changes = [
            *(FabricChange(op="unbind", binding=b) for c in leaving for b in bindings_of(c)),
            *(
                FabricChange(
                    op="remove_circuit",
                    circuit=FabricCircuit(ocs=e.ocs, a_port=e.a_port, b_port=e.b_port),
                )
                for e in events
                if isinstance(e, CircuitRemoved)
            ),
        ]
        reserved = [e.composition_id for e in events if isinstance(e, DevicesReserved)]
        if changes:
            self._idle.clear()
            self._held_back += changes
        if reserved:
            self._idle.clear()
            self._start_sagas(reserved)  # one saga carries what is held back; more wait for it
        elif changes and (len(leaving) != 1 or self._sagas or self._letting):
            # Not a lone release in a quiet moment: the sagas of the next commits would wait
            # for a call not yet started.
            self._let_go_now()
        elif changes and self._lingering is None:
            loop = asyncio.get_running_loop()
            self._lingering = loop.call_later(LINGER_S, self._linger_over)
        self._maybe_idle()

    def _linger_over(self) -> None:
        """What is held back goes on its own call, unless a reservation is being appended:
        its saga, starting at that commit, carries it. (Sent alone while the append was in
        flight, the call made the saga wait for it and then make its own: two durable writes
        in sequence, on a compose whose append was already slow.) The append ends, committed
        or not; without a reservation committed by then it goes at the next look."""
        self._lingering = None
        if any(isinstance(e, DevicesReserved) for e in self._appending()):
            loop = asyncio.get_running_loop()
            self._lingering = loop.call_later(LINGER_S, self._linger_over)
        else:
            self._let_go_now()

    def _take_held_back(self) -> list[FabricChange]:
        """What is held back, no longer held (its linger stops)."""
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        held, self._held_back = self._held_back, []
        return held

    def _let_go_now(self) -> None:
        """Send what is held back on its own call now; sagas started later wait for it."""
        if changes := self._take_held_back():
            task = asyncio.create_task(self._take_away(changes), name="fabric-let-go")
            self._letting.add(task)

    def _carry(self) -> _Carried:
        """What is held back, for the one saga starting now to make first in its own call;
        sagas started after it wait for that call, as for a let-go call of its own."""
        carried = _Carried(self._take_held_back(), asyncio.get_running_loop().create_future())
        self._carrying.add(carried.done)
        return carried

    def _carried(self, carried: _Carried | None) -> None:
        """The call that carried `carried` ended (or never will): who waits for it goes on."""
        if carried is not None:
            self._carrying.discard(carried.done)
            if not carried.done.done():
                carried.done.set_result(None)

    async def _take_away(self, changes: list[FabricChange]) -> None:
        """Let the hardware go of what a commit released, in one call; if it fails, a pass
        finishes the work."""
        try:
            async with asyncio.timeout(self._deadline):
                await self._fabric.program(self.domain, changes, fence=self._fence)
        except WriterFenced as exc:
            self._fenced(exc)
        except (FabricError, TimeoutError) as exc:
            log.warning("domain %s: letting go failed (%s); a pass retries", self.domain, _why(exc))
            self.kick()
        except Exception:
            log.exception("domain %s: letting go failed; a pass retries", self.domain)
            self.kick()
        finally:
            self._letting.discard(asyncio.current_task())  # type: ignore[arg-type]
            self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self._known is not None and not (self._sagas or self._letting or self._held_back):
            self._idle.set()

    async def close(self) -> None:
        """Stop driving the fabric. Whoever waits for a settlement hears `unavailable`: the
        domain's next writer finishes the saga, and a resend gets its settlement."""
        self._take_held_back()  # what it held back is the next writer's pass's
        tasks = [*self._sagas.values(), *self._letting, *([self._task] if self._task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for cid, future in self._settled.items():
            if not future.done():
                future.set_result(
                    replies.error(
                        "unavailable",
                        f"composition {cid} is being established by another writer; ask again "
                        "with the same request_id",
                        {"composition_id": cid},
                    )
                )

    async def wait_idle(self) -> None:
        """Until a pass found the hardware in step with the log, no saga runs and nothing
        else is due."""
        await self._idle.wait()

    @property
    def idle(self) -> bool:
        """True while the hardware was last found in step and nothing is due (wait_idle's
        condition); False while a pass or a saga is running or due."""
        return self._idle.is_set()

    def settlement(self, composition_id: str) -> asyncio.Future[bytes]:
        """Resolves to the reply that settles `composition_id` when this engine settles it."""
        future = self._settled.get(composition_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._settled[composition_id] = future
        return future

    async def _run(self) -> None:
        backoff = 0.0
        while True:
            if backoff:
                await asyncio.sleep(backoff)
                self._wake.set()
            elif not (self._wake.is_set() or self._sagas or self._letting or self._held_back):
                self._idle.set()
            await self._wake.wait()
            self._wake.clear()
            try:
                in_step = await self.run_pass()
            except WriterFenced as exc:
                self._fenced(exc)
                return
            except (FabricError, TimeoutError) as exc:  # expected of hardware: one line
                log.warning(
                    "domain %s: fabric pass failed (%s); the next one starts from the log",
                    self.domain,
                    f"{type(exc).__name__}: {exc}" if str(exc) else _why(exc),
                )
                in_step = False
            except Exception as exc:  # the next pass starts from the log again
                log.error(
                    "domain %s: fabric pass failed: %s: %s",
                    self.domain,
                    type(exc).__name__,
                    exc,
                    exc_info=not backoff,  # the traceback once, then a line per pass
                )
                in_step = False
            if not in_step or self._wake.is_set():
                self._known = None  # (a pass in step sets it; anything since asks for another)
            backoff = 0.0 if in_step else min(self._max_backoff, max(0.1, backoff * 2))

    async def run_pass(self) -> bool:
        """One pass; True when every operation it tried succeeded."""
        try:
            snapshot = await asyncio.wait_for(
                self._fabric.snapshot(self.domain, fence=self._fence), self._deadline
            )
        except WriterFenced:
            raise
        except Exception:
            # The fabric cannot be read now (its manager is down, its state file damaged, a
            # driver raising what it should not). Pending compositions still get their saga:
            # its own steps meet the same fabric and fail (undone, as any failed step), so
            # the composer hears an outcome instead of waiting for it.
            state = self._state()
            self._start_sagas(
                sorted(c for c, v in state.compositions.items() if v.state == "pending")
            )
            raise
        state = self._state()
        plan = reconcile(snapshot, state)
        if not plan.in_step:
            self._say_repairs(snapshot, plan)
        fabric = self._fabric
        ok = await self._apply(fabric.unbind, plan.unbind)
        ok &= await self._apply(fabric.remove_circuit, plan.remove)
        ok &= await self._apply(fabric.create_circuit, plan.create)
        ok &= await self._apply(fabric.bind, plan.bind)
        self._start_sagas(plan.pending)
        self.passes += 1
        if ok:
            self._known = self._steady = state
            self._composed_here &= state.compositions.keys()
        return ok

    def _say_repairs(self, snapshot: FabricSnapshot, plan: Reconciliation) -> None:
        """One line for each change of the pass that the log did not ask for: the hardware
        differs from what it held when last in step (changed at the fabric manager, or left
        by a crash or a late completion; after a start, everything). What the log moved since
        (a release, a reroute, a circuit removed) is no repair, and a repair still due at the
        next pass is not said again."""
        drift = reconcile(snapshot, self._steady) if self._steady is not None else plan
        lines = [
            *(
                (logging.WARNING, f"removing {_bound(b)}: the log does not hold it")
                for b in plan.unbind
                if b in drift.unbind and b.composition_id not in self._composed_here
            ),
            *(
                (logging.WARNING, f"removing circuit {_circuit(c)}: the log does not hold it")
                for c in plan.remove
                if c in drift.remove
            ),
            *(
                (logging.INFO, f"making circuit {_circuit(c)} again: the log holds it")
                for c in plan.create
                if c in drift.create
            ),
            *(
                (logging.INFO, f"making {_bound(b)} again: the log holds it")
                for b in plan.bind
                if b in drift.bind
            ),
        ]
        for level, line in lines:
            if line not in self._repairs_said:
                log.log(level, "domain %s: repairing the fabric: %s", self.domain, line)
        self._repairs_said = {line for _, line in lines}

    def _start_sagas(self, pending: list[str]) -> None:
        """Start the saga of each of `pending` that is still pending and has none running.

        Sagas run on their own: one slow fabric call must not hold up the rest of the domain.
        The list is as old as the state read before the caller's awaits; meanwhile a saga may
        have settled its composition (and a release ended it), so only compositions pending
        *now* get a saga. Nothing else settles a pending composition, so it stays pending
        until the saga started here settles it.

        What the last commits let go and is still held back goes first: as the first part of
        the one saga's call when one starts (one call, one durable write, where the hardware
        can), else on a call of its own that every saga started here waits for."""
        now = self._state().compositions
        starting = [
            composition
            for cid in dict.fromkeys(pending)
            if cid not in self._sagas
            and (composition := now.get(cid)) is not None
            and composition.state == "pending"
        ]
        if len(starting) != 1:
            self._let_go_now()
        after = [*self._letting, *self._carrying]  # devices and ports they free come first
        carried = self._carry() if starting and self._held_back else None
        for composition in starting:
            self._composed_here.add(composition.id)
            self._sagas[composition.id] = asyncio.create_task(
                self._saga(composition, after, carried), name=f"saga-{composition.id}"
            )

    async def _saga(
        self,
        composition: Composition,
        after: list[asyncio.Future[None]],
        carried: _Carried | None,
    ) -> None:
        """Program one pending composition once the let-go calls `after` ended (`carried`, let
        go by the commits before, first in the same call), settle it and tell whoever waits
        for it. If the store could not record the settlement it stays pending and a later pass
        runs it again."""
        cid = composition.id
        settled_ok = False
        try:
            if after:
                await asyncio.wait(after)
            settlement = await self._compose_saga(composition, carried)
            reply = await self._settle(self.domain, settlement)
            if replies.decode_ok(reply) is not None:
                established = isinstance(settlement, EstablishComposition)
                outcome: SagaOutcome = "established" if established else "failed"
                self._telemetry.settled(self.domain, outcome)
            future = self._settled.pop(cid, None)
            if future is not None and not future.done():
                future.set_result(reply)
            settled = self._state().compositions.get(cid)
            if settled is not None and settled.state == "pending":
                await asyncio.sleep(1.0)  # the store said no; give it a moment
            else:
                settled_ok = isinstance(settlement, EstablishComposition)
        except WriterFenced as exc:  # the domain's next writer drives this saga again
            self._fenced(exc)
            return
        except Exception:
            log.exception("domain %s: saga of %s failed; a later pass retries", self.domain, cid)
            await asyncio.sleep(1.0)
        finally:
            self._carried(carried)
            del self._sagas[cid]
        if settled_ok:
            self._maybe_idle()  # its commit said what the hardware holds now
        else:
            self.kick()  # a failure, undone or not: a pass looks at what is left

    async def _apply(self, op: Callable[..., Awaitable[None]], items: list[_Item]) -> bool:
        """Run one kind of operation for every item, each within the deadline; failures are
        logged and retried by a later pass.

        Raises:
            WriterFenced: the driver refused our writer epoch: another engine drives it now.
        """

        async def one(item: _Item) -> None:
            # The call is made inside the task: a pass cancelled before the task ran leaves no
            # driver coroutine created and never awaited.
            await asyncio.wait_for(op(self.domain, item, fence=self._fence), self._deadline)

        results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
        for result in results:
            if isinstance(result, WriterFenced):
                raise result
        failed = [(item, r) for item, r in zip(items, results, strict=True) if r is not None]
        for item, exc in failed:
            said = _bound(item) if isinstance(item, FabricBinding) else f"circuit {_circuit(item)}"
            log.warning("domain %s: %s failed (%s): %s", self.domain, op.__name__, said, _why(exc))
        return not failed

    def _fenced(self, exc: WriterFenced) -> None:
        log.warning("domain %s: the fabric refused this writer: %s", self.domain, exc)
        if self._on_fenced is not None:
            self._on_fenced(exc.seen)

    async def _compose_saga(self, composition: Composition, carried: _Carried | None) -> Settlement:
        """Program one pending composition after what it `carried`; on failure undo it. Never
        raises for the fabric."""
        cid = composition.id
        request_id = settle_request_id(cid)
        changes = [
            *(FabricChange(op="create_circuit", circuit=c) for c in circuits_of(composition)),
            *(FabricChange(op="bind", binding=b) for b in bindings_of(composition)),
        ]
        at: list[FabricChange] = []  # the change the driver began last: the one that failed
        try:
            if carried is not None:
                try:
                    async with asyncio.timeout(self._deadline):
                        await self._fabric.program(
                            self.domain, [*carried.changes, *changes], fence=self._fence,
                            started=at.append,
                        )  # fmt: skip
                    return EstablishComposition(request_id=request_id, composition_id=cid)
                except (FabricError, TimeoutError) as exc:
                    if at and not any(at[-1] is c for c in carried.changes):
                        raise
                    # Letting go failed or hung, so nothing of this saga was tried: a pass
                    # finishes letting go, and the saga makes its own changes alone, within a
                    # deadline of their own (as after a let-go call of its own).
                    log.warning(
                        "domain %s: letting go failed (%s); a pass retries",
                        self.domain,
                        _why(exc),
                    )
                    self.kick()
                    at.clear()
                finally:
                    self._carried(carried)
            async with asyncio.timeout(self._deadline):
                await self._fabric.program(
                    self.domain, changes, fence=self._fence, started=at.append
                )
            return EstablishComposition(request_id=request_id, composition_id=cid)
        except FabricError as exc:
            component, error = exc.component or "", str(exc)
        except TimeoutError:
            component, error = "", f"no answer within {self._deadline:g}s"
        except WriterFenced:
            raise
        except Exception as exc:  # the driver broke its word (FabricError only): still a failure
            log.exception("domain %s: the fabric driver failed composing %s", self.domain, cid)
            component, error = "", f"the fabric driver failed: {type(exc).__name__}: {exc}"
        step, target = (at[-1].op, at[-1].target) if at else ("", "")
        log.warning(
            "domain %s: composing %s failed at %s %s: %s", self.domain, cid, step, target, error
        )
        await self._undo(composition)
        return FailComposition(
            request_id=request_id,
            composition_id=cid,
            step=step,
            target=target,
            component=component,
            error=error,
        )

    async def _undo(self, composition: Composition) -> None:
        """Take back whatever the saga may have programmed, the call that failed included (it
        may have taken effect). Circuits another composition also passes stay. What cannot be
        undone now is removed by a later pass, once the failure is recorded."""
        state, cid = self._state(), composition.id
        changes = [
            *(FabricChange(op="unbind", binding=b) for b in bindings_of(composition)),
            *(
                FabricChange(
                    op="remove_circuit",
                    circuit=FabricCircuit(ocs=c.ocs, a_port=c.a_port, b_port=c.b_port),
                )
                for c in unused_circuits(state, composition)
            ),
        ]
        try:
            async with asyncio.timeout(self._deadline):
                await self._fabric.program(self.domain, changes, fence=self._fence)
        except (FabricError, TimeoutError) as exc:
            log.warning(
                "domain %s: undoing %s left work for later: %s", self.domain, cid, _why(exc)
            )
        except WriterFenced:
            raise
        except Exception:  # the failure is recorded all the same; a pass finishes the undoing
            log.exception("domain %s: undoing %s left work for later", self.domain, cid)


def _why(exc: BaseException) -> str:
    """A fabric call's failure in words: its message, else (a deadline's TimeoutError has
    none) that no answer came in time."""
    return str(exc) or "no answer in time"


def _bound(b: FabricBinding) -> str:
    over = " > ".join(b.path) or "no path"
    return f"{b.device} bound to {b.host} for {b.composition_id} over {over}"


def _circuit(c: FabricCircuit) -> str:
    return f"{c.ocs}:{c.a_port}-{c.b_port}"
