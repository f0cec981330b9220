"""An engine's refusal is exit 1; its `unavailable`, which a retry may get past, is 3.

docs/operations.md's exit table: 3 is for what could not be reached or did not answer in time,
and scripts retry on it; an engine that answers `unavailable` (its Postgres, or the domain's
fabric, did not answer) is that case too.
"""

from __future__ import annotations

import argparse

import pytest

from trellis.adapters.entrypoints.cli.errors import EXIT_FAILED, EXIT_UNAVAILABLE
from trellis.adapters.entrypoints.cli.talk import print_reply


@pytest.mark.parametrize("output", ["table", "json"])
@pytest.mark.parametrize(
    ("code", "exit"),
    [("unavailable", EXIT_UNAVAILABLE), ("no_capacity", EXIT_FAILED), ("forbidden", EXIT_FAILED)],
)
def test_an_error_reply_exits_by_its_code(
    code: str, exit: int, output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    reply = {"ok": False, "error": {"code": code, "message": "the fabric could not be read"}}
    args = argparse.Namespace(output=output)
    assert print_reply(args, reply, show=None) == exit
    said = capsys.readouterr()
    assert code in (said.out if output == "json" else said.err)
