"""The event loop the long-running processes run on: `trellis up` (the engine) and its follower
process.

uvloop (libuv, the loop asyncpg's authors wrote beside it) where it is installed, which is a
dependency on every platform Trellis supports; asyncio's own loop when TRELLIS_EVENT_LOOP says
`asyncio`, or when uvloop is missing. The follower process runs on the engine's kind of loop.
What uvloop pays, measured in bench/intents.py (docs/benchmarks.md, "The event loop"): under
load (8 and 64 clients) 4-5% less CPU per compose+release pair and 2% more pairs a second;
with one client no CPU saved, and the compose p50 about 0.1 ms higher.
Short commands (the CLI's requests, the demos) stay on asyncio: they start a loop once.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar, get_args

EventLoopName = Literal["uvloop", "asyncio"]
EVENT_LOOPS: tuple[str, ...] = get_args(EventLoopName)

T = TypeVar("T")


def default() -> EventLoopName:
    """uvloop when it can be imported, else asyncio's."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run(main: Coroutine[Any, Any, T], loop: EventLoopName) -> T:
    """Run `main` to its end on a new event loop of the kind named, as asyncio.run does."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running() -> EventLoopName:
    """The kind of the event loop this code runs on."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.partition(".")[0] == "uvloop" else "asyncio"
