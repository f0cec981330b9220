"""Flood benchmark (ARCHITECTURE §10, Tenants): one tenant floods, another tenant's latency.

- calm: tenant `calm` composes a GPU and releases it, CALM_PAIRS_PER_S pairs a second (a tenant
  within its rate), alone; its compose and release latencies (ms) are the baseline.
- flood: the same, while tenant `flood` sends FLOOD composes (a model nobody has, so every one
  that reaches the engine is refused and recorded) with IN_FLIGHT in flight.
- Both phases run twice, each on an engine of its own in the same run: with the default tenant
  rate (`engine/core/throttle.py`: what `trellis up` uses) and with no rate at all (the baseline
  that shows what the rate prevents).
- `--views`: the flood is tenant `flood`'s `preview` views instead (each places a request for
  more GPUs than the hall has, on the engine that writes the domain), VIEW_IN_FLIGHT in
  flight, with the default view budget and with none.

Printed: calm's p50/p99 calm and flooding (ROUNDS floods one after another, calm sampling
them all), their ratio, what one flood was answered (`throttled`, refused), how many events it
added to the log, and how long it took (means of the rounds). The target:
with the default rate, most of the flood is `throttled`, it adds under 1,000 events, and calm's
p99 while flooding stays within 5x its calm p99. Every calm reply is checked; the last line
is one JSON object with every figure.

    python bench/flood.py             # ~1 min on 2 cores
    python bench/flood.py --quick
    python bench/flood.py --views     # a flood of previews against the view budget
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path as FsPath
from typing import Any

sys.path.insert(0, str(FsPath(__file__).resolve().parents[1]))

from bench.intents import (
    BenchFailure,
    check_compose,
    check_release,
    fresh_schema,
    percentile,
    progress,
    servers,
    topology,
)
from trellis.adapters.bootstrap import engine_on
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats
from trellis.adapters.settings import Settings
from trellis.engine.core.throttle import RateLimit, ViewBudget

DOMAIN = "flood"
CALM_HOST = "host-r0-0"
IMPOSSIBLE = {"host": "host-r1-0", "devices": [{"kind": "gpu", "models": ["B999"]}]}
# A preview that places: every host's every GPU looked at, none enough.
PREVIEW = {"manifest": {"host_selector": {}, "devices": [{"kind": "gpu", "count": 100}]}}
VIEW_FLOOD, VIEW_IN_FLIGHT = 2000, 16
# Two intents a pair: 40 a second, within the default rate of 50 a tenant.
CALM_PAIRS_PER_S = 20


async def calm_pairs(client: TrellisClient, until: asyncio.Event, at_least: int) -> list[float]:
    """Compose-and-release pairs as tenant `calm` until `until` is set (and `at_least` done):
    each operation's latency in ms."""
    samples: list[float] = []
    done = 0
    next_at = time.perf_counter()
    while not until.is_set() or done < at_least:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        next_at += 1 / CALM_PAIRS_PER_S
        started = time.perf_counter()
        reply = await client.intent(
            DOMAIN, "calm", "compose", {"host": CALM_HOST, "devices": [{"kind": "gpu"}]}
        )
        samples.append((time.perf_counter() - started) * 1000)
        cid = check_compose(reply, CALM_HOST)
        started = time.perf_counter()
        reply = await client.intent(DOMAIN, "calm", "release", {"composition_id": cid})
        samples.append((time.perf_counter() - started) * 1000)
        check_release(reply, cid)
        done += 1
    return samples


# The flooder runs in a process of its own, as a hostile tenant's client would: its requests
# compete with the engine for the machine, not for the engine's event loop.
FLOODER = """
import asyncio, collections, json, sys, uuid
import nats

async def main(url, subject, count, in_flight, body):
    nc = await nats.connect(url)
    codes, slots = collections.Counter(), asyncio.Semaphore(in_flight)

    async def one():
        async with slots:
            ids = {"request_id": uuid.uuid4().hex} if ".intent." in subject else {}
            request = json.dumps({**ids, **body}).encode()
            reply = json.loads((await nc.request(subject, request, timeout=60)).data)
        codes["ok" if reply.get("ok") else reply["error"]["code"]] += 1

    await asyncio.gather(*(one() for _ in range(count)))
    await nc.close()
    print(json.dumps(codes))

url, subject, count, in_flight, body = sys.argv[1:]
asyncio.run(main(url, subject, int(count), int(in_flight), json.loads(body)))
"""


async def flood(
    nats_url: str, prefix: str, count: int, in_flight: int, views: bool
) -> Counter[str]:
    """`count` impossible composes (or previews) as tenant `flood`, `in_flight` at a time, from
    a process of their own: their codes."""
    subject = f"{prefix}.intent.{DOMAIN}.flood.compose"
    body: dict[str, Any] = IMPOSSIBLE
    if views:
        subject, body = f"{prefix}.view.{DOMAIN}.flood.preview", PREVIEW
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOODER, nats_url, subject, str(count), str(in_flight),
        json.dumps(body), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise BenchFailure(f"the flooder exited {proc.returncode}")
    return Counter(json.loads(out))


