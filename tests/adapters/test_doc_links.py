"""Every relative link of README.md and docs/*.md leads somewhere (issue 22 item 5).

The README's manual moved into docs/, and pages link to each other's headings: a renamed
heading or a moved file must fail here, not in a reader's browser. A link is `[text](target)`
or `![alt](target)` outside code; its file must exist in the checkout without passing through
one of the root links (`engine/`, `adapters/`, ...: a checkout without symlinks has small text
files there, and GitHub does not follow them), and its `#anchor` must be a heading of the
target page, slugged as GitHub slugs them. Pages named in prose (`docs/x.md`) must exist too.
Links to other sites are not fetched.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
PAGE_IN_PROSE = re.compile(r"(?<![\w/.])docs/[\w.-]+\.md\b")
# Links into trellis/ for readers; text files in a checkout without symlinks.
ROOT_LINKS = {"engine", "projections", "adapters", "ext"}
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced code, with code spans blanked."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, CODE_SPAN.sub("``", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces to `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := HEADING.match(line)):
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def problem(page: Path, target: str) -> str | None:
    """What is wrong with a link from `page` to `target`, or None."""
    path, _, anchor = target.partition("#")
    goal = page
    if path:
        relative = os.path.normpath(page.parent.relative_to(REPO) / path)
        if relative.startswith(".."):
            return f"{target} leaves the repository"
        goal = REPO / relative
        parts = Path(relative).parts
        if len(parts) > 1 and parts[0] in ROOT_LINKS:
            return f"{target} goes through the root link {parts[0]}/ (link into trellis/)"
        walked = REPO
        for part in parts:
            walked = walked / part
            if walked.is_symlink():
                return f"{target} goes through the link {walked.relative_to(REPO)}"
        if not goal.exists():
            return f"{target}: no such file"
    if anchor and goal.suffix == ".md" and anchor not in anchors(goal):
        return f"{target}: {goal.relative_to(REPO)} has no heading #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(REPO)) for page in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = [
        f"{page.relative_to(REPO)}:{number}: {found}"
        for number, line in prose(page)
        for target in LINK.findall(line)
        if target and not EXTERNAL.match(target) and (found := problem(page, target))
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(REPO)) for page in PAGES])
def test_every_page_named_in_prose_exists(page: Path) -> None:
    missing = [
        f"{page.relative_to(REPO)}:{number}: {name}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for name in PAGE_IN_PROSE.findall(line)
        if not (REPO / name).is_file()
    ]
    assert not missing, "\n".join(missing)


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    page = REPO / "docs" / "tour.md"
    assert problem(page, "operations.md#metrics-and-health-trellis-up---metrics-port") is None
    assert problem(page, "#any-past-moment") is None
    assert problem(page, "../trellis/adapters/http/server.py") is None
    assert problem(page, "nowhere.md") == "nowhere.md: no such file"
    assert problem(page, "operations.md#nowhere") == (
        "operations.md#nowhere: docs/operations.md has no heading #nowhere"
    )
    assert problem(page, "../adapters/http/server.py") == (
        "../adapters/http/server.py goes through the root link adapters/ (link into trellis/)"
    )
    assert slug("Metrics and health (`trellis up --metrics-port`)") == (
        "metrics-and-health-trellis-up---metrics-port"
    )
    assert slug(
        "5. Path semantics (contract; the Cython core and the reference agree exactly)"
    ) == ("5-path-semantics-contract-the-cython-core-and-the-reference-agree-exactly")
