"""A simulated fabric: the FabricDriver the engine uses until a real one is configured.

It stands in for the hardware, not for the engine: it keeps its own record of what is programmed
per domain and enforces the fabric's physical rules itself (an OCS port is in at most one
circuit; a device is bound to at most one host), so a test can compare `snapshot(domain)` with
the log and catch an engine that believes something the hardware would not hold. Jitter, random
failures and random hangs come from one seeded `random.Random` and scripted faults fire in call
order, so a run is reproducible from its seed and its sequence of calls.

Given a `state_file`, what is programmed outlives the process, as real hardware outlives the
engine that drives it, and is shared by every process that names the same file, as hardware is
shared by the engines of a deployment. No process ever waits for another (real hardware is not
locked by a client that stopped, so the simulator is not either): the changes queued together
(one `program` call's, and whatever other calls queued meanwhile) are published as one new
generation of the state, `<state_file>.g<N>`, a complete file linked under a name only one
process can create. Every operation applies to the newest generation; a process that finds its
generation's successor taken (another process published first) applies its operation again to
the newest one, so a process that stopped mid-operation and wakes never overwrites newer state
(and its fence is checked against the newest fences). A crash at any moment leaves the last
complete generation. Readers (`read_state_file`, and `snapshot`, which answers the engine's
`fabric` query behind `trellis fabric show` and `check`) take the newest generation;
`state_file` itself is read only while there is none (as an older Trellis, or a person, wrote
it); generations more than a few behind the newest are deleted. That is
what lets a test kill or pause an engine mid-saga (or run two) and then compare the "hardware"
with the log.

Fencing: every call may carry the caller's writer epoch for the domain (`fence`). The fabric
keeps the highest epoch it has seen per domain (in the state file, when there is one) and
refuses a call with a lower one (WriterFenced), so an engine that lost its writer lease can no
longer change the hardware once its successor has made a call.
Scripted faults (`fail_next`, `hang_next`) can also come from a one-line script
(`parse_script`), which is how `trellis up` takes them from its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import re
import secrets
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import msgspec

from trellis.engine.core.errors import FabricError, WriterFenced
from trellis.engine.core.fabric import FabricBinding, FabricChange, FabricCircuit, FabricSnapshot

FabricOp = Literal["create_circuit", "remove_circuit", "bind", "unbind", "snapshot"]
FABRIC_OPS: tuple[str, ...] = get_args(FabricOp)
# Random failures, hangs and jitter apply to these only: reading the hardware must stay
# dependable (and must not shift the seeded sequence) so tests can compare it with the log.
MUTATING_OPS: frozenset[str] = frozenset(FABRIC_OPS) - {"snapshot"}

# The name of the thread that reads and writes the state file (a bench tells the simulated
# hardware's own CPU from the engine's by it).
STATE_THREAD = "fabric-state"

Call = tuple[str, str, tuple[Any, ...]]
_T = TypeVar("_T")


@dataclass
class _Domain:
    """What the hardware of one domain holds."""

    # Keyed by every (ocs, port) a circuit occupies, so the one-circuit-per-port rule is a lookup.
    ports: dict[tuple[str, int], FabricCircuit] = field(default_factory=dict)
    # Keyed by (device, composition_id): a memory pool can carry one slice per composition.
    bindings: dict[tuple[str, str], FabricBinding] = field(default_factory=dict)

    @classmethod
    def holding(cls, snapshot: FabricSnapshot) -> _Domain:
        domain = cls()
        for c in snapshot.circuits:
            domain.ports[(c.ocs, c.a_port)] = domain.ports[(c.ocs, c.b_port)] = c
        for b in snapshot.bindings:
            domain.bindings[(b.device, b.composition_id)] = b
        return domain

    def snapshot(self) -> FabricSnapshot:
        """What it holds, in a stable order (the structs are frozen; paths are copied)."""
        circuits = sorted(set(self.ports.values()), key=lambda c: (c.ocs, c.a_port, c.b_port))
        bindings = sorted(
            self.bindings.values(), key=lambda b: (b.host, b.device, b.composition_id)
        )
        return FabricSnapshot(
            circuits=circuits,
            bindings=[msgspec.structs.replace(b, path=list(b.path)) for b in bindings],
        )


STATE_FORMAT = 1  # bumped, with an upcast on read, if the file's layout ever has to change
KEPT_GENERATIONS = 8  # older generations left for readers that listed them a moment ago
LINEAGE = 64  # publications a generation remembers, so a writer can tell whether its own held


class SavedFabric(msgspec.Struct, frozen=True, kw_only=True):
    """One generation of the state: what the simulated hardware of every domain holds, and the
    highest writer epoch it has seen per domain."""

    format: int = STATE_FORMAT
    domains: dict[str, FabricSnapshot] = {}
    fences: dict[str, int] = {}
    # The tokens of the last LINEAGE generations, oldest first, this one's last: a process
    # that published a generation finds its token in every later one built on it.
    lineage: list[str] = []


_encode_saved = msgspec.json.Encoder().encode
_decode_saved = msgspec.json.Decoder(SavedFabric).decode


class _Overtaken(Exception):
    """Another process published the next generation first: apply the operation again."""


def read_state_file(path: Path) -> dict[str, FabricSnapshot] | None:
    """What the state file at `path` says the simulated hardware holds, by domain (its newest
    generation); None if there is none.

    Raises:
        ValueError: The file exists but is not a simulated fabric's state file.
    """
    saved = _read_newest(path)[1]
    return None if saved is None else saved.domains


def _generation(path: Path, number: int) -> Path:
    """Where generation `number` of the state at `path` lives; generation 0 is `path` itself,
    as an older Trellis (or a person) wrote it, read only while no later generation exists."""
    return path.with_name(f"{path.name}.g{number}") if number else path


def _generations(path: Path) -> list[int]:
    """The numbers of the generations of `path` on disk, in no order (none: no directory)."""
    prefix = f"{path.name}.g"
    try:
        with os.scandir(path.parent) as entries:
            names = [e.name[len(prefix) :] for e in entries if e.name.startswith(prefix)]
    except FileNotFoundError:
        return []
    return [int(n) for n in names if n.isascii() and n.isdigit()]


def _read_newest(
    path: Path, held: int | None = None, generations: list[int] | None = None
) -> tuple[int, SavedFabric | None]:
    """The number of the newest generation of the state at `path`, and what it holds: None if
    there is no state at all, or if the newest is `held` (a generation never changes under
    its name). `generations`: the caller's listing of them, just made (else listed here)."""
    if generations is None:
        generations = _generations(path)
    while True:
        newest = max(generations, default=0)
        if newest and newest == held:
            return newest, None
        try:
            return newest, _read_saved(_generation(path, newest))
        except FileNotFoundError:
            if not newest:
                return 0, None
            # Deleted or reused as it was read, because newer generations exist; unless it is
            # still listed, and so is not an old generation but something that cannot be read.
            generations = _generations(path)
            if newest in generations:
                raise


