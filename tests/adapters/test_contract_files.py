"""The committed contract files match the code and are standard: JSON Schema (draft 2020-12)
whose references resolve, a typed reply per subject, an AsyncAPI document naming each
subject's request and reply; and old event payloads still decode."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from trellis.adapters.nats.contract import contract_files
from trellis.adapters.postgres.migrations import SCHEMA_DIR
from trellis.engine.core.contract import RESULTS, subjects
from trellis.engine.core.intents import INTENTS
from trellis.engine.core.upcast import UnknownEventType, upcast

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


def refs(node: object) -> list[str]:
    """Every `$ref` in a document."""
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


def test_every_subject_has_its_result_struct() -> None:
    """A subject added to INTENTS needs its reply's result in engine.core.contract.RESULTS."""
    assert set(RESULTS) == set(INTENTS)
    # Every query has a tenant's view but the operator's `fabric`.
    assert set(subjects()) == {f"{f}.{v}" for f, v in INTENTS} | {
        f"view.{v}" for f, v in INTENTS if f == "query" and v != "fabric"
    }


@pytest.mark.parametrize("name", sorted(n for n in contract_files() if n.endswith(".schema.json")))
def test_each_schema_file_is_standard_and_complete_in_itself(name: str) -> None:
    """Draft 2020-12 with `$schema` and `$id`, and every `$ref` points inside the file."""
    doc = json.loads(contract_files()[name])
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert doc["$id"] == f"urn:trellis:contract:{name.removesuffix('.schema.json')}"
    jsonschema.Draft202012Validator.check_schema(doc)
    assert refs(doc)
    for ref in refs(doc):
        assert ref.startswith("#/"), ref
        assert resolve(doc, ref[1:]) is not None, ref


def test_each_subjects_reply_is_its_result_or_an_error() -> None:
    """replies.schema.json: `#/$defs/<subject>` is the ok envelope with that subject's result
    (a view's is its query's), or ErrorReply; every field the engine always writes is
    required, so generated types need not make it optional."""
    doc = json.loads(contract_files()["replies.schema.json"])
    defs = doc["$defs"]
    for name, key in subjects().items():
        ok, error = (resolve(doc, r["$ref"][1:]) for r in defs[name]["anyOf"])
        assert error == defs["ErrorReply"]
        assert isinstance(ok, dict)
        assert ok["required"] == ["ok", "result", "position", "replayed"]
        assert ok["properties"]["result"] == {"$ref": f"#/$defs/{RESULTS[key].__name__}"}
    assert defs["view.why"] == {**defs["query.why"], "description": defs["view.why"]["description"]}
    assert defs["ErrorBody"]["required"] == ["code", "message", "details"]
    # Left out when absent (UNSET), so not required: the cable an OCS port names.
    assert "link" not in defs["BlastRadiusResult"]["required"]
    required = defs["ImportResult"]["required"]
    assert required[-6:] == [
        "added",
        "updated",
        "removed",
        *(f"{c}_count" for c in ("added", "updated", "removed")),
    ]


def test_the_asyncapi_document_names_every_subject_and_its_references_resolve() -> None:
    """schema/json/asyncapi.json (AsyncAPI 3): a channel and an operation per subject, each
    naming its request's and its reply's schema, and every `$ref` it holds points at
    something, in it or in a schema file beside it."""
    folder = SCHEMA_DIR / "json"
    doc = json.loads((folder / "asyncapi.json").read_text())
    assert doc["asyncapi"] == "3.0.0"
    named = set(subjects())
    assert named | {"events", "checkpoints", "state"} <= set(doc["operations"])
    assert set(doc["operations"]) <= set(doc["channels"])
    # The operator's fabric query is listed; tenants have no view of it.
    assert "query.fabric" in doc["channels"] and "view.fabric" not in doc["channels"]
    for name, channel in doc["channels"].items():
        address = channel["address"]
        if address is not None:  # the reply channel's is the request's own reply subject
            tokens = set(re.findall(r"{(\w+)}", address))
            assert tokens == set(channel.get("parameters", {})), name

    for ref in refs(doc):
        file, _, pointer = ref.partition("#")
        target = doc if not file else json.loads((folder / file).read_text())
        assert resolve(target, pointer) is not None, ref

    def payload(message_ref: str) -> str:
        message = resolve(doc, message_ref[1:])
        assert isinstance(message, dict)
        if "$ref" in message:  # a channel's message names a component
            message = resolve(doc, message["$ref"][1:])
        assert isinstance(message, dict)
        schema: str = message["payload"]["schema"]["$ref"]
        return schema

    for name in named:
        operation = doc["operations"][name]
        (request,) = operation["messages"]
        (reply,) = operation["reply"]["messages"]
        assert payload(request["$ref"]) == f"intents.schema.json#/$defs/{name}"
        assert payload(reply["$ref"]) == f"replies.schema.json#/$defs/{name}"


def test_schema_export_writes_under_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trellis schema export` with no --dir writes ./schema/json, never the package's own
    folder (inside site-packages when installed from the wheel)."""
    from trellis.adapters.entrypoints import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["schema", "export"]) == 0
    written = tmp_path / "schema" / "json"
    assert sorted(p.name for p in written.iterdir()) == sorted(contract_files())
    assert f"wrote {Path('schema', 'json', 'intents.schema.json')}" in capsys.readouterr().out
