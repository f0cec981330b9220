"""An external scheduler for Trellis, written only against its wire contract.

It is what a user would write: it imports nothing from Trellis, only nats-py, msgspec and the
standard library, and talks to a running engine (`trellis up`) only through NATS
(ARCHITECTURE.md sections 3 and 4):

- it watches the KV bucket TRELLIS_STATE (initial values, then updates) and keeps a local view
  of the domain: free GPUs by model, free GiB per memory pool, and the compositions it holds;
- it places inference demand (JSON lines `{"at", "gpus", "model", "memory_gib", "seconds"}`,
  `at` in seconds from the start) by publishing `compose` intents when its view says the demand
  fits, and `release` intents when a demand's time is up;
- a refusal (`no_capacity`, `no_path`, `quota`, ...) is logged with its why-not funnel
  (`details.funnel`) and tried again once the view shows something freed;
- it follows `CompositionImpaired` and `CompositionFailed` on the JetStream stream
  TRELLIS_EVENTS (logged with their reasons), and acts on the composition state in the bucket:
  a composition of its own that stays `impaired` (the engine could not repair it) is released
  and its demand placed afresh; one that ended without it (lease expired, fabric failure) is
  forgotten and its demand placed again if time is left.

Logs are JSON lines on stderr. SIGUSR1 writes the local view to `--dump` (also written at
exit); SIGTERM or SIGINT stop it, releasing what it holds unless `--leave`.

    python examples/scheduler.py --nats nats://127.0.0.1:4222 --domain hall-1 \\
        --tenant acme --demand demand.jsonl --once
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_PURGE

log = logging.getLogger("scheduler")
DEFAULT_PREFIX = "trellis"
CONNECT_ATTEMPTS = 5  # at start, then it gives up (exit 3); once connected, it reconnects for good
REQUEST_TIMEOUT_S = 30.0  # a compose is answered once the fabric saga settled it
ATTEMPT_S = 5.0  # one attempt's wait: a compose waits for its saga, so longer than a query's
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


# ---- the contract's shapes, as this scheduler reads them (fields it needs only) ----


class DeviceValue(msgspec.Struct):
    """`<domain>.device.<id>` in TRELLIS_STATE."""

    kind: str
    model: str | None
    health: str
    free: bool
    position: int
    free_gib: float | None = None


class BoundDevice(msgspec.Struct):
    id: str
    kind: str
    capacity_gib: float | None = None


class CompositionValue(msgspec.Struct):
    """`<domain>.composition.<id>` in TRELLIS_STATE."""

    tenant: str
    host: str
    state: str  # pending, active, impaired, released, failed
    devices: list[BoundDevice]
    impaired_by: list[str]
    position: int


class HostValue(msgspec.Struct):
    """`<domain>.host.<id>` in TRELLIS_STATE."""

    compositions: list[str]
    position: int


class Envelope(msgspec.Struct):
    """A message of the TRELLIS_EVENTS stream."""

    type: str
    position: int
    data: msgspec.Raw


class CompositionEvent(msgspec.Struct):
    composition_id: str
    reason: str = ""
    component: str = ""


class Demand(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of a demand file: `gpus` of `model` and/or `memory_gib` of pooled memory, for
    `seconds`, starting `at` seconds after the scheduler starts."""

    at: float = 0.0
    gpus: int = 0
    model: str | None = None
    memory_gib: float = 0.0
    seconds: float = 60.0
    max_hops: int | None = None


class DemandError(ValueError):
    """A demand file cannot be used; the message says which line and why."""


def read_demand(path: Path) -> list[Demand]:
    """The demand of a JSON-lines file, in file order (blank lines skipped).

    Raises:
        DemandError: a line is not a demand.
    """
    demands = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            demand = msgspec.json.decode(line, type=Demand)
        except msgspec.DecodeError as exc:
            raise DemandError(f"{path}:{number}: {exc}") from None
        numbers = (demand.at, demand.memory_gib, demand.seconds)
        if not all(math.isfinite(v) and v >= 0 for v in numbers) or demand.gpus < 0:
            raise DemandError(f"{path}:{number}: at, gpus, memory_gib and seconds must be >= 0")
        if demand.gpus == 0 and demand.memory_gib == 0:
            raise DemandError(f"{path}:{number}: asks for neither gpus nor memory_gib")
        demands.append(demand)
    return demands


