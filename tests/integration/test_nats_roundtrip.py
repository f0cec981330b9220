"""A round trip through a hung NATS server gives up, and costs the connection nothing once the
server answers again (adapters/nats/roundtrip.py: nats-py's flush(timeout) left a cancelled
PONG future whose late PONG ended the client's read loop)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import nats
from nats.aio.msg import Msg

from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.nats.roundtrip import RoundTrip, server_has_read


async def test_a_round_trip_through_a_hung_server_gives_up_and_leaves_the_connection_whole(
    tmp_path: Path,
) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    nc = await nats.connect(server.url, ping_interval=60)
    try:
        await server_has_read(nc, 2.0)
        echo = RoundTrip(nc)
        assert await echo(2.0)

        async def answer(msg: Msg) -> None:
            await msg.respond(b"pong:" + msg.data)

        await nc.subscribe("roundtrip.answer", cb=answer)
        pid = int(server.pid_path.read_text())
        os.kill(pid, signal.SIGSTOP)
        try:
            assert not await echo(0.3)  # its late echo must find nobody waiting
            try:
                await server_has_read(nc, 0.3)
            except TimeoutError as exc:
                assert str(exc) == "the NATS server did not answer within 0.3 s"
            else:
                raise AssertionError("a hung server was said to have read everything")
        finally:
            os.kill(pid, signal.SIGCONT)
        # The late echoes arrive now; the read loop must live through them and carry answers.
        reply = await nc.request("roundtrip.answer", b"1", timeout=5)
        assert reply.data == b"pong:1"
        assert await echo(2.0)
        await echo.close()
        assert nc.is_connected
    finally:
        await nc.close()
        server.stop()
