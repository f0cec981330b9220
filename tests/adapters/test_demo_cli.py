"""`trellis demo economics` refuses a bad plan in one line, before any server starts."""

from __future__ import annotations

import pytest

from trellis.adapters.entrypoints import cli


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "economics", "--seconds", "2"],
        ["demo", "economics", "--seconds", "lots"],
        ["demo", "economics", "--requests", "0"],
        ["demo", "economics", "--requests", "1.5"],
    ],
)
def test_a_bad_plan_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("trellis: usage: argument --") and err.count("\n") == 1