def derived_name(base: str, prefix: str) -> str:
    """TRELLIS_STATE / TRELLIS_EVENTS, or `<base>_<prefix>` for another subject prefix."""
    return base if prefix == DEFAULT_PREFIX else f"{base}_{_UNSAFE.sub('_', prefix)}"


# ---- the local view ----


@dataclass
class View:
    """The domain as the bucket shows it, plus what this scheduler's own compose replies told
    it first (`claims`). A value replaces an entry only when its log position is not older.

    A claim lasts until the bucket shows its composition on a host: the relay writes a
    batch's composition keys, then its device keys, then its host keys, so by then the device
    values include what the composition took."""

    devices: dict[str, DeviceValue] = field(default_factory=dict)
    compositions: dict[str, CompositionValue] = field(default_factory=dict)
    hosted: dict[str, set[str]] = field(default_factory=dict)  # host -> its compositions
    claims: dict[str, dict[str, float | None]] = field(default_factory=dict)  # cid -> device: GiB
    freed: int = 0  # counts changes that made something free: a cue to retry refused demand

    def apply(self, kind: str, name: str, value: bytes | None) -> CompositionValue | None:
        """Fold one bucket write in; the composition value it brought, if any."""
        if kind == "device":
            if value is None:
                self.devices.pop(name, None)
            else:
                self._device(name, msgspec.json.decode(value, type=DeviceValue))
        elif kind == "host":
            on_host = (
                set()
                if value is None
                else set(msgspec.json.decode(value, type=HostValue).compositions)
            )
            self.hosted[name] = on_host
            for cid in on_host:
                self.claims.pop(cid, None)
        elif kind == "composition":
            if value is None:
                self.compositions.pop(name, None)
                self.claims.pop(name, None)
                return None
            composition = msgspec.json.decode(value, type=CompositionValue)
            old = self.compositions.get(name)
            if old is None or composition.position >= old.position:
                self.compositions[name] = composition
                if composition.state in ("released", "failed"):
                    self.claims.pop(name, None)
                return composition
        return None

    def _device(self, name: str, device: DeviceValue) -> None:
        old = self.devices.get(name)
        if old is not None and device.position < old.position:
            return
        if old is None or _free_amount(device) > _free_amount(old):
            self.freed += 1
        self.devices[name] = device

    def took(self, cid: str, devices: list[dict[str, Any]]) -> None:
        """What a compose reply said composition `cid` took, until the bucket says so."""
        if any(cid in on_host for on_host in self.hosted.values()):
            return  # the bucket was faster than the reply
        self.claims[cid] = {d["id"]: d.get("capacity_gib") for d in devices}

    def _claimed(self) -> dict[str, float | None]:
        """Device -> GiB claimed from it (None: the whole device)."""
        out: dict[str, float | None] = {}
        for claim in self.claims.values():
            for device, gib in claim.items():
                out[device] = None if gib is None else (out.get(device) or 0.0) + gib
        return out

    def free_gpus(self) -> dict[str, list[str]]:
        """Free GPU ids by model ("" for a GPU without one), sorted."""
        claimed = self._claimed()
        out: dict[str, list[str]] = {}
        for name, device in sorted(self.devices.items()):
            if device.kind == "gpu" and device.free and name not in claimed:
                out.setdefault(device.model or "", []).append(name)
        return out

    def free_memory(self) -> dict[str, float]:
        """Free GiB by memory pool, for pools with some left."""
        claimed = self._claimed()
        out = {}
        for name, device in sorted(self.devices.items()):
            if device.kind != "memory" or not device.free or claimed.get(name, 0.0) is None:
                continue
            left = (device.free_gib or 0.0) - (claimed.get(name) or 0.0)
            if left > 1e-9:
                out[name] = left
        return out

    def fits(self, demand: Demand) -> str | None:
        """None when the view has room for `demand`; else why not, in a sentence."""
        if demand.gpus:
            free = self.free_gpus()
            have = len(free.get(demand.model, [])) if demand.model else sum(map(len, free.values()))
            if have < demand.gpus:
                what = f"{demand.model} GPUs" if demand.model else "GPUs"
                return f"{have} free {what}, {demand.gpus} needed"
        if demand.memory_gib:
            largest = max(self.free_memory().values(), default=0.0)
            if largest < demand.memory_gib:
                wanted = demand.memory_gib
                return f"the largest free memory slice is {largest:g} GiB, {wanted:g} needed"
        return None


