"""The reply envelope every request gets (ARCHITECTURE §3)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from trellis.engine.errors import ErrorCode, IntentRejected


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    code: ErrorCode
    message: str
    details: dict[str, Any] = {}


class OkReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: Literal[True] = True
    # Already-encoded result object (each verb documents its own shape).
    result: Annotated[msgspec.Raw, msgspec.Meta(extra_json_schema={"type": "object"})]
    position: int
    replayed: bool = False


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: Literal[False] = False
    error: ErrorBody


_encode = msgspec.json.Encoder().encode
_decode_ok = msgspec.json.Decoder(OkReply).decode


def ok(result: bytes, position: int, *, replayed: bool = False) -> bytes:
    """Encode a success reply around an already-encoded `result` object."""
    return _encode(OkReply(result=msgspec.Raw(result), position=position, replayed=replayed))


def error(code: ErrorCode, message: str, details: dict[str, Any] | None = None) -> bytes:
    return _encode(ErrorReply(error=ErrorBody(code=code, message=message, details=details or {})))


def rejection(exc: IntentRejected) -> bytes:
    return error(exc.code, exc.message, exc.details)


def decode_ok(reply: bytes) -> OkReply | None:
    """The success reply inside `reply`; None when it is an error reply."""
    try:
        return _decode_ok(reply)
    except msgspec.ValidationError:
        return None


def as_replayed(stored: bytes) -> bytes:
    """The stored first answer, marked as a replay (error answers have no such flag)."""
    try:
        reply = _decode_ok(stored)
    except msgspec.ValidationError:
        return stored
    return _encode(msgspec.structs.replace(reply, replayed=True))
