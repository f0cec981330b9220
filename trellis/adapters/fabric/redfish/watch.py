"""What the Redfish driver does besides answering the engine's calls, for one engine: the
reconciliation timer, and health from the fabric manager (ARCHITECTURE §11, "Southbound
details").

Reconciliation: every `resync_s` seconds (at most 30) the timer wakes the fabric pass of every
domain the engine writes (engine.service.saga.FabricSync). The pass reads the fabric manager deeply
(RedfishFabric.snapshot) and compares it with the log: what matches is adopted, what is tagged
as Trellis's and the log does not hold is removed, what the log holds and the fabric lacks is
made again; what the driver cannot explain is a finding of the `fabric` query, logged here
when it changes. The engine also runs a pass at start, so a restart reconciles first thing.

Health: every `poll_s` seconds (at most 10), and at once when the service sends an event, the
service root is read, and then the ports of every cable the log holds. A service root that
does not answer makes the fabric manager unreachable (reachability.py: the health check's
`fabric` check fails, and the log says so once, then as a reminder every few minutes, and
once more when it answers again); the ports are not read then.

Port `Status.Health` Critical or `LinkStatus` LinkDown (or NoLink) makes the cable's link
`failed`, Warning (or a link still Starting or Training) `degraded`, OK and LinkUp `healthy`;
on a cable between two switch ports the worse end counts. `LinkState: Disabled` drains the link
(forced: the hardware took it down already), and Enabled again undrains it. Each change becomes
the admin intent an operator would send (`report-fault`, `drain`, `undrain`, actor `operator`,
detail `redfish: ...`), so the engine impairs, reroutes or replaces compositions exactly as for
a fault reported by hand. Only changes are reported: what the fabric said at the last poll is
remembered, so a fault an operator reported by hand is not undone by a port that says OK all
along. At the first poll after a start, a port that is not OK is reported, and one that is OK
again recovers a link that a `redfish:` report faulted.

Events: when the driver is given an address (`events_at`) and the service has an
EventService, one subscription (Context `trellis`) sends its events to a small HTTP listener
there; any event wakes the poll at once (polls start at least EVENT_POLL_GAP_S apart). The
subscription is removed on a clean stop; one a killed engine left behind is replaced at the
next start: one with the same destination, and, with the service on this machine (where the
listener takes a fresh loopback port each start), any with Context `trellis` and the events
path whose loopback port no longer accepts connections (a live engine's, or another client's,
is never touched). One the service forgot (a restart) is made again at the next
reconciliation tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
import uuid
from typing import Any

import msgspec

from trellis.adapters.fabric.redfish.client import HttpError, Json, RedfishError, Resource
from trellis.adapters.fabric.redfish.discovery import obj, ref
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.adapters.fabric.redfish.reachability import REMIND_S, Reachability
from trellis.engine.core.errors import FabricError, ServedElsewhere
from trellis.engine.core.model import Health
from trellis.engine.service.router import Engine

log = logging.getLogger(__name__)

EVENTS_PATH = "/trellis/events"
CONTEXT = "trellis"
MARK = "redfish:"
_WORSE: dict[Health, int] = {"healthy": 0, "degraded": 1, "failed": 2}
_EVENT_TYPES = ["Alert", "StatusChange", "ResourceUpdated", "ResourceAdded", "ResourceRemoved"]
_MAX_EVENT = 1024 * 1024
#: Seconds at least from one poll's start to the next (unless poll_s is shorter): a burst of
#: events asks for one poll, not one each.
EVENT_POLL_GAP_S = 1.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


async def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at host:port (a refusal is the only no: what
    cannot be told, a timeout, counts as yes)."""
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return False
    except (OSError, TimeoutError):
        return True
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class Seen(msgspec.Struct, frozen=True):
    """What a cable's ports said at one poll."""

    health: Health
    disabled: bool
    detail: str


def port_health(port: Json) -> Health:
    """A port's health as Trellis counts it (§11)."""
    health = obj(port.get("Status")).get("Health")
    status = port.get("LinkStatus")
    if health == "Critical" or status in ("LinkDown", "NoLink"):
        return "failed"
    if health == "Warning" or status in ("Starting", "Training"):
        return "degraded"
    return "healthy"


def seen(ports: dict[str, Json]) -> Seen:
    """A cable's state from its ports: the worse end, disabled when either is."""
    healths = {uri: port_health(body) for uri, body in ports.items()}
    worst: Health = max(healths.values(), key=_WORSE.__getitem__, default="healthy")
    said = [
        f"{uri} LinkStatus {body.get('LinkStatus', '-')}, "
        f"Health {obj(body.get('Status')).get('Health', '-')}"
        + (", LinkState Disabled" if body.get("LinkState") == "Disabled" else "")
        for uri, body in sorted(ports.items())
        if healths[uri] == worst or body.get("LinkState") == "Disabled"
    ]
    disabled = any(body.get("LinkState") == "Disabled" for body in ports.values())
    return Seen(worst, disabled, f"{MARK} port {'; '.join(said)}")


