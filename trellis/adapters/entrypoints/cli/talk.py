"""Talking to a running engine: the CLI's session (adapters/nats/client.py's TrellisClient, as
the identity secure mode gives the subject), a request and its reply with every failure one
line, and printing the reply as `-o` asks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from nats.errors import NoRespondersError

from trellis.adapters.embedded.process import default_data_dir
from trellis.adapters.endpoints import find_endpoint
from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.errors import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, CliError
from trellis.adapters.nats.auth import (
    CredentialsError,
)
from trellis.adapters.nats.client import NatsRefused, NoIdentity, TrellisClient, identity_for
from trellis.adapters.settings import Settings, redacted

T = TypeVar("T")


def at(args: argparse.Namespace, body: dict[str, Any]) -> dict[str, Any]:
    return body if getattr(args, "at", None) is None else {**body, "at": args.at}


def send_admin(args: argparse.Namespace, verb: str, body: dict[str, Any], show: Any) -> int:
    body = {**body, "request_id": args.request_id or str(uuid.uuid4())}
    reply = request(args, f"admin.{args.domain}.{verb}", body)
    code = print_reply(args, reply, show)
    may_have_been_committed(args, reply, body["request_id"])
    return code


def may_have_been_committed(args: argparse.Namespace, reply: dict[str, Any], rid: str) -> None:
    """After an engine's `unavailable` to an intent or admin request, name its request id:
    a store that stalled (a paused or overloaded Postgres) may still commit what the engine
    gave up waiting for, so resending with a fresh id could apply it twice, where the same id
    is answered from the log (ARCHITECTURE §3: "safe to retry with the same request_id")."""
    if reply.get("ok") or reply["error"].get("code") != "unavailable" or args.output == "json":
        return
    print(
        f"(the request may have been committed all the same (request id {rid}): resend the "
        f"same command with --request-id {shlex.quote(rid)}; the engine answers a request id "
        "it has seen from its log and applies it once, a fresh id could apply it twice)",
        file=sys.stderr,
    )


def paged(args: argparse.Namespace, subject_tail: str, body: dict[str, Any]) -> dict[str, Any]:
    """A query whose answer may come in pages: all of them, as one reply."""
    return request(args, subject_tail, body, send=lambda c: c.all_pages(subject_tail, body))


def query_subject(args: argparse.Namespace, what: str) -> str:
    """The operator's query, or with --view the tenant's own view of it."""
    if args.view:
        return f"view.{args.domain}.{args.view}.{what}"
    return f"query.{args.domain}.{what}"


#: The intents that name a composition or reservation of the tenant's own.
_OWNED = {"release", "extend", "apply", "cancel-reservation"}


def send_intent(args: argparse.Namespace, verb: str, body: dict[str, Any], show: Any) -> int:
    body = {**body, "request_id": args.request_id or body.get("request_id") or str(uuid.uuid4())}
    reply = request(args, f"intent.{args.domain}.{args.tenant}.{verb}", body)
    code = print_reply(args, reply, show)
    may_have_been_committed(args, reply, body["request_id"])
    error = {} if reply.get("ok") else reply["error"]
    unknown = error.get("code") == "not_found" and "domain" not in (error.get("details") or {})
    ended = _ended(args, body) if unknown and verb in _ON_A_LIVE_ONE else None
    if ended is not None and args.output != "json":
        # `composition get` shows it released: "no composition" alone read as a wrong id.
        print(f"({ended}: there is nothing to {verb})", file=sys.stderr)
    elif unknown and verb in _OWNED and args.output != "json":
        # The contract answers another tenant's composition or reservation as not found: say
        # who asked, since the default tenant is easily not the one that made it. (An unknown
        # domain, host or device is unknown whoever asks.)
        print(
            f"(asked as tenant {args.tenant!r}: what another tenant holds is not found either;"
            " --tenant names who asks)",
            file=sys.stderr,
        )
    return code


#: The intents on a live composition: one that ended is not found by them.
_ON_A_LIVE_ONE = {"release", "extend"}


def _ended(args: argparse.Namespace, body: dict[str, Any]) -> str | None:
    """How the tenant's composition of `body` ended ("composition c-1 was released at position
    12"), or None: unknown to the tenant, still live, or the engine did not say."""
    cid = body.get("composition_id")
    with contextlib.suppress(CliError):
        reply = request(args, f"view.{args.domain}.{args.tenant}.composition", {"id": cid})
        result = reply.get("result") or {}
        if reply.get("ok") and result.get("state") in ("released", "failed"):
            chain = result.get("chain", [])
            ends = ("CompositionReleased", "CompositionFailed")
            at = [e["position"] for e in chain if e["type"] in ends]
            where = f" at position {at[-1]}" if at else ""
            if result["state"] == "failed":
                return f"composition {cid} failed{where}"
            expired = any(e["type"] == "LeaseExpired" for e in chain)
            return f"composition {cid} was released{where}" + (
                " (its lease expired)" if expired else ""
            )
    return None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, or from stdin for `-`."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        doc = msgspec.json.decode(data)
    except (OSError, msgspec.DecodeError) as exc:
        # The JSON itself where its file's name was to be: say how to give it.
        inline = isinstance(exc, FileNotFoundError) and str(path).lstrip().startswith("{")
        hint = "put the JSON in a file, or pass - and give it on stdin" if inline else None
        raise CliError(f"cannot read {path}: {exc}", hint=hint) from None
    if not isinstance(doc, dict):
        raise CliError(f"{path} must hold a JSON object")
    return doc


