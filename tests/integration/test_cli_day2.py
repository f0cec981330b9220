"""Day-2 mistakes an on-call probe of the `trellis` CLI found: each is a usage line (exit 2,
nothing sent), or an answer that says what it is, instead of a silent surprise."""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from trellis.adapters.entrypoints import cli
from trellis.adapters.entrypoints.cli import talk
from trellis.adapters.entrypoints.cli.parser import make_parser


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


class _SilentEngine:
    """A client whose every request times out (the engine's Postgres paused)."""

    async def _never(self) -> dict[str, Any]:
        return {}

    def raw(self, subject: str, data: bytes) -> Any:
        return self._never()

    def all_pages(self, subject: str, body: Any) -> Any:
        return self._never()

    def import_topology(self, domain: str, body: Any, request_id: str) -> Any:
        return self._never()

    async def unrefused(self, asked: Any, timeout: float | None = None) -> Any:
        asked.close()
        raise TimeoutError


@pytest.fixture
def timing_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    sent: list[Any] = []
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(tmp_path / "data"))

    def on_nats(args: Any, subject_tail: str, work: Any) -> Any:
        sent.append(subject_tail)
        return asyncio.run(work(_SilentEngine(), None, "nats://127.0.0.1:4222", "nobody"))

    monkeypatch.setattr(talk, "on_nats", on_nats)
    return sent


