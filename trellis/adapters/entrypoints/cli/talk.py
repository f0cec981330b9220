"""Talking to a running engine: connecting as the CLI does, a request and its reply, and printing
the reply as `-o` asks."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from trellis.adapters.embedded.servers import default_data_dir
from trellis.adapters.endpoints import find_endpoint
from trellis.adapters.entrypoints import (
    render,
)
from trellis.adapters.entrypoints.cli.errors import EXIT_UNAVAILABLE, CliError
from trellis.adapters.nats.auth import (
    CredentialsError,
    NkeyCredentials,
    Principal,
    SecureDir,
)
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.settings import Settings, redacted


def at(args: argparse.Namespace, body: dict[str, Any]) -> dict[str, Any]:
    return body if getattr(args, "at", None) is None else {**body, "at": args.at}


def send_admin(args: argparse.Namespace, verb: str, body: dict[str, Any], show: Any) -> int:
    body = {**body, "request_id": args.request_id or str(uuid.uuid4())}
    reply = request(args, f"admin.{args.domain}.{verb}", body)
    return print_reply(args, reply, show)


def paged(args: argparse.Namespace, subject_tail: str, body: dict[str, Any]) -> dict[str, Any]:
    """A query whose answer may come in pages: all of them, as one reply."""
    return request(args, subject_tail, body, send=lambda c: c.all_pages(subject_tail, body))


def query_subject(args: argparse.Namespace, what: str) -> str:
    """The operator's query, or with --view the tenant's own view of it."""
    if args.view:
        return f"view.{args.domain}.{args.view}.{what}"
    return f"query.{args.domain}.{what}"


def send_intent(args: argparse.Namespace, verb: str, body: dict[str, Any], show: Any) -> int:
    body = {**body, "request_id": args.request_id or body.get("request_id") or str(uuid.uuid4())}
    reply = request(args, f"intent.{args.domain}.{args.tenant}.{verb}", body)
    return print_reply(args, reply, show)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, or from stdin for `-`."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        doc = msgspec.json.decode(data)
    except (OSError, msgspec.DecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise CliError(f"{path} must hold a JSON object")
    return doc


def pairs(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"expected K=V, got {item!r}")
        pairs[key] = value
    return pairs


def credentials(
    settings: Settings, creds: Path | None, subject_tail: str
) -> NkeyCredentials | None:
    """Who to connect as: --creds / TRELLIS_NATS_CREDS; else, where the data dir holds secure
    mode's identities, the tenant's own for an intent or a view and the operator's for the
    rest; else nobody (a server without users)."""
    if creds is not None:
        return NkeyCredentials(creds)
    secure = SecureDir(settings.data_dir or default_data_dir())
    if not secure.exists():
        return None
    family, _, rest = subject_tail.partition(".")
    if family in ("intent", "view"):
        tenant = Principal("tenant", rest.split(".")[1])
        if not secure.seed_path(tenant).is_file():
            raise CliError(
                f"secure mode: no identity for tenant {tenant.name!r} in {secure.tenants_dir}; "
                f"`trellis tenant add {tenant.name}` issues one (or give --creds FILE)"
            )
        return secure.credentials(tenant)
    return secure.credentials(Principal("operator", "operator"))


class Refusals:
    """What the server refused on this connection (credentials, or a publish its permissions
    deny): nats-py reports those only to the error callback, and a request would just time
    out. `first(...)` gives up on the awaited step as soon as one arrives."""

    def __init__(self) -> None:
        self.refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_error(self, exc: Exception) -> None:
        text = str(exc)
        if "violation" in text.lower() and not self.refused.done():
            self.refused.set_result(text.removeprefix("nats: ").strip("'"))

    async def first(self, step: Any, timeout: float | None) -> Any:
        task = asyncio.ensure_future(step)
        done, _ = await asyncio.wait(
            {task, self.refused}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self.refused.done():
            raise CliError(f"NATS refused it: {self.refused.result()}")
        raise TimeoutError


def request(
    args: argparse.Namespace,
    subject_tail: str,
    body: dict[str, Any],
    send: Callable[[TrellisClient], Awaitable[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Send `body` on `subject_tail` (or have `send` talk to the engine, e.g. an import in
    parts) and return the reply, every failure turned into one CliError line. `--timeout` is
    each request's: `send` may make many (pages, parts)."""

    async def ask(nc: NATS, settings: Settings, url: str, refusals: Refusals, who: str) -> Any:
        client = TrellisClient(nc, prefix=settings.subject_prefix, timeout=args.timeout)
        asked = send(client) if send else client.raw(subject_tail, msgspec.json.encode(body))
        try:  # the client's own timeout bounds each request
            return await refusals.first(asked, None if send else args.timeout)
        except CliError as exc:
            raise CliError(f"{exc} ({who} may not send that)", code="forbidden") from None
        except NoRespondersError:
            raise CliError(
                f"no engine serves {settings.subject_prefix}.* on {url}",
                code="unavailable",
                hint="start one with `trellis up`; check TRELLIS_SUBJECT_PREFIX",
                exit=EXIT_UNAVAILABLE,
            ) from None
        except TimeoutError:
            raise CliError(
                f"no reply within {args.timeout}s from {url}",
                code="unavailable",
                hint="is the engine busy or stopped? try a longer --timeout",
                exit=EXIT_UNAVAILABLE,
            ) from None

    reply: dict[str, Any] = on_nats(args, subject_tail, ask)
    return reply


