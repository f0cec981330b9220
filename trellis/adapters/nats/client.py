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
