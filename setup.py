"""Build the Cython extensions and ship the files the package reads from outside it (the SQL
migrations, the economics demo's inputs); all other metadata lives in pyproject.toml."""

import shutil
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# Where an installed engine finds its migrations (adapters/postgres/migrations.py): the
# repository keeps them in schema/, which is no package, so the wheel carries a copy here.
PACKAGED_SCHEMA = Path("trellis") / "adapters" / "postgres" / "schema"
# Likewise `trellis demo economics` (adapters/entrypoints/economics/data.py): examples/ stays
# the one copy in the repository, and the wheel carries what the demo reads, the trace with
# its CC-BY credit (NOTICE.md, LICENSE) beside it.
PACKAGED_EXAMPLES = Path("trellis") / "adapters" / "entrypoints" / "economics" / "examples"
DEMO_INPUTS = [
    "hall.json",
    "make_hall.py",
    "scheduler.py",
    "azure-llm-trace-2023/*.csv",
    "azure-llm-trace-2023/NOTICE.md",
    "azure-llm-trace-2023/LICENSE",
]


class BuildWithPackagedFiles(build_py):
    """build_py, plus schema/*.sql copied into the built trellis/adapters/postgres/schema/ and
    the demo's inputs from examples/ into trellis/adapters/entrypoints/economics/examples/."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / PACKAGED_SCHEMA
        target.mkdir(parents=True, exist_ok=True)
        for sql in sorted(Path("schema").glob("*.sql")):
            shutil.copy2(sql, target / sql.name)
        examples = Path("examples")
        for pattern in DEMO_INPUTS:
            found = sorted(examples.glob(pattern))
            if not found:  # a wheel without the demo's inputs would fail only when run
                raise FileNotFoundError(f"examples/{pattern} is missing")
            for source in found:
                copy = Path(self.build_lib) / PACKAGED_EXAMPLES / source.relative_to(examples)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, copy)


setup(
    cmdclass={"build_py": BuildWithPackagedFiles},
    ext_modules=cythonize(
        [Extension("trellis.ext._paths_c", ["ext/_paths_c.pyx"])],
        compiler_directives={"language_level": "3"},
    ),
)
