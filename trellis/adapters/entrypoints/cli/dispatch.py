"""`trellis`'s main: parse the command line, run the command, and turn every failure into one
line on stderr and its exit code (errors.py)."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence

import asyncpg

from trellis.adapters.embedded.postgres_server import DataDirVersionError
from trellis.adapters.embedded.process import EmbeddedServerError, PortTakenError
from trellis.adapters.entrypoints.cli.errors import (
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    UsageError,
    say,
)
from trellis.adapters.entrypoints.cli.parser import make_parser
from trellis.adapters.nats.jetstream import (
    StreamConfigError,
)
from trellis.adapters.postgres.export import ExportError
from trellis.adapters.postgres.migrations import MigrationError
from trellis.adapters.postgres.privileges import PrivilegeError
from trellis.adapters.settings import SettingsError
from trellis.engine.core.errors import StoreUnavailable


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart from a bug
        return code
    except KeyboardInterrupt:  # at any moment: parsing, a command, printing its answer
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`trellis ... | head -1`): stop quietly, as a command killed by
        # SIGPIPE would, and keep the interpreter's last flush from complaining.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def _main(argv: Sequence[str] | None) -> int:
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        say("usage", str(exc), exc.hint)
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.run(args)
    except BrokenPipeError:
        raise  # not a bug, nor a database that is down: main stops quietly
    except CliError as exc:
        say(exc.code, str(exc), exc.hint)
        return exc.exit
    except SettingsError as exc:
        say("config", str(exc), "see docs/configuration.md")
        return EXIT_FAILED
    except (MigrationError, PrivilegeError, StreamConfigError, ExportError) as exc:
        say("error", str(exc), None)
        return EXIT_FAILED
    except DataDirVersionError as exc:
        say("incompatible", str(exc), exc.hint)
        return EXIT_FAILED
    except PortTakenError as exc:  # another process listens on a pinned port: not a bug
        say("taken", str(exc), _PORT_TAKEN_HINT)
        return EXIT_FAILED
    except EmbeddedServerError as exc:  # the message quotes the tail of the server's log
        say("error", str(exc), "the embedded servers live under TRELLIS_DATA_DIR")
        return EXIT_FAILED
    except _POSTGRES_REFUSED as exc:  # configuration, not an outage: not waited out
        say("refused", f"Postgres refused the connection: {exc}", "check TRELLIS_DATABASE_URL")
        return EXIT_FAILED
    except StoreUnavailable as exc:
        say("unavailable", str(exc), "is Postgres running? see TRELLIS_DATABASE_URL")
        return EXIT_UNAVAILABLE
    except _POSTGRES_DOWN as exc:  # the local commands that read the database themselves
        say(
            "unavailable",
            f"cannot reach Postgres: {str(exc) or type(exc).__name__}",
            "is `trellis up` or Postgres running? see TRELLIS_DATABASE_URL",
        )
        return EXIT_UNAVAILABLE
    except OSError as exc:
        if exc.filename is None:  # not a file's: nothing the operator named
            return _internal(exc, args.verbose)
        # A file or directory the command was to read or write (its path, or under it).
        say("error", f"{exc.filename}: {exc.strerror or exc}", None)
        return EXIT_FAILED
    except Exception as exc:
        return _internal(exc, args.verbose)
    return code


def _internal(exc: Exception, verbose: bool) -> int:
    if verbose:
        traceback.print_exc()
    say("internal", f"{type(exc).__name__}: {exc}", "run with -v for the traceback")
    return EXIT_INTERNAL


_PORT_TAKEN_HINT = (
    "stop what listens there, or pin another port: TRELLIS_NATS_PORT, TRELLIS_PG_PORT, "
    "TRELLIS_NATS_MONITOR_PORT (unset: a free one)"
)

# A wrong role or password, or no such database.
_POSTGRES_REFUSED = (
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
)


# Nothing listens, or the server is starting or shutting down. (NATS commands report their
# own connection trouble in on_nats, so what reaches main is a database connection's.)
_POSTGRES_DOWN = (ConnectionError, asyncpg.CannotConnectNowError)