def _free_amount(device: DeviceValue) -> float:
    if not device.free:
        return 0.0
    return device.free_gib if device.free_gib is not None else 1.0


# ---- the scheduler ----


@dataclass
class Placement:
    """One demand's life in this scheduler."""

    number: int  # the demand's line in the input, from 0
    demand: Demand
    due: float  # monotonic time it may start
    until: float  # monotonic time its work is done
    composition_id: str | None = None
    refused_at: int | None = None  # View.freed when it was last refused
    waiting_for: str | None = None  # why the view said it does not fit (logged once)
    resend: dict[str, Any] | None = None  # a compose whose answer was lost: sent again as is
    not_before: float = 0.0  # monotonic time before which it is not tried again
    done: bool = False


class Scheduler:
    """Places demand on one domain of a Trellis engine as one tenant, through NATS only.

    Drive it with `start`, then `submit` demand and call `step` (or `run` for a whole
    timeline), and `stop`. `dump()` is the local view as JSON-ready data.
    """

    def __init__(
        self,
        nc: NATS,
        *,
        domain: str,
        tenant: str,
        prefix: str = DEFAULT_PREFIX,
        lease_slack: float = 30.0,
        retry_seconds: float = 2.0,
    ) -> None:
        self.nc = nc
        self.domain = domain
        self.tenant = tenant
        self.prefix = prefix
        self.lease_slack = lease_slack
        self.retry_seconds = retry_seconds
        self.view = View()
        self.placements: list[Placement] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self._watcher: Any = None
        self.counts = dict.fromkeys(
            ("placed", "refused", "released", "impaired", "failed", "foreign"), 0
        )

    # -- feeds --

    async def start(self) -> None:
        """Load the bucket's current values, then follow its updates and the event stream."""
        js = self.nc.jetstream()
        kv = await js.key_value(derived_name("TRELLIS_STATE", self.prefix))
        self._watcher = await kv.watch(f"{self.domain}.>")
        while (entry := await self._watcher.updates(timeout=REQUEST_TIMEOUT_S)) is not None:
            self._on_entry(entry)
        self._tasks.append(asyncio.create_task(self._follow_bucket()))
        stream = derived_name("TRELLIS_EVENTS", self.prefix)
        for event_type in ("CompositionImpaired", "CompositionFailed"):
            self._subs.append(
                await js.subscribe(
                    f"{self.prefix}.events.{self.domain}.{event_type}",
                    stream=stream,
                    cb=self._on_event,
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.NEW,
                )
            )
        note("started", devices=len(self.view.devices), free_gpus=self.view.free_gpus())

    async def _follow_bucket(self) -> None:
        async for entry in self._watcher:
            if entry is not None:
                self._on_entry(entry)

    def _on_entry(self, entry: Any) -> None:
        deleted = entry.operation in (KV_DEL, KV_PURGE)
        try:
            _, kind, name = entry.key.split(".", 2)
            composition = self.view.apply(kind, name, None if deleted else entry.value)
        except (ValueError, msgspec.DecodeError):  # not the contract's: skip and count it
            self._foreign(f"key {entry.key}")
            return
        if composition is not None and composition.tenant == self.tenant:
            self._our_composition(name, composition)
        self._wake.set()

    def _our_composition(self, cid: str, value: CompositionValue) -> None:
        placement = self._holding(cid)
        if placement is None:
            return
        if value.state == "impaired":
            # The engine repairs what it can in the same commit; still impaired means it could
            # not: give the devices back and place the demand afresh.
            self.counts["impaired"] += 1
            placement.composition_id = None
            placement.refused_at = None
            note(
                "impaired",
                composition_id=cid,
                impaired_by=value.impaired_by,
                demand=placement.number,
            )
            self._tasks.append(asyncio.create_task(self._release(placement, cid, "impaired")))
        elif value.state in ("released", "failed"):
            note("ended", composition_id=cid, state=value.state, demand=placement.number)
            placement.composition_id = None

    def _foreign(self, where: str) -> None:
        """A message of the bucket or the stream that is not the contract's (ARCHITECTURE §3):
        skipped and counted, never a reason to stop; logged the first time."""
        if not self.counts["foreign"]:
            note("foreign", where=where, detail="skipped; later ones are counted, not logged")
        self.counts["foreign"] += 1

    async def _on_event(self, msg: Any) -> None:
        try:
            envelope = msgspec.json.decode(msg.data, type=Envelope)
            event = msgspec.json.decode(envelope.data, type=CompositionEvent)
        except msgspec.DecodeError:
            self._foreign(f"seq {msg.metadata.sequence.stream}")
            return
        ours = self._holding(event.composition_id) is not None
        if envelope.type == "CompositionFailed" and ours:
            self.counts["failed"] += 1
        note(
            "event",
            type=envelope.type,
            position=envelope.position,
            composition_id=event.composition_id,
            component=event.component or None,
            reason=event.reason,
            ours=ours,
        )

    def _holding(self, cid: str) -> Placement | None:
        return next((p for p in self.placements if p.composition_id == cid), None)

    # -- intents --

    async def _request(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        """The reply, within REQUEST_TIMEOUT_S; an attempt unanswered within ATTEMPT_S is sent
        again as it is (same request_id), in case NATS handed it to a frozen engine."""
        data = json.dumps(body).encode()
        deadline, pause = time.monotonic() + REQUEST_TIMEOUT_S, 0.05
        while True:
            wait = min(ATTEMPT_S, deadline - time.monotonic())
            try:
                reply = await self.nc.request(subject, data, timeout=max(wait, 0.001))
                break
            except nats.errors.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)
        answer: dict[str, Any] = json.loads(reply.data)
        return answer

    def _intent(self, verb: str) -> str:
        return f"{self.prefix}.intent.{self.domain}.{self.tenant}.{verb}"

    async def compose(self, placement: Placement) -> bool:
        """Ask for `placement`'s demand; True when it was composed."""
        demand = placement.demand
        devices: list[dict[str, Any]] = []
        if demand.gpus:
            gpu: dict[str, Any] = {"kind": "gpu", "count": demand.gpus}
            if demand.model:
                gpu["models"] = [demand.model]
            devices.append(gpu)
        if demand.memory_gib:
            devices.append({"kind": "memory", "capacity_gib": demand.memory_gib})
        left = max(1.0, placement.until - time.monotonic())
        body: dict[str, Any] = placement.resend or {
            "request_id": f"sched-{uuid.uuid4().hex}",
            "host_selector": {"labels": {}},
            "devices": devices,
            "lease_seconds": math.ceil(left + self.lease_slack),
            "labels": {"scheduler": "example", "demand": str(placement.number)},
            "reason": f"example scheduler: demand {placement.number}",
        }
        if demand.max_hops is not None and placement.resend is None:
            body["constraints"] = {"max_hops": demand.max_hops}
        try:
            reply = await self._request(self._intent("compose"), body)
        except (nats.errors.Error, OSError) as exc:
            reply = {"ok": False, "error": {"code": "unavailable", "message": str(exc)}}
        placement.resend = None
        error = reply.get("error", {}) if not reply.get("ok") else {}
        if error.get("code") in ("unavailable", "throttled"):
            # unavailable: maybe composed, maybe not; the same request_id and body again later
            # tell which. throttled: nothing was written; again once the rate allows.
            placement.resend = body
            wait = error.get("details", {}).get("retry_after_ms")
            # Up to as long again at random: a burst refused together is told one time.
            pause = self.retry_seconds
            if isinstance(wait, int | float):
                pause = wait / 1000 * (1 + random.random())
            placement.not_before = time.monotonic() + pause
            note(error["code"], demand=placement.number, request_id=body["request_id"],
                 message=error.get("message"))  # fmt: skip
            return False
        if reply.get("ok"):
            result = reply["result"]
            placement.composition_id = result["composition_id"]
            placement.refused_at = None
            self.view.took(result["composition_id"], result["devices"])
            self.counts["placed"] += 1
            note(
                "placed",
                demand=placement.number,
                composition_id=result["composition_id"],
                host=result["host"],
                devices=[d["id"] for d in result["devices"]],
                position=reply["position"],
            )
            return True
        error = reply.get("error", {})
        code = error.get("code")
        details = error.get("details") or {}
        placement.refused_at = self.view.freed
        if code == "failed":
            self.counts["failed"] += 1
        else:
            self.counts["refused"] += 1
        note(
            "refused",
            demand=placement.number,
            code=code,
            message=error.get("message"),
            funnel=details.get("funnel"),
            nearest=details.get("nearest"),
        )
        return False

    async def release(self, placement: Placement, why: str) -> None:
        """Give back what `placement` holds, if anything."""
        cid = placement.composition_id
        if cid is not None:
            placement.composition_id = None
            await self._release(placement, cid, why)

    async def _release(self, placement: Placement, cid: str, why: str) -> None:
        body = {"request_id": f"sched-{uuid.uuid4().hex}", "composition_id": cid}
        try:
            reply = await self._request(self._intent("release"), body)
        except (nats.errors.Error, OSError) as exc:  # its lease ends it
            reply = {"ok": False, "error": {"code": "unavailable", "message": str(exc)}}
        if reply.get("ok"):
            self.counts["released"] += 1
            note("released", demand=placement.number, composition_id=cid, why=why)
        else:  # ended already (lease expired, failed): nothing is held
            note("release_refused", composition_id=cid, error=reply.get("error"))
        self._wake.set()

    # -- the timeline --

    def submit(self, number: int, demand: Demand, start: float) -> None:
        due = start + demand.at
        self.placements.append(Placement(number, demand, due, due + demand.seconds))
        self._wake.set()

    async def step(self) -> None:
        """One pass: release what is done, place what is due and fits."""
        now = time.monotonic()
        for placement in self.placements:
            if placement.done:
                continue
            if now >= placement.until:
                placement.done = True
                if placement.composition_id is not None:
                    await self.release(placement, "done")
                else:
                    note("unserved", demand=placement.number)
                continue
            if placement.composition_id is not None or now < max(
                placement.due, placement.not_before
            ):
                continue
            if placement.refused_at is not None and placement.refused_at == self.view.freed:
                continue  # refused, and nothing was freed since
            why_not = self.view.fits(placement.demand)
            if why_not is not None:
                if why_not != placement.waiting_for:
                    note("waiting", demand=placement.number, why=why_not)
                placement.waiting_for = why_not
                continue
            placement.waiting_for = None
            await self.compose(placement)

    def finished(self) -> bool:
        return all(p.done for p in self.placements)

    async def run(self, demands: list[Demand], *, once: bool, duration: float | None) -> None:
        start = time.monotonic()
        for number, demand in enumerate(demands):
            self.submit(number, demand, start)
        end = start + duration if duration is not None else math.inf
        while time.monotonic() < end and not (once and self.finished()):
            await self.step()
            self._wake.clear()
            nearest = min(
                [p.due for p in self.placements if not p.done and p.due > time.monotonic()]
                + [p.until for p in self.placements if not p.done]
                + [end],
                default=end,
            )
            timeout = max(0.0, min(nearest - time.monotonic(), self.retry_seconds))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def stop(self, *, release: bool = True) -> None:
        """Stop following the feeds; release what is held unless told not to."""
        if release:
            for placement in self.placements:
                await self.release(placement, "scheduler stopping")
        for task in self._tasks:
            task.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()

    def dump(self) -> dict[str, Any]:
        """The local view as JSON-ready data."""
        return {
            "domain": self.domain,
            "tenant": self.tenant,
            "position": max((d.position for d in self.view.devices.values()), default=0),
            "free_gpus": self.view.free_gpus(),
            "free_memory_gib": self.view.free_memory(),
            "claims": sorted(self.view.claims),
            "held": {
                p.composition_id: p.number for p in self.placements if p.composition_id is not None
            },
            "counts": dict(self.counts),
        }


