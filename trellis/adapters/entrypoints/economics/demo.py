"""`trellis demo economics`, whole: both runs on one engine, then the table, the storm's `why`
answers, the plots and a JSON of every figure, written to an output folder.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import msgspec

from trellis.adapters.bootstrap import running_engine
from trellis.adapters.entrypoints.economics import live, plots
from trellis.adapters.entrypoints.economics.data import read_hall
from trellis.adapters.entrypoints.economics.figures import (
    PERCENTILES,
    SERVING_PERCENTILES,
    Figures,
    comparison,
    figures,
    sparkline,
    storm_refusal,
)
from trellis.adapters.entrypoints.economics.runs import (
    TRACE_WINDOW_S,
    Plan,
    Run,
    demand,
    fixed,
    history,
    log_of,
    pooled,
)
from trellis.adapters.entrypoints.economics.serving import (
    Assumption,
    assumptions,
    assumptions_text,
)
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.settings import Settings
from trellis.engine.core.throttle import RateLimit

CREDIT = (
    "demand: Azure LLM inference trace 2023 (Azure/AzurePublicDataset, CC-BY 4.0);"
    " figures from the log's history and events; latency and the waits for GPUs as the client"
    " measured them; TTFT and TPOT from those through the serving model (assumptions above)."
)


RUNS = ("pooled", "fixed")  # in the order they run

# The demo's two schedulers are the hall's own: a throttled compose writes nothing, so the
# figures (from the log) could tell it neither as served nor as refused. `main` runs its engine
# so, and says it.
UNTHROTTLED = Assumption(
    "tenant rate limit",
    "off",
    "TRELLIS_TENANT_RATE=0 for this engine",
    "the limit guards against a tenant's flood; here the two schedulers are the hall's own,"
    " and a throttled compose would be neither served nor refused",
)


def new_stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def domain_of(run: str, stamp: str) -> str:
    return f"econ-{run}-{stamp}"


def watch(page_url: str, stamp: str) -> str:
    """The line naming the fabric page, opened on the first run's domain: that domain is
    imported just after, and the page shows it as it arrives."""
    first, then = (domain_of(run, stamp) for run in RUNS)
    return (
        f"fabric page: {page_url}/?domain={first} (operators only)\n"
        f"  the {RUNS[0]} run; the {RUNS[1]} run follows in {then} (pick it under domain);"
        " the page stops with the demo"
    )


@dataclasses.dataclass
class Outcome:
    """What the demo found: each run's figures, log and record, by run name, and the
    assumptions the figures rest on."""

    figures: dict[str, Figures]
    logs: dict[str, list[dict[str, Any]]]
    runs: dict[str, Run]
    assumptions: list[Assumption]


async def economics(
    client: TrellisClient,
    store: Any,
    plan: Plan,
    *,
    stamp: str | None = None,
    show: live.View = "off",
) -> Outcome:
    """Both runs on a running engine, one after the other, each in a domain of its own,
    econ-pooled-<stamp> and econ-fixed-<stamp>. `show`: the progress view (live.View)."""
    hall = read_hall(plan.hall)
    requests = demand(plan)
    nc, prefix = client.nc, client.prefix
    stamp = stamp or new_stamp()
    runs = [Run(name, domain_of(name, stamp)) for name in RUNS]
    outcome = Outcome({}, {}, {run.name: run for run in runs}, assumptions(hall))
    for run in runs:
        topology = {**hall, "request_id": f"hall-{run.domain}", "reason": "economics hall"}
        reply = await client.admin(run.domain, "import-topology", topology)
        if not reply["ok"]:
            raise RuntimeError(f"the hall was refused: {reply['error']['message']}")
    # The progress view counts the requests that run, which the trace may have capped.
    async with live.progress(runs, dataclasses.replace(plan, requests=len(requests)), show):
        for run in runs:
            run.stage = "running"
            if run.name == "pooled":
                await pooled(nc, prefix, run, requests, plan)  # then drains: every lease ran out
            else:
                await fixed(nc, prefix, run, requests, plan, hall)
            head = (await store.head(run.domain)).position
            intervals = await history(client, run.domain, head)
            outcome.logs[run.name] = await log_of(store, run.domain)
            outcome.figures[run.name] = figures(
                hall, outcome.logs[run.name], intervals, requests, run.latencies, run.waits
            )
            run.stage = "done"
    return outcome


def report(outcome: Outcome, plan: Plan) -> str:
    """The text a person reads at the end: sparklines, the table and the assumptions beside
    it, the storm's why answers."""
    lines: list[str] = []
    for name, got in outcome.figures.items():
        run = outcome.runs[name]
        lines.append(f"{name} ({run.domain}): {arriving(got, plan)}; {held_over(got, plan)}")
        lines.append(f"  GPUs held       |{sparkline(got.gpus_held_share)}|")
        lines.append(f"  memory held     |{sparkline(got.memory_held_share)}|")
    ran = min((got.requests for got in outcome.figures.values()), default=plan.requests)
    if ran < plan.requests:
        lines.append(
            f"(asked for {plan.requests} requests: the trace's first"
            f" {TRACE_WINDOW_S / 60:g} minutes hold {ran}, and every one of them ran)"
        )
    spans = ", ".join(f"{name} {got.span_s:.1f} s" for name, got in outcome.figures.items())
    lines += [
        "",
        comparison(outcome.figures["pooled"], outcome.figures["fixed"]),
        f"(whole hall: every device of the hall, priced over each run's own span: {spans},"
        " the first compose to the last lease's end)",
        "",
        assumptions_text(outcome.assumptions),
        "",
    ]
    for name, run in outcome.runs.items():
        lines.append(f"the storm in {name}: {', '.join(run.struck)} failed")
        for why in run.whys:
            lines.append(f"  why {why.id} ({why.at:g} s in, {why.moment}): {why.text}")
            lines.append(f"    chain: {' > '.join(why.chain[-6:])}")
        refusal = storm_refusal(outcome.logs[name])
        if refusal is not None:
            then = "; that request then composed on another box" if refusal["then_composed"] else ""
            lines.append(
                f"  first refusal recorded in the storm (position {refusal['position']}):"
                f" {refusal['code']}: {refusal['message']}{then}"
            )
    lines += ["", CREDIT]
    return "\n".join(lines)


