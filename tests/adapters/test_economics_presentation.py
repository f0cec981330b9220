"""What a reader of `trellis demo economics` sees first: the assumptions name the model the
figures rest on (weights, KV cache per token, batch, each box kind's HBM headroom) and say that
the token rates are per GPU whatever its kind; the plots draw nothing below a count's zero and
hide no data under their notes."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from trellis.adapters.entrypoints.economics import plots
from trellis.adapters.entrypoints.economics.data import read_hall
from trellis.adapters.entrypoints.economics.figures import Figures, figures
from trellis.adapters.entrypoints.economics.runs import WEIGHTS_GIB, boxes, hbm_headroom
from trellis.adapters.entrypoints.economics.serving import assumptions, assumptions_text
from trellis.adapters.entrypoints.economics.workload import BATCH, KV_MIB_PER_TOKEN, Request


def flat(text: str) -> str:
    """The text with its wrapping undone: one space between words."""
    return " ".join(text.split())


def test_the_assumptions_name_the_model_its_kv_cache_and_each_box_kinds_headroom() -> None:
    hall = read_hall()
    items = {a.what: a for a in assumptions(hall)}
    text = flat(assumptions_text(list(items.values())))

    assert f"model: 70B, fp16, weights {WEIGHTS_GIB:g} (GiB)" in text
    assert f"KV cache per token: {KV_MIB_PER_TOKEN:g} (MiB per token per session)" in text
    assert f"batch: {BATCH} (sessions per request)" in text
    assert f"{KV_MIB_PER_TOKEN * BATCH / 1024:g} GiB per token of context + output" in text

    hbm = {n["id"]: n.get("memory_gib") or 0.0 for n in hall["nodes"]}
    model = {n["id"]: n.get("model") for n in hall["nodes"]}
    kinds = {}
    for gpus in boxes(hall).values():
        kinds[f"{len(gpus)} x {model[gpus[0]]}"] = (gpus, hbm_headroom(gpus, hbm))
    assert len(kinds) >= 2  # the hall's boxes differ: each kind is said
    for kind, (gpus, room) in kinds.items():
        line = f"HBM headroom, {kind} box: {room:,.0f} (GiB for KV cache)"
        assert line in text
        why = items[f"HBM headroom, {kind} box"].why
        tokens = math.floor(room / (KV_MIB_PER_TOKEN * BATCH / 1024))
        assert f"up to {tokens:,} tokens" in why
        assert f"{sum(hbm[g] for g in gpus):,.0f} GiB of HBM" in why


def test_the_assumptions_say_the_token_rates_are_per_gpu_whatever_its_kind() -> None:
    hall = read_hall()
    order = [a.what for a in assumptions(hall)]
    # Beside the rates, not pages away.
    assert order.index("rates by GPU kind") == order.index("decode rate") + 1
    (caveat,) = [a for a in assumptions(hall) if a.what == "rates by GPU kind"]
    prices = {
        n["model"]: n["cost_per_hour"]
        for n in hall["nodes"]
        if n.get("device_kind") == "gpu" and n.get("cost_per_hour") is not None
    }
    cheap, dear = min(prices, key=prices.__getitem__), max(prices, key=prices.__getitem__)
    assert prices[cheap] < prices[dear]
    assert f"{cheap} ${prices[cheap]:.2f} to {dear} ${prices[dear]:.2f}" in caveat.why
    assert "depends on which kinds were picked, not on their speed" in caveat.why


# ---- the plots, drawn off-screen and kept open to be looked at ----

T0 = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)
HALL: dict[str, Any] = {
    "nodes": [
        {"id": "gpu-1", "kind": "device", "device_kind": "gpu", "model": "H100",
         "cost_per_hour": 2.0},
    ]
}  # fmt: skip


def one_run() -> Figures:
    """A run of one request, held 2 s, nothing refused."""
    request = {
        "labels": {"scheduler": "example", "demand": "0"},
        "devices": [{"kind": "gpu", "count": 1}],
        "lease_seconds": 2,
    }
    events = [
        {
            "type": "CompositionRequested",
            "at": T0,
            "position": 0,
            "data": {"request": request, "composition_id": "c0"},
        }
    ]

    def iso(seconds: float) -> str:
        return (T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")

    intervals = [
        {"kind": "gpu", "device": "gpu-1", "start": iso(0), "end": iso(2),
         "cost_per_hour": 2.0, "capacity_gib": None, "composition_id": "c0"},
    ]  # fmt: skip
    return figures(HALL, events, intervals, [Request(0, 0.0, 1024, 100)], [0.1], {0: 0.1})


def drawn(
    pooled: Figures, fixed: Figures, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float
) -> list[Any]:
    """plots.draw's three figures (utilization, latency, refusals), not closed."""
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot

    kept: list[Any] = []
    monkeypatch.setattr(pyplot, "close", kept.append)
    plots.draw(pooled, fixed, tmp_path, (seconds / 2, seconds / 2 + 1), seconds)
    monkeypatch.undo()
    return kept


