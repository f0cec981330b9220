"""Routine mistakes with the `trellis` CLI end in one line and a documented exit code.

Issue 12 item 2. Each case runs the real CLI in a subprocess and checks its exit code, that
stderr is exactly one line starting `trellis: <code>:`, and that no traceback leaks. The
servers a case needs are real: the session's NATS with no engine serving the case's subject
prefix, ports where nothing listens, a data dir holding another engine's endpoints.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_cli
from isolation import unique_subject_prefix

from trellis.adapters.checkpoint_key import KEY_FILE, load_or_create
from trellis.adapters.embedded.postgres_server import postgres_bin_dir, postgres_major_version
from trellis.adapters.embedded.process import free_port
from trellis.adapters.embedded.watchdog import started_at
from trellis.adapters.entrypoints import cli
from trellis.adapters.entrypoints.cli import queries

EXIT_USAGE, EXIT_UNAVAILABLE = cli.EXIT_USAGE, cli.EXIT_UNAVAILABLE

# Mistakes caught before anything is sent: (arguments, exit code, text the line must hold).
USAGE = [
    (["compose", "--tenant", "acme corp", "--host", "h1", "--gpu", "1"], "not a valid tenant"),
    (["compose", "--tenant", "acme.corp", "--host", "h1", "--gpu", "1"], "not a valid tenant"),
    (["release", "--domain", "a.b", "c-1"], "not a valid domain"),
    (["compose", "--host", "h1", "--gpu", "1", "--lease", "0"], "a lease is 1 to"),
    (["extend", "c-1", "--lease", "soon"], "not a whole number of seconds"),
    (["why", "bad.id"], "not a valid component or composition id"),
    (["quota", "set", "a b", "gpu", "--count", "1"], "not a valid tenant"),
    # Said in the flags' terms, not the wire's (`devices`, `count`, `capacity_gib`).
    (["compose", "--host", "h1"], "nothing to compose: give --gpu, --memory, --nic, --nvme or"),
    (["reserve", "--host", "h1"], "nothing to reserve: give --gpu, --memory, --nic, --nvme or"),
    (["quota", "set", "acme", "gpu"], "give --count, --gib or both (hint: `trellis quota clear"),
    (["compose", "--bogus"], "unrecognized arguments: --bogus (hint: `trellis compose --help`)"),
    # An argument no command takes is the innermost command's to explain, not the root's.
    (["release", "c-x", "extra"], "unrecognized arguments: extra (hint: `trellis release --help`)"),
    (["topology", "show", "x"], "unrecognized arguments: x (hint: `trellis topology show --help`)"),
    (["--bogus", "free"], "unrecognized option --bogus (hint: `trellis --help`)"),
    # With no abbreviations, an unknown option before the command left its value to be taken
    # for the command ("invalid choice: 'json'"): the option is named, and the one meant.
    (
        ["--out", "json", "engines"],
        "unrecognized option --out (did you mean --output?) (hint: `trellis --help`)",
    ),
    (["-o", "json", "--tim", "3", "free"], "unrecognized option --tim (did you mean --timeout?)"),
    # The shared options are taken before the command too, but only by a command that has them.
    (
        ["-o", "json", "up"],
        "-o/--output given before the command, which takes none (hint: `trellis up",
    ),
    (["--timeout", "0", "free"], "a timeout is a positive number of seconds, not 0"),
    # Hostile shapes of the same mistakes: arguments that are not UTF-8, numbers past int64.
    (["compose", "--host", "\udcff\udcfe", "--gpu", "1"], "not a valid host id"),
    (["compose", "--host", "h1", "--gpu", "1", "--lease", "9" * 30], "a lease is 1 to"),
    # A timeout that could never wait for a reply (it read as an unreachable NATS).
    (["free", "--timeout", "0"], "a timeout is a positive number of seconds, not 0"),
    (["free", "--timeout", "-1"], "a timeout is a positive number of seconds, not -1"),
    (["free", "--timeout", "nan"], "'nan' is not a finite number"),
    (["free", "--timeout", "soon"], "'soon' is not a number"),
    # JSON has no nan or inf: sent, they became null and the engine's refusal named another
    # mistake ("capacity_gib is required").
    (["compose", "--host", "h1", "--memory", "nan"], "'nan' is not a finite number"),
    (["compose", "--host", "h1", "--gpu", "1", "--bandwidth", "inf"], "'inf' is not a finite"),
    (["quota", "set", "t1", "memory", "--gib", "1e400"], "'1e400' is not a finite number"),
    (["compose", "--host", "h1", "--gpu", "1", "--label", "rack"], "expected K=V, got 'rack'"),
    (["compose", "--host-label", "=r1", "--gpu", "1"], "expected K=V, got '=r1'"),
    # A count that is never reached: the watch ran until interrupted.
    (["watch", "--count", "0"], "a count is 1 or more, not 0"),
    # An event type the contract does not know: the watch waited forever for it.
    (["watch", "--type", "NoSuchEvent"], "invalid choice: 'NoSuchEvent' (choose from 'Circuit"),
    # Amounts of nothing: `--memory 0` and `--nic 0` were dropped unsaid (a compose without
    # them went out), `--gpu -1` and `--max-hops 0` reached the engine to be refused there.
    (["compose", "--host", "h1", "--gpu", "1", "--memory", "0"], "an amount is above 0, not 0"),
    (["compose", "--host", "h1", "--gpu", "1", "--nic", "0"], "a count is 1 or more, not 0"),
    (["reserve", "--host", "h1", "--gpu", "-1"], "a count is 1 or more, not -1"),
    (["preview", "--host", "h1", "--gpu", "1", "--max-hops", "0"], "a count is 1 or more"),
    # A moment that is no moment: it was sent, and refused after the round trip as an invalid
    # body (`--at`), or said as a failure, exit 1 (`export`).
    (["replay", "--at", "yesterday"], "'yesterday' is not an ISO time"),
    (["free", "--at", "-1"], "'-1' is not an ISO time (2026-12-01T10:00:00Z), or a log position"),
    (["why", "gpu-1", "--at", "2026-12-01T10:00:00"], "names no moment: add its zone"),
    (["export", "--parquet", "out", "--until", "5"], "'5' is not an ISO time"),
    (["export", "--parquet", "out", "--since", "2026-12-01"], "names no moment"),
    # A tenant name no identity can have: it was refused as config, exit 1, after the start
    # had generated the checkpoint key.
    (["up", "--secure", "--tenant", "bad id"], "'bad id' is not a valid tenant"),
    # An empty request id was replaced by a fresh one, unsaid: a resend with it was no resend.
    (["release", "c-1", "--request-id", ""], "'' is not a request id"),
    (["drain", "gpu-1", "--request-id", "x" * 129], "is not a request id: 1 to 128"),
    (["topology", "import", "t.json", "--request-id", "a\tb"], "is not a request id"),
]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def base_env(tmp_path: Path) -> dict[str, str]:
    """No configured servers and an empty data dir of the test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
    env["TRELLIS_DATA_DIR"] = str(tmp_path / "data")
    return env


