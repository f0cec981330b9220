"""The economics run's progress while it runs: a live table (rich) on a terminal, else a line
every few seconds.

The counts are the run's own (composes sent, composed, refused) and the GPUs its scheduler's
KV view shows held; they say how far it has got. The figures come afterwards, from the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from trellis.adapters.entrypoints.economics.runs import Plan, Run

PLAIN_EVERY_S = 5.0
LIVE_PER_S = 4
#: How progress shows: not at all, as lines, as the live table, or the table when stdout is a
#: terminal and rich is installed and lines otherwise.
View = Literal["off", "lines", "live", "auto"]


def rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def seconds(run: Run, plan: Plan) -> str:
    """How far the run is: into its arrivals (never past them), then the time since, the
    drain's leases running out."""
    elapsed = run.elapsed()
    shown = f"{min(elapsed, plan.seconds):.0f}/{plan.seconds:g} s"
    past = elapsed - plan.seconds
    return f"{shown} +{past:.0f} s" if past >= 0.5 else shown


def line(run: Run, plan: Plan) -> str:
    c = run.counts
    storm = f", storm: {' '.join(run.struck)}" if run.stage == "storm" else ""
    return (
        f"{run.name}: {run.stage}, {seconds(run, plan)}, composes"
        f" {c['sent']} ({c['composed']} composed, {c['refused']} refused),"
        f" GPUs held {run.gpus_held}/{run.gpus}{storm}"
    )


def status_table(runs: Sequence[Run], plan: Plan) -> Any:
    from rich.table import Table

    table = Table(title=f"trellis demo economics: {plan.requests} requests over {plan.seconds:g} s")
    for heading in ("run", "stage", "seconds", "composes", "composed", "refused", "GPUs held"):
        table.add_column(heading, justify="left" if heading in ("run", "stage") else "right")
    for run in runs:
        stage = f"[red]storm: {run.struck[0]}[/red]" if run.stage == "storm" else run.stage
        c = run.counts
        table.add_row(
            run.name,
            stage,
            seconds(run, plan),
            str(c["sent"]),
            str(c["composed"]),
            str(c["refused"]),
            f"{run.gpus_held}/{run.gpus}",
        )
    return table


@contextlib.asynccontextmanager
async def progress(runs: Sequence[Run], plan: Plan, view: View = "auto") -> AsyncIterator[None]:
    """Show `runs` progressing until the block ends, as `view` says."""
    if view == "off":
        yield
        return
    if view == "auto":
        view = "live" if sys.stdout.isatty() and rich_available() else "lines"
    if view == "live":
        from rich.live import Live

        with Live(status_table(runs, plan), refresh_per_second=LIVE_PER_S) as table:

            async def refresh() -> None:
                while True:
                    await asyncio.sleep(1 / LIVE_PER_S)
                    table.update(status_table(runs, plan))

            task = asyncio.create_task(refresh())
            try:
                yield
            finally:
                task.cancel()
                table.update(status_table(runs, plan))
        return

    async def lines() -> None:
        while True:
            await asyncio.sleep(PLAIN_EVERY_S)
            for run in runs:
                if run.stage not in ("waiting", "done"):
                    print(line(run, plan), flush=True)

    task = asyncio.create_task(lines())
    try:
        yield
    finally:
        task.cancel()
