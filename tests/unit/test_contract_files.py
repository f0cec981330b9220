"""The committed contract files match the code: JSON Schema export and old event payloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.nats.contract import contract_files
from adapters.postgres.migrations import SCHEMA_DIR
from engine.upcast import UnknownEventType, upcast

PAYLOADS = Path(__file__).parent / "payloads"


@pytest.mark.parametrize("name", sorted(contract_files()))
def test_committed_json_schema_matches_the_structs(name: str) -> None:
    committed = SCHEMA_DIR / "json" / name
    assert committed.exists(), f"{committed} missing: run `trellis schema export`"
    assert committed.read_bytes() == contract_files()[name], (
        f"{committed} is out of date: run `trellis schema export` and commit the result"
    )


@pytest.mark.parametrize("path", sorted(PAYLOADS.glob("v*/*.json")), ids=lambda p: p.stem)
def test_checked_in_payloads_of_old_schema_versions_still_decode(path: Path) -> None:
    version = int(path.parent.name.removeprefix("v"))
    event = upcast(path.stem, version, path.read_bytes())
    assert type(event).__name__ == path.stem


def test_an_event_type_this_code_does_not_know_is_a_typed_error() -> None:
    with pytest.raises(UnknownEventType):
        upcast("FluxCapacitorCharged", 1, b"{}")
