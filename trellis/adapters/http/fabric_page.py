"""The live fabric page of `trellis up --http PORT`: one page for operators that shows the
fabric, who holds what, health and utilization, updated as it changes.

The server is a NATS client like any other (in secure mode it connects as the operator):
- it watches the KV bucket TRELLIS_STATE (initial values, then updates) and keeps the current
  value of every key, and follows the event feed (JetStream TRELLIS_EVENTS, from the last
  REPLAYED events at its start), keeping each domain's last RECENT_EVENTS;
- it pushes both to each open page as server-sent events on `/events`: first a `snapshot` of
  every key and the recent events, then a `kv` message per changed key and a `feed` message
  per event;
- it samples utilization per domain (GPUs held, memory GiB sliced out) from its copy of the
  bucket, at most once a second and only after a change, and keeps the last samples so a page
  opened later still sees the recent past (`utilization` messages, and in the snapshot);
- `/api/topology`, `/api/connections` and `/api/why` ask the engine's queries of those names
  over NATS and answer with the engine's reply, as is.

The page itself is plain HTML, JS and CSS in web/, shipped as package data (no CDN, no build).
It is an operator's view: every tenant's compositions are on it. It binds to loopback unless
told otherwise; put anything wider behind an authenticating proxy.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import importlib.resources
import logging
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.kv import KV_DEL, KV_PURGE

from trellis.adapters.http.server import DEFAULT_HOST, HttpServer, Request, Response, Stream
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.foreign import ForeignMessages
from trellis.adapters.nats.jetstream import bucket_name, stream_event, stream_name
from trellis.adapters.nats.kv_state import bucket_entry

log = logging.getLogger(__name__)

#: The queries the page may ask, by the path it asks them on.
QUERIES = {"/api/topology": "topology", "/api/connections": "connections", "/api/why": "why"}
#: The page's files (web/), by the path they are served on.
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
}
SAMPLES_KEPT = 900  # utilization samples per domain: 15 minutes at one a second
SAMPLE_EVERY_S = 1.0
RECENT_EVENTS = 100  # per domain, in the snapshot: a page opened on a busy log shows them
REPLAYED = 1000  # the stream's last events read at start, to fill the recent ones
KEEPALIVE_S = 15.0  # a comment line, so a page that is gone is noticed
QUERY_TIMEOUT_S = 5.0
#: Messages waiting for one page; a page that falls this far behind is dropped, and its
#: EventSource reconnects and starts again from a fresh snapshot.
BACKLOG = 10_000
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def token_cookie(url: str) -> str:
    """The name of the cookie holding the page token for the page at `url`. Browsers share
    cookies across ports, so each page's is named after its port: two engines' pages on one
    machine then keep a token each instead of overwriting one another's."""
    return f"trellis_page_{urllib.parse.urlsplit(url).port}"


_NO_STORE = (("Cache-Control", "no-store"),)


class _FeedEvent(msgspec.Struct):
    """The fields of a stream message (adapters/nats/jetstream.py's Envelope) the page shows."""

    domain: str
    type: str
    position: int
    recorded_at: str
    actor: str


class Sample(msgspec.Struct, array_like=True):
    """Utilization at one moment: [time, GPUs held, GPUs, memory GiB used, memory GiB]."""

    t: float  # Unix seconds
    gpus_held: int
    gpus: int
    memory_used_gib: float
    memory_gib: float


class _Device(msgspec.Struct):
    """The fields of a KV device value (adapters/nats/kv_state.py) that utilization needs."""

    kind: str
    owner: str | None = None
    capacity_gib: float | None = None
    free_gib: float | None = None


_encode = msgspec.json.Encoder().encode
_feed_event = msgspec.json.Decoder(_FeedEvent)
_device = msgspec.json.Decoder(_Device)


