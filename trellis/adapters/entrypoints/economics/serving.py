"""The serving model: what the economics run measured, turned into the seeds' own units, and
the assumptions that turn it so, printed beside the figures.

Nothing here runs a model or a token. Time to first token (TTFT) and time per output token
(TPOT) come from this model, driven by what was measured (how long each request waited for its
GPUs, as the client timed it) and by the workload's own sizing rates (workload.py), which the
leases were sized by too:

- TTFT = the wait for the prefill's GPUs (arrival to the composed reply: compose latency, and a
  fixed request's tries of other boxes) + context tokens / (prefill rate x the GPUs it got);
- TPOT = (the wait for the decode's GPUs + generated tokens / (decode rate x the GPUs it got))
  / generated tokens. Pooled composes the decode when the prefill's second is up; a fixed
  request decodes on the box it already holds, so it waits 0.

There is no queue: a request that finds no capacity is refused (and not retried), so it has no
TTFT; queueing adds nothing to the served ones beyond the wait measured.
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trellis.adapters.entrypoints.economics.runs import WEIGHTS_GIB, boxes, hbm_headroom
from trellis.adapters.entrypoints.economics.workload import (
    BATCH,
    KV_MIB_PER_TOKEN,
    OUTPUT_TOKENS_PER_SECOND,
    PREFILL_SECONDS,
    TOKENS_PER_PREFILL_GPU,
)

PREFILL_TOKENS_PER_GPU_S = TOKENS_PER_PREFILL_GPU / PREFILL_SECONDS
DECODE_TOKENS_PER_GPU_S = float(OUTPUT_TOKENS_PER_SECOND)
TOKENS_PER_MILLION = 1e6
SECONDS_PER_HOUR = 3600.0
MIB_PER_GIB = 1024


@dataclass(frozen=True)
class Served:
    """One served request, as the model needs it."""

    context_tokens: int
    generated_tokens: int
    prefill_wait_s: float  # arrival to the reply that composed its prefill GPUs (client-timed)
    prefill_gpus: int
    decode_wait_s: float  # the decode's due time to the reply that composed it; 0 in a box
    decode_gpus: int


def ttft(s: Served) -> float:
    """Seconds from arrival to the first token."""
    return s.prefill_wait_s + s.context_tokens / (PREFILL_TOKENS_PER_GPU_S * s.prefill_gpus)


def decoding(generated_tokens: int, gpus: int) -> float:
    """Seconds a decode on `gpus` GPUs takes to generate its tokens; its lease holds them a
    second more, rounded up to whole seconds (workload.py)."""
    return generated_tokens / (DECODE_TOKENS_PER_GPU_S * gpus)


def tpot(s: Served) -> float:
    """Seconds per output token, the wait for the decode's GPUs spread over them."""
    return (s.decode_wait_s + decoding(s.generated_tokens, s.decode_gpus)) / s.generated_tokens


def per_million_tokens(dollars: float, served_tokens: int) -> float | None:
    """Dollars per million tokens served; None when none were (no ratio over nothing)."""
    return dollars / (served_tokens / TOKENS_PER_MILLION) if served_tokens else None


@dataclass(frozen=True)
class Assumption:
    """A constant the figures rest on: its value, its unit, and where it comes from."""

    what: str
    value: str
    unit: str
    why: str


def prices(hall: dict[str, Any]) -> list[Assumption]:
    """The hall's prices, one line per device kind: the models and their $ per hour."""
    by_kind: dict[str, dict[str, float]] = defaultdict(dict)
    for node in hall["nodes"]:
        if node["kind"] == "device" and node.get("cost_per_hour") is not None:
            name = node.get("model") or node["device_kind"]
            if node.get("capacity_gib"):
                name += f" {node['capacity_gib']:g} GiB"
            by_kind[node["device_kind"]][name] = node["cost_per_hour"]
    return [
        Assumption(
            f"price, {kind}",
            ", ".join(f"{name} {price:.2f}" for name, price in sorted(models.items())),
            f"$ per {kind}-hour",
            "illustrative: the hall's cost_per_hour (examples/make_hall.py)",
        )
        for kind, models in sorted(by_kind.items())
    ]


def request_kv_gib_per_token() -> float:
    """The GiB of KV cache one token of a request takes: a batch of BATCH sessions' worth."""
    return KV_MIB_PER_TOKEN * BATCH / MIB_PER_GIB


def model(hall: dict[str, Any]) -> list[Assumption]:
    """The model the figures rest on: its weights, its KV cache per token, the batch a request
    stands for, and what a fixed box's HBM holds of it, one line per box kind."""
    per_request = request_kv_gib_per_token()
    return [
        Assumption(
            "model",
            f"70B, fp16, weights {WEIGHTS_GIB:g}",
            "GiB",
            "a Llama-2-70B-shaped model (runs.py); its weights fill a fixed box's HBM before"
            " any KV cache. The pooled arm's composes do not place the weights: its decode's"
            " one GPU is not checked to hold them, which favours pooled",
        ),
        Assumption(
            "KV cache per token",
            f"{KV_MIB_PER_TOKEN:g}",
            "MiB per token per session",
            "Llama-2-70B's, fp16, grouped-query attention: layers x KV heads x head size x 2"
            " (K and V) x 2 bytes (workload.py)",
        ),
        Assumption(
            "batch",
            f"{BATCH}",
            "sessions per request",
            f"a trace request stands for {BATCH} concurrent sessions like it, so its KV cache"
            f" is {per_request:g} GiB per token of context + output (workload.py)",
        ),
        *headroom(hall),
    ]


