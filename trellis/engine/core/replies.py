"""The reply envelope every request gets (ARCHITECTURE §3).

`OkReply[R]` is the envelope of a result of type R: the engine fills it with the result
already encoded (`msgspec.Raw`), and engine/core/contract.py gives each subject's the Struct of
engine/core/results.py that subject answers with.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

import msgspec

from trellis.engine.core.errors import ErrorCode, IntentRejected


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    code: ErrorCode
    message: str
    details: dict[str, Any] = {}


R = TypeVar("R")


class OkReply(msgspec.Struct, Generic[R], frozen=True, kw_only=True):
    ok: Literal[True] = True
    result: R
    position: int  # the log position the answer includes (read your writes with it)
    replayed: bool = False  # the stored first answer to a repeated request_id


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: Literal[False] = False
    error: ErrorBody


_encode = msgspec.json.Encoder().encode
_decode_ok = msgspec.json.Decoder(OkReply[msgspec.Raw]).decode
_decode_error = msgspec.json.Decoder(ErrorReply).decode


def ok(result: bytes, position: int, *, replayed: bool = False) -> bytes:
    """Encode a success reply around an already-encoded `result` object."""
    return _encode(OkReply(result=msgspec.Raw(result), position=position, replayed=replayed))


_POSITION_MARK = 1 << 62  # no log reaches this position; its digits mark where a position goes


def ok_around_position(result: bytes) -> tuple[bytes, bytes]:
    """The success reply for `result` in two pieces, before and after the digits of its
    position: `head + str(position) + tail == ok(result, position)`. So a store can put the
    position in when it knows it (in the statement that draws it), from this one envelope."""
    head, _, tail = ok(result, _POSITION_MARK).rpartition(str(_POSITION_MARK).encode())
    return head, tail


def error(code: ErrorCode, message: str, details: dict[str, Any] | None = None) -> bytes:
    return _encode(ErrorReply(error=ErrorBody(code=code, message=message, details=details or {})))


def internal_failure(what: str, exc: BaseException, incident: str) -> bytes:
    """`unavailable` for a failure the engine did not expect: the client hears its kind and
    the incident id the engine logged it under, never its text (which may name hosts, SQL or
    another tenant's data)."""
    kind = type(exc).__name__
    message = f"{what} ({kind}, incident {incident} in the engine's log); retry"
    return error("unavailable", message, {"error": kind, "incident": incident})


def rejection(exc: IntentRejected) -> bytes:
    return error(exc.code, exc.message, exc.details)


def decode_ok(reply: bytes) -> OkReply[msgspec.Raw] | None:
    """The success reply inside `reply`; None when it is an error reply."""
    try:
        return _decode_ok(reply)
    except msgspec.ValidationError:
        return None


def as_replayed(stored: bytes) -> bytes:
    """The stored first answer, marked as a replay: `replayed` on a success, and on a refusal
    (whose envelope has no such field) `details.replayed`, so a client that retries can tell a
    refusal recorded earlier, and final for its request_id, from a new one."""
    try:
        reply = _decode_ok(stored)
    except msgspec.ValidationError:
        refused = _decode_error(stored)
        marked = {**refused.error.details, "replayed": True}
        return _encode(ErrorReply(error=msgspec.structs.replace(refused.error, details=marked)))
    return _encode(msgspec.structs.replace(reply, replayed=True))