def note(what: str, **fields: Any) -> None:
    """One structured log line: `{"event": what, ...}`."""
    log.info(json.dumps({"event": what, **fields}, default=str))


def write_dump(path: Path, data: dict[str, Any]) -> None:
    """Write atomically, so a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(partial, path)


# ---- the command ----


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Place demand on a Trellis domain through NATS only (an example scheduler)."
    )
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", help="NATS server URL")
    parser.add_argument("--domain", required=True, help="the fabric domain to place on")
    parser.add_argument("--tenant", required=True, help="the tenant to compose as")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Trellis's subject prefix")
    parser.add_argument(
        "--demand", type=Path, help='JSON lines {"at", "gpus", "model", "memory_gib", "seconds"}'
    )
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--once", action="store_true", help="exit when all demand has run")
    stop.add_argument("--duration", type=float, help="exit after this many seconds")
    parser.add_argument("--dump", type=Path, help="write the view here on SIGUSR1, and at exit")
    parser.add_argument("--retry-seconds", type=float, default=2.0)
    parser.add_argument("--leave", action="store_true", help="keep compositions at exit")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace, demands: list[Demand]) -> int:
    nc = await nats.connect(
        args.nats,
        name=f"example-scheduler-{args.tenant}",
        connect_timeout=2,
        max_reconnect_attempts=CONNECT_ATTEMPTS,
        reconnect_time_wait=1,
        error_cb=_nats_error,
        disconnected_cb=_nats_disconnected,
        reconnected_cb=_nats_reconnected,
    )
    # Connected: from now on NATS going away (an engine's restart moves an embedded server,
    # a cluster node restarts) is waited out, however long, not the end of the connection:
    # after CONNECT_ATTEMPTS the connection closed for good and the scheduler placed nothing
    # again. nats-py reads its options at each reconnect.
    nc.options["max_reconnect_attempts"] = -1
    scheduler = Scheduler(
        nc,
        domain=args.domain,
        tenant=args.tenant,
        prefix=args.prefix,
        retry_seconds=args.retry_seconds,
    )
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if args.dump is not None:
        loop.add_signal_handler(signal.SIGUSR1, lambda: write_dump(args.dump, scheduler.dump()))
    try:
        await scheduler.start()
        running = asyncio.create_task(
            scheduler.run(demands, once=args.once, duration=args.duration)
        )
        stopped = asyncio.create_task(stopping.wait())
        await asyncio.wait({running, stopped}, return_when=asyncio.FIRST_COMPLETED)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        stopped.cancel()
        await scheduler.stop(release=not args.leave)
        note("stopped", **scheduler.counts)
    finally:
        if args.dump is not None:
            write_dump(args.dump, scheduler.dump())
        await nc.close()
    return 0


async def _nats_error(exc: Exception) -> None:
    note("nats_error", error=str(exc) or type(exc).__name__)


async def _nats_disconnected() -> None:
    note("nats_disconnected")


async def _nats_reconnected() -> None:
    note("nats_reconnected")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        demands = read_demand(args.demand) if args.demand else []
    except (OSError, DemandError) as exc:
        print(f"scheduler: cannot use the demand file: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(main_async(args, demands))
    except (OSError, nats.errors.Error) as exc:
        print(f"scheduler: cannot reach NATS or the engine: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
