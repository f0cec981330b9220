"""The economics demo's demand (adapters/entrypoints/economics/workload.py): trace rows to
phases."""

from __future__ import annotations

import itertools
from pathlib import Path

from trellis.adapters.entrypoints.economics.workload import (
    BATCH,
    KV_MIB_PER_TOKEN,
    MAX_GPUS,
    Request,
    TraceRow,
    compress,
    read_trace,
)


def test_prefill_is_sized_by_the_prompt_and_decode_by_context_and_output() -> None:
    short = Request(0, 0.0, context_tokens=300, generated_tokens=50)
    long = Request(1, 0.0, context_tokens=7000, generated_tokens=50)
    huge = Request(2, 0.0, context_tokens=100_000, generated_tokens=50)
    assert (short.prefill_gpus, long.prefill_gpus, huge.prefill_gpus) == (1, 7, MAX_GPUS)
    assert long.decode_gib == round(7050 * KV_MIB_PER_TOKEN * BATCH / 1024, 1)
    assert long.decode_gib > 20 * short.decode_gib  # long context wants memory, not GPUs
    assert Request(3, 0.0, 100, 1000).decode_seconds > short.decode_seconds
    assert short.seconds == 1 + short.decode_seconds


def test_compress_keeps_the_arrivals_shape_within_the_window() -> None:
    rows = [TraceRow(at=float(t), context_tokens=t, generated_tokens=1) for t in range(0, 1000)]
    requests = compress(rows, seconds=10.0, count=50, window=500.0)
    assert len(requests) == 50
    assert [r.number for r in requests] == list(range(50))
    assert all(0.0 <= r.at <= 10.0 for r in requests)
    assert [r.at for r in requests] == sorted(r.at for r in requests)
    assert requests[1].at - requests[0].at == (requests[1].context_tokens) / 50  # scaled 10/500


def test_the_committed_trace_reads_whole_and_merged() -> None:
    trace = Path(__file__).resolve().parents[2] / "examples" / "azure-llm-trace-2023"
    rows = read_trace(sorted(trace.glob("*.csv")))
    # Every row of both files (the NOTICE's counts, 8,818 and 19,365, are one short each).
    assert len(rows) == 8819 + 19366
    assert rows[0].at == 0.0
    assert all(a.at <= b.at for a, b in itertools.pairwise(rows))
