"""One error tree for the whole engine; the wire `code` is the contract's (ARCHITECTURE §3)."""

from __future__ import annotations

from typing import Any, Literal

ErrorCode = Literal[
    "invalid",
    "not_found",
    "forbidden",
    "conflict",
    "no_capacity",
    "no_path",
    "quota",
    "throttled",
    "unavailable",
    "failed",
]
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__  # type: ignore[attr-defined]


class TrellisError(Exception):
    """Base of every error Trellis raises on purpose."""


class IntentRejected(TrellisError):
    """An intent the engine refuses; becomes an `{"ok": false, "error": ...}` reply."""

    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.details: dict[str, Any] = details or {}


class ConcurrencyConflict(TrellisError):
    """Another writer appended to the domain first (expected version was stale)."""

    def __init__(self, domain: str, expected: int, actual: int | None = None):
        # Logged as "domain D: <this>; catching up": the domain is said once, by the caller.
        head = "" if actual is None else f" (its head is at version {actual})"
        super().__init__(f"the log is no longer at version {expected} as this writer held it{head}")
        self.domain = domain
        self.expected = expected
        self.actual = actual


class DomainUnreadable(TrellisError):
    """A domain's log holds an event this code cannot fold (a newer engine wrote it, or it is
    damaged): the domain cannot be served until the code can read it."""

    def __init__(self, domain: str, position: int, cause: str):
        super().__init__(
            f"domain {domain!r} cannot be served: its log holds an event this engine cannot "
            f"read at position {position} ({cause})"
        )
        self.domain = domain
        self.position = position
        self.cause = cause


class EventRefused(TrellisError):
    """The log refused an event's content (an id or integer that validation should have
    refused): a bug at the boundary, never worth a retry. Nothing of the append was written."""


class WriterFenced(TrellisError):
    """This engine is no longer the domain's writer: another took its lease over (or it ran
    out), so the log and the fabric refuse what it still tries to do. Nothing was written.

    `seen`: the highest writer epoch the refuser has seen for the domain (0: not said). A fabric
    manager's record can outlive the log (a new deployment's leases start again at 1), and the
    next lease must be drawn above it."""

    def __init__(self, domain: str, detail: str = "", *, seen: int = 0):
        super().__init__(f"domain {domain!r}: this engine is no longer its writer ({detail})")
        self.domain = domain
        self.seen = seen


class ServedElsewhere(TrellisError):
    """Another engine writes the request's domain: hand the request to `writer`."""

    def __init__(self, domain: str, writer: str):
        super().__init__(f"domain {domain!r} is written by engine {writer}")
        self.domain = domain
        self.writer = writer


class StoreUnavailable(TrellisError):
    """The event store cannot be reached or cannot commit now; safe to retry."""


class FabricError(TrellisError):
    """The fabric refused or failed an operation; `component` names the part that failed."""

    def __init__(self, message: str, *, component: str | None = None):
        super().__init__(message)
        self.component = component