@pytest.mark.parametrize(("args", "says"), USAGE, ids=[" ".join(a) for a, _ in USAGE])
async def test_a_wrong_command_line_is_one_usage_line_and_exit_2(
    tmp_path: Path, args: list[str], says: str
) -> None:
    code, out, err = await run_cli(base_env(tmp_path), *args)
    line = one_line(err)
    assert code == EXIT_USAGE, (code, err)
    assert line.startswith("trellis: usage: ") and says in line and "(hint: " in line, line
    assert out == ""


async def test_a_redfish_certificate_without_a_redfish_port_is_a_configuration_mistake(
    tmp_path: Path,
) -> None:
    """It was ignored without a word: an operator who meant TLS got no Redfish at all."""
    env = {**base_env(tmp_path), "TRELLIS_REDFISH_CERT": str(tmp_path / "cert.pem")}
    code, _, err = await run_cli(env, "up")
    line = one_line(err)
    assert code == 1 and line.startswith("trellis: config: a Redfish certificate or key"), line
    assert not (tmp_path / "data").exists()  # refused before anything started


async def test_trellis_follow_without_its_servers_says_so_as_a_configuration_mistake(
    tmp_path: Path,
) -> None:
    """It printed "trellis follow: ..." in a format of its own and exited 2, a usage code."""
    code, out, err = await run_cli(base_env(tmp_path), "follow")
    line = one_line(err)
    assert code == 1 and out == "", (code, out, err)
    assert line.startswith("trellis: config: `trellis follow` needs TRELLIS_NATS_URL"), line


