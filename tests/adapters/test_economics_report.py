"""The economics demo's pure parts: repairs told from recoveries, the storm's first refusal,
percentiles, and the progress view (live.py) in both its forms."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from trellis.adapters.entrypoints.economics import live
from trellis.adapters.entrypoints.economics.figures import mended, percentile, storm_refusal
from trellis.adapters.entrypoints.economics.runs import Plan, Run


def event(type: str, position: int = 0, **data: Any) -> dict[str, Any]:
    return {"type": type, "at": None, "position": position, "data": data}


def test_a_composition_moved_off_its_fault_is_repaired_one_that_waited_recovered() -> None:
    events = [
        event("CompositionImpaired", composition_id="moved", component="tray-1"),
        event("DeviceReplaced", composition_id="moved"),
        event("CompositionActivated", composition_id="moved"),
        event("CompositionImpaired", composition_id="waited", component="tray-1"),
        event("CompositionActivated", composition_id="waited"),
        event("CompositionActivated", composition_id="never-impaired"),
        event("CompositionImpaired", composition_id="still", component="tray-1"),
        event("PathRerouted", composition_id="still"),
    ]
    assert mended(events) == ({"moved"}, {"waited"})


def test_the_storms_first_refusal_is_the_first_one_while_something_is_faulted() -> None:
    refused = {"code": "no_path", "message": "no path", "details": {"funnel": {"gpu": 3}}}
    events = [
        event("CompositionRejected", 1, code="no_capacity", message="before"),
        event("ComponentFaulted", 2, component="tray-1", state="failed"),
        event("CompositionRejected", 3, **refused),
        event("CompositionRejected", 4, code="no_path", message="later"),
    ]
    assert storm_refusal(events) == {
        "position": 3,
        "code": "no_path",
        "message": "no path",
        "funnel": {"gpu": 3},
    }
    healed = [*events[:2], event("ComponentRecovered", 3, component="tray-1"), events[0]]
    assert storm_refusal(healed) is None


def test_percentiles_are_nearest_rank_in_milliseconds() -> None:
    seconds = [k / 1000 for k in range(1, 101)]  # 1 .. 100 ms
    assert percentile(seconds, 50) == pytest.approx(50)
    assert percentile(seconds, 99) == pytest.approx(99)
    assert percentile(seconds, 99.9) == pytest.approx(100)
    assert percentile([], 99) == 0.0


def a_run_in_the_storm() -> Run:
    run = Run("pooled", "econ-pooled-x", stage="storm", gpus=128, gpus_held=40)
    run.counts.update(sent=30, composed=28, refused=2)
    run.struck = ["tray-host-r1-1", "ocs-2:1"]
    return run


def test_the_plain_progress_line_says_where_a_run_is() -> None:
    text = live.line(a_run_in_the_storm(), Plan(seconds=20, requests=50))
    assert text.startswith("pooled: storm, ")
    assert "composes 30 (28 composed, 2 refused)" in text
    assert "GPUs held 40/128" in text and "storm: tray-host-r1-1 ocs-2:1" in text


def test_the_live_table_shows_each_run_and_the_storm() -> None:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120, record=True)
    idle = Run("fixed", "econ-fixed-x")
    console.print(live.status_table([a_run_in_the_storm(), idle], Plan(seconds=20, requests=50)))
    text = console.export_text()
    assert "50 requests over 20 s" in text
    assert "storm: tray-host-r1-1" in text and "40/128" in text
    assert "fixed" in text and "waiting" in text


async def test_plain_progress_prints_running_runs_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "PLAIN_EVERY_S", 0.01)
    runs = [a_run_in_the_storm(), Run("fixed", "econ-fixed-x")]
    async with live.progress(runs, Plan(seconds=20, requests=50), "lines"):
        await asyncio.sleep(0.05)
    out = capsys.readouterr().out
    assert "pooled: storm" in out and "fixed:" not in out
