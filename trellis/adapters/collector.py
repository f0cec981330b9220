"""Python's cyclic garbage collector, set for a process that serves for a long time.

Reference counting frees almost everything the engine makes: each event's state replaces the
last, an intent's messages and structs go with its answer. What survives two young collections
(the state of the moment) is promoted to the oldest generation, and at CPython's defaults a
full collection of every live object then ran every few seconds under load: 80-110 ms with the
event loop stopped, every intent waiting, and nothing collected (bench/intents.py, 64
clients). Two settings, once the process has started:

- `gc.freeze()`: what start-up built (modules, the servers' clients, the domains' state as
  loaded) is never scanned again; it is still freed by reference counting.
- Higher thresholds: a young collection every 10,000 net allocations instead of 700, a full
  one at most every 10 million instead of 70,000 (and, as before, only once a quarter of the
  old generation is new). A cycle (an exception's traceback, say) waits longer to be freed,
  which costs little memory next to a loop that stops.
"""

from __future__ import annotations

import gc

THRESHOLDS = (10_000, 20, 50)  # young, then middle and full collections per collection below


def settle_for_serving() -> None:
    """Freeze what start-up made and make collections rarer (see the module's text); once,
    when the process serves."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