def headroom(hall: dict[str, Any]) -> list[Assumption]:
    """Each box kind's HBM beyond the weights (runs.py's hbm_headroom): the KV cache a fixed
    request may have before it is refused."""
    hbm = {n["id"]: n.get("memory_gib") or 0.0 for n in hall["nodes"]}
    model_of = {n["id"]: n.get("model") or n["id"] for n in hall["nodes"]}
    kinds: dict[str, tuple[float, float]] = {}
    for gpus in boxes(hall).values():
        models = sorted({model_of[g] for g in gpus})
        kind = f"{len(gpus)} x {' + '.join(models)}"
        kinds[kind] = (sum(hbm[g] for g in gpus), hbm_headroom(gpus, hbm))
    per_token = request_kv_gib_per_token()
    return [
        Assumption(
            f"HBM headroom, {kind} box",
            f"{room:,.0f}",
            "GiB for KV cache",
            f"the box's {total:,.0f} GiB of HBM less the weights' {WEIGHTS_GIB:g}: a request"
            f" of up to {math.floor(max(room, 0.0) / per_token):,} tokens (context + output,"
            f" at batch {BATCH}); a fixed request needing more is refused, a box has no pooled"
            " memory",
        )
        for kind, (total, room) in sorted(kinds.items())
    ]


def rates_caveat(hall: dict[str, Any]) -> Assumption:
    """The token rates are per GPU whatever its kind, while prices differ by kind."""
    gpu_prices = {
        node.get("model") or node["id"]: node["cost_per_hour"]
        for node in hall["nodes"]
        if node["kind"] == "device"
        and node["device_kind"] == "gpu"
        and node.get("cost_per_hour") is not None
    }
    span = ""
    if gpu_prices:
        cheap = min(gpu_prices, key=lambda m: gpu_prices[m])
        dear = max(gpu_prices, key=lambda m: gpu_prices[m])
        span = (
            f" (from {cheap} ${gpu_prices[cheap]:.2f} to {dear} ${gpu_prices[dear]:.2f}"
            " per GPU-hour)"
        )
    return Assumption(
        "rates by GPU kind",
        "the same for every kind",
        "tokens/s per GPU",
        "the prefill and decode rates above do not depend on the GPU's kind, while its price"
        f" does{span}: $ per million tokens depends on which kinds were picked, not on their"
        " speed",
    )


def assumptions(hall: dict[str, Any]) -> list[Assumption]:
    """Every constant behind the seeds' units, with its unit and its source."""
    return [
        *model(hall),
        Assumption(
            "prefill rate",
            f"{PREFILL_TOKENS_PER_GPU_S:,.0f}",
            "context tokens/s per GPU",
            f"workload.py sizes a prefill at one GPU per {TOKENS_PER_PREFILL_GPU:,} tokens"
            f" for {PREFILL_SECONDS} s; a fixed request prefills on its box's 8",
        ),
        Assumption(
            "decode rate",
            f"{DECODE_TOKENS_PER_GPU_S:,.0f}",
            "output tokens/s per GPU",
            "one rate per arm, the one its leases are sized by (workload.py): pooled decodes"
            " on 1 GPU, a fixed box on its 8, linear in GPUs (an optimistic bound for the box:"
            " no tensor-parallel cost), so it holds the box an eighth as long; a decode lease"
            " holds 1 s more than its output takes, rounded up to whole seconds",
        ),
        rates_caveat(hall),
        Assumption(
            "wait for GPUs",
            "measured",
            "seconds",
            "arrival (or the prefill's second ending) to the composed reply, as the client"
            " timed it; no queue: a request finding no capacity is refused",
        ),
        Assumption(
            "served",
            "composed",
            "requests",
            "pooled: both phases composed; fixed: a box. A request whose composition the"
            " scheduler released before its lease ran out (impaired, not repaired) counts as"
            " served, its tokens in full, though its GPU time stops at the release: the rows"
            " 'of them cut short by a release'",
        ),
        Assumption(
            "tokens served",
            "context + generated",
            "tokens",
            f"the trace's counts of each served request, once (its KV cache is sized for a"
            f" batch of {BATCH} like it; the tokens are not multiplied)",
        ),
        Assumption(
            "GPU-hours",
            "held",
            "GPU-hours",
            "GPU-seconds held in the log's history / 3600: held, not busy",
        ),
        Assumption(
            "billed $",
            "held device-hours x price",
            "$",
            "every device kind, from the log's history; a fixed request holds its whole box"
            " for its lease; hall $: every device of the hall for the run's span",
        ),
        Assumption(
            "pooled memory billed",
            "per GiB-hour held: price / capacity",
            "$ per GiB-hour",
            "a slice pays its GiB's share of its pool's price, as many slices share a pool ("
            + memory_prices(hall)
            + ")",
        ),
        *prices(hall),
    ]


def memory_prices(hall: dict[str, Any]) -> str:
    """The hall's pooled memory models at their price per GiB-hour."""
    per_gib = {
        node.get("model") or node["id"]: node["cost_per_hour"] / node["capacity_gib"]
        for node in hall["nodes"]
        if node["kind"] == "device"
        and node["device_kind"] == "memory"
        and node.get("cost_per_hour") is not None
        and node.get("capacity_gib")
    }
    return ", ".join(f"{model} {price:.5f}" for model, price in sorted(per_gib.items())) or "none"


def assumptions_text(items: Sequence[Assumption]) -> str:
    """The assumptions as the report prints them under the table, one each, wrapped."""
    lines = ["assumptions (the figures above rest on these):"]
    for a in items:
        text = f"{a.what}: {a.value} ({a.unit}); {a.why}."
        lines += textwrap.wrap(text, 100, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)
