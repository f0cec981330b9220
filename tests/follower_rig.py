"""What the follower-process tests share: an environment naming servers nobody runs (the
follower waits for them), and a poll until something holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from trellis.adapters.embedded.process import free_port
from trellis.adapters.follow_process import follower_env


def unreachable_follower_env(
    tmp_path: Path, event_loop: str = "asyncio", gather_s: float = 0.05
) -> dict[str, str]:
    """A follower process's environment naming servers nobody runs: it waits for them."""
    return follower_env(
        nats_url=f"nats://127.0.0.1:{free_port()}",
        database_url=f"postgresql://nobody@127.0.0.1:{free_port()}/nowhere",
        schema=None,
        prefix="nowhere",
        checkpoint_key=str(tmp_path / "checkpoint-key.pem"),
        checkpoint_every=1000,
        snapshot_every=0,
        stream_limits=(1 << 20, 60.0, 1, 3600),
        secure_data_dir=None,
        event_loop=event_loop,
        gather_s=gather_s,
    )


async def until(what: str, check: Callable[[], bool], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)