@pytest.mark.parametrize(
    "argv",
    [
        ["compose", "--host", "h1", "--gpu", "1"],
        ["drain", "gpu-1", "--reason", "x"],
        ["quota", "set", "acme", "gpu", "--count", "2"],
    ],
    ids=["intent", "admin", "quota"],
)
def test_a_timed_out_change_may_be_committed_and_names_its_request_id_to_resend(
    argv: list[str], timing_out: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """It said `unavailable: no reply within 5.0s` and nothing more: the change landed later
    (Postgres was paused), and the request id to resend it safely was never shown."""
    assert cli.main(argv) == cli.EXIT_UNAVAILABLE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "may have been committed" in err, err
    found = re.search(r"\(request id ([^)]+)\)", err)
    assert found, err
    rid = found.group(1)
    assert f"resend the same command with --request-id {rid}:" in err, err
    # The id it names is the one given, when one was.
    assert cli.main([*argv, "--request-id", "r-42"]) == cli.EXIT_UNAVAILABLE
    assert "(request id r-42)" in capsys.readouterr().err


class _StalledStore(_SilentEngine):
    """An engine that answers `unavailable`: its Postgres stalled past the statement bound."""

    async def unrefused(self, asked: Any, timeout: float | None = None) -> Any:
        asked.close()
        error = {"code": "unavailable", "message": "event store unavailable: TimeoutError"}
        return {"ok": False, "error": error}


@pytest.mark.parametrize(
    "argv",
    [
        ["compose", "--host", "h1", "--gpu", "1"],
        ["drain", "gpu-1", "--reason", "x"],
        ["topology", "import", "FABRIC"],
    ],
    ids=["intent", "admin", "import"],
)
def test_an_engines_unavailable_to_a_change_names_its_request_id_to_resend(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fabric = tmp_path / "fabric.json"
    fabric.write_text('{"nodes": [], "links": []}')
    argv = [str(fabric) if a == "FABRIC" else a for a in argv]
    """The chaos probe froze Postgres: `error [unavailable]: event store unavailable` and no
    request id, and the compose committed on resume; the retry with a fresh id made a second
    composition."""
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(tmp_path / "data"))

    def on_nats(args: Any, subject_tail: str, work: Any) -> Any:
        return asyncio.run(work(_StalledStore(), None, "nats://127.0.0.1:4222", "nobody"))

    monkeypatch.setattr(talk, "on_nats", on_nats)
    assert cli.main([*argv, "--request-id", "r-42"]) == cli.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith("error [unavailable]: event store unavailable"), err
    assert "(the request may have been committed all the same (request id r-42): resend" in err
    assert "--request-id r-42;" in err, err
    assert cli.main([*argv, "-o", "json"]) == cli.EXIT_UNAVAILABLE  # json: the reply alone
    assert capsys.readouterr().err == ""


def test_a_timed_out_query_says_only_that_it_timed_out(
    timing_out: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["free"]) == cli.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "no reply within" in err and "committed" not in err, err


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                found += _parsers(sub)
    return found


@pytest.mark.parametrize(
    "argv",
    [
        ["compose", "--ten", "acme", "--host", "h1", "--gpu", "1", "--reas", "x"],
        ["compose", "--tenant", "acme", "--host", "h1", "--gpu", "1", "--reas", "x"],
        ["quota", "set", "acme", "gpu", "--cou", "2"],
        ["--out", "json", "free"],
    ],
)
def test_an_abbreviated_long_option_is_a_usage_error(
    argv: list[str], nothing_sent: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """`compose --ten acme --reas x` composed, as --tenant and --reason."""
    assert cli.main(argv) == cli.EXIT_USAGE
    usage_line(capsys)
    assert nothing_sent == []


def test_no_parser_takes_abbreviations() -> None:
    assert all(not p.allow_abbrev for p in _parsers(make_parser()))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["quota", "set", "globex", "gpu", "--count", "-1"], "a count is 0 or more, not -1"),
        (["quota", "set", "globex", "memory", "--gib", "-0.5"], "an amount is 0 or more"),
        (["why", "ocs-1:0"], "'ocs-1:0' is an OCS port: why takes a node, link or composition"),
        (["why", "ocs-1:0"], "`trellis why ocs-1`"),
    ],
)
def test_input_the_engine_would_refuse_is_a_usage_error_before_sending(
    argv: list[str], says: str, nothing_sent: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """They reached the engine and came back `invalid`, exit 1 (`why ocs-1:0`: `Expected an
    id`, though drain and blast-radius take a port)."""
    assert cli.main(argv) == cli.EXIT_USAGE
    assert says in usage_line(capsys)
    assert nothing_sent == []


@pytest.mark.parametrize(
    "argv",
    [
        ["quota", "set", "globex", "gpu", "--count", "0"],
        ["quota", "set", "globex", "memory", "--gib", "0"],
        ["why", "ocs-1"],
        ["blast-radius", "ocs-1:0"],
    ],
)
def test_what_the_engine_takes_is_still_sent(argv: list[str], nothing_sent: list[Any]) -> None:
    assert cli.main(argv) == cli.EXIT_UNAVAILABLE
    assert len(nothing_sent) == 1


@pytest.fixture
def head_at_66(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(tmp_path / "data"))
    answer = {"ok": True, "result": {"connections": []}, "position": 66}
    monkeypatch.setattr(talk, "on_nats", lambda args, subject, work: answer)


@pytest.mark.parametrize("output", ["table", "json"])
def test_an_at_past_the_head_says_the_answer_is_the_state_now(
    output: str, head_at_66: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`connections --at 9999` with the head at 66 printed `0 connections at position 66`
    and nothing of the position asked for."""
    assert cli.main(["connections", "--at", "9999", "-o", output]) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert "(position 9999 is past the domain's head, 66: this is the state now)" in err, err
    # At or below the head: no note.
    for at in ("66", "12"):
        assert cli.main(["connections", "--at", at, "-o", output]) == cli.EXIT_OK
        assert capsys.readouterr().err == ""


def test_an_at_between_a_domains_events_is_no_past_the_head(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An auditor's probe: `--at 47` in a log whose position 47 is another domain's event was
    answered at the domain's 43 (right) and noted as past the head (wrong: it is at 54)."""
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(tmp_path / "data"))

    def on_nats(args: argparse.Namespace, subject: str, work: Any) -> dict[str, Any]:
        at_47 = subject.endswith(".connections")
        return {"ok": True, "result": {"connections": []}, "position": 43 if at_47 else 54}

    monkeypatch.setattr(talk, "on_nats", on_nats)
    assert cli.main(["connections", "--at", "47"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert "at position 43" in out and err == "", (out, err)
