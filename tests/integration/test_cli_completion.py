"""`trellis completion bash|zsh` completes in real shells (issue 12 item 4).

The script comes from the real CLI in a subprocess and is sourced by a real bash, whose
completion function is driven as readline drives it (COMP_WORDS, COMP_CWORD, COMPREPLY); zsh,
when installed, types into an interactive shell on a pseudo-terminal (zsh/zpty) and presses
Tab. No servers are needed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trellis.adapters.entrypoints.cli import parser

SHELL_TIMEOUT_S = 60.0


def completion_script(shell: str, tmp_path: Path) -> Path:
    made = subprocess.run(
        [sys.executable, "-m", "trellis.adapters.entrypoints.cli", "completion", shell],
        capture_output=True, text=True, check=True, timeout=SHELL_TIMEOUT_S,
    )  # fmt: skip
    path = tmp_path / f"trellis.{shell}"
    path.write_text(made.stdout)
    return path


def bash_completes(script: Path, *words: str) -> list[str]:
    """What bash offers for the command line `words` (the last one being completed)."""
    driver = (
        f"source {script}\n"
        'COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=()\n'
        "_trellis\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", driver, "bash", "trellis", *words],
        capture_output=True, text=True, check=True, timeout=SHELL_TIMEOUT_S,
    )  # fmt: skip
    return done.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_bash_script_completes_commands_options_and_choices(tmp_path: Path) -> None:
    script = completion_script("bash", tmp_path)
    assert bash_completes(script, "fab") == ["fabric"]
    assert bash_completes(script, "fabric", "") == [
        "-h",
        "--help",
        "show",
        "check",
        "-v",
        "--verbose",
    ]
    assert bash_completes(script, "fabric", "check", "-o", "") == ["table", "json", "wide"]
    assert bash_completes(script, "free", "--kind", "g") == ["gpu"]
    assert bash_completes(script, "topology", "import", "--domain", "x", "--re") == [
        "--request-id",
        "--reason",
    ]
    completes = ["-h", "--help", "bash", "zsh", "-v", "--verbose"]
    assert bash_completes(script, "completion", "") == completes
    # Generated from the parser: every command it has is offered, and nothing else.
    commands = next(
        a for a in parser.make_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    offered = [w for w in bash_completes(script, "") if not w.startswith("-")]
    assert offered == list(commands.choices)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="no zsh installed")
def test_the_zsh_script_completes_when_tab_is_pressed(tmp_path: Path) -> None:
    script = completion_script("zsh", tmp_path)
    home = tmp_path / "zdot"
    home.mkdir()
    (home / ".zshrc").write_text(
        f"PS1='> '\nautoload -U compinit && compinit -u\nsource {script}\ntrellis() {{ :; }}\n"
    )
    # Type, press Tab, and wait until the line shows the completed word.
    typing = (
        "zmodload zsh/zpty\n"
        f"zpty -b z 'ZDOTDIR={home} zsh -i'\n"
        "zpty -w -n z $'trellis fabric ch\\t'\n"
        "zpty -r z out '*trellis fabric check*' && print completed\n"
        "zpty -d z\n"
    )
    done = subprocess.run(
        ["zsh", "-f", "-c", typing], capture_output=True, text=True, timeout=SHELL_TIMEOUT_S
    )
    assert done.stdout.strip().endswith("completed"), (done.stdout, done.stderr)
