"""`trellis demo economics` refuses a bad plan in one line, before any server starts."""

from __future__ import annotations

from typing import Any

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


@pytest.mark.parametrize("seconds", ["inf", "nan", "4.9", "3600.5"])
def test_a_bad_number_of_seconds_says_the_bounds(
    seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", "economics", "--seconds", seconds]) == cli.EXIT_USAGE
    assert f"--seconds: '{seconds}' is not a number from 5 to 3,600" in capsys.readouterr().err


def test_a_fractional_number_of_seconds_is_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from trellis.adapters.entrypoints.cli import serve

    plans: list[Any] = []

    async def run(plan: Any, *_: Any, **__: Any) -> None:
        plans.append(plan)

    monkeypatch.setattr(serve, "_no_embedded_engine_running", lambda settings: None)
    monkeypatch.setattr(serve.economics, "main", run)
    argv = ["demo", "economics", "--seconds", "7.5", "--requests", "3", "--plain"]
    assert cli.main(argv) == cli.EXIT_OK
    assert [(p.seconds, p.requests) for p in plans] == [(7.5, 3)]
