"""The CLI examples of the README and of docs/ are real output (issue 12 item 4).

Every block of README.md or of a page docs/*.md marked
`<!-- checked: tests/integration/test_readme.py -->` is run, command by command and block after
block, one page as one session against a fresh engine over real NATS and Postgres, and what the
CLI prints must be what the page shows. In a block:

- a line starting `$ trellis ` is a command (a trailing backslash continues it on the next
  line; `# ...` is a comment), run from the repository's root;
- the lines after it, up to the next command, are what it prints (stdout, then stderr);
- a line `...` stands for any number of lines;
- a last line `(exit N)` is its exit code (else 0).

Log records (`2026-12-01 10:00:00,123 WARNING ...`) are left out: they depend on the setup.

Both sides are normalised first, as they differ on every run: composition ids, uuids, ISO
times, sha256 hashes, durations and rates, and the widths of table columns (runs of spaces).
A composition id in a command stands for the one the page showed: ids are matched up as the
page's output lines are matched with the real ones.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import pytest
import pytest_asyncio
from harness import Harness, cli_env, serving

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
TOUR = REPO / "docs" / "tour.md"
MARKER = "<!-- checked: tests/integration/test_readme.py -->"
# Every page with a checked block; each is a session of its own.
CHECKED = [
    page for page in [README, *sorted((REPO / "docs").glob("*.md"))] if MARKER in page.read_text()
]
DOMAIN = "default"  # the pages': no --domain, no TRELLIS_DOMAIN
ANY_LINES = "..."
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")

COMPOSITION_ID = re.compile(r"\bc-[0-9a-f]{16}\b")
VARYING = [
    (COMPOSITION_ID, "<composition>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uuid>"),
    (re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z?"), "<time>"),
    (re.compile(r"\b[0-9a-f]{64}\b"), "<hash>"),
    (re.compile(r"\bin \d+\.\d+ s \([\d,]+/s\)"), "in <seconds> s (<rate>/s)"),
]


class Example(NamedTuple):
    where: str  # page:line of the command
    command: str
    output: list[str]
    exit: int


def examples(page: Path) -> list[Example]:
    """The commands of every checked block of a page, in order."""
    name = str(page.relative_to(REPO))
    found: list[Example] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != MARKER:
            i += 1
            continue
        assert lines[i + 1].startswith("```"), f"{name}:{i + 2}: a fence follows {MARKER}"
        i += 2
        block: list[tuple[str, str]] = []
        while not lines[i].startswith("```"):
            block.append((f"{name}:{i + 1}", lines[i]))
            i += 1
        found += _commands(block)
    return found


def _commands(block: list[tuple[str, str]]) -> list[Example]:
    commands: list[Example] = []
    j = 0
    while j < len(block):
        where, text = block[j]
        assert text.startswith("$ trellis "), f"{where}: expected `$ trellis ...`"
        command = text[2:]
        while command.endswith("\\"):
            j += 1
            command = command[:-1] + block[j][1]
        j += 1
        output = []
        while j < len(block) and not block[j][1].startswith("$ "):
            output.append(block[j][1])
            j += 1
        code = 0
        if output and (ended := re.fullmatch(r"\(exit (\d+)\)", output[-1])):
            code, output = int(ended.group(1)), output[:-1]
        commands.append(Example(where, command, output, code))
    return commands


def normalised(line: str) -> str:
    for pattern, placeholder in VARYING:
        line = pattern.sub(placeholder, line)
    return " ".join(line.split())


def aligned(expected: list[str], actual: list[str]) -> list[tuple[str, str]] | None:
    """The pairs of matching lines when `actual` matches `expected` (`...` lines matching any
    run of lines); None when it does not."""
    want = [normalised(line) for line in expected]
    got = [normalised(line) for line in actual]

    def match(w: int, g: int) -> list[tuple[str, str]] | None:
        if w == len(want):
            return [] if g == len(got) else None
        if want[w] == ANY_LINES:
            for skip in range(g, len(got) + 1):
                rest = match(w + 1, skip)
                if rest is not None:
                    return rest
            return None
        if g < len(got) and want[w] == got[g]:
            rest = match(w + 1, g + 1)
            return None if rest is None else [(expected[w], actual[g]), *rest]
        return None

    return match(0, 0)


async def run(env: dict[str, str], args: list[str]) -> tuple[int, list[str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.cli", *args, cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    lines = (out.decode() + err.decode()).splitlines()
    # Log records depend on the setup (a superuser's Postgres warns), not on the command.
    return proc.returncode, [line for line in lines if not LOG_RECORD.match(line)]


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


def test_the_readme_and_the_tour_keep_their_checked_examples() -> None:
    readme = [example.command for example in examples(README)]
    for step in ("topology import", "compose", "why", "release", "--at"):
        assert any(step in command for command in readme), f"the README's tour lost `{step}`"
    assert len(examples(TOUR)) >= 20, "docs/tour.md lost its checked examples"
    assert CHECKED[:1] == [README] and TOUR in CHECKED


@pytest.mark.parametrize("page", CHECKED, ids=[str(page.relative_to(REPO)) for page in CHECKED])
async def test_each_checked_page_shows_what_the_cli_prints(
    page: Path,
    h: Harness,
    tmp_path: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
) -> None:
    env = cli_env(tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix)
    session = examples(page)
    ids: dict[str, str] = {}  # the page's composition ids -> this run's
    for example in session:
        if h.engine.state(DOMAIN) is not None:
            # The pages show a settled system: the fabric programmed, the KV feed caught up.
            await h.fabric_idle(DOMAIN)
            await h.relayed(DOMAIN)
        args = shlex.split(example.command, comments=True)[1:]
        args = [COMPOSITION_ID.sub(lambda m: ids.get(m.group(), m.group()), a) for a in args]
        code, printed = await run(env, args)
        pairs = aligned(example.output, printed)
        shown = "\n".join(["$ " + example.command, *printed, *([f"(exit {code})"] * (code != 0))])
        assert pairs is not None and code == example.exit, (
            f"{example.where}: the CLI prints something else; it prints:\n{shown}"
        )
        for shown_line, real_line in pairs:
            for theirs, ours in zip(
                COMPOSITION_ID.findall(shown_line), COMPOSITION_ID.findall(real_line), strict=True
            ):
                ids.setdefault(theirs, ours)
