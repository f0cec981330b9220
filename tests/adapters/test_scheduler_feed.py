"""The example scheduler's reading of the bucket and the stream (examples/scheduler.py): what is
not the contract's is skipped and counted, never a reason to stop (ARCHITECTURE §3)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec

from trellis.adapters.entrypoints.economics.data import example_scheduler

scheduler_module = example_scheduler()
DEVICE = {"kind": "gpu", "model": "H100", "health": "healthy", "free": True, "position": 3}


def entry(key: str, value: bytes, operation: str | None = None) -> Any:
    return SimpleNamespace(key=key, value=value, operation=operation)


def scheduler() -> Any:
    return scheduler_module.Scheduler(None, domain="d", tenant="acme")


def test_a_foreign_bucket_value_is_skipped_and_counted_and_the_view_goes_on() -> None:
    s = scheduler()
    value = msgspec.json.encode(DEVICE)
    s._on_entry(entry("d.device.gpu-1", value))
    for key, body in [
        ("d.device.gpu-2", b"garbage"),
        ("d.nonsense", b"{}"),
        ("d.composition.c-1", b'{"ok": true}'),
    ]:
        s._on_entry(entry(key, body))
    s._on_entry(entry("d.device.gpu-3", value))
    assert s.counts["foreign"] == 3
    assert sorted(s.view.devices) == ["gpu-1", "gpu-3"]


def test_a_foreign_stream_message_is_skipped_and_counted() -> None:
    s = scheduler()
    msg = SimpleNamespace(
        data=b'{"ok":true,"result":{}}',
        metadata=SimpleNamespace(sequence=SimpleNamespace(stream=7)),
    )
    asyncio.run(s._on_event(msg))
    assert s.counts["foreign"] == 1
