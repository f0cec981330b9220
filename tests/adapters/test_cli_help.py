"""Every `trellis ... --help` says what each option is for: a help line per option, a
description line per command, and a default named once, never as an empty "(default: )"."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from trellis.adapters.entrypoints.cli.parser import make_parser


def commands(
    parser: argparse.ArgumentParser, path: str = "trellis"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str]]:
    """Each option's first flag and its help as --help prints it (before %-formatting)."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            said = formatter._get_help_string(action) or ""  # type: ignore[attr-defined]
            yield action.option_strings[-1], said


def test_every_option_has_a_help_line_with_its_default_named_once() -> None:
    missing, empty_default, twice = [], [], []
    for path, parser in commands(make_parser()):
        for flag, said in options(parser):
            if not said.strip():
                missing.append(f"{path} {flag}")
            if "(default: %(default)s)" in said and parser.get_default(flag.lstrip("-")) == "":
                empty_default.append(f"{path} {flag}")
            if said.replace("%(default)s", "VALUE").count("default") > 1:
                twice.append(f"{path} {flag}: {said}")
    assert not missing, f"options with no help: {missing}"
    assert not empty_default, f"'(default: )' in: {empty_default}"
    assert not twice, f"a default named twice: {twice}"


def test_every_command_opens_its_help_with_a_description() -> None:
    undescribed = [
        path for path, parser in commands(make_parser()) if not (parser.description or "").strip()
    ]
    assert not undescribed, f"`--help` without a description line: {undescribed}"
    up = dict(commands(make_parser()))["trellis up"].format_help()
    assert "run the engine (embedded NATS/Postgres unless configured)" in up


def test_every_positional_argument_says_what_it_takes() -> None:
    """`trellis drain --help` listed a bare `id`, not that an OCS port (`ocs-1:3`) is one;
    `topology import`'s `file` said nothing."""
    bare = [
        f"{path} {action.dest}"
        for path, parser in commands(make_parser())
        for action in parser._actions
        if not action.option_strings
        and not isinstance(action, argparse._SubParsersAction)
        and not (action.help or "").strip()
    ]
    assert not bare, f"positional arguments with no help: {bare}"
    drain = dict(commands(make_parser()))["trellis drain"].format_help()
    assert "<ocs>:<port>" in drain