def request(
    args: argparse.Namespace,
    subject_tail: str,
    body: dict[str, Any],
    send: Callable[[TrellisClient], Awaitable[dict[str, Any]]] | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Send `body` on `subject_tail` (or have `send` talk to the engine, e.g. an import in
    parts) and return the reply, every failure turned into one CliError line. `--timeout` is
    each request's: `send` may make many (pages, parts). `request_id` is the intent's or admin
    request's when `send` sends it (else the body's): a timeout names it, to resend."""

    async def ask(client: TrellisClient, settings: Settings, url: str, who: str) -> Any:
        asked = send(client) if send else client.raw(subject_tail, msgspec.json.encode(body))
        try:  # the client's own timeout bounds each request
            return await client.unrefused(asked, None if send else args.timeout)
        except NatsRefused as exc:
            raise CliError(f"{exc} ({who} may not send that)", code="forbidden") from None
        except NoRespondersError:
            raise CliError(
                f"no engine serves {settings.subject_prefix}.* on {url}",
                code="unavailable",
                hint="start one with `trellis up`; check TRELLIS_SUBJECT_PREFIX",
                exit=EXIT_UNAVAILABLE,
            ) from None
        except TimeoutError:
            raise _no_reply(args, url, subject_tail, request_id or body.get("request_id")) from None

    reply: dict[str, Any] = on_nats(args, subject_tail, ask)
    return reply


def _no_reply(args: argparse.Namespace, url: str, subject_tail: str, rid: Any) -> CliError:
    """No reply in time. A query can simply be asked again; an intent or admin request may
    have been committed all the same (a paused Postgres commits it later), so the line says so
    and names its request id: resent with it, the engine answers from its log (ARCHITECTURE
    §3), never applying it twice."""
    changes = subject_tail.split(".", 1)[0] in ("intent", "admin")
    if not changes or not isinstance(rid, str):
        return CliError(
            f"no reply within {args.timeout}s from {url}",
            code="unavailable",
            hint="is the engine busy or stopped? try a longer --timeout",
            exit=EXIT_UNAVAILABLE,
        )
    return CliError(
        f"no reply within {args.timeout}s from {url}: the request may have been committed "
        f"all the same (request id {rid})",
        code="unavailable",
        hint=f"resend the same command with --request-id {shlex.quote(rid)}: the engine answers "
        "a request id it has seen from its log and applies it once; a fresh id could apply "
        "it twice",
        exit=EXIT_UNAVAILABLE,
    )


async def reading_jetstream(client: TrellisClient, step: Awaitable[T], who: str) -> T:
    """`step` (reads of the stream or the bucket); a refusal by the server is one line saying
    who may not, at once, instead of a JetStream timeout (a tenant's identity reads neither)."""
    try:
        return await client.unrefused(step)
    except NatsRefused as exc:
        raise CliError(
            f"{exc} ({who} may not read the stream or the bucket)",
            code="forbidden",
            hint="the operator's or the auditor's identity reads them (--creds)",
        ) from None


def on_nats(args: argparse.Namespace, subject_tail: str, work: Any) -> Any:
    """Connect as the CLI does (the engine's NATS, the identity for `subject_tail`; a client
    that stops at the server's first refusal), run `await work(client, settings, url, who)`,
    and close; connection trouble is one line."""
    settings = Settings.from_env()
    url = find_endpoint(settings, "nats_url")
    if url is None:
        raise CliError(
            f"no engine found on data dir {settings.data_dir or default_data_dir()}",
            code="unavailable",
            hint="start one with `trellis up` (one starting writes its address once it serves), "
            "or set TRELLIS_NATS_URL; TRELLIS_DATA_DIR names the data dir",
            exit=EXIT_UNAVAILABLE,
        )
    try:
        creds = identity_for(settings.data_dir or default_data_dir(), args.creds, subject_tail)
    except NoIdentity as exc:
        raise CliError(str(exc)) from None
    who = f"the identity in {creds.path}" if creds else "no credentials (see --creds)"

    async def go() -> Any:
        async with contextlib.AsyncExitStack() as stack:
            session = TrellisClient.connected(
                url,
                prefix=settings.subject_prefix,
                timeout=args.timeout,
                name="trellis-cli",
                credentials=creds,
                stop_on_refusal=True,
            )
            try:
                client = await stack.enter_async_context(session)
            except (NatsRefused, CredentialsError) as exc:
                raise CliError(
                    f"{exc} (connecting to {url} with {who})", code="refused", hint="see --creds"
                ) from None
            except Exception as exc:
                if isinstance(exc, TimeoutError):
                    reason = f"no connection within {args.timeout}s"
                else:
                    reason = str(exc) or type(exc).__name__
                raise CliError(
                    f"cannot reach NATS at {redacted(url)} ({reason})",
                    code="unavailable",
                    hint="is the engine up? `trellis up` starts one; see TRELLIS_NATS_URL",
                    exit=EXIT_UNAVAILABLE,
                ) from None
            return await work(client, settings, url, who)

    return asyncio.run(go())


def print_reply(args: argparse.Namespace, reply: dict[str, Any], show: Any) -> int:
    """Print a reply as `-o` asks: `show(result, reply, wide=...)` for people, or (json) the
    result as it came; a refusal is the error and its funnel on stderr, or (json) the error
    reply on stdout. Exit 1 on a refusal; 3 on `unavailable`, which a retry may get past
    (the Postgres behind the engine, or the domain's fabric, did not answer)."""
    ok = bool(reply.get("ok"))
    if args.output == "json":
        print(as_json(reply["result"] if ok else reply))
    elif ok:
        seen = render.visible(reply)  # text for a terminal: no control or bidi character raw
        print(show(seen["result"], seen, wide=args.output == "wide"))
    else:
        print(render.error_text(render.visible(reply["error"])), file=sys.stderr)
    if ok:
        _past_the_head(args, reply)
        return EXIT_OK
    return EXIT_UNAVAILABLE if reply["error"].get("code") == "unavailable" else EXIT_FAILED


def _past_the_head(args: argparse.Namespace, reply: dict[str, Any]) -> None:
    """A note on stderr when `--at` named a log position past the domain's head: the engine
    answers with the state now, and the answer said only its position (`--at 9999` with the
    head at 66 printed `10 connections at position 66`, unsaid).

    An answer below the position asked is also the domain's last event before it when other
    domains' events (or a gap) lie between, so the domain's head is asked for (a small query
    without `--at`) before saying so."""
    asked, position = getattr(args, "at", None), reply.get("position")
    if not (type(asked) is int and type(position) is int and position < asked):
        return
    head = request(args, query_subject(args, "quotas"), {}).get("position")
    if type(head) is int and position >= head:
        print(
            f"(position {asked} is past the domain's head, {position}: this is the state now)",
            file=sys.stderr,
        )


def as_json(value: Any) -> str:
    """One JSON document, indented."""
    return msgspec.json.format(msgspec.json.encode(value), indent=2).decode()
