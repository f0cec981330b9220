"""The event loop `trellis up` and its follower process run on (adapters/event_loop.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trellis.adapters import event_loop
from trellis.adapters.follow_process import follower_env
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


def test_the_follower_process_is_told_its_engines_kind_of_loop(tmp_path: Path) -> None:
    def env(loop: str) -> dict[str, str]:
        return follower_env(
            nats_url="nats://127.0.0.1:4222",
            database_url="postgresql://nobody@127.0.0.1/nowhere",
            schema=None,
            prefix="trellis",
            checkpoint_key=str(tmp_path / "checkpoint-key.pem"),
            checkpoint_every=1000,
            snapshot_every=0,
            stream_limits=(1 << 20, 60.0, 1, 3600),
            secure_data_dir=None,
            event_loop=loop,
        )

    for loop in event_loop.EVENT_LOOPS:
        assert Settings.from_env(env(loop)).event_loop == loop
