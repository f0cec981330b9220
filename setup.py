"""Build the Cython extensions and ship the SQL migrations; all other metadata lives in
pyproject.toml."""

import shutil
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# Where an installed engine finds its migrations (adapters/postgres/migrations.py): the
# repository keeps them in schema/, which is no package, so the wheel carries a copy here.
PACKAGED_SCHEMA = Path("adapters") / "postgres" / "schema"


class BuildWithMigrations(build_py):
    """build_py, plus schema/*.sql copied into the built adapters/postgres/schema/."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / PACKAGED_SCHEMA
        target.mkdir(parents=True, exist_ok=True)
        for sql in sorted(Path("schema").glob("*.sql")):
            shutil.copy2(sql, target / sql.name)


setup(
    cmdclass={"build_py": BuildWithMigrations},
    ext_modules=cythonize(
        [Extension("trellis.ext._paths_c", ["ext/_paths_c.pyx"])],
        compiler_directives={"language_level": "3"},
    ),
)