def arriving(got: Figures, plan: Plan) -> str:
    """How many requests arrived, and when the last did."""
    if got.requests == 1:
        return f"1 request, arriving at {got.last_arrival_s:g} s of a {plan.seconds:g} s run"
    return (
        f"{got.requests} requests arriving over {plan.seconds:g} s"
        f" (the last at {got.last_arrival_s:.1f} s)"
    )


def held_over(got: Figures, plan: Plan) -> str:
    """The span the figures sample, and whether the leases ran past the run's seconds."""
    text = f"held over {got.span_s:.0f} s, the first compose to the last lease's end"
    if got.span_s > plan.seconds:  # the first compose answers the first arrival, at 0 s
        return f"{text} (the last arrivals' leases run past {plan.seconds:g} s)"
    return text


def _plain(got: Figures) -> dict[str, Any]:
    """Figures as JSON-ready fields (dataclasses.asdict would rebuild the Counter from pairs)."""
    out = {f.name: getattr(got, f.name) for f in dataclasses.fields(got)}
    out["refused"] = dict(got.refused)
    # Every percentile named, null where its sample count cannot support it: one shape for
    # every run, as for the other figures over nothing.
    for name, qs in (
        ("ttft_ms", SERVING_PERCENTILES),
        ("tpot_ms", SERVING_PERCENTILES),
        ("latency_ms", PERCENTILES),
    ):
        out[name] = {f"p{q:g}": out[name].get(f"p{q:g}") for q in qs}
    return _rounded(out)


def _rounded(value: Any) -> Any:
    """`value` with every float to 9 decimals: a sum of time-weighted shares that is 7168 in
    the table is 7168.0 here too, not 7167.999999999998."""
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def write(outcome: Outcome, plan: Plan, out: Path, text: str) -> list[Path]:
    """report.txt, figures.json and (with matplotlib) the PNG plots in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.txt").write_text(text + "\n")
    record = {
        "plan": {"seconds": plan.seconds, "requests": plan.requests, "hall": str(plan.hall)},
        "assumptions": [dataclasses.asdict(a) for a in outcome.assumptions],
        "runs": {
            name: {
                "domain": outcome.runs[name].domain,
                "storm": outcome.runs[name].struck,
                "whys": [dataclasses.asdict(w) for w in outcome.runs[name].whys],
                "storm_refusal": storm_refusal(outcome.logs[name]),
                "figures": _plain(got),
            }
            for name, got in outcome.figures.items()
        },
    }
    (out / "figures.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    written = [out / "report.txt", out / "figures.json"]
    if plots.available():
        storm = (plan.storm_at, plan.storm_at + plan.storm_for)
        written += plots.draw(
            outcome.figures["pooled"], outcome.figures["fixed"], out, storm, plan.seconds
        )
    return written


async def main(plan: Plan, settings: Settings, out: Path, *, show: live.View = "auto") -> None:
    """Start an engine as configured (embedded servers for unset URLs), run both, compare."""
    out.mkdir(parents=True, exist_ok=True)  # a place the report cannot go fails now, not after
    stamp = new_stamp()
    settings = msgspec.structs.replace(settings, tenant_rate=RateLimit(per_second=0))  # UNTHROTTLED
    async with running_engine(settings) as running:
        if running.page_url:
            print(watch(running.page_url, stamp), flush=True)
        async with TrellisClient.connected(
            running.nats_url, prefix=running.subject_prefix, name="trellis-economics"
        ) as client:
            outcome = await economics(client, running.store, plan, stamp=stamp, show=show)
    outcome.assumptions.append(UNTHROTTLED)
    text = report(outcome, plan)
    print(text)
    written = write(outcome, plan, out, text)
    print(f"\nwritten: {', '.join(str(p) for p in written)}")
    if not plots.available():
        print("plots skipped: matplotlib is not installed (pip install 'trellis-fabric[demo]')")
