"""A checkout without symlinks works (issue 22): the package is real folders under trellis/.

The root names engine/, projections/, adapters/ and ext/ are links for readers only. A clone
with core.symlinks=false (Windows' default, some CI caches, a zip download) turns them into
small text files; nothing may depend on them. So: clone the committed tree that way, install
it (editable, its Cython extension built), import every module of the package from it, and run
there the suites that meet the extension and the package's files: tests/core (the Cython core
and its reference) and the adapters' tests of the migrations, the contract files, the layers,
the simulated fabric's file and the demo's data. The main run has the rest; running all of
tests/adapters again here took 90 s of a worker for no file they read that these do not."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from nested import nested_pytest

pytestmark = pytest.mark.slow  # a clone, an install with its extension built, two suites

REPO = Path(__file__).resolve().parents[2]
#: The adapters' suites that read the package's own files (migrations, schemas, examples, the
#: layout) or its simulated fabric's.
FILE_SUITES = [
    "test_migration_files.py",
    "test_contract_files.py",
    "test_house_rules.py",
    "test_fabric_sim.py",
    "test_demo_cli.py",
]
#: Imports every module of the installed package (but its `python -m` entry); prints each
#: one found outside its own folders (none), then how many it imported.
IMPORT_EVERY_MODULE = """
import importlib, pathlib, pkgutil, trellis
root = pathlib.Path(trellis.__file__).parent
walked = pkgutil.walk_packages(trellis.__path__, "trellis.")
names = [m.name for m in walked if not m.name.endswith(".__main__")]  # that one runs the CLI
for name in names:
    where = pathlib.Path(importlib.import_module(name).__file__)
    if root not in where.parents:
        print(name, where)
print(len(names))
"""


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_a_clone_without_symlinks_installs_and_passes_its_fast_suites(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    run("git", "clone", "-q", "-c", "core.symlinks=false", REPO, clone)
    for link in ("engine", "projections", "adapters", "ext"):
        assert (clone / link).is_file() and not (clone / link).is_symlink(), link
        assert (clone / "trellis" / link / "__init__.py").is_file(), link
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    # The dependencies are this environment's (already installed); the package is the clone.
    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "-e", clone)
    where = run(
        venv / "bin" / "python", "-c", "import trellis.engine.core.ids as m; print(m.__file__)",
        cwd=tmp_path,
    )  # fmt: skip
    assert where.strip() == str(clone / "trellis" / "engine" / "core" / "ids.py")
    outside = run(venv / "bin" / "python", "-c", IMPORT_EVERY_MODULE, cwd=tmp_path).split()
    assert outside[-1].isdigit() and int(outside[-1]) > 100 and outside[:-1] == [], outside
    done = nested_pytest(
        tmp_path, "-m", "not slow", "tests/core", *(f"tests/adapters/{f}" for f in FILE_SUITES),
        python=venv / "bin" / "python", cwd=clone, env=os.environ, timeout=900,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, f"{out[-3000:]}\n{done.stderr[-3000:]}"
    assert " passed" in out.splitlines()[-1] and "failed" not in out.splitlines()[-1], out
