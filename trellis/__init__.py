"""Trellis: an event-sourced control plane for composable AI infrastructure.

Every module lives under this one name (``trellis.engine``, ``trellis.projections``,
``trellis.adapters``, ``trellis.ext``), in real folders here. The repository's root names
``engine/``, ``projections/``, ``adapters/`` and ``ext/`` are links into them for readers, never
imported through; ``schema/`` and ``examples/`` are mapped in as ``trellis.schema`` and
``trellis.examples`` (setup.py).
"""

#: The distribution's name on PyPI ("trellis" there is an unrelated project).
DISTRIBUTION = "trellis-fabric"