# Files that cannot be a topology document: the CLI says so before it sends anything.
UNREADABLE = {
    "a directory": ("dir", None, "Is a directory"),
    "bytes that are not JSON": ("noise.json", bytes(range(256)) * 4, "JSON is malformed"),
    "JSON that is not UTF-8": (
        "latin.json",
        '{"nodes": "\xe9"}'.encode("latin-1"),
        "Invalid UTF-8",
    ),
}


@pytest.mark.parametrize(("name", "content", "says"), UNREADABLE.values(), ids=list(UNREADABLE))
async def test_a_file_that_is_no_document_is_one_error_line_and_exit_1(
    tmp_path: Path, name: str, content: bytes | None, says: str
) -> None:
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    code, out, err = await run_cli(base_env(tmp_path), "topology", "import", str(path))
    line = one_line(err)
    assert code == 1, (code, err)
    assert line.startswith(f"trellis: error: cannot read {path}") and says in line, line
    assert out == ""


@pytest.mark.parametrize("command", [["topology", "show"], ["fabric", "check"]], ids=" ".join)
async def test_no_engine_serving_on_a_live_nats_names_the_prefix_and_the_url(
    tmp_path: Path, nats_url: str, command: list[str]
) -> None:
    prefix = unique_subject_prefix()
    env = {**base_env(tmp_path), "TRELLIS_NATS_URL": nats_url, "TRELLIS_SUBJECT_PREFIX": prefix}
    code, _, err = await run_cli(env, *command, "--timeout", "5")
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE, err
    assert f"trellis: unavailable: no engine serves {prefix}.* on {nats_url}" in line, line


@pytest.mark.parametrize("command", [["topology", "show"], ["composition", "list"]], ids=" ".join)
async def test_a_nats_that_does_not_listen_is_unavailable_at_once(
    tmp_path: Path, command: list[str]
) -> None:
    """A refused TCP connection is known at once: it was retried until `--timeout` passed and
    then said as `TimeoutError`. With a minute to wait, the subprocess's 20 s bound fails the
    old behaviour; the new answer takes the CLI's start and one refused connect."""
    url = f"nats://127.0.0.1:{free_port()}"
    env = {**base_env(tmp_path), "TRELLIS_NATS_URL": url}
    code, out, err = await run_cli(env, *command, "--timeout", "60", timeout=20)
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE and out == "", err
    assert line == (
        f"trellis: unavailable: cannot reach NATS at {url} (connection refused)"
        " (hint: is the engine up? `trellis up` starts one; see TRELLIS_NATS_URL)"
    ), line


