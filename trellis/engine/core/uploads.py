"""Imports sent in parts: held until the last part is in, then decided once, whole.

A topology can be larger than one request body (NATS's message limit): a 65,536-device hall is
tens of MB. The client (adapters/nats/client.py) sends it as `parts` import-topology bodies
under one request_id, each marked with its `upload` part. The engine that writes the domain
keeps them here, in memory, answers each but the last with its progress, and, once every part
is in, decides the whole document as one import under that request_id, as if it had come in
one body. So an import in parts is all or nothing, and a resend of its parts after it was
decided gets the stored answer (the writer's request ids), like any resend.

Parts held are bounded (in number of uploads, of items, and in time): an upload nobody finishes
is forgotten after TTL_S, and one whose engine stops (or loses the domain) mid-way is lost;
its client sends it again. Pure but for the time, which the caller gives.
"""

from __future__ import annotations

import msgspec

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.intents import MAX_DOMAIN_ITEMS, ImportTopology
from trellis.engine.core.results import UploadProgress

TTL_S = 600.0  # an upload whose last part came this long ago is forgotten
MAX_UPLOADS = 8  # uploads held at once, per engine
# A part that comes again after its upload was assembled (a client resends a part it heard
# nothing for while the import was being decided) gets the assembled import, which the writer
# answers from its stored reply, for this long after the assembly, not a new upload's progress.
# A part that differs from the one assembled is `conflict`, as any request id sent again with
# another body is.
ASSEMBLED_TTL_S = 120.0


class _Assembled(msgspec.Struct):
    parts: dict[int, ImportTopology]  # as they came (their nodes are the import's own objects)
    whole: ImportTopology
    at: float


class _Upload(msgspec.Struct):
    parts: int
    received: dict[int, ImportTopology]
    touched: float
    items: int = 0


class Uploads:
    """The imports in parts an engine holds, by (domain, actor, request_id)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str, str], _Upload] = {}
        # Uploads assembled lately: their parts, the import, and when it was assembled.
        self._assembled: dict[tuple[str, str, str], _Assembled] = {}

    def add(
        self, domain: str, actor: str, intent: ImportTopology, now: float
    ) -> ImportTopology | UploadProgress:
        """Take one part: the whole import once every part is in, else the progress.

        Raises:
            IntentRejected: `invalid` for a part that does not fit its upload (another count of
                parts, a part out of range, too many nodes or links in all); `conflict` for a
                part sent again after the assembly with another body; `unavailable` when too
                many uploads are open.
        """
        assert intent.upload is not None
        part, parts = intent.upload.part, intent.upload.parts
        if part > parts:
            raise IntentRejected("invalid", f"part {part} of {parts}: past the last part")
        self._forget_stale(now)
        key = (domain, actor, intent.request_id)
        done = self._assembled.get(key)
        if done is not None and len(done.parts) == parts:
            if done.parts[part] != intent:
                raise IntentRejected(
                    "conflict",
                    f"request_id {intent.request_id!r} was used for another import: part {part}"
                    " differs from the part first sent",
                    {"request_id": intent.request_id, "part": part},
                )
            return done.whole
        held = self._held.get(key)
        if held is None:
            if len(self._held) >= MAX_UPLOADS:
                raise IntentRejected(
                    "unavailable",
                    f"{MAX_UPLOADS} imports in parts are open already; send this one again later",
                )
            held = self._held[key] = _Upload(parts=parts, received={}, touched=now)
        if held.parts != parts:
            raise IntentRejected(
                "invalid",
                f"part {part} says {parts} parts; request_id {intent.request_id!r} was sent in "
                f"{held.parts}",
            )
        replaced = held.received.get(part)
        held.items += len(intent.nodes) + len(intent.links)
        held.items -= len(replaced.nodes) + len(replaced.links) if replaced else 0
        if held.items > 2 * MAX_DOMAIN_ITEMS:
            del self._held[key]
            raise IntentRejected(
                "invalid",
                f"an import of over {MAX_DOMAIN_ITEMS:,} nodes and as many links is more than a "
                "domain may hold",
            )
        held.received[part] = intent
        held.touched = now
        if len(held.received) < parts:
            return UploadProgress(part=part, parts=parts, received=len(held.received))
        del self._held[key]
        ordered = [held.received[i] for i in range(1, parts + 1)]
        nodes = [n for p in ordered for n in p.nodes]
        links = [lk for p in ordered for lk in p.links]
        if len(nodes) > MAX_DOMAIN_ITEMS or len(links) > MAX_DOMAIN_ITEMS:
            raise IntentRejected(
                "invalid", f"a domain holds at most {MAX_DOMAIN_ITEMS:,} nodes and as many links"
            )
        assembled = ImportTopology(
            request_id=intent.request_id,
            nodes=nodes,
            links=links,
            reason=next((p.reason for p in ordered if p.reason), ""),
        )
        if len(self._assembled) >= MAX_UPLOADS:
            del self._assembled[min(self._assembled, key=lambda k: self._assembled[k].at)]
        self._assembled[key] = _Assembled(held.received, assembled, now)
        return assembled

    def _forget_stale(self, now: float) -> None:
        for key in [k for k, u in self._held.items() if now - u.touched > TTL_S]:
            del self._held[key]
        for key in [k for k, a in self._assembled.items() if now - a.at > ASSEMBLED_TTL_S]:
            del self._assembled[key]
