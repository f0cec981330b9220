"""The committed contract files match the code: JSON Schema export and old event payloads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trellis.adapters.nats.contract import contract_files
from trellis.adapters.postgres.migrations import SCHEMA_DIR
from trellis.engine.intents import INTENTS
from trellis.engine.upcast import UnknownEventType, upcast

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


def test_the_asyncapi_document_names_every_subject_and_its_references_resolve() -> None:
    """schema/json/asyncapi.json (AsyncAPI 3): a channel and an operation per subject, and
    every `$ref` it holds points at something, in it or in a schema file beside it."""
    folder = SCHEMA_DIR / "json"
    doc = json.loads((folder / "asyncapi.json").read_text())
    assert doc["asyncapi"] == "3.0.0"
    subjects = {f"{family}.{verb}" for family, verb in INTENTS}
    subjects |= {f"view.{verb}" for family, verb in INTENTS if family == "query"}
    assert subjects | {"events", "state"} <= set(doc["operations"]) <= set(doc["channels"])
    for name, channel in doc["channels"].items():
        address = channel["address"]
        if address is not None:  # the reply channel's is the request's own reply subject
            tokens = set(re.findall(r"{(\w+)}", address))
            assert tokens == set(channel.get("parameters", {})), name

    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return found + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    def resolve(document: object, pointer: str) -> object:
        for part in pointer.strip("/").split("/") if pointer.strip("/") else []:
            assert isinstance(document, dict) and part in document, pointer
            document = document[part]
        return document

    for ref in refs(doc):
        file, _, pointer = ref.partition("#")
        target = doc if not file else json.loads((folder / file).read_text())
        assert resolve(target, pointer) is not None, ref
    assert "intents.schema.json#/$defs/intent.compose" in refs(doc)
