"""Path core: the compiled Cython module, or its pure-Python reference as a fallback.

Set ``TRELLIS_PURE_PYTHON=1`` to force the reference (debugging, or checking a suspected drift).
"""

from __future__ import annotations

import os
import warnings
from typing import Literal

from ._paths_py import (
    Circuit,
    Conditions,
    Fabric,
    LinkInfo,
    NodeInfo,
    Path,
    PathError,
    PathRequest,
    best_paths,
)

__all__ = [
    "IMPLEMENTATION",
    "Circuit",
    "Conditions",
    "Fabric",
    "LinkInfo",
    "NodeInfo",
    "Path",
    "PathError",
    "PathRequest",
    "best_paths",
    "hop_distances",
]

# best_paths has only its networkx reference so far; the compiled twin follows (issue 4).

IMPLEMENTATION: Literal["cython", "python"]

if os.environ.get("TRELLIS_PURE_PYTHON", "") not in ("", "0"):
    from ._paths_py import hop_distances

    IMPLEMENTATION = "python"
else:
    try:
        from ._paths_c import hop_distances
    except ImportError as exc:
        # Still correct, only slower; say why so a missing build is not mistaken for a slow host.
        warnings.warn(
            f"trellis: compiled path core unavailable ({exc}); "
            "using the pure-Python reference ext._paths_py",
            RuntimeWarning,
            stacklevel=2,
        )
        from ._paths_py import hop_distances

        IMPLEMENTATION = "python"
    else:
        IMPLEMENTATION = "cython"
