"""`trellis verify --event FILE` takes the event as docs/auditing.md says: as the
TRELLIS_EVENTS stream carries it, or an export's row written in JSON by the auditor's own
tools (DuckDB's COPY, json.dumps of a pyarrow row), with its time at any offset; a file it
cannot read is the command line's to change (exit 2), an event that does not hash to its own
hash does not hold (exit 1). A real engine's proof, checkpoint and Parquet export."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg
import duckdb
import msgspec
import pyarrow.dataset as ds
import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric
from harness import Harness, serving

from trellis.adapters.entrypoints import cli
from trellis.adapters.nats.jetstream import Envelope
from trellis.adapters.postgres.export import export_parquet

HALL = "hall-1"
PROVED = 4  # the version of the event whose inclusion is proved


@dataclass
class Audit:
    """What the auditor holds: the export, the proof of version PROVED, a checkpoint, the
    key, and the event as the stream carries it."""

    export: Path
    verify: list[str]
    envelope: Envelope


@pytest_asyncio.fixture
async def audit(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    pool: asyncpg.Pool,
    tmp_path: Path,
) -> AsyncIterator[Audit]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as h:
        await some_history(h)
        note = expect_ok(await h.client.admin(HALL, "checkpoint", {}))["note"]
        key = expect_ok(await h.client.query(HALL, "checkpoint-key"))["verifier_key"]
        event = [e async for e in h.store.read(HALL)][PROVED - 1]
        proof = expect_ok(await h.client.query(HALL, "proof", {"event_id": event.id}))
        await h.projected(HALL)
        await export_parquet(pool, tmp_path / "export", domains=[HALL])
    (tmp_path / "note").write_text(note)
    (tmp_path / "proof.json").write_text(json.dumps(proof))
    (tmp_path / "key").write_text(key + "\n")
    verify = ["verify", "--checkpoint", str(tmp_path / "note"), "--key-file"]
    verify += [str(tmp_path / "key"), "--proof", str(tmp_path / "proof.json")]
    yield Audit(export=tmp_path / "export", verify=verify, envelope=Envelope.of(event))


async def some_history(h: Harness) -> None:
    expect_ok(await h.client.admin(HALL, "import-topology", fabric()))
    for tenant in ("acme", "globex"):
        body = {"host": "host-01", "devices": [{"kind": "gpu"}]}
        cid = expect_ok(await h.client.intent(HALL, tenant, "compose", body))["composition_id"]
        expect_ok(await h.client.intent(HALL, tenant, "release", {"composition_id": cid}))


def duckdb_row(audit: Audit, out: Path, *, time_zone: str = "UTC", array: bool = False) -> Path:
    """The auditor's `COPY (SELECT * ... WHERE version = N) TO 'row.json'` in DuckDB."""
    con = duckdb.connect()
    con.sql(f"SET TimeZone = '{time_zone}'")
    con.sql(
        f"COPY (SELECT * FROM read_parquet('{audit.export}/events/**/*.parquet')"
        f" WHERE version = {PROVED}) TO '{out}'" + (" (ARRAY true)" if array else "")
    )
    return out


def pyarrow_row(audit: Audit) -> dict[str, Any]:
    table = ds.dataset(audit.export / "events", format="parquet", partitioning="hive")
    (row,) = [r for r in table.to_table().to_pylist() if r["version"] == PROVED]
    return row


def check(audit: Audit, event: Path) -> int:
    code: int = cli.main([*audit.verify, "--event", str(event)])
    return code


def test_an_export_row_as_duckdb_writes_it_is_the_event_proved(
    audit: Audit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = duckdb_row(audit, tmp_path / "row.json")
    assert '"time":' in row.read_text() and '"recorded_at"' not in row.read_text()

    assert check(audit, row) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"ok: event hash {audit.envelope.hash[:16]}")
    # An array of the one row, its time in another zone (DuckDB writes the session's).
    kolkata = duckdb_row(audit, tmp_path / "array.json", time_zone="Asia/Kolkata", array=True)
    assert "+05:30" in kolkata.read_text()
    assert check(audit, kolkata) == 0, capsys.readouterr().err


def test_an_export_row_as_pyarrow_gives_it_is_the_event_proved(
    audit: Audit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = tmp_path / "row.json"
    row.write_text(json.dumps(pyarrow_row(audit), default=str))
    assert check(audit, row) == 0, capsys.readouterr().err


def test_the_stream_form_with_its_time_at_another_offset_is_the_same_event(
    audit: Audit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    instant = datetime.fromisoformat(audit.envelope.recorded_at)
    plus_one = instant.astimezone(timezone(timedelta(hours=1))).isoformat()
    assert plus_one.endswith("+01:00")
    event = tmp_path / "event.json"
    event.write_bytes(
        msgspec.json.encode(msgspec.structs.replace(audit.envelope, recorded_at=plus_one))
    )
    assert check(audit, event) == 0, capsys.readouterr().err


def test_a_row_changed_does_not_hold(
    audit: Audit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = pyarrow_row(audit)
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({**row, "actor": "mallory"}, default=str))
    assert check(audit, forged) == 1
    assert "does not hash to the hash it carries" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "cannot read "),
        ("not json", "cannot read the event in "),
        ("[{}, {}]", "holds 2 events in an array; give the one proved"),
        ('{"id": "e1"}', "neither the stream's form of an event"),
        ("naive", "has no offset"),
        ("no causation", "missing required field `causation`"),
    ],
)
def test_a_file_that_holds_no_readable_event_is_a_usage_error(
    audit: Audit,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    said: str,
) -> None:
    event = tmp_path / "event.json"
    row = pyarrow_row(audit)
    if content == "naive":
        event.write_text(json.dumps({**row, "time": row["time"].replace(tzinfo=None)}, default=str))
    elif content == "no causation":
        del row["causation"]
        event.write_text(json.dumps(row, default=str))
    elif content is not None:
        event.write_text(content)

    assert check(audit, event) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("trellis: usage: ") and said in line, line
    assert "FAILED" not in line
