"""The economics demo's demand: Azure's LLM inference trace (2023), turned into compose work.

Pure: rows in, requests and their phases out; `read_trace` is the one function that reads a file.
The trace (examples/azure-llm-trace-2023, CC-BY 4.0, see its NOTICE.md) has one row per request:
arrival time, prompt (context) tokens and generated tokens. A request becomes two phases, as
Splitwise (ISCA 2024) splits them:

- prefill, GPU-heavy: `ceil(context / TOKENS_PER_PREFILL_GPU)` GPUs (1 to 8), for a second;
- decode, memory-heavy: one GPU and a KV-cache slice of pooled memory sized by context plus
  output tokens, for a time that grows with the output (on a fixed box, which decodes on its
  eight GPUs, an eighth of it).

A request stands for a batch of `BATCH` concurrent sessions like it (one trace row is far too
small to compose hardware for), so its KV cache is `BATCH` times a 70B model's per-token cache.
Long-context requests need memory more than GPUs. Arrivals keep the trace's shape, compressed
into `seconds`; durations are whole seconds, because a lease is.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TOKENS_PER_PREFILL_GPU = 1024
MAX_GPUS = 8
KV_MIB_PER_TOKEN = 0.3125  # Llama-2-70B, fp16, grouped-query attention: 80 x 8 x 128 x 2 x 2 B
BATCH = 256
OUTPUT_TOKENS_PER_SECOND = 100  # per GPU: decode seconds = 1 + output / (this x GPUs)
PREFILL_SECONDS = 1


@dataclass(frozen=True)
class TraceRow:
    at: float  # seconds since the trace's first row
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class Request:
    """One trace request, compressed: when it arrives and what its phases need."""

    number: int
    at: float  # seconds from the run's start
    context_tokens: int
    generated_tokens: int

    @property
    def prefill_gpus(self) -> int:
        return max(1, min(MAX_GPUS, math.ceil(self.context_tokens / TOKENS_PER_PREFILL_GPU)))

    @property
    def decode_gib(self) -> float:
        tokens = self.context_tokens + self.generated_tokens
        return round(tokens * KV_MIB_PER_TOKEN * BATCH / 1024, 1)

    @property
    def decode_seconds(self) -> int:
        """The decode's lease on one GPU, as pooled composes it."""
        return self.decode_seconds_on(1)

    def decode_seconds_on(self, gpus: int) -> int:
        """The decode's lease on `gpus` GPUs, each generating OUTPUT_TOKENS_PER_SECOND (the
        serving model's rate, serving.py): a second more than the output takes, rounded up;
        never less, or the lease would end before the tokens the model counts."""
        return 1 + math.ceil(self.generated_tokens / (OUTPUT_TOKENS_PER_SECOND * gpus))

    @property
    def tokens(self) -> int:
        """What a served request counts for in $ per million tokens: context and generated."""
        return self.context_tokens + self.generated_tokens

    @property
    def seconds(self) -> int:
        """Prefill then decode on one GPU: the longest the request holds hardware."""
        return self.seconds_on(1)

    def seconds_on(self, decode_gpus: int) -> int:
        """Prefill then decode on `decode_gpus` GPUs: a fixed box's lease, decoding on its 8."""
        return PREFILL_SECONDS + self.decode_seconds_on(decode_gpus)


def read_trace(paths: Iterable[Path]) -> list[TraceRow]:
    """The rows of the trace's CSV files (TIMESTAMP,ContextTokens,GeneratedTokens), merged by
    arrival, times in seconds since the first."""
    stamped = []
    for path in paths:
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
                stamped.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    stamped.sort()
    if not stamped:
        return []
    first = stamped[0][0]
    return [TraceRow((t - first).total_seconds(), c, g) for t, c, g in stamped]


def compress(
    rows: Sequence[TraceRow], *, seconds: float, count: int, window: float
) -> list[Request]:
    """`count` requests spread over `seconds`: rows of the trace's first `window` seconds
    picked evenly from its first to its last (a fractional stride, so the arrivals span the
    run), their arrivals scaled so the window fits `seconds`. Every row when the window holds
    fewer than `count`: the caller says so (len() of the answer is what ran)."""
    inside = [r for r in rows if r.at <= window]
    if not inside or count <= 0:
        return []
    count = min(count, len(inside))
    stride = (len(inside) - 1) / (count - 1) if count > 1 else 0.0
    picked = [inside[round(k * stride)] for k in range(count)]
    scale = seconds / window
    return [
        Request(n, round(r.at * scale, 3), r.context_tokens, r.generated_tokens)
        for n, r in enumerate(picked)
    ]
