"""A small NATS client for the wire contract: what the CLI, the demo, the economics run and the
tests speak. `TrellisClient.connected` opens one on a connection of its own; with
`stop_on_refusal` (the CLI's session) a refusal by the server (credentials it does not know, a
subject its permissions deny) ends the step that waits for it at once, instead of as a timeout,
and `identity_for` chooses who to connect as in secure mode."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from trellis.adapters.nats.auth import NkeyCredentials, Principal, SecureDir
from trellis.adapters.nats.connect import NatsUnreachable, connect_nats, nats_servers
from trellis.adapters.nats.roundtrip import server_has_read

T = TypeVar("T")

# How long one attempt of a request waits before it is sent again (TrellisClient.raw).
ATTEMPT_S = 2.0
NO_RESPONDERS = "503"  # the status of the server's answer when nobody subscribes


class NatsRefused(Exception):
    """The server refused this connection, or a publish on it (credentials, permissions)."""


class NoIdentity(LookupError):
    """Secure mode's data dir holds no identity for the tenant a subject names; says how to
    issue one."""


class Refusals:
    """What the server refused on this connection (credentials, or a publish its permissions
    deny), and while connecting, that no server could be reached at all: nats-py reports those
    only to the error callback, retrying, and a request would just time out. `first(...)`
    gives up on the awaited step as soon as one arrives."""

    def __init__(self, servers: int = 1) -> None:
        self.refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.connecting = True
        self._servers = servers
        self._unreached: list[str] = []

    async def on_error(self, exc: Exception) -> None:
        text = str(exc)
        if self.refused.done():
            return
        if "violation" in text.lower():
            self.refused.set_result(text.removeprefix("nats: ").strip("'"))
        elif self.connecting and isinstance(exc, OSError):
            # nats-py would try again forever; once every server was tried, a refused TCP
            # connection (or one that never answered) is the CLI's answer, not a timeout.
            self._unreached.append(unreached_reason(exc))
            if len(self._unreached) >= self._servers:
                reasons = "; ".join(dict.fromkeys(self._unreached))
                self.refused.set_exception(NatsUnreachable(reasons))

    async def first(self, step: Awaitable[T], timeout: float | None) -> T:
        """`step`'s result; NatsRefused once the server refuses something first, TimeoutError
        after `timeout` seconds (None: no limit)."""
        task = asyncio.ensure_future(step)
        either: set[asyncio.Future[Any]] = {task, self.refused}
        done, _ = await asyncio.wait(either, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self.refused.done():  # result() raises NatsUnreachable if no server was reached
            raise NatsRefused(f"NATS refused it: {self.refused.result()}")
        raise TimeoutError


def unreached_reason(exc: OSError) -> str:
    """Why a connection to a server failed, as a person says it."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return exc.strerror or str(exc) or type(exc).__name__


def identity_for(data_dir: Path, creds: Path | None, subject_tail: str) -> NkeyCredentials | None:
    """Who to connect as to send on `subject_tail`: `creds` when given; else, where `data_dir`
    holds secure mode's identities, the tenant's own for an intent or a view and the
    operator's for the rest; else nobody (a server without users).

    Raises:
        NoIdentity: secure mode, and no identity for the tenant `subject_tail` names.
    """
    if creds is not None:
        return NkeyCredentials(creds)
    secure = SecureDir(data_dir)
    if not secure.exists():
        return None
    family, _, rest = subject_tail.partition(".")
    if family in ("intent", "view"):
        tenant = Principal("tenant", rest.split(".")[1])
        if not secure.seed_path(tenant).is_file():
            raise NoIdentity(
                f"secure mode: no identity for tenant {tenant.name!r} in {secure.tenants_dir}; "
                f"`trellis tenant add {tenant.name}` issues one (or give --creds FILE)"
            )
        return secure.credentials(tenant)
    return secure.credentials(Principal("operator", "operator"))


