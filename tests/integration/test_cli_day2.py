"""Day-2 mistakes an on-call probe of the `trellis` CLI found: each is a usage line (exit 2,
nothing sent), or an answer that says what it is, instead of a silent surprise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trellis.adapters.entrypoints import cli
from trellis.adapters.entrypoints.cli import talk


@pytest.fixture
def nothing_sent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """No engine: a request that would go out is recorded and answered `unavailable`."""
    sent: list[Any] = []
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(tmp_path / "data"))

    def on_nats(args: Any, subject_tail: str, work: Any) -> Any:
        sent.append(subject_tail)
        raise cli.CliError("no engine here", code="unavailable", exit=cli.EXIT_UNAVAILABLE)

    monkeypatch.setattr(talk, "on_nats", on_nats)
    return sent


def usage_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trellis: usage: "), captured.err
    assert captured.out == "", captured.out
    return lines[0]


@pytest.mark.parametrize("command", ["compose", "preview", "reserve"])
def test_a_body_flag_with_file_is_a_usage_error_naming_the_flags(
    command: str, tmp_path: Path, nothing_sent: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """`compose --file ok.json --gpu 3 --host host-01 --reason x` went out as the file's body,
    the flags dropped without a word (exit 0)."""
    body = tmp_path / "ok.json"
    body.write_text('{"host": "host-04", "devices": [{"kind": "gpu", "count": 1}]}')
    argv = [command, "--file", str(body), "--gpu", "3", "--host", "host-01", "--reason", "x"]
    assert cli.main(argv) == cli.EXIT_USAGE
    line = usage_line(capsys)
    assert "--host, --gpu, --reason cannot be given with it" in line, line
    assert nothing_sent == []
    # The file alone is the body: it goes out.
    assert cli.main([command, "--file", str(body)]) == cli.EXIT_UNAVAILABLE
    assert len(nothing_sent) == 1
