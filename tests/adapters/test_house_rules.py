"""The house's rules, as `make check` enforces them (ruff, pyproject.toml and
trellis/engine/core/ruff.toml): one name per module, and a pure core.

ruff reads each module against the config nearest to it; these tests hand it a module at a path
in each part of the house and check what it says, so a rule that stops applying fails here."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
pytestmark = pytest.mark.skipif(RUFF is None, reason="ruff (the dev extra) is not installed")

IMPURE = """\
import asyncio
import asyncpg
from trellis.engine.service.writer import DomainWriter
from trellis.adapters.nats.client import TrellisClient
from trellis.projections import ProjectionSink
"""


def banned(module: str, source: str) -> list[str]:
    """The TID251 findings ruff reports for `source` were it the module at `module`."""
    assert RUFF is not None
    done = subprocess.run(
        [RUFF, "check", "--select", "TID251", "--output-format", "concise", "--stdin-filename",
         module, "-"],
        input=source, capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if "TID251" in line]


def test_the_pure_core_may_import_no_io_no_service_and_no_adapter() -> None:
    found = banned("trellis/engine/core/probe.py", IMPURE)
    assert len(found) == 5, found
    for name in ("asyncio", "asyncpg", "trellis.engine.service", "trellis.adapters"):
        assert any(f"`{name}` is banned" in f for f in found), name


def test_the_service_and_the_adapters_may() -> None:
    assert banned("trellis/engine/service/probe.py", IMPURE) == []
    assert banned("trellis/adapters/probe.py", IMPURE) == []


@pytest.mark.parametrize("where", ["trellis/engine/core", "trellis/adapters/nats", "tests/core"])
def test_nothing_imports_through_a_root_link(where: str) -> None:
    source = "import engine.core.ids\nfrom adapters.nats import client\nimport ext\n"
    assert len(banned(f"{where}/probe.py", source)) == 3


def test_the_core_as_it_stands_keeps_the_rules() -> None:
    assert RUFF is not None
    done = subprocess.run(
        [RUFF, "check", "--select", "TID251", "trellis", "tests", "bench", "examples"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout


def entrypoint_imports(path: Path) -> list[str]:
    """The modules of trellis.adapters.entrypoints that the module at `path` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        found += [n for n in names if n.startswith("trellis.adapters.entrypoints")]
    return found


def test_the_adapters_never_import_the_entrypoints() -> None:
    # One way (docs/architecture.md §7): the entrypoints wire the adapters; an adapter that
    # imported an entrypoint would make the CLI's modules part of the engine's process.
    adapters = REPO / "trellis" / "adapters"
    entrypoints = adapters / "entrypoints"
    offenders = {
        str(path.relative_to(REPO)): found
        for path in sorted(adapters.rglob("*.py"))
        if entrypoints not in path.parents and (found := entrypoint_imports(path))
    }
    assert offenders == {}


def test_the_entrypoint_rule_sees_an_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from trellis.adapters.entrypoints.cli import main\n")
    assert entrypoint_imports(probe) == [
        "trellis.adapters.entrypoints.cli",
        "trellis.adapters.entrypoints.cli.main",
    ]
