"""What a reader of `trellis demo economics` sees first: the assumptions name the model the
figures rest on (weights, KV cache per token, batch, each box kind's HBM headroom) and say that
the token rates are per GPU whatever its kind."""

from __future__ import annotations

import math

from trellis.adapters.entrypoints.economics.data import read_hall
from trellis.adapters.entrypoints.economics.runs import WEIGHTS_GIB, boxes, hbm_headroom
from trellis.adapters.entrypoints.economics.serving import assumptions, assumptions_text
from trellis.adapters.entrypoints.economics.workload import BATCH, KV_MIB_PER_TOKEN


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
