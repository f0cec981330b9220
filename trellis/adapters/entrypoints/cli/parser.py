"""The `trellis` command line: the root parser and its help, and the order of the commands (as
`--help` lists them); each area's module adds its own commands, their arguments and handlers."""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.metadata
import sys
from pathlib import Path
from typing import Any, NoReturn

from trellis import DISTRIBUTION
from trellis.adapters.entrypoints import (
    audit_proofs,
    audit_verify,
    completion,
    export,
)
from trellis.adapters.entrypoints.cli import (
    admin,
    intents,
    local,
    queries,
    reservations,
    serve,
    topology,
    watching,
)
from trellis.adapters.entrypoints.cli.errors import EXIT_USAGE, UsageError
from trellis.adapters.entrypoints.cli.options import (
    client_options,
    identifier,
    moment,
    request_id_option,
)
from trellis.adapters.entrypoints.cli.talk import may_have_been_committed, request

DESCRIPTION = "The `trellis` command: run the engine, and talk to a running one over NATS."


class _Help(argparse.HelpFormatter):
    """Help that names each option's default, when it has one worth naming: not an empty one
    ("(default: )" said nothing), and not one its help names already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default in (None, False, [], "", argparse.SUPPRESS)
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands whose `--help` opens with the line `trellis --help` lists them by, and
    which are handed the shared options given before them (`trellis -o json free`)."""

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if "help" in kwargs and "description" not in kwargs:
            kwargs["description"] = kwargs["help"]
        return super().add_parser(name, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> Any:
        chosen = self._name_parser_map.get(values[0])
        if isinstance(chosen, _Parser):
            chosen.given_before = {
                dest: getattr(namespace, dest) for dest in _BEFORE if hasattr(namespace, dest)
            }
        return super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported as one line (not the usage block) and exit code 2,
    no abbreviated long option, and help that names defaults (every subcommand's parser is
    one of these)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        # A long option by its name only, as kubectl takes them: `--ten` taken as --tenant (or
        # `--reas` as --reason) composed, and a new option starting alike would change its
        # meaning unsaid.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)
        # Shared options given before this command (set by _Commands as it is chosen).
        self.given_before: dict[str, Any] = {}

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"`{self.prog} --help`")

    def add_subparsers(self, **kwargs: Any) -> Any:
        # A command named without its action (`trellis topology`): this one's help, not the
        # root's; an action's own `run` takes the place of this default.
        self.set_defaults(run=functools.partial(_help, self))
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if namespace is None and self.given_before:
            # Set before parsing, so they stand in for this command's defaults and the same
            # options given after the command override them.
            namespace = argparse.Namespace(**self.given_before)
            if self._subparsers is None:
                self._takes_all(self.given_before)
        if self._subparsers is not None:
            self._known_options_before_command(sys.argv[1:] if args is None else list(args))
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(namespace, _LEFT_TO):
            # The innermost command returns first: it names the help that lists its options.
            setattr(namespace, _LEFT_TO, self.prog)
        return namespace, extras

    def _known_options_before_command(self, args: list[str]) -> None:
        """An option this parser does not know, before its command, is named as such: with no
        abbreviations, `trellis --out json engines` left `--out` over and took `json` for the
        command ("invalid choice: 'json'")."""
        rest = iter(args)
        for arg in rest:
            if not arg.startswith("-") or arg in ("-", "--"):
                return  # the command: what follows is its own
            # `--output=json`, and a short option's value attached to it (`-ojson`).
            name = arg[:2] if arg[1] != "-" else arg.split("=", 1)[0]
            action = self._option_string_actions.get(name)
            if action is None:
                known = [o for o in self._option_string_actions if o.startswith("--")]
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise UsageError(f"unrecognized option {name}{hint}", f"`{self.prog} --help`")
            if action.nargs != 0 and name == arg:
                next(rest, None)  # its value, the next argument

    def _takes_all(self, given: dict[str, Any]) -> None:
        """A shared option given before a command that has no such option is a mistake, not
        ignored (`trellis -o json up`)."""
        own = {action.dest for action in self._actions}
        for dest in given:
            if dest not in own:
                raise UsageError(
                    f"{_BEFORE[dest]} given before the command, which takes none",
                    f"`{self.prog} --help`",
                )

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            message = f"unrecognized arguments: {' '.join(extras)}"
            raise UsageError(message, f"`{getattr(namespace, _LEFT_TO)} --help`")
        return namespace


# Set in the namespace of a command line with arguments no command took: the innermost
# command's name, for the hint.
_LEFT_TO = "_trellis_unrecognized_by"

# The options every command that talks to the engine shares (options.client_options), by
# their dest: taken before the command too, as kubectl takes its global flags.
_BEFORE = {
    "output": "-o/--output",
    "domain": "--domain",
    "timeout": "--timeout",
    "creds": "--creds",
}


