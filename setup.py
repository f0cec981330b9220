"""Build the Cython extension and map the root folders the package reads (schema/, examples/)
into it; all other metadata lives in pyproject.toml.

schema/ and examples/ stay at the repository's root, where people read and edit them, and are
installed as the packages `trellis.schema` (the SQL migrations) and `trellis.examples` (the
economics demo's inputs). A wheel carries them as real folders; an editable install maps the
same names onto the root folders, so code finds them one way (importlib.resources) in both.
"""

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

MAPPED = {"trellis.schema": "schema", "trellis.examples": "examples"}

setup(
    # web/ holds the fabric page's files, no Python: listed, so setuptools ships it as data.
    packages=[
        *find_packages(include=["trellis", "trellis.*"]),
        "trellis.adapters.http.web",
        *MAPPED,
    ],
    package_dir=MAPPED,
    ext_modules=cythonize(
        [
            # _live_c cimports _paths_c (its _paths_c.pxd), as _live_py imports _paths_py.
            Extension("trellis.ext._paths_c", ["trellis/ext/_paths_c.pyx"]),
            Extension("trellis.ext._live_c", ["trellis/ext/_live_c.pyx"]),
            Extension("trellis.ext._diff_c", ["trellis/ext/_diff_c.pyx"]),
        ],
        compiler_directives={"language_level": "3"},
    ),
)