async def phase(
    args: argparse.Namespace, limit: RateLimit, budget: ViewBudget, name: str
) -> dict[str, Any]:
    settings = Settings.from_env()
    async with servers(settings) as urls, fresh_schema(urls.database_owner_url, False) as schema:
        prefix = f"bench{int(time.time() * 1000) % 10**9}"
        settings = Settings(
            nats_url=urls.nats_url,
            database_url=urls.database_url,
            database_owner_url=urls.database_owner_url,
            db_schema=schema,
            subject_prefix=prefix,
            tenant_rate=limit,
            view_budget=budget,
        )
        async with engine_on(settings) as running:
            calm_nc = await connect_nats(urls.nats_url, name="bench-calm")
            try:
                calm = TrellisClient(calm_nc, prefix=prefix, timeout=30)
                reply = await calm.admin(DOMAIN, "import-topology", topology(16))
                if not reply.get("ok"):
                    raise BenchFailure(f"import: {reply}")
                stop = asyncio.Event()
                stop.set()
                await calm_pairs(calm, stop, args.warmup)
                progress(f"{name}: calm")
                quiet = await calm_pairs(calm, stop, args.pairs)
                before = (await running.store.head(DOMAIN)).version
                what = "previews" if args.views else "composes"
                progress(
                    f"{name}: {args.rounds} floods of {args.flood} {what}, "
                    f"{args.in_flight} in flight"
                )
                flooding = asyncio.Event()
                calm_task = asyncio.create_task(calm_pairs(calm, flooding, 10))
                started = time.perf_counter()
                codes: Counter[str] = Counter()
                for _ in range(args.rounds):
                    codes += await flood(
                        urls.nats_url, prefix, args.flood, args.in_flight, args.views
                    )
                seconds = (time.perf_counter() - started) / args.rounds
                flooding.set()
                loud = await calm_task
                after = (await running.store.head(DOMAIN)).version
            finally:
                await calm_nc.close()
    calm_events = len(loud) // 2 * 5  # a compose's 4 events and a release's 1
    return {
        "limit": {"per_second": limit.per_second, "burst": limit.burst},
        "view_budget": {
            "share": budget.share,
            "burst_s": budget.burst_s,
            "in_flight": budget.in_flight,
        },
        "calm": summary(quiet),
        "flooding": summary(loud),
        "flood": {  # per flood (the mean of the rounds)
            "sent": args.flood,
            "in_flight": args.in_flight,
            "codes": {code: n // args.rounds for code, n in codes.items()},
            "seconds": round(seconds, 2),
            "events_added": max(0, after - before - calm_events) // args.rounds,
        },
    }


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "p50_ms": round(percentile(samples, 50), 2),
        "p99_ms": round(percentile(samples, 99), 2),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| limit | calm p50 / p99 ms | flooding p50 / p99 ms | p99 ratio | throttled | "
        "refused (recorded) | events added | flood s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result.items():
        calm, loud, f = r["calm"], r["flooding"], r["flood"]
        ratio = loud["p99_ms"] / calm["p99_ms"]
        r["p99_ratio"] = round(ratio, 2)
        lines.append(
            f"| {name} | {calm['p50_ms']} / {calm['p99_ms']} | {loud['p50_ms']} / "
            f"{loud['p99_ms']} | {ratio:.2f}x | {f['codes'].get('throttled', 0)} of {f['sent']} | "
            f"{f['codes'].get('no_capacity', 0)} | {f['events_added']} | {f['seconds']} |"
        )
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rate, budget = RateLimit(), ViewBudget()
    if args.views:
        name = (
            f"view budget ({budget.share:g} of the engine, {budget.burst_s:g} s, "
            f"{budget.in_flight} in flight)"
        )
        return {
            name: await phase(args, rate, budget, "default view budget"),
            "none (baseline)": await phase(args, rate, ViewBudget(share=0), "no view budget"),
        }
    return {
        f"tenant rate ({rate.per_second:g}/s, burst {rate.burst})": await phase(
            args, rate, budget, "default rate"
        ),
        "none (baseline)": await phase(args, RateLimit(0), budget, "no rate"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=5000, help="composes the flooder sends")
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument(
        "--rounds", type=int, default=5, help="floods one after another (calm samples them all)"
    )
    parser.add_argument("--pairs", type=int, default=200, help="calm pairs timed alone")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--views", action="store_true", help="flood with previews against the view budget"
    )
    args = parser.parse_args()
    if args.views:
        args.flood, args.in_flight = VIEW_FLOOD, VIEW_IN_FLIGHT
    if args.quick:
        args.flood, args.pairs, args.warmup, args.rounds = args.flood // 5, 50, 5, 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = asyncio.run(bench(args))
    print(table(result))
    default = next(iter(result.values()))
    codes = default["flood"]["codes"]
    met = (
        codes.get("throttled", 0) > default["flood"]["sent"] / 2
        and default["flood"]["events_added"] < 1000
        and default["p99_ratio"] <= 5
    )  # a flood of views adds no event at all
    verdict = "met" if met else "MISSED"
    print(f"target (most throttled, < 1,000 events, calm p99 within 5x): {verdict}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
