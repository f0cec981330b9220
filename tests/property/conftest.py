"""One fixture runs every ext test on both path cores: the compiled one and the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from path_cores import CORES, implementation


@pytest.fixture(params=CORES)
def core(request: pytest.FixtureRequest) -> SimpleNamespace:
    """The implementation under test; every test using it runs once per core."""
    return implementation(request.param)