def _shared_before_command(parser: argparse.ArgumentParser) -> None:
    """The root takes client_options' options too (`trellis -o json free`), as the commands
    define them but without defaults: a command's own defaults stand unless one is given, and
    one given after the command wins."""
    group = parser.add_argument_group(
        "options of the commands that talk to the engine, also taken before the command "
        "(`trellis -o json free`; given after it too, the one after wins)"
    )
    scratch = argparse.ArgumentParser(add_help=False)
    client_options(scratch)
    for action in scratch._actions:
        assert action.dest in _BEFORE, action.dest  # a new shared option: name it in _BEFORE
        action.default = argparse.SUPPRESS
        action.help = (action.help or "").split(" (default")[0]
        group._add_action(action)


def _help(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    parser.print_help()
    return EXIT_USAGE


class _RawEpilog(_Help):
    """The root's help: its epilog's lines kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


ENVIRONMENT = """environment (docs/configuration.md has them all):
  TRELLIS_NATS_URL       the engine's NATS (unset: the local `trellis up`'s, or embedded)
  TRELLIS_DATABASE_URL   its PostgreSQL (unset: embedded)
  TRELLIS_DATA_DIR       embedded servers' data, endpoints.json, identities
  TRELLIS_SUBJECT_PREFIX subjects' first token (default trellis)
  TRELLIS_DOMAIN         --domain's default
  TRELLIS_TENANT         --tenant's default
  TRELLIS_NATS_CREDS     --creds' default
exit codes: 0 ok, 1 refused or failed, 2 usage, 3 unavailable, 70 internal (docs/operations.md)"""


def _verbose_anywhere(parser: argparse.ArgumentParser) -> None:
    """`-v` after a subcommand too (`trellis compose -v ...`), as people type it: every
    subcommand takes it, without resetting one given before the subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                if not any("-v" in a.option_strings for a in sub._actions):
                    sub.add_argument(
                        "-v",
                        "--verbose",
                        action="store_true",
                        default=argparse.SUPPRESS,
                        help="log at INFO level",
                    )
                _verbose_anywhere(sub)


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trellis",
        description=DESCRIPTION,
        epilog=ENVIRONMENT,
        formatter_class=_RawEpilog,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="show the version and the schema it migrates to"
    )
    _shared_before_command(parser)
    sub = parser.add_subparsers(metavar="COMMAND")
    # In the order `--help` lists them.
    serve.add_commands(sub)
    topology.add_commands(sub)
    intents.add_commands(sub)
    queries.add_composition(sub)
    watching.add_commands(sub)
    intents.add_extend(sub)
    reservations.add_commands(sub)
    admin.add_commands(sub)
    queries.add_commands(sub)
    admin.add_quota(sub)
    audit_proofs.register(sub, request, may_have_been_committed, client_options, request_id_option)
    # One `verify`, two modes: with --proof / --checkpoint the offline proof check
    # (audit_proofs), else the log against the database (audit_verify.run dispatches).
    verify = sub.add_parser(
        "verify",
        help="check the hash chain, the invariants, the projections, the event stream and the "
        "KV bucket against the log (exit 1 on any finding, 2 when it cannot run); with "
        "--proof, check a proof offline against signed checkpoints",
    )
    audit_verify.add_arguments(verify)
    audit_proofs.add_offline_verify(verify)
    verify.set_defaults(run=audit_verify.run)

    topology.add_fabric(sub)
    local.add_projections(sub)

    parquet = sub.add_parser(
        "export", help="append the log, connection history and compositions to Parquet files"
    )
    parquet.add_argument(
        "--parquet",
        type=Path,
        required=True,
        metavar="DIR",
        help="the folder of the Parquet files (made if missing; appended to if there)",
    )
    parquet.add_argument(
        "--domain", type=identifier("domain"), help="only this domain (default: every domain)"
    )
    parquet.add_argument(
        "--since", type=moment, metavar="TIME", help="skip events before this ISO time"
    )
    parquet.add_argument(
        "--until", type=moment, metavar="TIME", help="stop at the last event at or before"
    )
    parquet.set_defaults(run=export.run)

    local.add_schema(sub)

    complete = sub.add_parser(
        "completion",
        help="print a shell completion script (`source <(trellis completion bash)`)",
    )
    complete.add_argument("shell", choices=completion.SHELLS, help="the shell to complete in")
    complete.set_defaults(run=_completion)
    _verbose_anywhere(parser)
    return parser


class _Version(argparse.Action):
    """`--version`, worked out only when asked (the schema folder is read then)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> Any:
        print(f"trellis {_version()}")
        parser.exit()


def _version() -> str:
    """The package's version and the last schema migration it carries: two builds of one
    version may migrate further, and an engine refuses a schema migrated past its own."""
    from trellis.adapters.postgres.migrations import MigrationError, migration_files

    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        version = "unknown"
    try:
        return f"{version} (schema {migration_files()[-1][0]:03d})"
    except MigrationError as exc:  # TRELLIS_SCHEMA_DIR names no usable folder
        return f"{version} (schema: {exc})"


def _completion(args: argparse.Namespace) -> int:
    print(completion.script(make_parser(), args.shell), end="")
    return 0