async def test_a_nats_that_never_answers_is_unavailable_after_the_connect_timeout(
    tmp_path: Path,
) -> None:
    """A server that takes the TCP connection but never greets is given NATS's connect
    timeout (5 s), not retried for all of `--timeout`."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        env = {**base_env(tmp_path), "TRELLIS_NATS_URL": url}
        code, _, err = await run_cli(env, "free", "--timeout", "60", timeout=40)
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE, err
    assert line.startswith(f"trellis: unavailable: cannot reach NATS at {url} (no answer"), line


async def test_a_checkpoint_key_in_a_folder_that_is_not_there_is_a_config_line(
    tmp_path: Path,
) -> None:
    """A mistyped TRELLIS_CHECKPOINT_KEY: `trellis up` made that folder and a new key in it."""
    key = tmp_path / "kyes" / "deployment.pem"
    env = {**base_env(tmp_path), "TRELLIS_CHECKPOINT_KEY": str(key)}
    code, _, err = await run_cli(env, "up")
    line = one_line(err)
    assert code == cli.EXIT_FAILED, err
    assert line.startswith(f"trellis: config: checkpoint key {key}: there is no folder"), line
    assert not key.parent.exists()


async def test_no_engine_at_all_says_how_to_start_one(tmp_path: Path) -> None:
    code, _, err = await run_cli(base_env(tmp_path), "free")
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE and "no engine found" in line and "trellis up" in line, err
    # Where it looked: an engine started on another data dir is the newcomer's usual miss.
    assert f"no engine found on data dir {tmp_path / 'data'}" in line, line


@pytest.mark.parametrize(
    "command",
    [["projections", "rebuild"], ["export", "--parquet", "out"], ["verify"]],
    ids=["rebuild", "export", "verify"],
)
async def test_no_database_at_all_is_unavailable_as_no_engine_is(
    tmp_path: Path, command: list[str]
) -> None:
    """They said `error` and exit 1 (verify: a line of its own and exit 2), where every other
    command says `unavailable`, exit 3, when nothing is configured and no `trellis up` runs."""
    code, out, err = await run_cli(base_env(tmp_path), *command)
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE and out == "", (code, err)
    assert line == (
        "trellis: unavailable: no database found"
        " (hint: start one with `trellis up`, or set TRELLIS_DATABASE_URL)"
    ), line


@pytest.mark.parametrize(
    "command",
    [["projections", "rebuild"], ["export", "--parquet", "out"], ["verify"]],
    ids=["rebuild", "export", "verify"],
)
async def test_a_postgres_that_does_not_listen_is_unavailable(
    tmp_path: Path, command: list[str]
) -> None:
    env = {**base_env(tmp_path), "TRELLIS_DATABASE_URL": f"postgresql://127.0.0.1:{free_port()}/x"}
    code, _, err = await run_cli(env, *command)
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE and line.startswith("trellis: unavailable: "), err
    assert "TRELLIS_DATABASE_URL" in line


async def test_a_second_engine_on_a_data_dir_names_the_running_ones_pid(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    data = Path(env["TRELLIS_DATA_DIR"])
    data.mkdir()
    # What a running `trellis up` leaves: its endpoints and its pid (here, a live process).
    sleeper = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)"
    )
    try:
        endpoints = {"nats_url": "nats://127.0.0.1:1", "database_url": "x", "pid": sleeper.pid}
        (data / "endpoints.json").write_text(json.dumps(endpoints))
        code, _, err = await run_cli(env, "up")
        line = one_line(err)
        assert code == 1 and line.startswith("trellis: running: an engine already runs"), err
        assert f"(pid {sleeper.pid})" in line, line
    finally:
        sleeper.kill()
        await sleeper.wait()


async def test_endpoints_left_by_a_killed_engine_are_not_used(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    data = Path(env["TRELLIS_DATA_DIR"])
    data.mkdir()
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()  # its pid is no process any more
    port = free_port()
    endpoints = {"nats_url": f"nats://127.0.0.1:{port}", "database_url": "x", "pid": gone.pid}
    (data / "endpoints.json").write_text(json.dumps(endpoints))
    code, _, err = await run_cli(env, "free")
    line = one_line(err)
    # Not "cannot reach NATS at ...:port": the stale file is recognised as such.
    assert code == EXIT_UNAVAILABLE and "no engine found" in line and str(port) not in line, err


@pytest.mark.parametrize("left", ["a zombie", "a recycled pid"])
async def test_endpoints_whose_pid_is_a_zombie_or_another_process_are_not_used(
    tmp_path: Path, left: str
) -> None:
    """The chaos probe: after kill -9, the engine's pid stayed a zombie for seconds, and a
    pid given to another process after a reboot kept `trellis up` refusing for good."""
    env = base_env(tmp_path)
    data = Path(env["TRELLIS_DATA_DIR"])
    data.mkdir()
    if left == "a zombie":
        process = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; never reaped here
        while started_at(process.pid) is not None:
            await asyncio.sleep(0.01)
        assert Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
        started = None
    else:
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started = (started_at(process.pid) or 0) - 1  # the engine that wrote it started earlier
    port = free_port()
    endpoints = {"nats_url": f"nats://127.0.0.1:{port}", "database_url": "x", "pid": process.pid}
    (data / "endpoints.json").write_text(json.dumps({**endpoints, "started": started}))
    try:
        code, _, err = await run_cli(env, "free")
    finally:
        process.kill()
        process.wait()
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE and "no engine found" in line and str(port) not in line, err


@pytest.mark.parametrize(
    "variable", ["TRELLIS_NATS_PORT", "TRELLIS_NATS_MONITOR_PORT", "TRELLIS_PG_PORT"]
)
async def test_a_pinned_port_another_process_listens_on_is_named_not_a_bug(
    tmp_path: Path, variable: str
) -> None:
    env = base_env(tmp_path)
    data = Path(env["TRELLIS_DATA_DIR"])
    data.mkdir()
    load_or_create(data / KEY_FILE)  # made beforehand: its first start says so on stderr too
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        code, _, err = await run_cli({**env, variable: str(port)}, "up")
    line = one_line(err)
    assert code == 1 and line.startswith("trellis: taken: "), err
    assert f"port 127.0.0.1:{port} is already in use" in line and variable in line, line


async def test_a_path_that_cannot_be_written_is_named_not_a_bug(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "schemas"
    code, _, err = await run_cli(base_env(tmp_path), "schema", "export", "--dir", str(target))
    line = one_line(err)
    assert code == 1 and line == f"trellis: error: {target}: Not a directory", err


async def test_the_economics_demo_refuses_a_report_place_it_cannot_use_before_it_runs(
    tmp_path: Path,
) -> None:
    env = base_env(tmp_path)
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"
    code, _, err = await run_cli(env, "demo", "economics", "--out", str(out), "--plain")
    line = one_line(err)
    assert code == 1 and line == f"trellis: error: {out}: Not a directory", err
    assert not Path(env["TRELLIS_DATA_DIR"]).exists()  # no server was started for it


async def test_a_data_dir_that_is_a_file_is_named_as_the_setting_at_fault(
    tmp_path: Path,
) -> None:
    env = base_env(tmp_path)
    Path(env["TRELLIS_DATA_DIR"]).write_text("not a directory\n")
    code, _, err = await run_cli(env, "up")
    line = one_line(err)
    assert code == 1 and line.startswith("trellis: config: TRELLIS_DATA_DIR: "), err
    assert "Not a directory" in line, line


async def test_an_embedded_server_that_cannot_start_is_one_line_not_a_bug(
    tmp_path: Path,
) -> None:
    env = base_env(tmp_path)
    data = Path(env["TRELLIS_DATA_DIR"])
    # A PostgreSQL data dir of the bundled major that holds nothing else: the server cannot run.
    (data / "postgres").mkdir(parents=True)
    major = postgres_major_version(postgres_bin_dir())
    (data / "postgres" / "PG_VERSION").write_text(f"{major}\n")
    load_or_create(data / KEY_FILE)
    code, _, err = await run_cli(env, "up")
    line = one_line(err)
    assert code == 1 and line.startswith("trellis: error: postgres: "), err
    assert "TRELLIS_DATA_DIR" in line, line


def test_an_unexpected_failure_is_one_line_and_exit_70_and_v_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(queries, "free", broken)
    assert cli.main(["free"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert one_line(err) == (
        "trellis: internal: RuntimeError: a bug (hint: run with -v for the traceback)"
    )
    assert cli.main(["-v", "free"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("(hint: run with -v for the traceback)")


async def test_help_names_the_defaults_the_environment_and_the_exit_codes(tmp_path: Path) -> None:
    code, out, _ = await run_cli(base_env(tmp_path), "--help")
    assert code == 0 and "TRELLIS_NATS_URL" in out and "TRELLIS_DATABASE_URL" in out, out
    assert "2 usage, 3 unavailable, 70 internal" in out, out
    code, out, _ = await run_cli(base_env(tmp_path), "compose", "--help")
    assert code == 0 and "(default: 10.0)" in out and "$TRELLIS_TENANT" in out, out


GROUPS = {
    "topology": "import", "composition": "list", "quota": "show", "fabric": "check",
    "tenant": "add", "reservation": "cancel", "projections": "rebuild", "schema": "export",
    "demo": "economics",
}  # fmt: skip


@pytest.mark.parametrize(("group", "action"), GROUPS.items(), ids=list(GROUPS))
def test_a_command_without_its_action_prints_its_own_help(
    capsys: pytest.CaptureFixture[str], group: str, action: str
) -> None:
    """`trellis topology` alone printed the root's help, which lists no action of topology."""
    assert cli.main([group]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert out.startswith(f"usage: trellis {group} ") and f"    {action} " in out, out


def test_the_root_alone_prints_the_roots_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert out.startswith("usage: trellis [-h]") and "    topology " in out, out


async def test_drain_help_says_the_live_compositions_are_moved_off(tmp_path: Path) -> None:
    """It said "(existing ones stay)": a drain moves them off, or impairs them."""
    for args in (["--help"], ["drain", "--help"]):
        code, out, _ = await run_cli(base_env(tmp_path), *args)
        text = " ".join(out.split())
        assert code == 0 and "existing ones stay" not in text, out
        assert "the live compositions through it are moved off" in text, out
        assert "one that cannot be moved is impaired" in text, out


async def test_add_node_says_it_takes_a_file_and_how_to_give_inline_json(tmp_path: Path) -> None:
    """Its help said "the node as JSON", and JSON given so was read as a file's name."""
    code, out, _ = await run_cli(base_env(tmp_path), "add-node", "--help")
    assert code == 0 and "a file holding the node as a JSON object" in " ".join(out.split())
    code, _, err = await run_cli(base_env(tmp_path), "add-node", '{"id": "n1"}')
    line = one_line(err)
    assert code == 1 and line.startswith('trellis: error: cannot read {"id": "n1"}: '), line
    assert line.endswith("(hint: put the JSON in a file, or pass - and give it on stdin)"), line


async def test_watch_says_what_its_timeout_bounds(tmp_path: Path) -> None:
    """It said "seconds to wait for a reply", which a watch never waits for."""
    code, out, _ = await run_cli(base_env(tmp_path), "watch", "--help")
    says = "--timeout TIMEOUT seconds to wait for NATS to connect and the stream to start the watch"
    assert code == 0 and says in " ".join(out.split()), out


@pytest.mark.parametrize("command", [["completion", "bash"], ["completion", "zsh"], ["--version"]])
def test_a_reader_that_goes_away_stops_the_cli_quietly(command: list[str]) -> None:
    """`trellis ... | head -1`: no 'internal' line and no traceback when the pipe closes.
    (argparse's own --help output ignores a closed pipe already.)"""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write is EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "trellis.adapters.entrypoints.cli", *command],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, ""), done.stderr


