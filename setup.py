"""Build the Cython extensions; all other metadata lives in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("ext._paths_c", ["ext/_paths_c.pyx"])],
        compiler_directives={"language_level": "3"},
    ),
)