class TrellisClient:
    """Request-reply over `<prefix>.{intent,admin,query,view}.<domain>...` (ARCHITECTURE §3)."""

    def __init__(
        self,
        nc: NATS,
        *,
        prefix: str = "trellis",
        timeout: float = 10.0,
        refusals: Refusals | None = None,
    ):
        self.nc = nc
        self.prefix = prefix
        self.timeout = timeout
        self.refusals = refusals

    @classmethod
    @contextlib.asynccontextmanager
    async def connected(
        cls,
        url: str,
        *,
        prefix: str = "trellis",
        timeout: float = 10.0,
        name: str = "trellis-client",
        credentials: NkeyCredentials | None = None,
        stop_on_refusal: bool = False,
    ) -> AsyncIterator[TrellisClient]:
        """A client on a NATS connection of its own to `url` (adapters/nats/connect.py: one
        that keeps reconnecting), as `credentials` (None: anonymous), closed with the context;
        `timeout` is each request's. With `stop_on_refusal`, a refusal by the server is
        NatsRefused at once (connecting, or in `unrefused`), no server to connect to is
        NatsUnreachable once each was tried (a refused TCP connection: at once), and
        connecting is bounded by `timeout`; without it, refusals are logged as connect_nats
        logs them, and connecting is retried until a server answers.

        Raises:
            NatsRefused: (stop_on_refusal) the server refused the credentials.
            NatsUnreachable: (stop_on_refusal) no server could be connected to; says why.
            TimeoutError: (stop_on_refusal) no connection within `timeout`.
            CredentialsError: `credentials` holds no usable nkey seed.
        """
        refusals = Refusals(len(nats_servers(url))) if stop_on_refusal else None
        connecting = connect_nats(
            url,
            name=name,
            credentials=credentials,
            on_error=refusals.on_error if refusals is not None else None,
        )
        nc = await (refusals.first(connecting, timeout) if refusals is not None else connecting)
        if refusals is not None:
            refusals.connecting = False  # from now on a lost server is reconnected to
        try:
            yield cls(nc, prefix=prefix, timeout=timeout, refusals=refusals)
        finally:
            await nc.close()

    async def close(self) -> None:
        await self.nc.close()

    async def unrefused(self, step: Awaitable[T], timeout: float | None = None) -> T:
        """`step`'s result; NatsRefused as soon as the server refuses something on this
        connection (with `stop_on_refusal`), TimeoutError after `timeout` (None: no limit)."""
        if self.refusals is None:
            return await asyncio.wait_for(step, timeout)
        return await self.refusals.first(step, timeout)

    async def raw(self, subject_tail: str, body: bytes) -> dict[str, Any]:
        """One request's reply (`ask`); a tenant's view answered `throttled` is asked again
        once `retry_after_ms` has passed, while the answer can still come within `timeout`:
        a view writes nothing, and its tenant's views are metered by the time they take
        (docs/operations.md), so a view that costs more than the burst, or a page after a
        costly first page, is delayed rather than refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            reply = await self.ask(subject_tail, body)
            wait = _retry_after(reply) if subject_tail.startswith("view.") else None
            if wait is None or loop.time() + wait >= deadline:
                return reply
            await asyncio.sleep(wait)

    async def ask(self, subject_tail: str, body: bytes) -> dict[str, Any]:
        """One request's reply, waited for `timeout` seconds in all. An attempt unanswered
        within ATTEMPT_S is sent again as it is (the same request_id: safe by the contract,
        ARCHITECTURE §3), after a pause that doubles up to a second, to the same inbox: NATS
        may have handed it to a frozen engine and the resend reaches another one, while a
        slow engine's answer to an earlier attempt still counts.

        Raises:
            nats.errors.TimeoutError: no answer within `timeout`.
            nats.errors.NoRespondersError: no engine subscribes to the subject.
        """
        subject = f"{self.prefix}.{subject_tail}"
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + self.timeout, 0.05
        answered: asyncio.Future[Msg] = loop.create_future()

        async def on_answer(msg: Msg) -> None:
            if not answered.done():
                answered.set_result(msg)

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=on_answer)
        try:
            while not answered.done():
                await self.nc.publish(subject, body, reply=inbox)
                await asyncio.wait({answered}, timeout=min(ATTEMPT_S, deadline - loop.time()))
                left = deadline - loop.time()
                if answered.done():
                    break
                if left <= 0:
                    raise nats.errors.TimeoutError
                await asyncio.wait({answered}, timeout=min(pause, left))  # an answer ends it
                pause = min(2 * pause, 1.0)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        msg = answered.result()
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise nats.errors.NoRespondersError
        reply: dict[str, Any] = msgspec.json.decode(msg.data)
        return reply

    async def admin(self, domain: str, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.raw(f"admin.{domain}.{verb}", _with_request_id(body))

    async def engines(self, quiet: float = 0.5) -> list[dict[str, Any]]:
        """Every engine of this prefix, as its micro service's STATS tell (adapters/nats/
        micro.py): `engine`, `writes` (the domains it writes now) and `serves` (those it may
        write, TRELLIS_DOMAINS; `["*"]`: every one), sorted by engine. Answers are gathered
        until none came for `quiet` seconds; TimeoutError when the server did not read the
        question within the client's timeout."""
        inbox = self.nc.new_inbox()
        answers: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_answer(msg: Any) -> None:
            answers.put_nowait(msg.data)

        sub = await self.nc.subscribe(inbox, cb=on_answer)
        found: dict[str, dict[str, Any]] = {}
        try:
            await self.nc.publish("$SRV.STATS.trellis-engine", b"", reply=inbox)
            await server_has_read(self.nc, self.timeout)  # the quiet wait starts after it
            while True:
                try:
                    data = await asyncio.wait_for(answers.get(), quiet)
                except TimeoutError:
                    break
                meta = msgspec.json.decode(data).get("metadata") or {}
                if meta.get("subject_prefix") != self.prefix or "engine" not in meta:
                    continue  # another deployment's engine on the same NATS
                writes = [d for d in meta.get("writes", "").split(",") if d]
                found[meta["engine"]] = {
                    "engine": meta["engine"],
                    "writes": writes,
                    "serves": meta.get("domains", "*").split(","),
                }
        finally:
            await sub.unsubscribe()
        return [found[e] for e in sorted(found)]

    async def intent(
        self, domain: str, tenant: str, verb: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        return await self.raw(f"intent.{domain}.{tenant}.{verb}", _with_request_id(body))

    async def query(
        self, domain: str, what: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return await self.raw(f"query.{domain}.{what}", msgspec.json.encode(body or {}))

    async def all_pages(self, subject_tail: str, body: dict[str, Any]) -> dict[str, Any]:
        """A query whose answer may come in pages (engine/core/paging.py): every page, joined into
        one reply. Pages after the first are asked for at the first one's position, so they
        are all of one moment."""
        reply = await self.raw(subject_tail, msgspec.json.encode(body))
        result = reply.get("result") if reply.get("ok") else None
        while isinstance(result, dict) and "next" in result:
            later = {**body, "offset": result.pop("next"), "at": body.get("at", reply["position"])}
            page = await self.raw(subject_tail, msgspec.json.encode(later))
            if not page.get("ok"):
                return page
            for key, value in page["result"].items():
                if isinstance(value, list):
                    result[key].extend(value)
                elif key == "next":
                    result["next"] = value
        return reply

    async def import_topology(
        self, domain: str, doc: dict[str, Any], request_id: str | None = None
    ) -> dict[str, Any]:
        """Import `doc` (nodes, links, reason): in one request when it fits one, else in parts
        under one request_id (engine/core/uploads.py), the import's answer coming with the last.
        An engine that lost the first parts (it stopped, or another took the domain over)
        answers the last with its progress instead: then every part is sent again, once."""
        request_id = request_id or str(uuid.uuid4())
        body = {**doc, "request_id": request_id}
        if len(msgspec.json.encode(body)) <= PART_BYTES:
            return await self.admin(domain, "import-topology", body)
        parts = _parts(body)
        for _ in range(2):
            for part in parts:
                reply = await self.raw(f"admin.{domain}.import-topology", part)
                if not reply.get("ok"):
                    return reply
            if "upload" not in reply["result"]:
                return reply
        return reply

    async def view(
        self, domain: str, tenant: str, what: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The query `what` as `tenant`'s view: only that tenant's data."""
        return await self.raw(f"view.{domain}.{tenant}.{what}", msgspec.json.encode(body or {}))


def _retry_after(
    reply: dict[str, Any], jitter: Callable[[], float] = random.random
) -> float | None:
    """The seconds to wait before asking again after a `throttled` answer, else None: what it
    says, and up to as much again at random. A burst refused at once is told one time
    (when the next token is due); resent together, all but one would be refused again."""
    error = reply.get("error") if not reply.get("ok") else None
    if not isinstance(error, dict) or error.get("code") != "throttled":
        return None
    wait_ms = (error.get("details") or {}).get("retry_after_ms")
    if not isinstance(wait_ms, int | float) or wait_ms <= 0:
        return None
    return wait_ms / 1000 * (1 + jitter())


def _with_request_id(body: dict[str, Any]) -> bytes:
    """Bodies get a fresh request_id unless the caller chose one (to test resends)."""
    return msgspec.json.encode({"request_id": str(uuid.uuid4()), **body})


# A part of an import sent in parts stays well under NATS's 1 MiB message (the engine refuses a
# body over MAX_BODY_BYTES): the rest is headroom for the envelope of a request.
PART_BYTES = 768 * 1024


def _parts(body: dict[str, Any]) -> list[bytes]:
    """`body` (an import) as parts of at most PART_BYTES each, encoded."""
    nodes, links = body.get("nodes", []), body.get("links", [])
    items = [("nodes", n) for n in nodes] + [("links", lk) for lk in links]
    count = max(2, -(-len(msgspec.json.encode(body)) // PART_BYTES))
    while True:
        size = -(-len(items) // count)
        chunks = [items[i * size : (i + 1) * size] for i in range(count)]
        encoded = [
            msgspec.json.encode(
                {
                    "request_id": body["request_id"],
                    "nodes": [item for kind, item in chunk if kind == "nodes"],
                    "links": [item for kind, item in chunk if kind == "links"],
                    **({"reason": body["reason"]} if body.get("reason") else {}),
                    "upload": {"part": i + 1, "parts": count},
                }
            )
            for i, chunk in enumerate(chunks)
        ]
        if all(len(e) <= PART_BYTES for e in encoded):
            return encoded
        count += max(1, count // 4)
