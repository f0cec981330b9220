"""A compose is answered once its fabric saga has settled it.

The writer's reply to a compose says `pending`: the devices are reserved, the fabric not yet
programmed. The composer is told the outcome instead: the composition is active (or
impaired), or it failed and says what failed. A resend gets the same answer, from the stored
reply of the settlement.
"""

from __future__ import annotations

import asyncio

import msgspec

from trellis.engine.core import replies
from trellis.engine.core.actors import ENGINE
from trellis.engine.core.intents import settle_request_id
from trellis.engine.service.custody import Served
from trellis.engine.service.ports import EventStore


class _ComposeOutcome(msgspec.Struct):
    composition_id: str
    state: str


_decode_outcome = msgspec.json.Decoder(_ComposeOutcome).decode


async def once_settled(store: EventStore, served: Served, reply: bytes, wait_s: float) -> bytes:
    """The answer to a compose whose writer's reply is `reply`: the settlement's, waited for
    at most `wait_s` (then `unavailable`: ask again with the same request id)."""
    accepted = replies.decode_ok(reply)
    if accepted is None:
        return reply  # refused, or recorded as rejected: nothing to wait for
    outcome = _decode_outcome(accepted.result)
    if outcome.state != "pending":
        return reply
    cid = outcome.composition_id
    writer = served.writer
    composition = writer.state.compositions.get(cid)
    if composition is not None and composition.state == "pending":
        waiting = served.sync.settlement(cid)
        try:
            # A timer on this task, not wait_for's future and callbacks: one per compose.
            async with asyncio.timeout(wait_s):
                settled = await asyncio.shield(waiting)
        except TimeoutError:
            return replies.error(
                "unavailable",
                f"composition {cid} is still being established; ask again with the same request_id",
                {"composition_id": cid},
            )
    else:
        key = (ENGINE, settle_request_id(cid))
        stored = (await store.find_replies(writer.domain, [key])).get(key)
        if stored is None:
            return reply  # cannot happen: a composition leaves pending only by settling
        await store.barrier()  # read back from the log: durable before it is an answer
        settled = stored.reply
    return replies.as_replayed(settled) if accepted.replayed else settled
