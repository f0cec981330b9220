"""Path core: the compiled Cython modules, or their pure-Python reference as a fallback.

One surface, two implementations, file for file: ``Fabric``, ``best_paths``, ``best_costs``,
``reachable``, ``census`` and ``hop_distances`` come from ``ext._paths_c`` when it is built,
else from ``ext._paths_py`` (the reference, the spec); ``LiveConditions`` and ``best_devices`` from
``ext._live_c``, else from ``ext._live_py`` (the reference's incremental twins); and one helper
of the event relay beside them, ``changed_keys`` (which keys two versions of a state map differ
in), from ``ext._diff_c``, else ``ext._diff_py``. The compiled path pair share their C
declarations in ``ext/_paths_c.pxd``; a missing build of any selects the reference for all.
The value types (``Conditions``, ``PathRequest``, ``Path``, ``Circuit``, ``NodeInfo``,
``LinkInfo``, ``DeviceInfo``, ``Selector``) and ``PathError`` are the reference's in both.

Set ``TRELLIS_PURE_PYTHON=1`` to force the reference (debugging, or checking a suspected drift).
"""

from __future__ import annotations

import os
import warnings
from typing import Literal

from ._paths_py import (
    Circuit,
    Conditions,
    DeviceInfo,
    LinkInfo,
    NodeInfo,
    Path,
    PathError,
    PathRequest,
    Selector,
)

__all__ = [
    "IMPLEMENTATION",
    "Circuit",
    "Conditions",
    "DeviceInfo",
    "Fabric",
    "LinkInfo",
    "LiveConditions",
    "NodeInfo",
    "Path",
    "PathError",
    "PathRequest",
    "Selector",
    "best_costs",
    "best_devices",
    "best_paths",
    "census",
    "changed_keys",
    "hop_distances",
    "reachable",
]

IMPLEMENTATION: Literal["cython", "python"]


def _reference() -> None:
    global Fabric, LiveConditions, best_costs, best_devices, best_paths, census, hop_distances
    global reachable, changed_keys, IMPLEMENTATION
    from ._diff_py import changed_keys
    from ._live_py import LiveConditions, best_devices
    from ._paths_py import Fabric, best_costs, best_paths, census, hop_distances, reachable

    IMPLEMENTATION = "python"


if os.environ.get("TRELLIS_PURE_PYTHON", "") not in ("", "0"):
    _reference()
else:
    try:
        from ._diff_c import changed_keys
        from ._live_c import LiveConditions, best_devices
        from ._paths_c import (
            Fabric,
            best_costs,
            best_paths,
            census,
            hop_distances,
            reachable,
        )
    except ImportError as exc:
        # Still correct, only slower; say why so a missing build is not mistaken for a slow host.
        warnings.warn(
            f"trellis: compiled path core unavailable ({exc}); "
            "using the pure-Python reference ext._paths_py",
            RuntimeWarning,
            stacklevel=2,
        )
        _reference()
    else:
        IMPLEMENTATION = "cython"
