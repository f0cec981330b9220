"""The CLI's exit codes and its one-line errors (docs/operations.md)."""

from __future__ import annotations

import sys

# Exit codes (docs/operations.md): what a script can tell apart without reading the line.
EXIT_OK = 0
EXIT_FAILED = 1  # the engine refused, a check found a difference, or a local step failed
EXIT_USAGE = 2  # the command line is wrong (a flag, an id): nothing was sent
EXIT_UNAVAILABLE = 3  # NATS, the engine or Postgres could not be reached, or did not answer
EXIT_INTERNAL = 70  # a bug: the line says so, and -v shows the traceback
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # what a shell reports for a command killed by SIGPIPE


def say(code: str, message: str, hint: str | None) -> None:
    """One line on stderr: `trellis: <code>: <sentence> (hint: ...)`."""
    line = f"trellis: {code}: " + " ".join(message.split())
    if hint:
        line += f" (hint: {hint})"
    print(line, file=sys.stderr)


class CliError(Exception):
    """A problem to report in one line, without a traceback: its code, the sentence, a hint
    and the exit code."""

    def __init__(
        self, message: str, *, code: str = "error", hint: str | None = None, exit: int = 1
    ) -> None:
        super().__init__(message)
        self.code, self.hint, self.exit = code, hint, exit


def no_database() -> CliError:
    """What the commands that read Postgres themselves say when nothing is configured and no
    `trellis up` runs on this data dir: the outage code, as `no engine found` is."""
    return CliError(
        "no database found",
        code="unavailable",
        hint="start one with `trellis up`, or set TRELLIS_DATABASE_URL",
        exit=EXIT_UNAVAILABLE,
    )


class UsageError(Exception):
    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint
