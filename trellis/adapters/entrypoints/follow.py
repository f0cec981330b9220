"""The follower process: the log followers of TRELLIS_FOLLOWERS=process (follow_process.py).

`python -m trellis.adapters.entrypoints.follow` (or `trellis follow`) keeps the projections, the
event relay (JetStream stream and KV bucket) and the signed checkpoints up to date with every
domain in the log: the same sinks the engine follows inline (adapters.bootstrap.follower_sinks).
It is woken by the engine's commit signal on `<prefix>.internal.committed.<domain>`, looks at
the log every second as well (a missed signal, a new domain), and exits cleanly on SIGTERM or
SIGINT after a last catch-up, or when the process that started it is gone (a killed engine
leaves no follower behind, even one still waiting for its servers; the next engine starts its
own). It reads the engine's settings from the environment: both URLs must be set (the engine's
`FollowerProcess` sets them, with TRELLIS_FOLLOWER_CREDENTIALS in secure mode, and the pipe its
counters reach the engine's /metrics over: TRELLIS_FOLLOWER_REPORT_FD, follow_process.CountReport).
The schema must be migrated already: the engine does that before it starts this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from nats.aio.msg import Msg

from trellis.adapters import event_loop
from trellis.adapters.bootstrap import checkpoint_signer, follower_sinks
from trellis.adapters.collector import settle_for_serving
from trellis.adapters.follow_process import (
    PARENT_ENV,
    SECURE_DATA_DIR_ENV,
    CountReport,
    committed_subject,
)
from trellis.adapters.nats.auth import SecureDir
from trellis.adapters.nats.connect import until_reachable
from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.store import PostgresEventStore
from trellis.adapters.settings import Settings, SettingsError, redacted
from trellis.engine.core.errors import StoreUnavailable
from trellis.engine.core.ids import is_valid_id
from trellis.engine.service.follower import Followers

log = logging.getLogger("trellis.follow")

T = TypeVar("T")

#: Seconds between looks at the log for new domains and missed commits.
POLL_S = 1.0
#: Seconds a commit signal waits for others before it wakes the followers: a core of its own
#: would otherwise let them apply every commit alone, a transaction per sink each, and on a
#: small machine those commits compete with the engine's own for Postgres.
WAKE_DELAY_S = 0.02


class Stopped(Exception):
    """Asked to stop (a signal, or the engine gone) before it followed anything."""


async def follow(
    settings: Settings, secure: SecureDir | None = None, parent: int | None = None
) -> None:
    """Follow every domain in the log until SIGTERM or SIGINT, or until the process `parent`
    is no longer ours; either ends a wait for the servers at start too."""
    if not (settings.nats_url and settings.database_url):
        raise SettingsError("the follower process needs TRELLIS_NATS_URL and TRELLIS_DATABASE_URL")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    orphaned = None if parent is None else asyncio.create_task(_until_orphaned(parent, stop))
    try:
        await _follow(settings, settings.nats_url, settings.database_url, secure, stop)
    except Stopped:
        log.info("stopped before following anything")
    finally:
        if orphaned is not None:
            orphaned.cancel()


async def _until_orphaned(parent: int, stop: asyncio.Event) -> None:
    """Stop once the process `parent` is no longer ours: the engine died without stopping us."""
    while os.getppid() == parent:
        await asyncio.sleep(POLL_S)
    log.warning("the engine (pid %d) is gone; stopping", parent)
    stop.set()


async def _unless_stopped(stop: asyncio.Event, starting: Awaitable[T]) -> T:
    """What `starting` gives, unless `stop` is set first: then it is cancelled (a wait for a
    server that will never come back) and Stopped is raised."""
    start = asyncio.ensure_future(starting)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not start.done():
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
    if start.cancelled():
        raise Stopped
    return start.result()


async def _follow(
    settings: Settings,
    nats_url: str,
    database_url: str,
    secure: SecureDir | None,
    stop: asyncio.Event,
) -> None:
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        store = await _unless_stopped(
            stop,
            until_reachable(
                "Postgres",
                redacted(database_url),
                lambda: PostgresEventStore.open(
                    database_url, schema=settings.db_schema, application_name=sessions.FOLLOWER
                ),
                (StoreUnavailable,),
            ),
        )
        stack.push_async_callback(store.close)
        sinks = await _unless_stopped(
            stop,
            follower_sinks(
                stack,
                nats_url,
                database_url,
                schema=settings.db_schema,
                prefix=settings.subject_prefix,
                stream_limits=settings.stream_limits,
                secure=secure,
                signer=checkpoint_signer(settings),
                checkpoint_every=settings.checkpoint_every,
                snapshot_every=settings.snapshot_every,
            ),
        )
        report = CountReport.from_env()
        if report is not None:  # counted on the engine's /metrics, as inline followers count
            sinks.relay.foreign.on_skip = report.foreign_message
        followers = Followers(
            store,
            [sinks.projections, sinks.relay, sinks.audit],
            poll_interval=POLL_S,
            pass_interval=settings.follow_gather_s,
        )
        stack.push_async_callback(followers.close)

        pending: set[str] = set()

        def wake() -> None:
            for domain in sorted(pending):
                followers.follow(domain)
                followers.notify(domain)
            pending.clear()

        async def woken(msg: Msg) -> None:
            domain = msg.subject.rpartition(".")[2]
            if is_valid_id(domain):
                if not pending:
                    loop.call_later(WAKE_DELAY_S, wake)
                pending.add(domain)

        sub = await sinks.nc.subscribe(committed_subject(settings.subject_prefix), cb=woken)
        stack.push_async_callback(sub.unsubscribe)
        log.info("following the log of %s (pid %d)", settings.subject_prefix, os.getpid())
        settle_for_serving()
        while not stop.is_set():
            try:
                for domain in await store.domains():
                    followers.follow(domain)
            except Exception as exc:  # Postgres away: the followers report their own failures
                log.warning("cannot list the log's domains: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)
        log.info("stopping: a last catch-up, then exit")


def as_batch_work() -> None:
    """Run this process as batch work (Linux's SCHED_BATCH): the same share of the CPU, but
    a follower waking for its pass does not take a core from an intent that is running.

    Stopping this process for the serial phase of bench/intents.py took the serial compose
    p99 from 10-12 ms to 6-8 ms: its passes were taking the cores from the intents committed
    meanwhile. As batch work it never starves (its weight is a normal process's), and ten
    alternated runs put the serial compose p99 11% lower (docs/benchmarks.md). Threads made
    later inherit the policy; where there is none (not Linux), nothing changes."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def main() -> int:
    as_batch_work()
    logging.basicConfig(
        level=logging.INFO if os.environ.get("TRELLIS_VERBOSE") else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s [follow]: %(message)s",
    )
    secure = os.environ.get(SECURE_DATA_DIR_ENV)
    # The engine's pid from the engine itself: it may be gone before this line runs.
    parent = os.environ.get(PARENT_ENV)
    try:
        settings = Settings.from_env()
        event_loop.run(
            follow(
                settings,
                SecureDir(Path(secure)) if secure else None,
                int(parent) if parent and parent.isdigit() else None,
            ),
            settings.event_loop,
        )
    except SettingsError as exc:
        print(f"trellis follow: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
