"""The `trellis` command: run the engine, and talk to a running one over NATS.

It lives in adapters/ (not engine/, as the first module map had it) because it wires concrete
adapters, and the engine core imports none. The package:

- `main` here, the console script, which imports the rest only once it can catch Ctrl-C;
  `dispatch.py`: parsing and running a command, which owns the errors and exit codes
  (`errors.py`);
- `parser.py`: the root of the command line and the order of its commands;
- the commands by area, each module with their arguments and handlers: `serve.py` (up,
  follow, demo, tenant add), `intents.py` (compose, release, extend), `queries.py`,
  `admin.py` (the operator's verbs and quotas), `topology.py` (import, show, replay,
  fabric), `watching.py` (watch), `local.py` (projections rebuild, schema export); the
  audit's commands are `audit_proofs.py` and `audit_verify.py` beside this package;
- `options.py`: the options commands share and the types that check values;
- `talk.py`: a request to the running engine and printing its reply.
"""

from collections.abc import Sequence

from trellis.adapters.entrypoints.cli.errors import (
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "CliError",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """The `trellis` command (pyproject.toml's console script). The CLI's imports take most of
    a second: they are made here, under the catch, so a Ctrl-C during them is exit 130 without
    a traceback, as one at any later moment is (dispatch.main)."""
    try:
        from trellis.adapters.entrypoints.cli.dispatch import main as dispatch
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return dispatch(argv)
