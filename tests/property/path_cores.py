"""The path core's surface as each implementation provides it (for tests/property)."""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace

import pytest

from trellis.ext import _live_py, _paths_py

CORES = ("python", "cython")


def compiled(name: str = "_paths_c") -> ModuleType:
    try:
        return importlib.import_module(f"trellis.ext.{name}")
    except ImportError as exc:
        # A missing build must not turn into silently skipped cross-checks.
        pytest.fail(f"ext.{name} is not built ({exc}); run `make test` to build it")


def implementation(name: str) -> SimpleNamespace:
    """The path core's surface as one implementation provides it."""
    if name == "python":
        return SimpleNamespace(
            name="python",
            Fabric=_paths_py.Fabric,
            LiveConditions=_live_py.LiveConditions,
            best_paths=_paths_py.best_paths,
            best_costs=_paths_py.best_costs,
            reachable=_paths_py.reachable,
            census=_paths_py.census,
            best_devices=_live_py.best_devices,
            hop_distances=_paths_py.hop_distances,
        )
    module, live = compiled(), compiled("_live_c")
    return SimpleNamespace(
        name="cython",
        Fabric=module.Fabric,
        LiveConditions=live.LiveConditions,
        best_paths=module.best_paths,
        best_costs=module.best_costs,
        reachable=module.reachable,
        census=module.census,
        best_devices=live.best_devices,
        hop_distances=module.hop_distances,
    )
