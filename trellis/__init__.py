"""Trellis: an event-sourced control plane for composable AI infrastructure.

The installed import names live under this namespace (``trellis.engine``, ``trellis.projections``,
``trellis.adapters``, ``trellis.ext``). In the repository each is a symlink to its top-level folder,
so the source tree keeps ``engine/``, ``projections/``, ``adapters/`` and ``ext/`` while a built
wheel carries them here, as real folders, and installs no other top-level name.
"""

#: The distribution's name on PyPI ("trellis" there is an unrelated project).
DISTRIBUTION = "trellis-fabric"
