"""A message through the NATS server and back to this connection: proof that the server has
read everything sent before it (subscriptions included) and answers now.

Not nats-py's `flush()`: when its wait ends early (a timeout, or the caller cancelled) it
cancels its PONG future but leaves it queued, and the late PONG then ends the client's read
loop (InvalidStateError), cutting the process off NATS for minutes after a stall of seconds.
An echo through an inbox uses no future of nats-py's: a late echo finds nobody waiting and is
dropped.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class RoundTrip:
    """Echoes through one inbox of `nc`, subscribed at the first use; `close` unsubscribes."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._sub: Subscription | None = None
        self._waiting: dict[bytes, asyncio.Future[None]] = {}
        self._sent = 0

    async def __call__(self, timeout: float) -> bool:
        """Whether an echo came back within `timeout` seconds. A publish the connection
        refuses (it is closing, or its buffer is full) raises as nats-py raised it."""
        if self._sub is None:
            self._sub = await self._nc.subscribe(self._nc.new_inbox(), cb=self._echoed)
        self._sent += 1
        token = str(self._sent).encode()
        echoed = asyncio.get_running_loop().create_future()
        self._waiting[token] = echoed
        try:
            await self._nc.publish(self._sub.subject, token)
            await asyncio.wait({echoed}, timeout=timeout)
        finally:
            self._waiting.pop(token, None)
        return echoed.done()

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _echoed(self, msg: Msg) -> None:
        waiting = self._waiting.get(msg.data)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)


async def server_has_read(nc: NATS, timeout: float) -> None:
    """Wait until the server has read all `nc` sent so far; TimeoutError after `timeout`."""
    echo = RoundTrip(nc)
    try:
        if not await echo(timeout):
            raise TimeoutError(f"the NATS server did not answer within {timeout:g} s")
    finally:
        await echo.close()