class FabricWatch:
    """The reconciliation timer, the health poll and the event listener of one engine."""

    def __init__(
        self, fabric: RedfishFabric, engine: Engine, *, remind_s: float = REMIND_S
    ) -> None:
        self.fabric = fabric
        self.engine = engine
        self.reach = Reachability(fabric.client.origin, remind_s=remind_s)
        self._unmapped: dict[str, str] = {}  # domain -> why its map cannot be read, as logged
        self._subscribe_failed = False  # retried once the service answers again
        self._seen: dict[tuple[str, str], Seen] = {}
        self._findings: dict[str, list[str]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._server: asyncio.Server | None = None
        self._subscription: str | None = None
        self.polls = 0  # completed polls, for tests
        self.events = 0  # events received, for tests

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._resync_loop(), name="redfish-resync"),
            asyncio.create_task(self._poll_loop(), name="redfish-health"),
        ]
        if self.fabric.events_at is not None:
            host, port = self.fabric.events_at
            self._server = await asyncio.start_server(self._on_event, host, port)
            self._tasks.append(asyncio.create_task(self._subscribe(), name="redfish-subscribe"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._subscription is not None:
            with contextlib.suppress(RedfishError):
                await asyncio.wait_for(self.fabric.client.delete(self._subscription), 5.0)

    @property
    def events_url(self) -> str | None:
        """Where the service sends its events (None: no listener)."""
        if self._server is None:
            return None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{EVENTS_PATH}"

    # -- reconciliation ------------------------------------------------------------------------

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.fabric.resync_s)
            for domain in self.engine.domains:
                sync = self.engine.fabric_sync(domain)
                if sync is not None:
                    sync.kick()
                self._report_findings(domain)
            if self._subscription is not None and await self._subscription_gone():
                log.warning("the fabric manager lost its event subscription: subscribing again")
                await self._subscribe()

    async def _subscription_gone(self) -> bool:
        """Whether the service forgot the subscription (a restart that lost its state)."""
        assert self._subscription is not None
        try:
            return await self.fabric.client.get_or_none(self._subscription) is None
        except RedfishError:
            return False  # not answering: the next tick looks again

    def _report_findings(self, domain: str) -> None:
        findings = self.fabric.findings(domain)
        if findings != self._findings.get(domain, []):
            for finding in findings:
                log.warning("domain %s: on the fabric manager: %s", domain, finding)
            self._findings[domain] = findings

    # -- health --------------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        gap = min(EVENT_POLL_GAP_S, self.fabric.poll_s)
        while True:
            self._wake.clear()  # an event from now on asks for one more poll after this one
            started = time.monotonic()
            try:
                await self.poll()
            except Exception:  # the next poll tries again
                log.exception("polling the Redfish fabric's health failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.fabric.poll_s)
            await asyncio.sleep(started + gap - time.monotonic())

    async def poll(self) -> None:
        """Read every cable's ports once and report what changed."""
        if await self._reachable():
            await self._poll_domains()
        self.polls += 1

    async def _reachable(self) -> bool:
        """Whether the service root answers now; the outage's first failure, its reminders
        and its end are logged, nothing more (a poll every few seconds is no reason to warn
        every few seconds)."""
        try:
            await self.fabric.client.get(self.fabric.client.root)
        except RedfishError as exc:
            said = self.reach.failed(time.time(), str(exc))
            if said is not None:
                log.log(*said)
            return False
        said = self.reach.answered(time.time())
        if said is not None:
            log.log(*said)
            if self._subscribe_failed and self._server is not None:
                self._tasks.append(asyncio.create_task(self._subscribe(), name="redfish-subscribe"))
        return True

    async def _poll_domains(self) -> None:
        for domain in self.engine.domains:
            state = self.engine.state(domain)
            if state is None:
                continue
            try:
                fmap = await self.fabric.fabric_map(domain)
            except FabricError as exc:
                if self._unmapped.get(domain) != str(exc):  # said once, until it changes
                    log.warning("domain %s: no health from the fabric manager: %s", domain, exc)
                    self._unmapped[domain] = str(exc)
                continue
            if self._unmapped.pop(domain, None) is not None:
                log.info("domain %s: health from the fabric manager again", domain)
            cables = {k: v for k, v in fmap.cables.items() if k in state.links}
            uris = sorted({p for ports in cables.values() for p in ports})
            read = await asyncio.gather(
                *(self.fabric.client.get_or_none(u) for u in uris), return_exceptions=True
            )
            bodies = {u: r.body for u, r in zip(uris, read, strict=True) if isinstance(r, Resource)}
            for link_id, ports in sorted(cables.items()):
                if not all(p in bodies for p in ports):
                    continue  # unread: no news is no change
                now = seen({p: bodies[p] for p in ports})
                await self._changed(domain, link_id, now)

    def problems(self) -> list[str]:
        """Why the fabric of each domain the engine writes cannot do its job now (/healthz)."""
        return [p for d in self.engine.domains if (p := self.reach.problem(d)) is not None]

    async def _changed(self, domain: str, link_id: str, now: Seen) -> None:
        before = self._seen.get((domain, link_id))
        self._seen[(domain, link_id)] = now
        state = self.engine.state(domain)
        link = state.links.get(link_id) if state is not None else None
        if link is None:
            return
        first = before is None
        if now.health != link.health and (
            (not first and now.health != before.health)  # type: ignore[union-attr]
            or (first and now.health != "healthy")
            or (first and link.detail.startswith(MARK))
        ):
            body = {"component": link_id, "state": now.health, "detail": now.detail}
            await self._intent(domain, "report-fault", body)
        was_disabled = before is not None and before.disabled
        if now.disabled and not was_disabled and not link.drained:
            await self._intent(
                domain, "drain", {"id": link_id, "reason": now.detail, "force": True}
            )
        elif not now.disabled and was_disabled and link.drained:
            await self._intent(domain, "undrain", {"id": link_id, "reason": now.detail})

    async def _intent(self, domain: str, verb: str, body: dict[str, Any]) -> None:
        request = {"request_id": f"redfish-{verb}-{uuid.uuid4().hex}", **body}
        try:
            reply = await self.engine.handle(
                "admin", domain, None, verb, msgspec.json.encode(request)
            )
        except ServedElsewhere:
            return  # another engine writes the domain now; its watch reports
        answer = msgspec.json.decode(reply)
        level = logging.INFO if answer.get("ok") else logging.WARNING
        log.log(level, "domain %s: %s %s from the fabric manager: %s", domain, verb, body, answer)

    # -- events --------------------------------------------------------------------------------

    async def _subscribe(self) -> None:
        """Subscribe to the service's events, if it has an EventService."""
        client, destination = self.fabric.client, self.events_url
        try:
            root = (await client.get("/redfish/v1/")).body
            service = ref(root.get("EventService"))
            if not service:
                return
            collection = ref((await client.get(service)).body.get("Subscriptions"))
            if not collection:
                return
            for uri in await client.members(collection):
                old = await client.get_or_none(uri)
                if old is not None and (why := await self._left_behind(old.body, destination)):
                    log.warning("deleting event subscription %s: %s", uri, why)
                    await client.delete(uri)
            body: Json = {
                "Destination": destination,
                "Context": CONTEXT,
                "Protocol": "Redfish",
                "EventTypes": _EVENT_TYPES,
            }
            try:
                self._subscription = await client.post(collection, body)
            except HttpError as exc:
                if exc.status != 400:
                    raise
                del body["EventTypes"]  # a newer service may refuse the deprecated property
                self._subscription = await client.post(collection, body)
            log.info("subscribed to the fabric manager's events at %s", destination)
            self._subscribe_failed = False
        except RedfishError as exc:
            if not self._subscribe_failed:  # said once; tried again when the service answers
                log.warning("no events from the fabric manager (health is polled): %s", exc)
            self._subscribe_failed = True

    async def _left_behind(self, body: Json, destination: str | None) -> str | None:
        """Why a subscription is one a stopped engine of Trellis left (None: it is not).

        One sending to this engine's own listener; or, with the fabric manager on this
        machine (where an engine listens on a fresh loopback port each start), one with
        Trellis's Context and events path whose loopback listener is gone (its port refuses
        connections). Another client's, or a live engine's, is never one."""
        there = body.get("Destination")
        if not isinstance(there, str):
            return None
        if there == destination:
            return f"it sends to {there}, this engine's listener (a killed engine's)"
        if body.get("Context") != CONTEXT:
            return None
        try:
            parts = urllib.parse.urlsplit(there)
            port = parts.port
        except ValueError:
            return None
        local = urllib.parse.urlsplit(self.fabric.client.origin).hostname
        if parts.path != EVENTS_PATH or port is None or parts.hostname is None:
            return None
        if parts.hostname not in _LOOPBACK or local not in _LOOPBACK:
            return None
        if await _listening(parts.hostname, port):
            return None
        return f"nothing listens at {there} any more (a killed engine's)"

    async def _on_event(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One POST of events: any wakes the poll. Answered 204 (400 to anything else)."""
        status = 400
        try:
            async with asyncio.timeout(5.0):
                request = (await reader.readline()).decode("latin-1").split()
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                if length > _MAX_EVENT:
                    raise ValueError("event too large")
                body = await reader.readexactly(length)
                if request[:2] == ["POST", EVENTS_PATH]:
                    event = msgspec.json.decode(body)
                    if isinstance(event, dict) and event.get("Context", CONTEXT) == CONTEXT:
                        self.events += 1
                        self._wake.set()
                    status = 204
            writer.write(f"HTTP/1.1 {status} -\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
        except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError):
            pass
        except msgspec.DecodeError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
