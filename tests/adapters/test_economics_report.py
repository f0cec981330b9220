"""The economics demo's pure parts: repairs told from recoveries, the storm's first refusal,
percentiles, the seeds' units (TTFT, TPOT, GPU-hours, $ per million tokens) from hand-made logs
checked against arithmetic done by hand, the report's assumptions, and the progress view
(live.py) in both its forms."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import re
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from trellis.adapters.entrypoints.economics import demo, live, plots
from trellis.adapters.entrypoints.economics.data import read_hall
from trellis.adapters.entrypoints.economics.figures import (
    PERCENTILES,
    Figures,
    comparison,
    figures,
    mended,
    percentile,
    served_by_model,
    sparkline,
    storm_refusal,
    supported,
)
from trellis.adapters.entrypoints.economics.runs import (
    Plan,
    Run,
    Why,
    best_box,
    box_body,
    boxes,
    demand,
    hbm_headroom,
)
from trellis.adapters.entrypoints.economics.serving import (
    Served,
    assumptions,
    decoding,
    per_million_tokens,
    tpot,
    ttft,
)
from trellis.adapters.entrypoints.economics.workload import (
    PREFILL_SECONDS,
    Request,
    TraceRow,
    compress,
)
from trellis.adapters.settings import Settings


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
        "then_composed": False,
    }
    healed = [*events[:2], event("ComponentRecovered", 3, component="tray-1"), events[0]]
    assert storm_refusal(healed) is None
    # A fixed request one box refused, composed on the next: the refusal says so.
    box = {"labels": {"scheduler": "fixed-pods", "demand": "7"}, "devices": []}
    tried = [
        events[1],
        event("CompositionRejected", 3, request=box, **refused),
        event("CompositionRequested", 4, request=box, composition_id="c7"),
    ]
    assert storm_refusal(tried)["then_composed"] is True  # type: ignore[index]
    other = {"labels": {"scheduler": "fixed-pods", "demand": "8"}, "devices": []}
    tried[2] = event("CompositionRequested", 4, request=other, composition_id="c8")
    assert storm_refusal(tried)["then_composed"] is False  # type: ignore[index]


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


# ---- the seeds' units, on hand-made logs: every expected value is worked out by hand ----

T0 = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)

# Two GPUs at $2 an hour and a 100 GiB pool at $0.50: small enough to bill by hand.
HALL: dict[str, Any] = {
    "nodes": [
        {"id": "gpu-1", "kind": "device", "device_kind": "gpu", "model": "H100",
         "cost_per_hour": 2.0},
        {"id": "gpu-2", "kind": "device", "device_kind": "gpu", "model": "H100",
         "cost_per_hour": 2.0},
        {"id": "mem-1", "kind": "device", "device_kind": "memory", "model": "CXL",
         "capacity_gib": 100.0, "cost_per_hour": 0.5},
    ]
}  # fmt: skip


def asked(
    type: str,
    number: int,
    gpus: int,
    scheduler: str,
    at: float,
    lease: int | None = None,
    labels: dict[str, str] | None = None,
    **data: Any,
) -> Any:
    """A CompositionRequested (of composition c<number>) or CompositionRejected event."""
    request = {
        "labels": {"scheduler": scheduler, "demand": str(number), **(labels or {})},
        "devices": [{"kind": "gpu", "count": gpus}],
        "lease_seconds": lease,
    }
    if type == "CompositionRequested":
        data["composition_id"] = f"c{number}"
    when = T0 + timedelta(seconds=at)
    return {"type": type, "at": when, "position": 0, "data": {"request": request, **data}}


def held(
    kind: str, start: float, end: float, price: float, gib: float | None = None, cid: str = "c0"
) -> Any:
    """A history interval: a GPU of the hall's, or a slice of `gib` of its pool."""

    def iso(seconds: float) -> str:
        return (T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")

    device = "mem-1" if kind == "memory" else "gpu-1"
    return {"kind": kind, "device": device, "start": iso(start), "end": iso(end),
            "cost_per_hour": price, "capacity_gib": gib, "composition_id": cid}  # fmt: skip


def fixed_run() -> tuple[Figures, list[Any]]:
    """Requests 0 and 1 get a one-GPU box each, for an hour and for half an hour; request 2
    finds none free."""
    demand = [Request(0, 0.0, 1024, 100), Request(1, 0.5, 2048, 300), Request(2, 1.0, 300, 10)]
    events = [
        asked("CompositionRequested", 0, 1, "fixed-pods", 0.0, 3600,
              {"need_gpu_seconds": "900"}),
        asked("CompositionRequested", 1, 1, "fixed-pods", 0.5, 1800,
              {"need_gpu_seconds": "1800"}),
        asked("CompositionRejected", 2, 1, "fixed-pods", 1.0, code="no_capacity",
              message="no box", details={"entry": 0}),
    ]  # fmt: skip
    intervals = [held("gpu", 0, 3600, 2.0, cid="c0"), held("gpu", 0, 1800, 2.0, cid="c1")]
    waits = {0: 0.5, 1: 0.25}
    got = figures(HALL, events, intervals, demand, latencies=[0.5, 0.25, 0.1], waits=waits)
    return got, events


def pooled_run() -> tuple[Figures, list[Any]]:
    """Request 0: a prefill on both GPUs for 1 s, then a decode on one GPU and 50 GiB of the
    pool for 2 s. Request 1, a second later: a prefill on the other GPU, then a decode on it
    with 50 GiB, for 2 s. Each held as long as its lease asked."""
    demand = [Request(0, 0.0, 2048, 50), Request(1, 1.0, 1024, 100)]
    events = [
        asked("CompositionRequested", 0, 2, "example", 0.0, 1),
        asked("CompositionRequested", 1, 1, "example", 1.0, 2),
        asked("CompositionRequested", 2, 1, "example", 1.0, 1),
        asked("CompositionRequested", 3, 1, "example", 2.0, 2),
    ]
    intervals = [
        held("gpu", 0, 1, 2.0, cid="c0"),
        held("gpu", 0, 1, 2.0, cid="c0"),
        held("gpu", 1, 3, 2.0, cid="c1"),
        held("memory", 1, 3, 0.5, gib=50.0, cid="c1"),
        held("gpu", 1, 2, 2.0, cid="c2"),
        held("gpu", 2, 4, 2.0, cid="c3"),
        held("memory", 2, 4, 0.5, gib=50.0, cid="c3"),
    ]
    waits = {0: 0.1, 1: 0.05, 2: 0.2, 3: 0.0}
    got = figures(HALL, events, intervals, demand, latencies=[0.1, 0.05, 0.2, 0.0], waits=waits)
    return got, events


def test_ttft_is_the_wait_plus_the_prefill_and_tpot_the_decode_per_token() -> None:
    # Pooled: 2,048 tokens on 2 GPUs at 1,024 tokens/s each is 1 s, after a 0.1 s wait;
    # 50 tokens on 1 GPU at 100 tokens/s is 0.5 s, after a 0.05 s wait: 0.55 s / 50.
    pooled = Served(2048, 50, prefill_wait_s=0.1, prefill_gpus=2, decode_wait_s=0.05,
                    decode_gpus=1)  # fmt: skip
    assert ttft(pooled) == pytest.approx(1.1)
    assert tpot(pooled) == pytest.approx(0.011)
    # A box: 8 GPUs for both, 8,192 tokens/s of prefill and 800 of decode, no second wait.
    box = Served(2048, 50, prefill_wait_s=0.2, prefill_gpus=8, decode_wait_s=0.0, decode_gpus=8)
    assert ttft(box) == pytest.approx(0.45)
    assert tpot(box) == pytest.approx(0.00125)


def test_each_arm_leases_its_decode_for_as_long_as_the_serving_model_says_it_takes() -> None:
    # One rate per arm: a lease holds a decode for the time the model's TPOT counts (on the
    # GPUs that decode gets: a box's 8, pooled's 1), a second more, rounded up to whole seconds.
    hall = read_hall()
    hbm = {n["id"]: n.get("memory_gib") or 0.0 for n in hall["nodes"]}
    for box, gpus in boxes(hall).items():
        for request in demand(Plan(seconds=45, requests=400)):
            body = box_body(request, box, gpus, hbm)
            held = body["lease_seconds"] - PREFILL_SECONDS
            taking = decoding(request.generated_tokens, body["devices"][0]["count"])
            assert 0 <= held - 1 - taking < 1, (box, request)
    for request in demand(Plan(seconds=45, requests=400)):
        assert 0 <= request.decode_seconds - 1 - decoding(request.generated_tokens, 1) < 1


def test_a_fixed_request_tries_a_box_whose_hbm_holds_its_kv_cache_first() -> None:
    hall = read_hall()
    hbm = {n["id"]: n.get("memory_gib") or 0.0 for n in hall["nodes"]}
    pods = boxes(hall)
    # An H100 box holds 8 x 80 - 140 = 500 GiB of KV cache, an MI300X box 8 x 192 - 140.
    assert hbm_headroom(pods["host-r1-1"], hbm) == 500.0
    big = Request(0, 0.0, 7000, 100)  # 7,100 tokens: 555 GiB
    small = Request(1, 0.0, 1000, 100)
    assert big.decode_gib > 500 > small.decode_gib
    free = {*pods["host-r1-1"], *pods["host-r5-1"][:2], *pods["host-r6-1"][:1]}
    assert best_box(small, pods, hbm, free, set(), set()) == "host-r1-1"  # the most free GPUs
    assert best_box(big, pods, hbm, free, set(), set()) == "host-r5-1"  # the most that fit
    assert best_box(big, pods, hbm, free, set(), {"host-r5-1"}) == "host-r6-1"  # cut off
    assert best_box(big, pods, hbm, free, {"host-r5-1"}, set()) == "host-r6-1"  # tried
    # Only when every box that fits was tried does one that cannot hold it come up.
    fitting = {b for b, gpus in pods.items() if hbm_headroom(gpus, hbm) >= big.decode_gib}
    assert best_box(big, pods, hbm, free, fitting, set()) == "host-r1-1"


def test_cost_per_million_tokens_is_dollars_over_millions_of_tokens_never_over_none() -> None:
    assert per_million_tokens(3.0, 1_500_000) == pytest.approx(2.0)
    assert per_million_tokens(3.0, 0) is None


def test_the_model_takes_each_phase_s_gpus_and_wait_and_skips_what_was_not_measured() -> None:
    demand = [Request(0, 0.0, 2048, 50), Request(1, 1.0, 100, 10), Request(2, 2.0, 100, 10)]
    gpus = {0: 2, 1: 1, 2: 1, 3: 1, 4: 1}
    waits = {0: 0.1, 1: 0.05, 2: 0.2}  # request 1's decode reply was never seen
    assert served_by_model(demand, {0, 1}, True, gpus, waits) == [Served(2048, 50, 0.1, 2, 0.05, 1)]
    # Fixed: one compose per request, numbered as the request; the decode waits for nothing.
    assert served_by_model(demand[:1], {0}, False, {0: 8}, {0: 0.3}) == [
        Served(2048, 50, 0.3, 8, 0.0, 8)
    ]


def test_a_fixed_run_s_figures_by_hand() -> None:
    got, _ = fixed_run()
    assert (got.requests, got.served, got.refused) == (3, 2, Counter({"no_capacity (gpu)": 1}))
    assert got.tokens_served == (1024 + 100) + (2048 + 300)  # context and generated, served
    assert got.gpu_seconds == pytest.approx(3600 + 1800)
    assert got.gpu_hours == pytest.approx(1.5)
    assert got.billed == pytest.approx(1.5 * 2.0)  # GPU-hours at $2
    assert got.hall_cost == pytest.approx(2.0 + 2.0 + 0.5)  # the whole hall for the hour
    assert got.billed_per_million_tokens == pytest.approx(3.0 / 0.003472)
    assert got.hall_per_million_tokens == pytest.approx(4.5 / 0.003472)
    assert got.billed_per_served == pytest.approx(1.5)
    # Box 0 held its GPU an hour for 900 GPU-seconds of work; box 1 needed all it held.
    assert got.idle_gpu_seconds == pytest.approx(2700)
    # Both GPUs held the first half hour, one the second.
    assert (got.gpu_held_mean, got.gpu_held_peak, got.memory_held_mean) == (75.0, 100.0, 0.0)
    # TTFT: 0.5 s + 1,024 tokens at 1,024/s = 1.5 s; 0.25 s + 2,048 at 1,024/s = 2.25 s; the
    # nearest-rank p50 of two is the lower. TPOT: 100 tokens at 100/s, 300 at 100/s: 10 ms.
    assert got.ttft_ms == {"p50": pytest.approx(1500)}
    assert got.tpot_ms == {"p50": pytest.approx(10)}


def test_the_held_figures_are_exact_steps_not_samples() -> None:
    """The run samples the shares about once a second for its sparklines; the figures must
    not: a moment both GPUs were held between two samples is the peak, the mean is the
    GPU-seconds over the hall's GPUs and the span, and 'while GPUs >= 90% held' counts that
    moment's free GiB, weighted by how long it lasted."""
    demand = [Request(0, 0.0, 1024, 100), Request(1, 1.2, 1024, 100)]
    events = [
        asked("CompositionRequested", 0, 1, "fixed-pods", 0.0, 4),
        asked("CompositionRequested", 1, 1, "fixed-pods", 1.2, 1),
    ]
    intervals = [
        held("gpu", 0, 4, 2.0, cid="c0"),
        held("gpu", 1.2, 1.6, 2.0, cid="c1"),  # between the samples at 1 s and 2 s
        held("memory", 1.2, 1.6, 0.5, gib=25.0, cid="c1"),
    ]
    got = figures(HALL, events, intervals, demand, latencies=[0.1, 0.1], waits={0: 0.1, 1: 0.1})
    assert max(got.gpus_held_share) == 0.5  # the samples never see both held
    assert got.gpu_held_peak == 100.0
    assert got.held_steps == [
        (0.0, 0.5, 0.0),
        (pytest.approx(1.2), 1.0, 0.25),
        (pytest.approx(1.6), 0.5, 0.0),
        (pytest.approx(4.0), 0.0, 0.0),  # the span's end: the last lease has run out
    ]
    assert got.gpu_held_mean == pytest.approx(100 * got.gpu_seconds / (2 * got.span_s))
    assert got.free_gib_gpus_full == pytest.approx(75.0)  # 100 GiB, 25 of them held then
    assert got.memory_held_mean == pytest.approx(100 * (25 * 0.4) / (100 * 4))


def test_a_pooled_run_s_figures_by_hand() -> None:
    got, _ = pooled_run()
    assert (got.served, got.tokens_served) == (2, (2048 + 50) + (1024 + 100))
    assert got.gpu_seconds == pytest.approx(2 * 1 + 2 + 1 + 2)
    assert got.gpu_hours == pytest.approx(7 / 3600)
    # GPU-hours at $2; each decode's 50 GiB slice of the 100 GiB pool pays half its $0.50.
    billed = 7 / 3600 * 2.0 + 4 / 3600 * 0.5 * 50 / 100
    assert got.billed == pytest.approx(billed)
    assert got.billed_per_million_tokens == pytest.approx(billed / (3222 / 1e6))
    assert got.span_s == pytest.approx(4.0)
    assert got.times == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert got.gpus_held_share == pytest.approx([1.0, 1.0, 1.0, 0.5])
    assert got.memory_held_share == pytest.approx([0.0, 0.5, 1.0, 0.5])
    assert got.idle_gpu_seconds == 0  # every phase held what its lease asked, no longer
    # TTFT: 0.1 s + 2,048 tokens on 2 GPUs at 1,024/s = 1.1 s; 0.2 s + 1,024 on 1 = 1.2 s.
    # TPOT: (0.05 s + 50 tokens at 100/s) / 50 = 11 ms; (0 + 100 at 100/s) / 100 = 10 ms.
    assert got.ttft_ms == {"p50": pytest.approx(1100)}
    assert got.tpot_ms == {"p50": pytest.approx(10)}


def test_a_memory_slice_pays_its_share_of_the_pool_never_more_than_the_pool_costs() -> None:
    # Four decodes hold 25 GiB each of the 100 GiB pool for the whole 2 s span: the pool, whole,
    # for 2 s. Billed at the pool's full price each, they would cost four pools.
    events = [asked("CompositionRequested", n, 1, "example", 0.0, 2) for n in range(4)]
    intervals = [held("memory", 0, 2, 0.5, gib=25.0, cid=f"c{n}") for n in range(4)]
    got = figures(HALL, events, intervals, [], [], {})
    assert got.billed_by_kind == {"memory": pytest.approx(2 / 3600 * 0.5)}
    assert got.hall_cost_by_kind["memory"] == pytest.approx(2 / 3600 * 0.5)
    # What a run held never costs more than the hall's devices of that kind over its span.
    for run in (got, pooled_run()[0], fixed_run()[0]):
        for kind, dollars in run.billed_by_kind.items():
            assert dollars <= run.hall_cost_by_kind[kind] * (1 + 1e-9)
        assert run.billed == pytest.approx(sum(run.billed_by_kind.values()))
        assert run.hall_cost == pytest.approx(sum(run.hall_cost_by_kind.values()))


def test_served_says_how_many_a_release_cut_short_in_the_table_the_json_and_the_assumptions(
    tmp_path: Path,
) -> None:
    # Request 0's decode (c1) ran out its lease; request 1's (c3) was released 1 s into its
    # 2 s lease by the scheduler's policy: served, and cut short.
    got, events = pooled_run()
    assert (got.served_cut_short, got.tokens_cut_short) == (0, 0)
    ended = [
        event("LeaseExpired", composition_id="c1"),
        event("CompositionReleased", composition_id="c1", reason="lease expired"),
        event("CompositionReleased", composition_id="c3", reason="impaired, not repaired"),
    ]
    intervals = [held("gpu", 0, 1, 2.0, cid="c0"), held("gpu", 2, 3, 2.0, cid="c3")]
    demand = [Request(0, 0.0, 2048, 50), Request(1, 1.0, 1024, 100)]
    cut = figures(HALL, [*events, *ended], intervals, demand, [], {})
    assert (cut.served, cut.served_cut_short, cut.tokens_cut_short) == (2, 1, 1024 + 100)
    table = comparison(cut, fixed_run()[0])
    assert row_of(table, "  of them cut short by a release") == ["1", "0", "-", "worse"]
    assert row_of(table, "  of requests cut short") == ["1124", "0", "-", "worse"]
    (served,) = [a for a in assumptions(HALL) if a.what == "served"]
    assert "released before its lease ran out" in served.why and "cut short" in served.why
    plan = Plan(seconds=2, requests=2)
    result = dataclasses.replace(outcome(), figures={"pooled": cut, "fixed": fixed_run()[0]})
    demo.write(result, plan, tmp_path, demo.report(result, plan))
    record = json.loads((tmp_path / "figures.json").read_text())["runs"]["pooled"]["figures"]
    assert (record["served_cut_short"], record["tokens_cut_short"]) == (1, 1124)


def test_a_percentile_the_sample_cannot_support_is_hidden_not_printed() -> None:
    # Two served requests tell a p50, not a p99 (it would be their maximum).
    got, _ = fixed_run()
    assert "p99" not in got.ttft_ms and "p99" not in got.tpot_ms
    assert "p99" not in got.latency_ms  # three composes
    table = comparison(pooled_run()[0], got)
    for name in ("TTFT p99, ms (model)", "TPOT p99, ms (model)", "compose latency p99,"):
        (line,) = [line for line in table.splitlines() if line.startswith(name)]
        assert line.split()[-3:] == ["-", "-", "-"]
    (line,) = [line for line in table.splitlines() if line.startswith("TTFT p50")]
    assert line.split()[-4:] == ["1100.0", "1500.0", "0.73x", "better"]
    # The table shows each compose latency percentile the plot and figures.json show.
    (line,) = [line for line in table.splitlines() if line.startswith("compose latency p50,")]
    assert line.split()[-3:-1] != ["-", "-"], line


def outcome() -> demo.Outcome:
    (pooled, pooled_log), (fixed, fixed_log) = pooled_run(), fixed_run()
    runs = {"pooled": Run("pooled", "econ-pooled-x"), "fixed": Run("fixed", "econ-fixed-x")}
    return demo.Outcome(
        {"pooled": pooled, "fixed": fixed},
        {"pooled": pooled_log, "fixed": fixed_log},
        runs,
        assumptions(HALL),
    )


def test_the_report_prints_its_assumptions_beside_the_figures(tmp_path: Path) -> None:
    plan = Plan(seconds=2, requests=2)
    text = demo.report(outcome(), plan)
    assert not re.search(r"\b(inf|nan)\b", text)
    block = text[text.index("\nassumptions ") :].splitlines()  # beside the table, below it

    def line(what: str) -> str:
        (found,) = [line for line in block if line.startswith(f"  {what}: ")]
        return found

    for what in ("wait for GPUs", "tokens served", "GPU-hours", "billed $"):
        assert line(what)
    assert "1,024 (context tokens/s per GPU)" in line("prefill rate")
    assert "100 (output tokens/s per GPU); one rate per arm" in line("decode rate")
    assert "H100 2.00" in line("price, gpu") and "$ per gpu-hour" in line("price, gpu")
    assert "CXL 100 GiB 0.50" in line("price, memory")
    assert "per GiB-hour held: price / capacity" in line("pooled memory billed")
    (memory,) = [a for a in outcome().assumptions if a.what == "pooled memory billed"]
    assert "CXL 0.00500" in memory.why  # $0.50 / 100 GiB
    # The drain after the last arrival is said, not left to be guessed.
    assert "held over 4 s, the first compose to the last lease's end" in text
    assert "(the last arrivals' leases run past 2 s)" in text

    demo.write(outcome(), plan, tmp_path, text)
    record = json.loads((tmp_path / "figures.json").read_text())
    assert {a["what"] for a in record["assumptions"]} >= {"prefill rate", "decode rate"}
    fixed = record["runs"]["fixed"]["figures"]
    # Every percentile is named; one its count (two served) cannot support is null.
    assert fixed["ttft_ms"] == {"p50": pytest.approx(1500), "p99": None}
    assert fixed["latency_ms"] == {"p50": pytest.approx(250), "p90": None, "p99": None,
                                   "p99.9": None}  # fmt: skip
    assert fixed["billed_per_million_tokens"] == pytest.approx(3.0 / 0.003472)
    assert fixed["gpu_hours"] == pytest.approx(1.5)


def test_the_comparison_names_what_was_held_and_prints_no_infinite_ratio() -> None:
    base, _ = fixed_run()
    p = dataclasses.replace(base, refused=Counter(quota=3), gpu_held_mean=50.0)
    f = dataclasses.replace(
        base, refused=Counter(), tokens_served=0, billed_per_million_tokens=None
    )
    text = comparison(p, f)
    assert "GPU utilization" not in text and "GPUs held, mean % of the hall's" in text
    assert "inf" not in text
    (refused,) = [line for line in text.splitlines() if line.startswith("refused ")]
    assert refused.split()[-2:] == ["-", "worse"]  # 3 against 0: no ratio, and worse
    (cost,) = [line for line in text.splitlines() if line.startswith("$ per million tokens, b")]
    assert cost.split()[-2:] == ["-", "-"]  # no tokens served: no cost per token


def row_of(table: str, name: str) -> list[str]:
    (line,) = [line for line in table.splitlines() if line.startswith(name)]
    return line[len(name) :].split()


def test_a_mean_over_no_samples_is_no_figure_in_the_table_or_the_json(tmp_path: Path) -> None:
    # The fixed run's pool is never 90% held: no sample to take free GPUs from. Pooled's pool
    # is full at the third sample, with both GPUs held then: 0 free is a figure.
    pooled, fixed = pooled_run()[0], fixed_run()[0]
    assert fixed.free_gpus_memory_full is None
    assert pooled.free_gpus_memory_full == 0.0
    table = comparison(pooled, fixed)
    assert row_of(table, "free GPUs while memory >= 90% held") == ["0.0", "-", "-"]
    nothing = dataclasses.replace(pooled, free_gib_gpus_full=None)
    assert row_of(comparison(nothing, fixed), "free GiB while GPUs >= 90% held") == [
        "-",
        "100",
        "-",
    ]
    plan = Plan(seconds=2, requests=2)
    demo.write(outcome(), plan, tmp_path, demo.report(outcome(), plan))
    record = json.loads((tmp_path / "figures.json").read_text())
    assert record["runs"]["fixed"]["figures"]["free_gpus_memory_full"] is None


def test_stranded_is_what_was_held_past_what_the_work_asked_in_both_runs() -> None:
    # Pooled: a prefill asks for 2 GPUs for 1 s and is held 1.6 s, until the lease tick ended
    # it: 1.2 GPU-seconds held idle. A decode its policy released after 0.5 s of its 2 s lease
    # strands nothing (and does not offset the other's slack).
    events = [
        asked("CompositionRequested", 0, 2, "example", 0.0, 1),
        asked("CompositionRequested", 1, 1, "example", 1.0, 2),
    ]
    intervals = [
        held("gpu", 0, 1.6, 2.0, cid="c0"),
        held("gpu", 0, 1.6, 2.0, cid="c0"),
        held("gpu", 1, 1.5, 2.0, cid="c1"),
    ]
    got = figures(HALL, events, intervals, [Request(0, 0.0, 2048, 50)], [0.1, 0.1], {})
    assert got.idle_gpu_seconds == pytest.approx(1.2)


def test_held_shares_are_named_for_what_they_are_in_the_json(tmp_path: Path) -> None:
    plan = Plan(seconds=2, requests=2)
    demo.write(outcome(), plan, tmp_path, demo.report(outcome(), plan))
    pooled = json.loads((tmp_path / "figures.json").read_text())["runs"]["pooled"]["figures"]
    assert pooled["gpus_held_share"] == pytest.approx([1.0, 1.0, 1.0, 0.5])
    assert pooled["memory_held_share"] == pytest.approx([0.0, 0.5, 1.0, 0.5])
    assert not [key for key in pooled if "util" in key]


def test_a_sparkline_shows_anything_held_however_little() -> None:
    assert sparkline([0.0, 0.01, 0.06, 0.5, 1.0]) == " ▁▁▄█"


def test_the_demand_spans_the_run_and_says_when_the_trace_ran_out() -> None:
    rows = [TraceRow(k * 0.6, 100, 10) for k in range(1000)]  # 0 .. 599.4 s
    for count in (1, 2, 7, 400, 1000):
        picked = compress(rows, seconds=45, count=count, window=600)
        assert len(picked) == count and picked[0].at == 0.0
        assert count == 1 or picked[-1].at == pytest.approx(599.4 * 45 / 600)
        assert [r.number for r in picked] == list(range(count))
    assert len(compress(rows, seconds=45, count=5000, window=600)) == 1000
    # The shipped trace: arrivals reach the run's end, and asking for more than its first ten
    # minutes hold gets all of them.
    assert demand(Plan(seconds=45, requests=2))[-1].at > 44
    everything = demand(Plan(seconds=45, requests=100_000))
    assert len(everything) == len(demand(Plan(seconds=45, requests=len(everything))))
    assert len(everything) < 100_000
    capped = dataclasses.replace(outcome(), figures={
        name: dataclasses.replace(got, requests=2) for name, got in outcome().figures.items()
    })  # fmt: skip
    text = demo.report(capped, Plan(seconds=2, requests=5000))
    assert "2 requests arriving over 2 s" in text
    assert "asked for 5000 requests: the trace's first 10 minutes hold 2" in text


def test_a_short_run_claims_no_drain_past_it_and_its_plot_covers_it() -> None:
    # One request at 0 s of a 5 s run, held 4 s: nothing ran past the run.
    pooled, fixed = pooled_run()[0], fixed_run()[0]
    short = dataclasses.replace(pooled, requests=1, span_s=4.0, last_arrival_s=0.0)
    text = demo.report(dataclasses.replace(outcome(), figures={"pooled": short, "fixed": short}),
                       Plan(seconds=5, requests=1))  # fmt: skip
    assert "1 request, arriving at 0 s of a 5 s run; held over 4 s" in text
    assert "run past" not in text
    # The time axis spans the run (the storm, the last arrival) and every sample.
    assert plots.time_axis(short, short, 5.0) == (0.0, 5.0)
    assert plots.time_axis(pooled, fixed, 2.0) == (0.0, fixed.span_s)


def test_progress_never_shows_seconds_past_the_run_as_into_it() -> None:
    run = a_run_in_the_storm()
    run.stage = "draining"
    run.started = time.monotonic() - 53.2
    assert "45/45 s +8 s" in live.line(run, Plan(seconds=45, requests=50))
    run.ended = run.started + 50.0  # the last lease ran out: the clock stops
    assert live.seconds(run, Plan(seconds=45, requests=50)) == "45/45 s +5 s"
    run.ended, run.started = None, time.monotonic() - 10.2
    assert live.seconds(run, Plan(seconds=45, requests=50)) == "10/45 s"


def test_requests_neither_served_nor_refused_are_a_row_of_their_own() -> None:
    """A compose the log has no answer to (the client gave up, or it was throttled, which
    writes nothing) vanished between 'served' and 'refused'; the rows now add up."""
    pooled, fixed = pooled_run()[0], fixed_run()[0]
    assert "neither served nor refused" not in comparison(pooled, fixed)  # 2 + 0, 2 + 1
    lost = dataclasses.replace(fixed, requests=fixed.requests + 4)
    assert row_of(comparison(pooled, lost), "neither served nor refused") == [
        "0",
        "4",
        "0.00x",
        "better",
    ]


def test_the_report_says_when_each_why_was_asked_and_what_whole_hall_prices(
    tmp_path: Path,
) -> None:
    got = outcome()
    got.runs["pooled"].whys = [
        Why(5.0, "tray-1", "tray-1 carries the paths from h to g", ["TopologyImported"],
            "before the fault"),
        Why(5.1, "tray-1", "tray-1 carries nothing", ["ComponentFaulted"]),
    ]  # fmt: skip
    text = demo.report(got, Plan(seconds=2, requests=2))
    assert "why tray-1 (5 s in, before the fault): tray-1 carries the paths" in text
    assert "why tray-1 (5.1 s in, in the storm): tray-1 carries nothing" in text
    spans = (
        f"pooled {got.figures['pooled'].span_s:.1f} s, fixed {got.figures['fixed'].span_s:.1f} s"
    )
    assert f"priced over each run's own span: {spans}" in text


async def test_the_demo_runs_its_engine_unthrottled_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A throttled compose writes nothing, so the log's figures cannot count it: the demo's
    engine has no tenant rate limit, whatever TRELLIS_TENANT_RATE says, and the assumptions
    say so."""
    started: list[Any] = []

    class Stop(Exception):
        pass

    def running_engine(settings: Any) -> Any:
        started.append(settings)
        raise Stop

    monkeypatch.setattr(demo, "running_engine", running_engine)
    settings = Settings.from_env({"TRELLIS_TENANT_RATE": "5"})
    assert settings.tenant_rate.per_second == 5
    with pytest.raises(Stop):
        await demo.main(Plan(seconds=5, requests=1), settings, tmp_path / "out", show="off")
    assert started[0].tenant_rate.per_second == 0  # engine/core/throttle.py: no limit


def test_each_ratio_says_whether_it_is_better_or_worse_for_pooled_by_the_figures_own_sense() -> (
    None
):
    """A front-door probe read 'TTFT p50 3.94x' and '$ per million tokens 0.23x' side by side
    with no sign of which way is better."""
    pooled, fixed = pooled_run()[0], fixed_run()[0]
    faster = dataclasses.replace(pooled, ttft_ms={"p50": 100.0}, served=fixed.served + 1)
    slower = dataclasses.replace(fixed, ttft_ms={"p50": 400.0})
    table = comparison(faster, slower)
    assert table.splitlines()[0].split()[-2:] == ["pooled", "is"]
    assert row_of(table, "TTFT p50, ms (model)")[-1] == "better"  # lower is better
    assert row_of(table, "served")[-1] == "better"  # higher is better
    assert row_of(comparison(slower, faster), "TTFT p50, ms (model)")[-1] == "worse"
    assert row_of(table, "requests")[-1].endswith("x")  # what was asked: no verdict
    # The key under the table says what the column and a "-" mean.
    assert "pooled is: better or worse" in table and "p99 100" in table


def test_a_ratio_within_what_two_runs_differ_by_is_about_the_same() -> None:
    """'0.99x better' beside '1.04x worse' read as a contradiction (front-door probe): a few
    percent is what two runs of one arm differ by. Impaired is a share of what was made."""
    pooled, fixed = pooled_run()[0], fixed_run()[0]
    close = dataclasses.replace(pooled, hall_per_million_tokens=28.0, hall_per_served=0.0389)
    other = dataclasses.replace(fixed, hall_per_million_tokens=28.34, hall_per_served=0.0376)
    table = comparison(close, other)
    whole_hall = row_of(table, "$ per million tokens, whole hall")
    assert " ".join(whole_hall[-4:]) == "0.99x about the same"
    assert " ".join(row_of(table, "hall $ per served request")[-4:]) == "1.03x about the same"
    # Symmetric: 5% apart is a verdict whichever side is the larger.
    high, low = (
        dataclasses.replace(close, hall_per_served=1.05),
        dataclasses.replace(other, hall_per_served=1.0),
    )
    assert row_of(comparison(high, low), "hall $ per served request")[-1] == "worse"
    assert row_of(comparison(low, high), "hall $ per served request")[-1] == "better"
    apart = dataclasses.replace(other, hall_per_served=0.0300)
    assert row_of(comparison(close, apart), "hall $ per served request")[-1] == "worse"
    made = dataclasses.replace(pooled, compositions=80, impaired=5)
    assert row_of(comparison(made, dataclasses.replace(fixed, compositions=35, impaired=1)),
                  "compositions impaired, % of made")[:3] == ["6.2", "2.9", "2.19x"]  # fmt: skip