def on_nats(args: argparse.Namespace, subject_tail: str, work: Any) -> Any:
    """Connect as the CLI does (the engine's NATS, the identity for `subject_tail`), run
    `await work(nc, settings, url, refusals, who)`, and close; connection trouble is one
    line."""
    settings = Settings.from_env()
    url = find_endpoint(settings, "nats_url")
    if url is None:
        raise CliError(
            "no engine found",
            code="unavailable",
            hint="start one with `trellis up`, or set TRELLIS_NATS_URL",
            exit=EXIT_UNAVAILABLE,
        )
    creds = credentials(settings, args.creds, subject_tail)
    who = f"the identity in {creds.path}" if creds else "no credentials (see --creds)"

    async def go() -> Any:
        refusals = Refusals()
        connecting = connect_nats(
            url, name="trellis-cli", credentials=creds, on_error=refusals.on_error
        )
        try:
            nc = await refusals.first(connecting, args.timeout)
        except (CliError, CredentialsError) as exc:
            raise CliError(
                f"{exc} (connecting to {url} with {who})", code="refused", hint="see --creds"
            ) from None
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            raise CliError(
                f"cannot reach NATS at {redacted(url)}: {reason}",
                code="unavailable",
                hint="is `trellis up` running? see TRELLIS_NATS_URL",
                exit=EXIT_UNAVAILABLE,
            ) from None
        try:
            return await work(nc, settings, url, refusals, who)
        finally:
            await nc.close()

    return asyncio.run(go())


def print_reply(args: argparse.Namespace, reply: dict[str, Any], show: Any) -> int:
    """Print a reply as `-o` asks: `show(result, reply, wide=...)` for people, or (json) the
    result as it came; a refusal is the error and its funnel on stderr, or (json) the error
    reply on stdout. Exit 1 on a refusal."""
    ok = bool(reply.get("ok"))
    if args.output == "json":
        print(as_json(reply["result"] if ok else reply))
    elif ok:
        seen = render.visible(reply)  # text for a terminal: no control or bidi character raw
        print(show(seen["result"], seen, wide=args.output == "wide"))
    else:
        print(render.error_text(render.visible(reply["error"])), file=sys.stderr)
    return 0 if ok else 1


def as_json(value: Any) -> str:
    """One JSON document, indented."""
    return msgspec.json.format(msgspec.json.encode(value), indent=2).decode()
