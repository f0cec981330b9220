"""The economics demo's pure parts: repairs told from recoveries, the storm's first refusal,
percentiles, and the progress view (live.py) in both its forms."""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from typing import Any

import pytest

from trellis.adapters.entrypoints.economics import live
from trellis.adapters.entrypoints.economics.figures import (
    PERCENTILES,
    Figures,
    comparison,
    mended,
    percentile,
    storm_refusal,
    supported,
)
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


def test_a_percentile_is_shown_only_when_its_sample_count_supports_it() -> None:
    # 40 composes cannot tell a p99 or a p99.9 from their maximum (issue 26 item 6).
    assert [q for q in PERCENTILES if supported(q, 40)] == [50.0, 90.0]
    assert [q for q in PERCENTILES if supported(q, 100)] == [50.0, 90.0, 99.0]
    assert [q for q in PERCENTILES if supported(q, 1000)] == list(PERCENTILES)


def test_the_comparison_names_what_was_held_and_prints_no_infinite_ratio() -> None:
    def run(gpu_util: list[float], refused: int, latencies: int) -> Figures:
        ordered = [0.01] * latencies
        return Figures(
            requests=10, served=10 - refused, refused=Counter(quota=refused),
            gpu_util=gpu_util, memory_util=[0.0], gpu_seconds=1.0, idle_gpu_seconds=0.0,
            free_gpus_memory_full=0.0, free_gib_gpus_full=0.0, billed=1.0, hall_cost=2.0,
            impaired=0, repaired=0, recovered=0,
            p99_ms=percentile(ordered, 99) if supported(99, latencies) else None,
            latency_ms={},
        )  # fmt: skip

    text = comparison(run([0.5], refused=3, latencies=40), run([0.9], refused=0, latencies=40))
    assert "GPU utilization" not in text and "GPUs held, mean % of the hall's" in text
    assert "inf" not in text
    (refused,) = [line for line in text.splitlines() if line.startswith("refused ")]
    assert refused.split()[-1] == "-"  # 3 against 0: no ratio
    (p99,) = [line for line in text.splitlines() if line.startswith("p99 compose")]
    assert p99.split()[-3:] == ["-", "-", "-"]  # 40 composes tell no p99