class _Page:
    """One open page's queue of server-sent event chunks."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(BACKLOG)

    def send(self, chunk: bytes) -> bool:
        """Queue `chunk`; False when the page is too far behind (it is told to go)."""
        try:
            self.queue.put_nowait(chunk)
        except asyncio.QueueFull:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)
            return False
        return True


class FabricPage(HttpServer):
    """The fabric page at `host`:`port` (0: a free port; `url` says which), fed over `nc`."""

    def __init__(
        self,
        nc: NATS,
        *,
        prefix: str = "trellis",
        host: str = DEFAULT_HOST,
        port: int = 0,
        foreign: ForeignMessages | None = None,
        allowed_hosts: Iterable[str] = (),
        token: str | None = None,
    ):
        super().__init__(self._answer, host=host, port=port, allowed_hosts=allowed_hosts)
        # Secure mode: the page reads as the operator, so only a browser that was given the
        # token `trellis up` printed may see it (kept in an HttpOnly, SameSite cookie).
        self._token = token
        self._nc = nc
        self._prefix = prefix
        # What the stream and the bucket hold that is not the contract's: never shown.
        self.foreign = foreign or ForeignMessages("page")
        self._values: dict[str, msgspec.Raw] = {}  # the bucket, as last seen
        self._samples: dict[str, collections.deque[Sample]] = {}
        self._recent: dict[str, collections.deque[_FeedEvent]] = {}
        self._changed: set[str] = set()  # domains whose devices changed since the last sample
        self._pages: set[_Page] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._files = {
            path: (importlib.resources.files(__package__).joinpath("web", name).read_bytes(), kind)
            for path, (name, kind) in FILES.items()
        }

    async def start(self) -> None:
        """Watch the bucket, follow the feed, then listen.

        Raises:
            OSError: the address cannot be bound.
            nats.errors.Error: the bucket or the stream cannot be read (not there; in secure
                mode, an identity not allowed to).
        """
        js = self._nc.jetstream()
        kv = await js.key_value(bucket_name(self._prefix))
        watcher = await kv.watchall()
        self._closers.append(watcher.stop)
        stream = stream_name(self._prefix)
        last = (await js.stream_info(stream)).state.last_seq
        since = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, last - REPLAYED + 1),
        )
        feed = await js.subscribe(
            f"{self._prefix}.events.>",
            stream=stream,
            config=since,
            ordered_consumer=True,
            cb=self._on_event,
        )
        self._closers.append(feed.unsubscribe)
        self._tasks.append(asyncio.create_task(self._watch(watcher)))
        self._tasks.append(asyncio.create_task(self._sample()))
        await super().start()

    async def close(self) -> None:
        await super().close()  # ends every open page's stream
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stop in self._closers:
            with contextlib.suppress(NatsError, asyncio.CancelledError):
                await stop()

    # ---- from NATS ----

    async def _watch(self, watcher: Any) -> None:
        async for entry in watcher:
            if entry is None:  # the end of the initial values
                continue
            key: str = entry.key
            domain, _, rest = key.partition(".")
            if entry.operation in (KV_DEL, KV_PURGE):
                if key not in self._values:
                    continue  # never shown (or not the contract's): nothing to remove
                self._values.pop(key)
                value: msgspec.Raw | None = None
            elif bucket_entry(key, entry.value or b"") is None:
                self.foreign.skipped("", f"key {key}")
                continue
            else:
                value = msgspec.Raw(entry.value)
                self._values[key] = value
            if rest.startswith("device."):
                self._changed.add(domain)
            self._broadcast(_message("kv", {"key": key, "value": value}))

    async def _on_event(self, msg: Msg) -> None:
        if stream_event(self._prefix, msg.subject, msg.data, msg.headers) is None:
            self.foreign.skipped("", f"seq {msg.metadata.sequence.stream}")
            return
        event = _feed_event.decode(msg.data)
        kept = self._recent.setdefault(event.domain, collections.deque(maxlen=RECENT_EVENTS))
        kept.append(event)
        self._broadcast(_message("feed", event))

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            changed, self._changed = self._changed, set()
            for domain in sorted(changed):
                sample = self._utilization(domain)
                kept = self._samples.setdefault(domain, collections.deque(maxlen=SAMPLES_KEPT))
                kept.append(sample)
                self._broadcast(_message("utilization", {"domain": domain, "sample": sample}))

    def _utilization(self, domain: str) -> Sample:
        gpus = held = 0
        memory = used = 0.0
        start = f"{domain}.device."
        for key, raw in self._values.items():
            if not key.startswith(start):
                continue
            try:
                device = _device.decode(raw)
            except msgspec.DecodeError:
                continue
            if device.kind == "gpu":
                gpus += 1
                held += device.owner is not None
            elif device.kind == "memory" and device.capacity_gib is not None:
                memory += device.capacity_gib
                used += device.capacity_gib - (device.free_gib or 0.0)
        return Sample(round(time.time(), 3), held, gpus, used, memory)

    def _broadcast(self, chunk: bytes) -> None:
        for page in list(self._pages):
            if not page.send(chunk):
                self._pages.discard(page)

    # ---- to the browser ----

    def _unless_authorised(self, request: Request) -> Response | None:
        """None for a request that carries the page's token (its cookie); a redirect that sets
        the cookie for one that brings the token in its URL; 401 otherwise."""
        assert self._token is not None
        given = request.query.get("token")
        if given is not None and hmac.compare_digest(given.encode(), self._token.encode()):
            cookie = f"{token_cookie(self.url)}={self._token}; HttpOnly; SameSite=Strict; Path=/"
            # The rest of the query stays: a bookmarked `?domain=` still opens its domain.
            kept = [
                (k, v)
                for k, v in urllib.parse.parse_qsl(request.raw_query, keep_blank_values=True)
                if k != "token"
            ]
            rest = urllib.parse.urlencode(kept)
            location = f"{request.path}?{rest}" if rest else request.path
            headers = (("Location", location), ("Set-Cookie", cookie), *_NO_STORE)
            return Response(302, "text/plain", b"", headers)
        held = _cookie(request, token_cookie(self.url)) or ""
        if hmac.compare_digest(held.encode(), self._token.encode()):
            return None
        return Response(
            401,
            "text/plain",
            b"the fabric page needs the address `trellis up` printed (it carries a token)\n",
            _NO_STORE,
        )

    async def _answer(self, request: Request) -> Response | Stream:
        if self._token is not None:
            refused = self._unless_authorised(request)
            if refused is not None:
                return refused
        if request.path in self._files:
            body, kind = self._files[request.path]
            return Response(200, kind, body, _NO_STORE)
        if request.path == "/events":
            return Stream("text/event-stream", self._stream())
        what = QUERIES.get(request.path)
        if what is None:
            return Response(404, "text/plain", b"not found: the page is at /\n")
        return await self._query(what, request.query)

    async def _stream(self) -> AsyncIterator[bytes]:
        page = _Page()
        snapshot = {
            "prefix": self._prefix,
            "values": self._values,
            "utilization": {d: list(s) for d, s in self._samples.items()},
            "events": {d: list(e) for d, e in self._recent.items()},
        }
        page.send(b"retry: 1000\n\n" + _message("snapshot", snapshot))
        self._pages.add(page)
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(page.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    chunk = b": keepalive\n\n"
                if chunk is None:
                    return
                yield chunk
        finally:
            self._pages.discard(page)

    async def _query(self, what: str, query: dict[str, str]) -> Response:
        domain = query.get("domain", "")
        body: dict[str, str] = {}
        problem = None if _ID.fullmatch(domain) else f"domain {domain!r} is not an id"
        if what == "why":
            body["id"] = query.get("id", "")
            if problem is None and not _ID.fullmatch(body["id"]):
                problem = f"id {body['id']!r} is not an id"
        if problem is not None:
            return _envelope(400, {"ok": False, "error": {"code": "invalid", "message": problem}})
        client = TrellisClient(self._nc, prefix=self._prefix, timeout=QUERY_TIMEOUT_S)
        try:  # a large domain's topology comes in pages: the browser gets them joined
            reply = await client.all_pages(f"query.{domain}.{what}", body)
        except (NatsError, TimeoutError) as exc:
            message = f"the engine did not answer {what}: {str(exc) or type(exc).__name__}"
            return _envelope(
                503, {"ok": False, "error": {"code": "unavailable", "message": message}}
            )
        return _envelope(200, reply)


def _cookie(request: Request, name: str) -> str | None:
    for part in request.headers.get("cookie", "").split(";"):
        key, eq, value = part.strip().partition("=")
        if eq and key == name:
            return value
    return None


def _message(event: str, data: Any) -> bytes:
    """One server-sent event: its name and JSON data, on one line."""
    return b"event: " + event.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def _envelope(status: int, reply: dict[str, Any]) -> Response:
    return Response(status, "application/json", _encode(reply), _NO_STORE)
