"""`trellis export --parquet DIR`: the log, the connection history and the compositions as
Parquet files for the auditor's own tools (adapters/postgres/export.py writes them)."""

from __future__ import annotations

import argparse
import asyncio

from trellis.adapters.endpoints import find_endpoint
from trellis.adapters.entrypoints.cli.errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    no_database,
    say,
)
from trellis.adapters.postgres import sessions
from trellis.adapters.postgres.export import (
    DomainExport,
    ExportError,
    SinceWouldSkip,
    export_parquet,
)
from trellis.adapters.postgres.migrations import require_current
from trellis.adapters.postgres.store import connect_pool
from trellis.adapters.settings import Settings

# What to do with an export whose chain the log no longer continues.
_DIVERGED_HINT = (
    "the export holds events the log no longer has (a failover to a standby without them, or "
    "a rewrite): keep this export as it is, export into a new directory, and run "
    "`trellis verify`"
)


def run(args: argparse.Namespace) -> int:
    """Append what is new since the last export into `args.parquet`; print one line per domain.
    A domain whose log no longer continues the export is refused in a line on stderr (exit 1),
    the others are exported."""
    settings = Settings.from_env()
    url = find_endpoint(settings, "database_url")
    if url is None:
        raise no_database()
    since, until = args.since, args.until
    if since is not None and until is not None and since > until:
        raise ExportError("--since is after --until")

    async def go() -> list[DomainExport]:
        pool = await connect_pool(
            url, schema=settings.db_schema, max_size=2, application_name=sessions.COMMAND
        )
        try:
            async with pool.acquire() as conn:
                await require_current(conn)
            domains = [args.domain] if args.domain else None
            return await export_parquet(
                pool, args.parquet, domains=domains, since=since, until=until
            )
        finally:
            await pool.close()

    try:
        exported = asyncio.run(go())
    except SinceWouldSkip as exc:  # nothing was written: the command line is to change
        raise CliError(str(exc), code="usage", hint=exc.hint, exit=EXIT_USAGE) from None
    except OSError as exc:
        if exc.filename is None:  # a connection's, not a file's: main says Postgres is down
            raise
        raise ExportError(
            f"cannot write the export in {args.parquet}: {exc.strerror}: {exc.filename}"
        ) from None
    for done in exported:
        if done.diverged is None:
            print(_summary(done))
        if done.earlier_folds is not None and done.events:
            say(
                "folds",
                f"{done.domain}: the history and compositions rows of this run were folded by "
                f"{done.folds}, those of earlier runs into {args.parquet} by "
                f"{done.earlier_folds}; a fold that changed meaning (docs/operations.md, "
                "Upgrading) reads differently in the two",
                "export into a new directory for rows of one fold throughout "
                "(the files' trellis.folds says which)",
            )
    diverged = [done.diverged for done in exported if done.diverged is not None]
    for why in diverged:
        say("diverged", f"{why}; nothing was exported for it", _DIVERGED_HINT)
    edited = [done for done in exported if done.checkpoint_problem is not None]
    for done in edited:
        say(
            "checkpoint",
            f"{done.domain}: {done.checkpoint_problem}; its files carry no checkpoint",
            "check the log against a checkpoint note you kept: trellis verify --key-file ...",
        )
    return EXIT_FAILED if diverged or edited else EXIT_OK


def _summary(done: DomainExport) -> str:
    lag = (
        f" (the history projection has folded the log only this far, of {done.held_back};"
        " start the engine or run `trellis projections rebuild`)"
        if done.held_back is not None
        else ""
    )
    if not done.events:
        return f"{done.domain}: nothing new to export{lag}"
    return (
        f"{done.domain}: exported positions {done.first_position}-{done.last_position}:"
        f" {done.events} events, {done.history} ended intervals, {done.compositions} ended"
        f" compositions, in {len(done.files)} files{lag}"
    )
