"""What the economics demo runs with: the hall, the demand trace and the example scheduler.

They live in the repository's examples/, which a user reads and edits, installed as the package
`trellis.examples` (setup.py), so a checkout and a wheel find them the same way.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any


# The repository's examples/, which setup.py maps into the package as `trellis.examples`.
EXAMPLES = Path(str(resources.files("trellis.examples")))
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
