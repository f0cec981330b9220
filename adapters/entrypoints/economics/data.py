"""What the economics demo runs with: the hall, the demand trace and the example scheduler.

They live in the repository's examples/, which a user reads and edits; an installed wheel
carries a copy of them beside this module (setup.py), since it has no examples/.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def _examples_dir() -> Path:
    """The source tree's examples/ (a clone, an editable install), else the wheel's copy."""
    here = Path(__file__).resolve().parent
    source = here.parents[2] / "examples"
    return source if (source / "hall.json").is_file() else here / "examples"


EXAMPLES = _examples_dir()
HALL = EXAMPLES / "hall.json"
TRACE = EXAMPLES / "azure-llm-trace-2023"
SCHEDULER = EXAMPLES / "scheduler.py"


def read_hall(path: Path = HALL) -> dict[str, Any]:
    hall: dict[str, Any] = json.loads(path.read_text())
    return hall


def trace_files() -> list[Path]:
    return sorted(TRACE.glob("*.csv"))


def example_scheduler() -> ModuleType:
    """examples/scheduler.py as a module: it imports nothing from Trellis, so it is loaded by
    path, as a user's own file would be."""
    name = "trellis_example_scheduler"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCHEDULER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