# Ctrl-C at a chosen moment of the start: a finder asked for `target` first sends the process
# SIGINT, which lands inside that import, as a Ctrl-C typed during the CLI's imports does.
INTERRUPTED_AT = """
import os, signal, sys
from importlib.metadata import entry_points

TARGET = sys.argv[1]

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["trellis", "free"]
(script,) = entry_points(group="console_scripts", name="trellis")
sys.exit(script.load()())
"""


@pytest.mark.parametrize(
    "target",
    [
        "trellis.adapters.entrypoints.cli.dispatch",
        "asyncpg",
        "trellis.adapters.entrypoints.cli.parser",
        "trellis.adapters.entrypoints.audit_verify",
    ],
)
def test_ctrl_c_while_the_cli_starts_is_exit_130_without_a_traceback(
    tmp_path: Path, target: str
) -> None:
    """The console script imported the whole CLI (most of a second) before main could catch
    the interrupt: Ctrl-C then printed a traceback ending in KeyboardInterrupt."""
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_AT, target],
        env=base_env(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stderr, done.stdout) == (cli.EXIT_INTERRUPTED, "", "")


# Issue 21, finding 7: ways to exit 70 (the code for bugs) that users found. Each is now the
# documented code with one line. (A large import: test_size_limits.py; watch and composition
# list on foreign stream or KV content: test_foreign_messages.py.)
BAD_NATS_URLS = [
    ("nats//x", "the scheme must be one of"),
    ("http://x:4222", "the scheme must be one of"),
    ("nats://:99999", "its port is not a number"),
    ("nats://host:port", "its port is not a number"),
    ("nats://a b", "it holds a space"),
    ("nats://h:1,,nats://h:2", "an empty server between commas"),
]


