"""The Redfish `EventService`: a server-sent-events stream of resource changes
(ARCHITECTURE §11), from the engine's event feed (JetStream TRELLIS_EVENTS, new events only).

Each event of the log that changes a Redfish resource becomes one Redfish `Event` with one
record from DMTF's `ResourceEvent` registry, `OriginOfCondition` = the resource:

- CompositionActivated after its CompositionRequested: ResourceCreated of
  `Systems/<composition>`; after an impairment (a repair or a recovery), ResourceChanged of it;
- CompositionReleased, CompositionFailed: ResourceRemoved of `Systems/<composition>`;
- CompositionImpaired, PathRerouted, DeviceReplaced, LeaseExtended: ResourceChanged of
  `Systems/<composition>`;
- ComponentFaulted, ComponentRecovered, ComponentDrained, ComponentUndrained: ResourceChanged
  of `Fabrics/<domain>` (`Oem.Trellis.Component` names the node, link or port);
- TopologyImported, NodeAdded, LinkAdded, ComponentRemoved: ResourceChanged of
  `Fabrics/<domain>`;
- ReservationMade: ResourceCreated of `CompositionService/CompositionReservations/<id>`;
  ReservationApplied, ReservationExpired, ReservationCancelled: ResourceRemoved of it.

Filtered per account like everything else: a composition's events go to its tenant's accounts
and to Administrators; fabric events (blocks and switches every account reads) to everyone.
A composition's tenant is learned from its `CompositionRequested`, or asked of the engine
(`composition`) for one composed before the stream started. A reservation's is learned from its
`ReservationMade`; the end of one made before this service started names no tenant the engine
still knows (it is gone by then), so that event goes to Administrators only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy

from trellis.adapters.http.redfish.resources import R
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.foreign import Counted, ForeignMessages
from trellis.adapters.nats.jetstream import stream_event, stream_name

log = logging.getLogger(__name__)

REGISTRY = "ResourceEvent.1.3"
TEXT = {
    "ResourceCreated": "The resource has been created successfully.",
    "ResourceRemoved": "The resource has been removed successfully.",
    "ResourceChanged": "One or more resource properties have changed.",
}
CREATED = {"CompositionActivated"}
REMOVED = {"CompositionReleased", "CompositionFailed"}
CHANGED = {"CompositionImpaired", "PathRerouted", "DeviceReplaced", "LeaseExtended"}
COMPONENT = {"ComponentFaulted", "ComponentRecovered", "ComponentDrained", "ComponentUndrained"}
TOPOLOGY = {"TopologyImported", "NodeAdded", "LinkAdded", "ComponentRemoved"}
RESERVATION_ENDED = {"ReservationApplied", "ReservationExpired", "ReservationCancelled"}
RESERVATIONS = f"{R}/CompositionService/CompositionReservations"
KEEPALIVE_S = 15.0
BACKLOG = 1000  # events waiting for one stream; a stream this far behind is ended


class _Data(msgspec.Struct):
    composition_id: str | None = None
    reservation_id: str | None = None
    tenant: str | None = None
    component: str | None = None


_data = msgspec.json.Decoder(_Data)


class _Listener:
    def __init__(self, tenant: str | None) -> None:
        self.tenant = tenant
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(BACKLOG)


class EventFeed:
    """Follows the event feed and hands each open stream the events its account may see."""

    def __init__(
        self, nc: NATS, client: TrellisClient, prefix: str, on_foreign: Counted | None = None
    ) -> None:
        self._nc = nc
        self._client = client
        self._prefix = prefix
        self._listeners: set[_Listener] = set()
        self._tenants: dict[tuple[str, str], str] = {}  # (domain, composition) -> tenant
        # Compositions requested on this stream and not yet activated: only their activation
        # creates a system; a later one (after an impairment) changes it.
        self._starting: set[tuple[str, str]] = set()
        self._reservers: dict[tuple[str, str], str] = {}  # (domain, reservation) -> tenant
        self._sub: Any = None
        self.foreign = ForeignMessages("redfish", on_foreign)

    async def start(self) -> None:
        js = self._nc.jetstream()
        self._sub = await js.subscribe(
            f"{self._prefix}.events.>",
            stream=stream_name(self._prefix),
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
            cb=self._on_message,
        )

    async def close(self) -> None:
        for listener in list(self._listeners):
            with contextlib.suppress(asyncio.QueueFull):
                listener.queue.put_nowait(None)
        if self._sub is not None:
            with contextlib.suppress(NatsError, asyncio.CancelledError):
                await self._sub.unsubscribe()

    async def stream(self, tenant: str | None) -> AsyncIterator[bytes]:
        """An open stream's chunks for an account of `tenant` (None: an Administrator)."""
        listener = _Listener(tenant)
        self._listeners.add(listener)
        try:
            yield b": Trellis Redfish events\n\n"
            while True:
                try:
                    chunk = await asyncio.wait_for(listener.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if chunk is None:
                    return
                yield chunk
        finally:
            self._listeners.discard(listener)

    async def _on_message(self, msg: Msg) -> None:
        envelope = stream_event(self._prefix, msg.subject, msg.data, msg.headers)
        if envelope is None:
            self.foreign.skipped("", f"seq {msg.metadata.sequence.stream}")
            return
        try:
            data = _data.decode(envelope.data)
        except msgspec.DecodeError:
            return
        domain, kind = envelope.domain, envelope.type
        if kind == "CompositionRequested" and data.composition_id and data.tenant:
            self._tenants[(domain, data.composition_id)] = data.tenant
            self._starting.add((domain, data.composition_id))
            return
        record: tuple[str, str] | None = None
        tenant: str | None = None
        public = False
        # First: ReservationApplied names a composition too, but the resource it ends is the
        # reservation.
        if data.reservation_id and kind == "ReservationMade":
            tenant = data.tenant
            if tenant is not None:
                self._reservers[(domain, data.reservation_id)] = tenant
            record = ("ResourceCreated", f"{RESERVATIONS}/{data.reservation_id}")
        elif data.reservation_id and kind in RESERVATION_ENDED:
            tenant = self._reservers.pop((domain, data.reservation_id), None)
            record = ("ResourceRemoved", f"{RESERVATIONS}/{data.reservation_id}")
        elif data.composition_id and kind in CREATED | REMOVED | CHANGED:
            key = (domain, data.composition_id)
            created = kind in CREATED and key in self._starting
            if kind in CREATED | REMOVED:
                self._starting.discard(key)
            message = (
                "ResourceCreated"
                if created
                else "ResourceRemoved"
                if kind in REMOVED
                else "ResourceChanged"
            )
            record = (message, f"{R}/Systems/{data.composition_id}")
            tenant = await self._tenant_of(domain, data.composition_id)
            if kind in REMOVED:
                self._tenants.pop(key, None)
        elif kind in COMPONENT and data.component:
            # A node or a link (or an OCS port): the fabric is the resource every account
            # reads that holds them all.
            record = ("ResourceChanged", f"{R}/Fabrics/{domain}")
            public = True
        elif kind in TOPOLOGY:
            record = ("ResourceChanged", f"{R}/Fabrics/{domain}")
            public = True
        if record is None:
            return
        # The log's own name for the event: the same on every restart and every replica, so
        # a client that reconnects can tell which events it has seen.
        event_id = f"{domain}.{envelope.position}"
        body = {
            "@odata.type": "#Event.v1_11_0.Event",
            "Id": event_id,
            "Name": "Trellis resource event",
            "Context": "",
            "Events": [
                {
                    "MemberId": "0",  # required of every record: its index in Events
                    "EventType": "Other",  # required in Event v1.0, deprecated since
                    "EventId": envelope.id,
                    "EventTimestamp": envelope.recorded_at,
                    "MessageId": f"{REGISTRY}.{record[0]}",
                    "Message": TEXT[record[0]],
                    "MessageArgs": [],
                    "MessageSeverity": "OK",
                    "OriginOfCondition": {"@odata.id": record[1]},
                    "Oem": {
                        "Trellis": {
                            "Domain": domain,
                            "EventType": kind,
                            "Position": envelope.position,
                            **({"Component": data.component} if data.component else {}),
                        }
                    },
                }
            ],
        }
        chunk = b"id: %s\ndata: %s\n\n" % (event_id.encode(), msgspec.json.encode(body))
        for listener in list(self._listeners):
            if not (public or listener.tenant is None or listener.tenant == tenant):
                continue
            try:
                listener.queue.put_nowait(chunk)
            except asyncio.QueueFull:
                log.warning("redfish: an event stream fell %d events behind; ended", BACKLOG)
                self._listeners.discard(listener)
                with contextlib.suppress(asyncio.QueueEmpty):
                    listener.queue.get_nowait()
                listener.queue.put_nowait(None)

    async def _tenant_of(self, domain: str, composition: str) -> str | None:
        known = self._tenants.get((domain, composition))
        if known is not None:
            return known
        try:
            reply = await self._client.query(domain, "composition", {"id": composition})
        except (NatsError, TimeoutError):
            return None
        if reply.get("ok"):
            tenant = reply["result"].get("tenant")
            if isinstance(tenant, str):
                self._tenants[(domain, composition)] = tenant
                return tenant
        return None


def event_service() -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/EventService",
        "@odata.type": "#EventService.v1_12_0.EventService",
        "Id": "EventService",
        "Name": "Event Service",
        "ServiceEnabled": True,
        "Status": {"State": "Enabled", "Health": "OK"},
        "ServerSentEventUri": f"{R}/EventService/SSE",
        # Required by the schema (Nullable="false"), and by sushy, which refused the resource
        # without it: no action is offered.
        "Actions": {},
        "RegistryPrefixes": ["ResourceEvent"],
        "SSEFilterPropertiesSupported": {
            "EventFormatType": False,
            "MessageId": False,
            "MetricReportDefinition": False,
            "OriginResource": False,
            "RegistryPrefix": False,
            "ResourceType": False,
        },
    }