def _read_saved(path: Path) -> SavedFabric:
    """One generation of the state.

    Raises:
        FileNotFoundError: There is no such file, or it left that name while it was read (an
            old generation's file is reused for a new one: renamed, then written over; the
            name still on the same file after the read means the read saw none of that).
        ValueError: It is not a simulated fabric's state file.
    """
    before = os.stat(path)
    data = path.read_bytes()
    after = os.stat(path)
    if (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
        raise FileNotFoundError(errno.ENOENT, "reused while it was read", str(path))
    try:
        saved = _decode_saved(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not a simulated fabric state file: {exc}") from None
    if saved.format != STATE_FORMAT:
        raise ValueError(
            f"{path} has state file format {saved.format}; this Trellis reads {STATE_FORMAT}"
        )
    return saved


def _write_durably(temp: Path, data: bytes, spare: Path | None) -> None:
    """Write `data` to the new file `temp` and fsync it. When `spare`, an old generation,
    can be had, it becomes `temp` (renamed, then written over) rather than a new file being
    made: a filesystem without a journal (ext4 so run) scans past every recently freed inode
    to allocate one, and at hundreds of generations a second that scan was about 40% of this
    thread's CPU. A reader that opened the old generation just before finds, once it has read,
    that the name is gone (`_read_saved`), and lists again."""
    fd = -1
    if spare is not None:
        with contextlib.suppress(FileNotFoundError):  # another process reused it first
            os.rename(spare, temp)
            fd = os.open(temp, os.O_WRONLY)
    if fd < 0:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        written = 0
        while written < len(data):  # over the old bytes, whose blocks it keeps
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make a name just linked in `directory` survive a crash of the machine too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(eq=False)  # identity: two identical scripts are two separate faults
class _Fault:
    """A scripted fault waiting for the next matching operations."""

    kind: Literal["fail", "hang"]
    op: str
    component: str | None
    remaining: int
    applied: bool


class SimulatedFabric:
    """A FabricDriver without hardware, with deterministic latency and fault injection; what
    it holds lives in memory, and in `state_file` when one is given.

    Args:
        seed: Seeds the one random generator behind jitter, failures and hangs.
        latency: Seconds every operation takes, or a mapping from operation name to seconds
            (operations not named take none).
        jitter: Up to this many extra seconds, drawn uniformly, on each mutating operation.
        failure_rate: Probability that a mutating operation raises FabricError (without
            changing anything).
        hang_rate: Probability that a mutating operation never returns until it is cancelled
            (1.0 is "hang mode": every mutating operation hangs).
        shared_devices: Devices that may be bound to several hosts at once, as ids or a
            predicate on the id. A binding of a memory slice (`capacity_gib` set) always may:
            a pooled CXL device serves slices to many hosts. Every other device is bound to at
            most one host.
        state_file: Keep what is programmed in generations of this JSON file (its directory is
            created): read here, a new generation after every change, shared with every process
            naming the same file. Without one the hardware lives in memory only.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        latency: float | Mapping[str, float] = 0.0,
        jitter: float = 0.0,
        failure_rate: float = 0.0,
        hang_rate: float = 0.0,
        shared_devices: Collection[str] | Callable[[str], bool] = (),
        state_file: Path | None = None,
    ) -> None:
        delays = latency.values() if isinstance(latency, Mapping) else [latency]
        if any(d < 0 for d in delays) or jitter < 0:
            raise ValueError("latency and jitter must not be negative")
        if isinstance(latency, Mapping):
            _check_ops(latency)
        for name, rate in (("failure_rate", failure_rate), ("hang_rate", hang_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {rate}")
        self.seed = seed
        self.latency = latency
        self.jitter = jitter
        self.failure_rate = failure_rate
        self.hang_rate = hang_rate
        self._shared = (
            shared_devices if callable(shared_devices) else frozenset(shared_devices).__contains__
        )
        self.calls: list[Call] = []
        self._rng = random.Random(seed)
        self._domains: dict[str, _Domain] = {}
        self._faults: list[_Fault] = []
        self._broken: set[str] = set()
        self._fences: dict[str, int] = {}  # domain -> the highest writer epoch seen
        self.state_file = state_file
        # The generation memory holds (None: none, or memory is ahead of every generation),
        # what it holds without its lineage, and its lineage.
        self._held: int | None = None
        self._saved = b""
        self._lineage: list[str] = []
        self._spare: Path | None = None  # an old generation the next publication may reuse
        self._writer: ThreadPoolExecutor | None = None
        self._queued: list[_Queued] = []  # operations for the state thread, in call order
        self._queue_lock = threading.Lock()
        self._draining = False  # the state thread is writing what is queued
        if state_file is not None:
            self._refresh()
            state_file.parent.mkdir(parents=True, exist_ok=True)
            # One thread does every operation on the file: the event loop never waits on the
            # disk, and this process's changes are published in the order they were made.
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=STATE_THREAD)

    # -- the FabricDriver port ---------------------------------------------------------------

    async def create_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        """Cross-connect two OCS ports; a no-op when exactly this circuit exists."""
        await self.program(
            domain, [FabricChange(op="create_circuit", circuit=circuit)], fence=fence
        )

    async def remove_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        """Remove a cross-connect; a no-op when this exact circuit is not programmed."""
        await self.program(
            domain, [FabricChange(op="remove_circuit", circuit=circuit)], fence=fence
        )

    async def bind(self, domain: str, binding: FabricBinding, *, fence: int | None = None) -> None:
        """Bind a device to a host over a path; a no-op when exactly this binding exists."""
        await self.program(domain, [FabricChange(op="bind", binding=binding)], fence=fence)

    async def unbind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> None:
        """Release a device from a host; a no-op when the host does not hold it for that
        composition. The path is not compared: releasing needs only host, device, composition."""
        await self.program(domain, [FabricChange(op="unbind", binding=binding)], fence=fence)

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        """Make `changes` in order, written to the state file once for all of them (one
        generation), and return when they hold there. Each change meets the scripted and
        random faults as a call of its own would, in order; at the first that fails, what
        came before it (and it, if its fault says `applied`) is written, then it raises or
        hangs, and nothing after it is tried."""
        effects: list[Callable[[], None]] = []
        stopped: tuple[FabricChange, _Roll] | None = None
        delay = 0.0
        for change in changes:
            if started is not None:
                started(change)
            roll = self._roll(change.op, domain, _item(change), _touched_by(change))
            delay += roll.delay
            if roll.takes_effect:
                effects.append(self._effect(domain, change))
            if not roll.clean:
                stopped = (change, roll)
                break
        if delay > 0:
            await asyncio.sleep(delay)
        if effects:
            failed_at: list[int] = []

            def apply_in_order() -> None:
                for i, effect in enumerate(effects):
                    try:
                        effect()
                    except FabricError:
                        failed_at.append(i)
                        raise

            try:
                # Returning means "it holds now", and now includes after a crash: on disk first.
                await self._hardware(domain, apply_in_order, fence, "+".join(
                    dict.fromkeys(c.op for c in changes[: len(effects)])
                ))  # fmt: skip
            except FabricError:
                if started is not None and failed_at:
                    started(changes[failed_at[0]])
                raise
        if stopped is not None:
            change, roll = stopped
            if started is not None:
                started(change)
            if roll.hangs:
                await _forever()
            raise roll.error(change.op, domain)

    def _effect(self, domain: str, change: FabricChange) -> Callable[[], None]:
        """What `change` does to the hardware's state (run where the state is: in the state
        thread, on the newest generation); raises FabricError where the hardware would."""
        if change.circuit is not None:
            circuit = change.circuit
            if change.op == "create_circuit":
                return lambda: self._create_circuit(domain, circuit)
            return lambda: self._remove_circuit(domain, circuit)
        assert change.binding is not None
        binding = change.binding
        if change.op == "bind":
            return lambda: self._bind(domain, binding)
        return lambda: self._unbind(domain, binding)

    def _create_circuit(self, domain: str, circuit: FabricCircuit) -> None:
        _check_ports(circuit)
        ports = self._domain(domain).ports
        for port in (circuit.a_port, circuit.b_port):
            held = ports.get((circuit.ocs, port))
            if held is not None and held != circuit:
                raise FabricError(
                    f"{circuit.ocs} port {port} is already in circuit {held.a_port}-{held.b_port}",
                    component=circuit.ocs,
                )
        ports[(circuit.ocs, circuit.a_port)] = circuit
        ports[(circuit.ocs, circuit.b_port)] = circuit

    def _remove_circuit(self, domain: str, circuit: FabricCircuit) -> None:
        _check_ports(circuit)
        ports = self._domain(domain).ports
        if ports.get((circuit.ocs, circuit.a_port)) == circuit:
            del ports[(circuit.ocs, circuit.a_port)]
            del ports[(circuit.ocs, circuit.b_port)]

    def _bind(self, domain: str, binding: FabricBinding) -> None:
        if not binding.path or binding.path[0] != binding.host:
            raise FabricError(
                f"path of {binding.device} does not start at host {binding.host}",
                component=binding.device,
            )
        if binding.path[-1] != binding.device:
            raise FabricError(
                f"path to {binding.device} ends at {binding.path[-1]}",
                component=binding.device,
            )
        bindings = self._domain(domain).bindings
        if binding.capacity_gib is None and not self._shared(binding.device):
            for other in bindings.values():
                if other.device == binding.device and other.host != binding.host:
                    raise FabricError(
                        f"{binding.device} is already bound to host {other.host}",
                        component=binding.device,
                    )
        key = (binding.device, binding.composition_id)
        held = bindings.get(key)
        if held is not None and held != binding:
            # Silently re-pointing a live binding would hide an engine that lost track of
            # one; a reroute is an unbind of the old path, then a bind of the new.
            raise FabricError(
                f"{binding.device} is already bound to {held.host} for "
                f"{binding.composition_id} over {'>'.join(held.path)}",
                component=binding.device,
            )
        # A copy, so a caller mutating its path list cannot rewrite the "hardware".
        bindings[key] = msgspec.structs.replace(binding, path=list(binding.path))

    def _unbind(self, domain: str, binding: FabricBinding) -> None:
        bindings = self._domain(domain).bindings
        key = (binding.device, binding.composition_id)
        held = bindings.get(key)
        if held is not None and held.host == binding.host:
            del bindings[key]

    async def snapshot(self, domain: str, *, fence: int | None = None) -> FabricSnapshot:
        """What the simulated hardware of `domain` holds, in a stable order."""

        roll = self._roll("snapshot", domain, None, ())
        if roll.delay > 0:
            await asyncio.sleep(roll.delay)
        if roll.hangs:
            await _forever()
        if not roll.clean:
            raise roll.error("snapshot", domain)
        return await self._hardware(
            domain, lambda: (self._domains.get(domain) or _Domain()).snapshot(), fence, "snapshot"
        )

    def fence_of(self, domain: str) -> int:
        """The highest writer epoch this fabric has seen for `domain` (0: none yet)."""
        return self._fences.get(domain, 0)

    # -- fault injection ---------------------------------------------------------------------

    def fail_next(
        self, op: str, component: str | None = None, times: int = 1, *, applied: bool = False
    ) -> None:
        """Make the next `times` calls of `op` (touching `component`, if given) raise FabricError.

        Args:
            op: An operation name: create_circuit, remove_circuit, bind, unbind or snapshot.
            component: Only calls touching this OCS, host, device or path node match.
            times: How many matching calls fail.
            applied: The change takes effect on the hardware before the error is raised (a
                lost reply), to test that compensation copes with either outcome.
        """
        self._script("fail", op, component, times, applied)

    def hang_next(
        self, op: str, component: str | None = None, times: int = 1, *, applied: bool = False
    ) -> None:
        """Make the next `times` calls of `op` never return until cancelled.

        Args:
            op: An operation name: create_circuit, remove_circuit, bind, unbind or snapshot.
            component: Only calls touching this OCS, host, device or path node match.
            times: How many matching calls hang.
            applied: The change takes effect on the hardware before the call hangs, as when a
                controller applies a request and its answer is lost.
        """
        self._script("hang", op, component, times, applied)

    def break_component(self, component: str) -> None:
        """Make every operation touching `component` fail until `repair_component`."""
        self._broken.add(component)

    def repair_component(self, component: str) -> None:
        """Undo `break_component`; repairing a sound component is a no-op."""
        self._broken.discard(component)

    @property
    def broken(self) -> frozenset[str]:
        return frozenset(self._broken)

    @property
    def pending_faults(self) -> int:
        """Scripted failures and hangs not yet consumed (0 once every one has fired)."""
        return sum(f.remaining for f in self._faults)

    def reset(self) -> None:
        """Forget all programmed state (in the state file too), calls, scripted faults and
        broken components, and reseed; the constructor's knobs stay."""
        self.calls.clear()
        self._rng = random.Random(self.seed)
        self._domains.clear()
        self._fences.clear()
        self._faults.clear()
        self._broken.clear()
        if self._writer is not None:
            forgotten: Future[None] = Future()
            self._queue(_Queued(self._forget, "reset", forgotten))
            forgotten.result()

    # -- internals ---------------------------------------------------------------------------

    def _domain(self, domain: str) -> _Domain:
        return self._domains.setdefault(domain, _Domain())

    def _encode(self, lineage: list[str] | None = None) -> bytes:
        held = {d: s for d, s in sorted(self._domains.items()) if s.ports or s.bindings}
        return _encode_saved(
            SavedFabric(
                domains={d: s.snapshot() for d, s in held.items()},
                fences=dict(sorted(self._fences.items())),
                lineage=lineage or [],
            )
        )

    def _refresh(self) -> None:
        """Make memory hold the newest generation of the state file."""
        assert self.state_file is not None
        newest, saved = _read_newest(self.state_file, self._held)
        if saved is None and newest == self._held:
            return  # held already (or still no state at all)
        saved = saved or SavedFabric()
        self._domains = {d: _Domain.holding(s) for d, s in saved.domains.items()}
        self._fences = dict(saved.fences)
        self._held = newest
        self._saved = self._encode()
        self._lineage = list(saved.lineage)

    def _forget(self) -> None:
        self._domains.clear()
        self._fences.clear()

    def _fenced(self, domain: str, fence: int | None) -> None:
        """Refuse a call from an older writer epoch; remember a newer one."""
        if fence is None:
            return
        seen = self._fences.get(domain, 0)
        if fence < seen:
            raise WriterFenced(
                domain,
                f"the fabric has seen writer epoch {seen}; this call carries {fence}",
                seen=seen,
            )
        self._fences[domain] = fence

    async def _hardware(
        self, domain: str, apply: Callable[[], _T], fence: int | None, op: str
    ) -> _T:
        """Check the fence and apply one operation to the hardware: in memory, or, with a
        state file, to its newest generation."""

        def fenced_apply() -> _T:
            self._fenced(domain, fence)
            return apply()

        if self._writer is None:
            return fenced_apply()
        done: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        # Its outcome is read even when nobody waits for it any more, so asyncio does not
        # log it as "never retrieved".
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._queue(_Queued(fenced_apply, op, done))
        # Shielded: a caller that gives up (the engine's deadline) must not stop a change the
        # "hardware" is making, nor its write to disk.
        return await asyncio.shield(done)

    def _queue(self, queued: _Queued) -> None:
        """Queue an operation for the state thread, which writes everything queued meanwhile
        as one generation (a group commit: one durable write for many changes)."""
        with self._queue_lock:
            self._queued.append(queued)
            start, self._draining = not self._draining, True
        if start:
            assert self._writer is not None
            self._writer.submit(self._drain)

    def _drain(self) -> None:
        """Run in the state thread: write what is queued, batch after batch, until none is."""
        while True:
            with self._queue_lock:
                batch, self._queued = self._queued, []
                if not batch:
                    self._draining = False
                    return
            self._transact(batch)

    def _transact(self, batch: list[_Queued]) -> None:
        """Apply `batch` to the newest generation and publish what it changed as the next;
        while another process publishes first, again on its generation. Nothing here waits
        for another process."""
        while True:
            try:
                outcomes = self._attempt(batch)
            except _Overtaken:
                continue
            except Exception as exc:  # the state could not be read or written: all failed
                outcomes = [(False, exc)] * len(batch)
            break
        waiting: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        for queued, (ok, value) in zip(batch, outcomes, strict=True):
            future = queued.future
            if isinstance(future, asyncio.Future):
                waiting.setdefault(future.get_loop(), []).append((future, ok, value))
            else:
                _settle(future, ok, value)
        for loop, settled in waiting.items():
            # One wake-up of each waiting loop for the whole batch, not one per operation.
            with contextlib.suppress(RuntimeError):  # that loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle_all, settled)

    def _attempt(self, batch: list[_Queued]) -> list[tuple[bool, Any]]:
        self._refresh()
        fences = dict(self._fences)
        outcomes: list[tuple[bool, Any]] = []
        try:
            for queued in batch:
                try:
                    outcomes.append((True, queued.apply()))
                except Exception as exc:
                    outcomes.append((False, exc))
        finally:
            ops = [queued.op for queued in batch]
            # Reads that saw no newer fence changed nothing: no need to encode the state to
            # find that out. Anything else may have (even a failed call: the fence, an applied
            # fault), so what memory holds is compared with the generation it was read from.
            if set(ops) != {"snapshot"} or self._fences != fences:
                data = self._encode()
                if data != self._saved or "reset" in ops:
                    self._publish(data, ", ".join(dict.fromkeys(ops)))
        return outcomes

    def _publish(self, data: bytes, op: str) -> None:
        """Publish memory as the generation after the one it was read from.

        Raises:
            _Overtaken: Another process published that generation, or one after it that does
                not descend from this one; memory is read again.
            FabricError: This process stopped for so long after publishing that it cannot
                tell whether its generation is in the newest one's past (as a lost reply).
        """
        assert self.state_file is not None and self._held is not None
        number, self._held = self._held + 1, None  # memory is ahead until this lands
        token = secrets.token_hex(8)  # not the seeded generator: it must not shift outcomes
        lineage = [*self._lineage, token][-LINEAGE:]
        # Complete and on disk under a name of its own first, so no generation is ever partial.
        temp = self.state_file.with_name(f"{self.state_file.name}.{os.getpid()}-{token}.tmp")
        spare, self._spare = self._spare, None
        try:
            _write_durably(temp, self._encode(lineage), spare)
            try:  # the compare-and-swap: only one process can create a name
                os.link(temp, _generation(self.state_file, number))
            except FileExistsError:
                raise _Overtaken from None
        finally:  # also when the write failed (a full disk): no temp file is left behind
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        _fsync_directory(self.state_file.parent)
        # A process that stopped between reading and linking may find that number free again
        # (deleted as old) and link it below the newest: then it has published nothing.
        generations = _generations(self.state_file)
        newest, saved = _read_newest(self.state_file, number, generations)
        if saved is not None and token not in saved.lineage:
            if newest - len(saved.lineage) < number:
                raise _Overtaken
            raise FabricError(
                f"{op}: the simulated fabric lost track of whether this change took effect"
            )
        old = sorted(g for g in generations if g <= newest - KEPT_GENERATIONS)
        for gone in old[:-1]:
            _generation(self.state_file, gone).unlink(missing_ok=True)
        # The newest old one is left for the next publication to reuse.
        self._spare = _generation(self.state_file, old[-1]) if old else None
        self._held, self._saved, self._lineage = number, data, lineage

    def _script(
        self,
        kind: Literal["fail", "hang"],
        op: str,
        component: str | None,
        times: int,
        applied: bool,
    ) -> None:
        _check_ops([op])
        if times < 1:
            raise ValueError(f"times must be at least 1, got {times}")
        if applied and op == "snapshot":
            raise ValueError("a snapshot changes nothing, so it cannot be applied")
        self._faults.append(_Fault(kind, op, component, times, applied))

    def _claim(self, op: str, touched: tuple[str, ...]) -> _Fault | None:
        for fault in self._faults:
            if fault.op == op and (fault.component is None or fault.component in touched):
                fault.remaining -= 1
                if fault.remaining == 0:
                    self._faults.remove(fault)
                return fault
        return None

    def _delay(self, op: str) -> float:
        if isinstance(self.latency, Mapping):
            return self.latency.get(op, 0.0)
        return self.latency

    def _roll(
        self, op: str, domain: str, arg: FabricCircuit | FabricBinding | None,
        touched: tuple[str, ...],
    ) -> _Roll:  # fmt: skip
        """Record one call and decide its fate. Everything random is decided here, before any
        await, so outcomes follow call order and not the timing of concurrent calls. Mutating
        calls always draw all three numbers, so changing one rate does not reshuffle the
        others."""
        self.calls.append((op, domain, () if arg is None else (arg,)))
        fault = self._claim(op, touched)
        delay = self._delay(op)
        hang = fail = False
        if op in MUTATING_OPS:
            jitter, hang_roll, fail_roll = (self._rng.random() for _ in range(3))
            delay += self.jitter * jitter
            hang = hang_roll < self.hang_rate
            fail = fail_roll < self.failure_rate
        broken = next((c for c in touched if c in self._broken), None)
        primary = touched[-1] if touched else None  # the OCS, or the device being bound
        return _Roll(delay, fault, broken, hang, fail, primary)


@dataclass(frozen=True)
class _Roll:
    """The fate of one call: its delay, and what goes wrong with it, if anything (a scripted
    fault first, then a broken component, then a random hang, then a random failure)."""

    delay: float
    fault: _Fault | None
    broken: str | None
    hang: bool
    fail: bool
    primary: str | None

    @property
    def clean(self) -> bool:
        return self.fault is None and self.broken is None and not self.hang and not self.fail

    @property
    def takes_effect(self) -> bool:
        """The change reaches the hardware (when clean, or a fault says applied)."""
        return self.clean or (self.fault is not None and self.fault.applied)

    @property
    def hangs(self) -> bool:
        if self.fault is not None:
            return self.fault.kind == "hang"
        return self.broken is None and self.hang

    def error(self, op: str, domain: str) -> FabricError:
        if self.fault is not None:
            culprit = self.fault.component or self.primary
            return FabricError(
                f"{op} in {domain}: injected failure at {culprit}", component=culprit
            )
        if self.broken is not None:
            return FabricError(f"{op} in {domain}: {self.broken} is broken", component=self.broken)
        return FabricError(f"{op} in {domain}: random failure at {self.primary}",
                           component=self.primary)  # fmt: skip


@dataclass(frozen=True)
class _Queued:
    """An operation waiting for the state thread, and where its outcome goes: a future of the
    event loop that asked, or a thread's future for a caller outside any loop."""

    apply: Callable[[], Any]
    op: str
    future: asyncio.Future[Any] | Future[Any]


def _settle(future: asyncio.Future[Any] | Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _settle_all(settled: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    """In the waiting loop: every outcome of one batch of the state thread."""
    for future, ok, value in settled:
        _settle(future, ok, value)


class ScriptedFault(msgspec.Struct, frozen=True, kw_only=True):
    """One `fail_next` or `hang_next`, as a script names it."""

    kind: Literal["fail", "hang"]
    op: str
    component: str | None = None
    times: int = 1
    applied: bool = False

    def arm(self, fabric: SimulatedFabric) -> None:
        scripted = fabric.fail_next if self.kind == "fail" else fabric.hang_next
        scripted(self.op, self.component, self.times, applied=self.applied)


SCRIPT_SYNTAX = "KIND:OP[:COMPONENT][*TIMES][+applied], comma-separated; KIND is fail or hang"
_SCRIPT_ITEM = re.compile(
    r"(?P<kind>\w+):(?P<op>\w+)(?::(?P<component>[A-Za-z0-9_-]{1,64}))?"
    r"(?:\*(?P<times>\d+))?(?P<applied>\+applied)?"
)


def parse_script(script: str) -> list[ScriptedFault]:
    """Scripted faults from one line, in order: `hang:bind` (the next bind hangs),
    `fail:create_circuit:ocs-1` (the next circuit on ocs-1 fails), `fail:bind*2` (the next two
    binds), `hang:bind:gpu-01+applied` (binding gpu-01 takes effect, then the call hangs).

    Raises:
        ValueError: An item does not follow SCRIPT_SYNTAX or names no fabric operation.
    """
    faults = []
    for item in (i.strip() for i in script.split(",")) if script.strip() else ():
        match = _SCRIPT_ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"cannot read fault {item!r}: expected {SCRIPT_SYNTAX}")
        kind, op, times = match["kind"], match["op"], int(match["times"] or 1)
        if kind not in ("fail", "hang"):
            raise ValueError(f"fault {item!r}: kind must be fail or hang, got {kind!r}")
        if op not in FABRIC_OPS:
            raise ValueError(f"fault {item!r}: {op!r} is no fabric operation; known: {FABRIC_OPS}")
        if times < 1:
            raise ValueError(f"fault {item!r}: times must be at least 1")
        if match["applied"] and op == "snapshot":
            raise ValueError(f"fault {item!r}: a snapshot changes nothing, so it cannot be applied")
        faults.append(
            ScriptedFault(
                kind=kind,  # type: ignore[arg-type]  # checked above
                op=op,
                component=match["component"],
                times=times,
                applied=bool(match["applied"]),
            )
        )
    return faults


async def _forever() -> None:
    """Wait until cancelled: the engine's deadline is the only way out."""
    await asyncio.get_running_loop().create_future()


def _item(change: FabricChange) -> FabricCircuit | FabricBinding:
    item = change.circuit if change.circuit is not None else change.binding
    assert item is not None, f"a {change.op} names nothing to change"
    return item


def _touched_by(change: FabricChange) -> tuple[str, ...]:
    if change.circuit is not None:
        return (change.circuit.ocs,)
    assert change.binding is not None
    return _touched(change.binding)


def _touched(binding: FabricBinding) -> tuple[str, ...]:
    # Host, every node on the path, device last (the default culprit of a binding failure).
    nodes = dict.fromkeys([binding.host, *binding.path])
    nodes.pop(binding.device, None)
    return (*nodes, binding.device)


def _check_ports(circuit: FabricCircuit) -> None:
    if circuit.a_port >= circuit.b_port:
        raise FabricError(
            f"circuit on {circuit.ocs} must name two ports with a_port < b_port, "
            f"got {circuit.a_port}-{circuit.b_port}",
            component=circuit.ocs,
        )


def _check_ops(ops: Collection[str]) -> None:
    unknown = sorted(set(ops) - set(FABRIC_OPS))
    if unknown:
        raise ValueError(f"unknown fabric operation(s) {unknown}; known: {list(FABRIC_OPS)}")
