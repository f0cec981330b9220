"""NATS in front of the engine: request-reply subjects of ARCHITECTURE §3, in a queue group.

Each message is served in its own task, so intents that arrive together wait in the domain
writer's queue at the same time and are committed as one batch (group commit). Any engine of a
deployment may receive any request; one that does not write the request's domain forwards it,
reply subject and all, to `<prefix>.engine.<writer id>.<subject>`, where the writer answers
the client directly (engine/ownership.py decides who writes what).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from trellis.engine import replies
from trellis.engine.errors import ServedElsewhere
from trellis.engine.service import Engine

log = logging.getLogger(__name__)

QUEUE_GROUP = "trellis-engine"
STOP_GRACE_S = 10.0


def subjects(prefix: str, domains: list[str] | None) -> list[str]:
    """The subjects to serve: every domain by wildcard, or just the listed ones."""
    tokens = domains or ["*"]
    out = []
    for d in tokens:
        out += [f"{prefix}.intent.{d}.*.*", f"{prefix}.admin.{d}.*", f"{prefix}.query.{d}.*"]
        out += [f"{prefix}.view.{d}.*.*"]  # a tenant's own view of the queries
    return out


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
    ):
        self._nc = nc
        self._engine = engine
        self._prefix = prefix
        self._domains = domains
        self._depth = len(prefix.split("."))
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_in_flight)

    async def start(self) -> None:
        for subject in subjects(self._prefix, self._domains):
            self._subs.append(await self._nc.subscribe(subject, queue=QUEUE_GROUP, cb=self._on_msg))
        # Requests other engines forward here: this engine writes their domain, or should.
        own = f"{self._prefix}.engine.{self._engine.identity}.>"
        self._subs.append(await self._nc.subscribe(own, cb=self._on_msg))
        await self._nc.flush()

    async def stop(self) -> None:
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

    async def _on_msg(self, msg: Msg) -> None:
        await self._slots.acquire()  # backpressure: bounded work in flight
        task = asyncio.create_task(self._serve(msg))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _serve(self, msg: Msg) -> None:
        tokens = msg.subject.split(".")[self._depth :]
        forwarded = tokens[:2] == ["engine", self._engine.identity]
        if forwarded:
            tokens = tokens[2:]  # forwarded to us: answer here, never forward again
        elif len(tokens) > 2 and (writer := self._engine.route(tokens[1])) is not None:
            await self._forward(msg, tokens, writer)
            return
        try:
            reply = await self._route(tokens, msg.data, forwarded)
        except ServedElsewhere as exc:
            await self._forward(msg, tokens, exc.writer)
            return
        except Exception as exc:
            log.exception("failed to serve %s", msg.subject)
            cause = f"{type(exc).__name__}: {exc}"
            reply = replies.error(
                "unavailable",
                f"the engine failed to serve this request ({cause}); retry",
                {"cause": cause},
            )
        if msg.reply:
            try:
                await msg.respond(reply)
            except Exception:  # the requester is gone or NATS is down; the log still has it
                log.warning("could not reply on %s", msg.subject, exc_info=True)

    async def _forward(self, msg: Msg, tokens: list[str], writer: str) -> None:
        """Hand the request to the engine that writes its domain, as it came, reply subject
        and all, so that engine answers the client directly."""
        forward = ".".join([self._prefix, "engine", writer, *tokens])
        try:
            await self._nc.publish(forward, msg.data, reply=msg.reply, headers=msg.headers)
        except Exception:  # NATS is down: the client times out and resends
            log.warning("could not forward %s to engine %s", msg.subject, writer)

    async def _route(self, tokens: list[str], body: bytes, forwarded: bool) -> bytes:
        handle = self._engine.handle
        match tokens:
            case ["intent", domain, tenant, verb]:
                return await handle("intent", domain, tenant, verb, body, forwarded=forwarded)
            case ["admin", domain, verb]:
                return await handle("admin", domain, None, verb, body, forwarded=forwarded)
            case ["query", domain, verb]:
                return await handle("query", domain, None, verb, body, forwarded=forwarded)
            case ["view", domain, tenant, verb]:
                return await handle("query", domain, tenant, verb, body, forwarded=forwarded)
        return replies.error("invalid", f"unknown subject {'.'.join(tokens)!r}")
