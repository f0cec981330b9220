"""A small NATS client for the wire contract: what the CLI, the demo and the tests speak."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from nats.aio.client import Client as NATS


class TrellisClient:
    """Request-reply over `<prefix>.{intent,admin,query,view}.<domain>...` (ARCHITECTURE §3)."""

    def __init__(self, nc: NATS, *, prefix: str = "trellis", timeout: float = 10.0):
        self.nc = nc
        self.prefix = prefix
        self.timeout = timeout

    async def raw(self, subject_tail: str, body: bytes) -> dict[str, Any]:
        msg = await self.nc.request(f"{self.prefix}.{subject_tail}", body, timeout=self.timeout)
        reply: dict[str, Any] = msgspec.json.decode(msg.data)
        return reply

    async def admin(self, domain: str, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.raw(f"admin.{domain}.{verb}", _with_request_id(body))

    async def intent(
        self, domain: str, tenant: str, verb: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        return await self.raw(f"intent.{domain}.{tenant}.{verb}", _with_request_id(body))

    async def query(
        self, domain: str, what: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return await self.raw(f"query.{domain}.{what}", msgspec.json.encode(body or {}))

    async def view(
        self, domain: str, tenant: str, what: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The query `what` as `tenant`'s view: only that tenant's data."""
        return await self.raw(f"view.{domain}.{tenant}.{what}", msgspec.json.encode(body or {}))


def _with_request_id(body: dict[str, Any]) -> bytes:
    """Bodies get a fresh request_id unless the caller chose one (to test resends)."""
    return msgspec.json.encode({"request_id": str(uuid.uuid4()), **body})
