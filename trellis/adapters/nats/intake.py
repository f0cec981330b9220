"""NATS in front of the engine: request-reply subjects of ARCHITECTURE §3, in a queue group.

Each message is served in its own task, so intents that arrive together wait in the domain
writer's queue at the same time and are committed as one batch (group commit). Any engine of a
deployment may receive any request; one that does not write the request's domain forwards it,
reply subject and all, to `<prefix>.engine.<writer id>.<subject>`, where the writer answers
the client directly (engine/service/ownership.py decides who writes what).

The intake is also the engine's NATS micro service (adapters/nats/micro.py): each subscription
is an endpoint there, counted as it answers, and an observer (adapters/instruments.py) is told
every answer's family, verb, reply code and time.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from trellis.adapters.nats.micro import EndpointCount, EngineService
from trellis.adapters.nats.replies import AnyInbox, DropLog, ReplyRule
from trellis.adapters.nats.roundtrip import server_has_read
from trellis.adapters.nats.throttle_log import ThrottleLog
from trellis.engine.core import replies
from trellis.engine.core.errors import ServedElsewhere
from trellis.engine.service.router import Engine

log = logging.getLogger(__name__)

QUEUE_GROUP = "trellis-engine"
STOP_GRACE_S = 10.0
SERVICE_STOP_S = 2.0
SUBSCRIBED_WITHIN_S = 10.0  # a server that has not read the subscriptions by then is not serving


FAMILIES = ("intent", "admin", "query", "view")  # view: a tenant's own view of the queries


def served(prefix: str, domains: list[str] | None) -> list[tuple[str, str, str]]:
    """(family, domain token, subject) of every subject to serve: every domain by wildcard,
    or just the listed ones."""
    out = []
    for d in domains or ["*"]:
        for family in FAMILIES:
            tail = "*.*" if family in ("intent", "view") else "*"  # tenant and verb, or verb
            out.append((family, d, f"{prefix}.{family}.{d}.{tail}"))
    return out


class RequestObserver(Protocol):
    """Told of every answer the intake sends, and of every request it drops unanswered
    (adapters/instruments.py counts them)."""

    def replied(self, family: str, verb: str, code: str, seconds: float) -> None: ...

    def dropped(self, family: str) -> None: ...


class _Error(msgspec.Struct):
    code: str
    message: str = ""


class _Outcome(msgspec.Struct):
    """What the intake reads of a reply: whether it is an error, and which."""

    ok: bool
    error: _Error | None = None


_decode_outcome = msgspec.json.Decoder(_Outcome).decode


def _error_of(reply: bytes) -> _Error | None:
    """The error a reply (an envelope of engine.core.replies) carries; None for a success."""
    outcome = _decode_outcome(reply)
    return None if outcome.ok else outcome.error


class NatsIntake:
    """Subscribes the engine to its subjects and answers each request after its commit."""

    def __init__(
        self,
        nc: NATS,
        engine: Engine,
        *,
        prefix: str = "trellis",
        domains: list[str] | None = None,
        max_in_flight: int = 10_000,
        observer: RequestObserver | None = None,
        reply_rule: ReplyRule | None = None,
    ):
        self._nc = nc
        self._engine = engine
        self._prefix = prefix
        self._domains = domains
        self._depth = len(prefix.split("."))
        self._observer = observer
        self._reply_rule = reply_rule or AnyInbox()
        self._drops = DropLog()
        self._throttles = ThrottleLog()
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_in_flight)
        self.service = EngineService(
            nc,
            metadata={
                "engine": engine.identity,
                "subject_prefix": prefix,
                "domains": ",".join(domains) if domains else "*",
            },
            # Discovery is the operator's and auditors', as queries are: their inboxes only.
            may_answer=lambda msg: self._answerable(msg, ["query"]),
            now=lambda: {
                "writes": ",".join(engine.domains),
                "writes_count": str(len(engine.domains)),
            },
        )
        self.serving = False  # subscribed, and not stopping

    async def start(self) -> None:
        await self.service.start()  # $SRV.PING, INFO and STATS
        for family, domain, subject in served(self._prefix, self._domains):
            name = family if domain == "*" else f"{family}-{domain}"
            metadata = {"family": family, "domain": domain}
            await self._serve_endpoint(self.service.add(name, subject, QUEUE_GROUP, metadata))
        # Requests other engines forward here: this engine writes their domain, or should.
        # Only this engine subscribes to its own subject, so it needs no queue group.
        own = f"{self._prefix}.engine.{self._engine.identity}.>"
        await self._serve_endpoint(self.service.add("forwarded", own, "", {"family": "any"}))
        # Subscribed at the server before anyone is told this engine serves.
        await server_has_read(self._nc, SUBSCRIBED_WITHIN_S)
        self.serving = True

    async def _serve_endpoint(self, endpoint: EndpointCount) -> None:
        async def on_msg(msg: Msg) -> None:
            await self._on_msg(msg, endpoint)

        queue = endpoint.queue_group
        self._subs.append(await self._nc.subscribe(endpoint.subject, queue=queue, cb=on_msg))

    async def stop(self) -> None:
        self.serving = False
        try:  # gone from discovery first; its drain needs NATS, which may be away
            await asyncio.wait_for(self.service.stop(), SERVICE_STOP_S)
        except Exception as exc:
            log.debug("micro service not stopped cleanly: %r", exc)
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        if self._tasks:
            # Requests in flight get their answers; a request stuck past the grace period is
            # cancelled (its client times out and resends with the same request_id).
            _, stuck = await asyncio.wait(self._tasks, timeout=STOP_GRACE_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        self._throttles.tell()  # the throttled since its last line, not lost with the engine

    async def _on_msg(self, msg: Msg, endpoint: EndpointCount) -> None:
        tokens = msg.subject.split(".")[self._depth :]
        forwarded = tokens[:2] == ["engine", self._engine.identity]
        if forwarded:
            tokens = tokens[2:]  # forwarded to us: answer here, never forward again
        if not self._answerable(msg, tokens):
            return  # nothing is decided, nothing is written, nobody is answered
        admitted = False
        if (
            len(tokens) == 4
            and tokens[0] in ("intent", "view")
            and (forwarded or self._engine.route(tokens[1]) is None)
        ):
            # The domain's writer takes the tenant's token (or, for a view, checks its time)
            # here, on arrival, and answers a throttled request at once: a flood is answered as
            # fast as it comes, ahead of the tasks and the writer's queue other tenants need.
            admit = self._engine.admit if tokens[0] == "intent" else self._engine.admit_view
            refused = admit(tokens[2])
            if refused is not None:
                self._throttles.throttled(tokens[0], tokens[2])
                await self._reply(msg, refused, endpoint, endpoint.received(), tokens)
                return
            admitted = True
        await self._slots.acquire()  # backpressure: bounded work in flight
        task = asyncio.create_task(self._serve(msg, endpoint, tokens, forwarded, admitted))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _answerable(self, msg: Msg, tokens: list[str]) -> bool:
        """Whether the request's reply subject is an inbox its subject's identity may be
        answered on (adapters/nats/replies.py); counts and logs it when not."""
        family = tokens[0] if tokens and tokens[0] in FAMILIES else "other"
        tenant = tokens[2] if family in ("intent", "view") and len(tokens) > 2 else None
        if msg.reply and self._reply_rule.allows(family, tenant, msg.reply):
            return True
        self._drops.dropped(family, msg.subject, msg.reply)
        if self._observer is not None:
            self._observer.dropped(family)
        return False

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _serve(
        self,
        msg: Msg,
        endpoint: EndpointCount,
        tokens: list[str],
        forwarded: bool,
        admitted: bool,
    ) -> None:
        started_ns = endpoint.received()
        if not forwarded and len(tokens) > 2 and (writer := self._engine.route(tokens[1])):
            await self._forward(msg, tokens, writer)
            endpoint.done(started_ns)  # handed on: the writer answers, and counts the answer
            return
        try:
            reply = await self._route(tokens, msg.data, forwarded, admitted)
        except ServedElsewhere as exc:
            await self._forward(msg, tokens, exc.writer)
            endpoint.done(started_ns)
            return
        except Exception as exc:
            incident = secrets.token_hex(4)
            log.exception("failed to serve %s (incident %s)", msg.subject, incident)
            reply = replies.internal_failure(
                "the engine failed to serve this request", exc, incident
            )
        await self._reply(msg, reply, endpoint, started_ns, tokens)

    async def _reply(
        self, msg: Msg, reply: bytes, endpoint: EndpointCount, started_ns: int, tokens: list[str]
    ) -> None:
        """Send `reply` (to an inbox: checked on arrival) and count it. Published bare: Msg.respond
        sends the request's own headers back with it, so a request with `Status: 503` had its
        committed answer read as "no responders" by its own client."""
        try:
            await self._nc.publish(msg.reply, reply)
        except Exception:  # the requester is gone or NATS is down; the log still has it
            log.warning("could not reply on %s", msg.subject, exc_info=True)
        error = _error_of(reply)
        endpoint.done(started_ns, None if error is None else f"{error.code}: {error.message}")
        if self._observer is not None:
            family, verb = _family_and_verb(tokens)
            code = "ok" if error is None else error.code
            self._observer.replied(family, verb, code, (time.perf_counter_ns() - started_ns) / 1e9)

    async def _forward(self, msg: Msg, tokens: list[str], writer: str) -> None:
        """Hand the request to the engine that writes its domain, as it came, reply subject
        and all, so that engine answers the client directly."""
        forward = ".".join([self._prefix, "engine", writer, *tokens])
        try:
            await self._nc.publish(forward, msg.data, reply=msg.reply, headers=msg.headers)
        except Exception:  # NATS is down: the client times out and resends
            log.warning("could not forward %s to engine %s", msg.subject, writer)

    async def _route(
        self, tokens: list[str], body: bytes, forwarded: bool, admitted: bool
    ) -> bytes:
        handle = self._engine.handle
        match tokens:
            case ["intent", domain, tenant, verb]:
                return await handle(
                    "intent", domain, tenant, verb, body, forwarded=forwarded, admitted=admitted
                )
            case ["admin", domain, verb]:
                return await handle("admin", domain, None, verb, body, forwarded=forwarded)
            case ["query", domain, verb]:
                return await handle("query", domain, None, verb, body, forwarded=forwarded)
            case ["view", domain, tenant, verb]:
                return await handle(
                    "query", domain, tenant, verb, body, forwarded=forwarded, admitted=admitted
                )
        return replies.error("invalid", f"unknown subject {'.'.join(tokens)!r}")


def _family_and_verb(tokens: list[str]) -> tuple[str, str]:
    """A request's family and verb, from its subject's tokens after the prefix."""
    family = tokens[0] if tokens and tokens[0] in FAMILIES else "other"
    return family, tokens[-1] if len(tokens) > 2 else ""