def test_no_refusals_is_said_plainly_on_a_count_axis_from_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = one_run()
    assert not run.refused
    kept = drawn(run, run, tmp_path, monkeypatch, 2.0)
    refusals = kept[2]
    try:
        (axes,) = refusals.axes
        low, high = axes.get_ylim()
        assert low >= 0 and high > low
        assert all(tick >= 0 for tick in axes.get_yticks() if low <= tick <= high)
        assert "no refusals" in " ".join(t.get_text() for t in axes.texts)
        assert "none" not in [t.get_text() for t in axes.get_xticklabels()]
    finally:
        close(kept)


def close(kept: list[Any]) -> None:
    from matplotlib import pyplot

    for figure in kept:
        pyplot.close(figure)


def test_the_drain_note_hides_no_plotted_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The probe's case: a 10 s run whose fixed pods hold 90-100% of the GPUs from the last
    # arrival at 10.2 s to 11.5 s, right where the note used to sit.
    times = [k / 10 for k in range(0, 121)]
    shares = [0.9 + 0.1 * (10.2 <= t <= 11.5) for t in times]
    fixed = dataclasses.replace(
        one_run(),
        span_s=12.0,
        last_arrival_s=10.2,
        times=times,
        gpus_held_share=shares,
        memory_held_share=[0.0 for _ in times],
        held_steps=[(t, g, 0.0) for t, g in zip(times, shares, strict=True)],
    )
    pooled = dataclasses.replace(
        fixed,
        gpus_held_share=[0.5 for _ in times],
        held_steps=[(t, 0.5, 0.0) for t in times],
    )
    kept = drawn(pooled, fixed, tmp_path, monkeypatch, 10.0)
    utilization = kept[0]
    try:
        gpu = utilization.axes[0]
        (note,) = [t for t in gpu.texts if "last arrival" in t.get_text()]
        assert "drain" in note.get_text()  # it still says why the axis runs past the run
        renderer = utilization.canvas.get_renderer()
        utilization.canvas.draw()
        box = note.get_window_extent(renderer)
        # Wherever a line can be drawn is inside an axes: the note is outside every one.
        for axes in utilization.axes:
            assert not box.overlaps(axes.get_window_extent(renderer)), axes.get_ylabel()
        # And inside the figure, where it is seen.
        assert utilization.bbox.contains(box.x0, box.y0) and utilization.bbox.contains(
            box.x1, box.y1
        )
    finally:
        close(kept)


def test_the_held_plot_draws_the_exact_steps_and_so_the_table_s_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot drew the once-a-second samples: a run whose table said a peak of 100% showed
    86% at most. It draws the history's steps, ending at the span's end."""
    run = dataclasses.replace(
        one_run(),
        times=[0.0, 1.0],
        gpus_held_share=[0.5, 0.5],  # the samples miss the moment both GPUs were held
        held_steps=[(0.0, 0.5, 0.0), (1.2, 1.0, 0.0), (1.6, 0.5, 0.0), (2.0, 0.5, 0.0)],
        gpu_held_peak=100.0,
    )
    kept = drawn(run, run, tmp_path, monkeypatch, 2.0)
    try:
        gpu = kept[0].axes[0]
        for line in gpu.get_lines()[:2]:  # pooled's and fixed's
            assert max(line.get_ydata()) == run.gpu_held_peak
            assert line.get_drawstyle() == "steps-post"
    finally:
        close(kept)
