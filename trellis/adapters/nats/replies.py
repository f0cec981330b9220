"""Where the engine may answer (ARCHITECTURE §3): only a request's own reply subject, and only
when it is an inbox.

A request names its reply subject itself, and the engine publishes the answer there under its
own identity. Without this rule a tenant could have the engine write its answer into another
tenant's KV key or into the event stream (a reply subject of `$KV.TRELLIS_STATE.…` or
`trellis.events.…`), which overwrote a composition's value and stopped a domain's relay. So a
request whose reply subject is no inbox, or that has none, is dropped unanswered before it is
decided: it writes nothing.

An inbox is a subject one requester can subscribe to alone: `_INBOX.` and tokens, none empty,
none a wildcard, no space in any. (`_INBOX.` alone or `_INBOX.a..b` can reach nobody, so the
intent was decided with no one to answer; `_INBOX.>` reached every requester waiting on an
inbox.) In plain mode any inbox is allowed. In secure mode it must also be the inbox
prefix of the identity the request's subject admits (adapters/nats/auth.py): the tenant of an
`intent` or `view` subject, the operator for `admin`, the operator or an auditor for `query`.
So a tenant cannot have the engine answer into another tenant's inbox either.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

#: `_INBOX` and one or more tokens, none empty, none holding a NATS wildcard or a character
#: that ends a subject on the wire (one C call: it runs for every request).
_INBOX_SUBJECT = re.compile(r"_INBOX(?:\.[^.*> \t\r\n]+)+")
#: How often a refusal of one kind is logged at most (each is counted in the metrics anyway).
REREAD_EVERY_S = 1.0  # how often a reply that matches no identity reads them again
LOG_EVERY_S = 60.0


class ReplyRule(Protocol):
    """Whether a request of `family` (for `tenant`, of an intent or a view) may be answered on
    `reply`."""

    def allows(self, family: str, tenant: str | None, reply: str) -> bool: ...


def is_inbox(reply: str) -> bool:
    """Whether `reply` is an inbox subject: `_INBOX.` and whole tokens, no wildcard or space."""
    return _INBOX_SUBJECT.fullmatch(reply) is not None


class AnyInbox:
    """Plain mode: any inbox, nothing else."""

    def allows(self, family: str, tenant: str | None, reply: str) -> bool:
        return is_inbox(reply)


class OwnInbox:
    """Secure mode: the inbox of the identity the subject admits. `inboxes` gives the inbox
    prefixes (`_INBOX.<public key>`) of the operator, the auditor and each tenant. A reply
    subject that matches none of them may be an identity issued since they were read (a new
    tenant, or a tenant's key replaced with `trellis tenant add`): they are read again, at most
    once every REREAD_EVERY_S. Only the server's users can send, and a tenant's user sends only
    under its own name, so a mismatch is rare, not a flood; the bound keeps it so."""

    def __init__(
        self,
        inboxes: Callable[[], tuple[str, str, dict[str, str]]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self._read = inboxes
        self._clock = clock
        self._operator, self._auditor, self._tenants = inboxes()
        self._read_at = -math.inf  # the first mismatch reads them again at once

    def allows(self, family: str, tenant: str | None, reply: str) -> bool:
        if not is_inbox(reply):
            return False
        if self._matches(family, tenant, reply):
            return True
        now = self._clock()
        if now - self._read_at < REREAD_EVERY_S:
            return False
        self._operator, self._auditor, self._tenants = self._read()
        self._read_at = now
        return self._matches(family, tenant, reply)

    def _matches(self, family: str, tenant: str | None, reply: str) -> bool:
        match family:
            case "intent" | "view":
                prefix = self._tenants.get(tenant) if tenant is not None else None
                return prefix is not None and reply.startswith(prefix + ".")
            case "admin":
                return reply.startswith(self._operator + ".")
            case "query":
                return reply.startswith((self._operator + ".", self._auditor + "."))
        return False


class DropLog:
    """Logs refused reply subjects, once a minute per family at most."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last: dict[str, float] = {}

    def dropped(self, family: str, subject: str, reply: str) -> None:
        now = self._clock()
        if now - self._last.get(family, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last[family] = now
            log.warning(
                "dropped a request on %s unanswered: its reply subject %r is not the "
                "requester's inbox (counted in trellis_requests_dropped; logged once a minute)",
                subject,
                reply[:120],
            )