@pytest.mark.parametrize(("url", "says"), BAD_NATS_URLS, ids=[u for u, _ in BAD_NATS_URLS])
async def test_a_malformed_nats_url_is_a_config_line_at_once(
    tmp_path: Path, url: str, says: str
) -> None:
    env = {**base_env(tmp_path), "TRELLIS_NATS_URL": url}
    started = asyncio.get_running_loop().time()
    code, _, err = await run_cli(env, "topology", "show")
    line = one_line(err)
    assert code == cli.EXIT_FAILED, err
    assert line.startswith(f"trellis: config: TRELLIS_NATS_URL {url!r} is not a NATS URL"), line
    assert says in line, line
    # Not a connection timeout: it is refused before anything is dialled.
    assert asyncio.get_running_loop().time() - started < 8


@pytest.mark.parametrize(
    "args",
    [["free", "-v"], ["topology", "show", "-v"], ["composition", "list", "-v"], ["-v", "free"]],
    ids=" ".join,
)
async def test_v_after_the_subcommand_is_taken_as_before_it(
    tmp_path: Path, args: list[str]
) -> None:
    code, _, err = await run_cli(base_env(tmp_path), *args)
    line = one_line(err)
    assert code == EXIT_UNAVAILABLE, err  # it went on to look for an engine: -v was understood
    assert line.startswith("trellis: unavailable: no engine found"), line
