"""The event loop `trellis up` and its follower process run on (adapters/event_loop.py)."""

from __future__ import annotations

import pytest

from trellis.adapters import event_loop
from trellis.adapters.settings import Settings, SettingsError


async def kind() -> str:
    return event_loop.running()


def test_each_kind_of_loop_runs_what_it_is_given() -> None:
    assert event_loop.run(kind(), "uvloop") == "uvloop"
    assert event_loop.run(kind(), "asyncio") == "asyncio"


def test_uvloop_is_the_default_where_it_is_installed_and_asyncio_can_be_chosen() -> None:
    assert event_loop.default() == "uvloop"  # a dependency on every platform Trellis supports
    assert Settings.from_env({}).event_loop == "uvloop"
    assert Settings.from_env({"TRELLIS_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"


def test_without_uvloop_the_default_is_asyncio_and_asking_for_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(event_loop, "default", lambda: "asyncio")
    assert Settings.from_env({}).event_loop == "asyncio"
    with pytest.raises(SettingsError, match="uvloop is not installed"):
        Settings.from_env({"TRELLIS_EVENT_LOOP": "uvloop"})
