"""What the Redfish service's handlers share: the reply each returns, and the checks of a
request (its method, the account's privilege, If-Match, a JSON body) that answer with the
Redfish error DSP0266 names when they fail."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from trellis.adapters.http.redfish import resources as rs
from trellis.adapters.http.redfish.accounts import Account
from trellis.adapters.http.redfish.registries import RedfishError, error, message
from trellis.adapters.http.server import Request

#: The most unknown properties one refusal names: a body may hold thousands.
MAX_UNKNOWN_LISTED = 16


class Reply(msgspec.Struct, kw_only=True):
    """What a resource's handler answers; the service renders it (headers, ETag, Link)."""

    status: int = 200
    body: dict[str, Any] | None = None
    headers: list[tuple[str, str]] = []
    allow: str = "GET, HEAD"
    etag: bool = True  # a single resource: send its ETag


def only(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise error(405, "OperationNotAllowed")


def may_change(account: Account) -> None:
    if account.role == "ReadOnly":
        raise error(403, "InsufficientPrivilege")


def admin_only(account: Account) -> None:
    if not account.admin:
        raise error(403, "InsufficientPrivilege")


def matches(header: str | None, tag: str) -> bool:
    if header is None:
        return False
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or tag in tags or tag.removeprefix("W/") in tags


def if_match(request: Request, current: dict[str, Any]) -> None:
    """412 when If-Match names no current representation of the resource."""
    header = request.headers.get("if-match")
    if header is not None and not matches(header, rs.etag(current)):
        raise error(412, "PreconditionFailed")


def json_body(request: Request) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(request.body or b"")
    except (msgspec.DecodeError, RecursionError):  # nested past the decoder's depth: malformed
        raise error(400, "MalformedJSON") from None
    if not isinstance(body, dict):
        raise error(400, "MalformedJSON")
    return body


def refuse_unknown(
    body: dict[str, Any], known: Iterable[str], where: str = "", *, action: str | None = None
) -> None:
    """A 400 naming each property of `body` not in `known` (at `where`, a path ending in `/`):
    a property a create does not take is refused, never dropped, so a typo never makes less
    than was asked. OData annotations (`@odata.type`, `Members@odata.count`) are any body's.
    With `action`, the properties are that action's parameters (`ActionParameterUnknown`)."""
    allowed = set(known)
    unknown = sorted(k for k in body if k not in allowed and "@odata." not in k)
    if unknown:
        raise RedfishError(400, [
            message("ActionParameterUnknown", action, f"{where}{k}") if action is not None
            else message("PropertyUnknown", f"{where}{k}")
            for k in unknown[:MAX_UNKNOWN_LISTED]
        ])  # fmt: skip


def wrong_type(value: Any, where: str, resolution: str | None = None) -> RedfishError:
    """The 400 for a property `where` whose value is of a JSON type it cannot take: the value as
    JSON text (cut short, as a value may be huge), as bmcweb sends it."""
    text = msgspec.json.encode(value).decode()
    shown = text if len(text) <= 64 else f"{text[:61]}..."
    return error(400, "PropertyValueTypeError", shown, where, resolution=resolution)


def patched(
    body: dict[str, Any], writable: set[str], current: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What a PATCH may change, and a message for each property it may not (DSP0266, "Update
    a resource"): those are left as they are when something else changes (200, the messages
    beside the resource), and refuse the whole PATCH when nothing else does (400). OData
    annotations (`@odata.etag` and the like) are ignored: a body of only those, like an empty
    one, changes nothing (200)."""
    others = sorted(k for k in body if k not in writable and not k.startswith("@odata."))
    notes = [
        message("PropertyNotWritable" if k in current else "PropertyUnknown", k) for k in others
    ]
    wanted = {k: v for k, v in body.items() if k in writable}
    if notes and not wanted:
        raise RedfishError(400, notes)
    return wanted, notes


def with_notes(body: dict[str, Any], notes: list[dict[str, Any]]) -> dict[str, Any]:
    """`body` with `notes` as its `@Message.ExtendedInfo` (none: `body` itself)."""
    return {**body, "@Message.ExtendedInfo": notes} if notes else body


def dig(body: dict[str, Any], *keys: str) -> Any:
    value: Any = body
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value
