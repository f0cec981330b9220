"""Parquet export (adapters/postgres/export.py, `trellis export --parquet`) of a scripted day
over real NATS and Postgres: what is exported equals the log, column types round-trip, a
second export appends only what is new, and the auditing guide's DuckDB query gives the
GPU-hours a sum over the log's own events gives."""

from __future__ import annotations

import base64
import json
import os
import re
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest_asyncio
from fabrics import expect_ok
from harness import Harness, ManualClock, run_cli
from history_day import DOMAIN, T0, Day, at, day_served, play

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.postgres.export import MANIFEST, DomainExport, export_parquet
from trellis.engine.core.checkpoints import Checkpoint, Signer, origin_of

ROOT = Path(__file__).parents[2]


@pytest_asyncio.fixture
async def clock() -> ManualClock:
    return ManualClock(T0)


@pytest_asyncio.fixture
async def sim() -> SimulatedFabric:
    return SimulatedFabric(seed=3)


@pytest_asyncio.fixture
async def h(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    clock: ManualClock,
    sim: SimulatedFabric,
) -> AsyncIterator[Harness]:
    async with day_served(nats_url, database_url, pg_schema, subject_prefix, clock, sim) as harness:
        yield harness


@pytest_asyncio.fixture
async def day(h: Harness, clock: ManualClock, sim: SimulatedFabric) -> Day:
    played = await play(h, clock, sim)
    await h.projected(DOMAIN)
    return played


async def export(pool: asyncpg.Pool, out: Path, **kwargs: Any) -> DomainExport:
    (done,) = await export_parquet(pool, out, domains=[DOMAIN], **kwargs)
    return done


def table(out: Path, name: str) -> pa.Table:
    # pyarrow.parquet's own readers take hive partitions as dictionaries, which clash with
    # the files' own `domain` column; a dataset with plain hive partitioning does not.
    return ds.dataset(out / name, format="parquet", partitioning="hive").to_table()


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))}


async def log_rows(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        "SELECT position, version, recorded_at, id::text AS id, type, schema_version, actor,"
        " causation_id, correlation_id, prev_hash, hash, data::text AS data"
        " FROM trellis_events WHERE domain = $1 ORDER BY position",
        DOMAIN,
    )
    return [dict(r) for r in rows]


async def test_the_export_holds_every_event_of_the_log_in_typed_columns(
    pool: asyncpg.Pool, day: Day, tmp_path: Path
) -> None:
    done = await export(pool, tmp_path)
    log = await log_rows(pool)
    assert (done.events, done.first_position, done.last_position) == (
        len(log),
        1,
        log[-1]["position"],
    )
    parts = sorted((tmp_path / "events").rglob("*.parquet"))
    assert parts and all(
        re.fullmatch(
            rf"events/domain={DOMAIN}/day=\d{{4}}-\d\d-\d\d/part-\d{{20}}-\d{{20}}\.parquet",
            str(p.relative_to(tmp_path)),
        )
        for p in parts
    )
    schema = pq.read_schema(parts[0])
    assert schema.field("position").type == pa.int64()
    assert schema.field("version").type == pa.int64()
    assert schema.field("schema_version").type == pa.int64()
    assert schema.field("time").type == pa.timestamp("us", tz="UTC")
    for name in ("type", "actor", "causation", "correlation", "hash", "data", "domain", "id"):
        assert schema.field(name).type == pa.string(), name
    rows = sorted(
        (r for p in parts for r in pq.read_table(p).to_pylist()), key=lambda r: r["position"]
    )
    assert [
        (r["position"], r["version"], r["time"], r["id"], r["type"], r["schema_version"])
        for r in rows
    ] == [
        (e["position"], e["version"], e["recorded_at"], e["id"], e["type"], e["schema_version"])
        for e in log
    ]
    assert [(r["actor"], r["causation"], r["correlation"]) for r in rows] == [
        (e["actor"], e["causation_id"], e["correlation_id"]) for e in log
    ]
    # The stored JSON text itself, byte for byte: what the hash chain covers.
    assert [(r["data"], r["prev_hash"], r["hash"]) for r in rows] == [
        (e["data"], e["prev_hash"], e["hash"]) for e in log
    ]
    meta = schema.metadata
    assert meta[b"trellis.domain"] == DOMAIN.encode()
    assert meta[b"trellis.first_position"] == b"1"
    assert meta[b"trellis.last_position"] == str(log[-1]["position"]).encode()
    assert meta[b"trellis.chain_head_version"] == str(log[-1]["version"]).encode()
    assert meta[b"trellis.chain_head_hash"] == log[-1]["hash"].encode()


async def stored_checkpoints(
    owner_url: str, pg_schema: str, rows: list[tuple[int, str, str]]
) -> None:
    """Checkpoint rows (size, root, note) as schema/010 holds them, written by the table's
    owner (the engine signs its own; here the notes are made to measure)."""
    owner = await asyncpg.connect(owner_url, server_settings={"search_path": pg_schema})
    try:
        for size, root, note in rows:
            await owner.execute(
                "INSERT INTO trellis_checkpoints VALUES ($1, $2, $3, now(), $4)"
                " ON CONFLICT DO NOTHING",
                DOMAIN,
                size,
                root,
                note,
            )
    finally:
        await owner.close()


def signed(size: int, root: str) -> str:
    """A checkpoint note of `size` events with `root` (base64), signed by a key of its own."""
    body = Checkpoint(origin=origin_of(DOMAIN), size=size, root=base64.b64decode(root)).body()
    return Signer.generate().sign(body)


async def test_the_files_name_the_latest_checkpoint_the_export_covers_and_carry_its_note(
    pool: asyncpg.Pool, owner_url: str, pg_schema: str, day: Day, tmp_path: Path
) -> None:
    head = (await log_rows(pool))[-1]["version"]
    roots = [base64.b64encode(bytes([n]) * 32).decode() for n in (1, 2, 3)]
    sizes = (2, head, head + 1)
    notes = [signed(size, root) for size, root in zip(sizes, roots, strict=True)]
    await stored_checkpoints(owner_url, pg_schema, list(zip(sizes, roots, notes, strict=True)))

    done = await export(pool, tmp_path)

    assert done.checkpoint_problem is None
    for name in done.files:
        meta = pq.read_schema(tmp_path / name).metadata
        assert meta[b"trellis.checkpoint_size"] == str(head).encode()
        assert meta[b"trellis.checkpoint_root"] == roots[1].encode()
        # The signed statement itself: an auditor checks it with the key they hold.
        assert meta[b"trellis.checkpoint_note"] == notes[1].encode()


async def test_a_checkpoint_row_unlike_its_signed_note_is_named_and_not_stamped(
    pool: asyncpg.Pool,
    owner_url: str,
    database_url: str,
    pg_schema: str,
    day: Day,
    tmp_path: Path,
) -> None:
    """An auditor's probe rewrote the log and the checkpoint rows' roots as a superuser, and
    left the signed notes: the export stamped the forged root as the one to check against."""
    head = (await log_rows(pool))[-1]["version"]
    signed_root, forged_root = (base64.b64encode(bytes([n]) * 32).decode() for n in (1, 2))
    await stored_checkpoints(owner_url, pg_schema, [(head, forged_root, signed(head, signed_root))])

    done = await export(pool, tmp_path)

    assert done.files and done.checkpoint_problem is not None
    assert forged_root in done.checkpoint_problem and signed_root in done.checkpoint_problem
    for name in done.files:
        meta = pq.read_schema(tmp_path / name).metadata
        assert not {k for k in meta if k.startswith(b"trellis.checkpoint_")}, meta
    # The CLI says so and fails, though it wrote the events.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
        "TRELLIS_DATA_DIR": str(tmp_path / "data"),
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DB_SCHEMA": pg_schema,
    }
    code, text = await trellis(env, "export", "--parquet", str(tmp_path / "by-cli"))
    assert code == 1 and f"{DOMAIN}: exported positions 1-" in text, text
    assert "trellis: checkpoint: " in text and "the checkpoint table was edited" in text, text


async def test_history_and_compositions_are_exported_with_their_lifecycle(
    pool: asyncpg.Pool, day: Day, tmp_path: Path
) -> None:
    await export(pool, tmp_path)
    history = table(tmp_path, "history")
    assert history.schema.field("start").type == pa.timestamp("us", tz="UTC")
    assert history.schema.field("cost_per_hour").type == pa.float64()
    ended = sorted(history.to_pylist(), key=lambda r: (r["start_position"], r["device"]))
    assert [(r["device"], r["tenant"], r["end_reason"]) for r in ended] == [
        ("gpu-1", "acme", "replaced"),
        ("gpu-2", "globex", "released"),
        ("mem-1", "globex", "released"),
        ("gpu-3", "acme", "lease_expired"),
        ("gpu-2", "initech", "failed"),
    ]
    assert str(ended[3]["end"].isoformat()) == at(3600).replace("Z", "+00:00")
    lives = {r["composition_id"]: r for r in table(tmp_path, "compositions").to_pylist()}
    assert {cid: (r["state"], r["end_reason"]) for cid, r in lives.items()} == {
        day.acme: ("released", "lease_expired"),
        day.globex: ("released", "released"),
        day.failed: ("failed", "failed"),
    }
    # A lease's end is one moment: the release it causes, where the composition ends too.
    assert ended[3]["end_position"] == lives[day.acme]["end_position"]
    assert ended[1]["end_position"] == lives[day.globex]["end_position"]
    assert lives[day.failed]["activated_at"] is None and lives[day.failed]["failure_reason"]
    assert lives[day.globex]["activated_at"] == lives[day.globex]["requested_at"]
    # Nothing was open at the end of the day.
    (snapshot,) = (tmp_path / "open" / f"domain={DOMAIN}").iterdir()
    assert pq.read_table(snapshot / "history.parquet").num_rows == 0


async def test_a_second_export_appends_only_what_is_new(
    pool: asyncpg.Pool, day: Day, tmp_path: Path
) -> None:
    first = await export(pool, tmp_path, until=datetime.fromisoformat(at(2000)))
    before = files(tmp_path)
    # As of 2000 s: acme's first A100 was replaced; acme's stand-in and globex still held.
    (snapshot,) = (tmp_path / "open" / f"domain={DOMAIN}").iterdir()
    held = pq.read_table(snapshot / "history.parquet").to_pylist()
    assert sorted((r["device"], r["end"]) for r in held) == [
        ("gpu-2", None),
        ("gpu-3", None),
        ("mem-1", None),
    ]
    assert [r["device"] for r in table(tmp_path, "history").to_pylist()] == ["gpu-1"]

    second = await export(pool, tmp_path)
    after = files(tmp_path)
    assert {k: after[k] for k in before} == before  # no file rewritten
    assert second.first_position == first.last_position + 1
    log = await log_rows(pool)
    positions = table(tmp_path, "events").column("position").to_pylist()
    assert sorted(positions) == [e["position"] for e in log]  # each event once
    assert first.events + second.events == len(log)
    assert table(tmp_path, "history").num_rows == 5
    assert table(tmp_path, "compositions").num_rows == 3
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["domains"][DOMAIN]["last_position"] == log[-1]["position"]
    assert len(manifest["domains"][DOMAIN]["exports"]) == 2

    third = await export(pool, tmp_path)
    assert third.events == 0 and files(tmp_path) == after


async def test_an_export_stops_where_the_history_projection_has_folded(
    h: Harness, pool: asyncpg.Pool, day: Day, tmp_path: Path
) -> None:
    folded = (await log_rows(pool))[-1]["position"]
    follower = h.followers.of("projections", DOMAIN)
    assert follower is not None
    await follower.stop()
    body = {"host": "host-1", "devices": [{"kind": "gpu"}]}
    expect_ok(await h.client.intent(DOMAIN, "acme", "compose", body))
    head = (await log_rows(pool))[-1]["position"]
    assert head > folded

    done = await export(pool, tmp_path)

    assert (done.last_position, done.held_back) == (folded, head)
    assert max(table(tmp_path, "events").column("position").to_pylist()) == folded
    follower.start()
    await h.projected(DOMAIN)
    rest = await export(pool, tmp_path)
    assert (rest.first_position, rest.last_position, rest.held_back) == (folded + 1, head, None)


async def test_the_auditing_guide_duckdb_query_gives_the_gpu_hours_of_the_log(
    pool: asyncpg.Pool, day: Day, tmp_path: Path
) -> None:
    await export(pool, tmp_path)
    guide = (ROOT / "docs" / "auditing.md").read_text()
    section = guide[guide.index("### GPU-hours and cost by tenant and model") :]
    query = sql_block(section).replace("'export/", f"'{tmp_path}/")
    answered = {
        (tenant, model): (hours, cost)
        for tenant, model, hours, cost in duckdb.sql(query).fetchall()
    }
    expected = gpu_hours_from_the_log(await log_rows(pool))
    assert answered == {
        key: (round(hours, 3), round(cost, 2)) for key, (hours, cost) in expected.items()
    }
    assert answered == {
        ("acme", "A100"): (1.0, 1.15),
        ("globex", "H100"): (0.5, 1.25),
        ("initech", "H100"): (0.0, 0.0),
    }


async def test_the_auditing_guide_finds_who_was_on_a_device_during_an_outage(
    pool: asyncpg.Pool, day: Day, tmp_path: Path
) -> None:
    await export(pool, tmp_path)
    guide = (ROOT / "docs" / "auditing.md").read_text()
    section = guide[guide.index("### Who was on gpu-042 during the outage") :]
    query = sql_block(section).replace("'export/", f"'{tmp_path}/").replace("gpu-042", "gpu-2")
    query = query.replace("'hall-1'", f"'{DOMAIN}'")
    query = query.replace("2026-11-30 12:30:00+00", at(2000)).replace(
        "2026-11-30 12:40:00+00", at(2100)
    )
    rows = duckdb.sql(query).fetchall()
    assert [(device, tenant) for device, tenant, *_ in rows] == [("gpu-2", "globex")]


async def test_the_cli_exports_and_says_what_it_wrote(
    h: Harness,
    day: Day,
    tmp_path: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
        "TRELLIS_DATA_DIR": str(tmp_path / "data"),
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DB_SCHEMA": pg_schema,
    }
    out = tmp_path / "export"
    code, text = await trellis(env, "export", "--parquet", str(out), "--domain", DOMAIN)
    assert code == 0 and f"{DOMAIN}: exported positions 1-" in text, text
    code, text = await trellis(env, "export", "--parquet", str(out))
    assert code == 0 and f"{DOMAIN}: nothing new to export" in text, text
    code, text = await trellis(env, "export", "--parquet", str(out), "--since", "today")
    assert code == 2 and "'today' is not an ISO time" in text and "Traceback" not in text, text
    code, text = await trellis(env, "export", "--parquet", str(out), "--domain", "nowhere")
    assert code == 1 and "no domain 'nowhere'" in text, text
    # A place the export cannot be written: the operator's to fix, not a bug in Trellis.
    (tmp_path / "a-file").write_text("")
    code, text = await trellis(env, "export", "--parquet", str(tmp_path / "a-file"))
    assert code == 1 and text.startswith("trellis: error: cannot write the export in "), text
    assert "Not a directory" in text and "Traceback" not in text, text


def sql_block(text: str) -> str:
    """The first ```sql block of a Markdown text."""
    start = text.index("```sql") + len("```sql")
    return text[start : text.index("```", start)]


async def trellis(env: dict[str, str], *args: str) -> tuple[int, str]:
    """The CLI's exit code and everything it printed."""
    code, out, err = await run_cli(env, *args)
    return code, out + err


def gpu_hours_from_the_log(log: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[float, float]]:
    """GPU-hours and cost by tenant and model, summed over the raw events alone (its own small
    fold, independent of the projection): a GPU is charged from its reservation until its
    composition ends or it is replaced, at the price the topology gave it."""
    prices: dict[str, tuple[str, float]] = {}
    tenants: dict[str, str] = {}
    held: dict[tuple[str, str], datetime] = {}
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])

    def end(cid: str, device: str, when: datetime) -> None:
        if (cid, device) not in held:
            return  # not a GPU
        start = held.pop((cid, device))
        model, price = prices[device]
        hours = (when - start).total_seconds() / 3600
        totals[(tenants[cid], model)][0] += hours
        totals[(tenants[cid], model)][1] += hours * price

    for row in log:
        data, when = json.loads(row["data"]), row["recorded_at"]
        match row["type"]:
            case "TopologyImported":
                for node in data["nodes"]:
                    if node.get("device_kind") == "gpu":
                        prices[node["id"]] = (node["model"], node["cost_per_hour"])
            case "CompositionRequested":
                tenants[data["composition_id"]] = data["tenant"]
            case "DevicesReserved":
                for binding in data["devices"]:
                    if binding["kind"] == "gpu":
                        held[(data["composition_id"], binding["device"])] = when
            case "DeviceReplaced":
                end(data["composition_id"], data["old_device"], when)
                if data["binding"]["kind"] == "gpu":
                    held[(data["composition_id"], data["binding"]["device"])] = when
            case "LeaseExpired" | "CompositionReleased" | "CompositionFailed":
                for cid, device in [k for k in held if k[0] == data["composition_id"]]:
                    end(cid, device, when)
    assert not held, "the scripted day ends with every GPU given back"
    return {key: (hours, cost) for key, (hours, cost) in totals.items()}


async def test_the_open_snapshot_says_impaired_and_each_file_says_where_its_rows_come_from(
    h: Harness, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """An impaired composition was exported as `active` (the auditor probe); and the history
    and compositions files carry the chain head and checkpoint of the events they sit beside,
    which vouch for the events files only: `trellis.source` says what each file's rows are."""
    acme = expect_ok(
        await h.client.intent(
            DOMAIN,
            "acme",
            "compose",
            {
                "request_id": "r-a100",
                "host": "host-1",
                "devices": [{"kind": "gpu", "models": ["A100"]}],
            },
        )
    )
    for gpu in ("gpu-1", "gpu-3"):  # the A100 and then its stand-in, the other A100
        fault = {"component": gpu, "state": "failed", "detail": "xid 79"}
        expect_ok(await h.client.admin(DOMAIN, "report-fault", fault))
    await h.projected(DOMAIN)

    await export(pool, tmp_path)

    (snapshot,) = (tmp_path / "open" / f"domain={DOMAIN}").iterdir()
    live = pq.read_table(snapshot / "compositions.parquet").to_pylist()
    assert [(r["composition_id"], r["state"]) for r in live] == [
        (acme["composition_id"], "impaired")
    ]
    sources = {
        str(p.relative_to(tmp_path)).split("/")[0] + "/" + p.name.split("-")[0]: pq.read_schema(
            p
        ).metadata[b"trellis.source"]
        for p in tmp_path.rglob("*.parquet")
    }
    assert sources == {
        "events/part": b"log",
        "history/part": b"projection proj_history_intervals",
        "compositions/part": b"projection proj_history_compositions",
        "open/history.parquet": b"projection proj_history_intervals",
        "open/compositions.parquet": b"projection proj_history_compositions",
    }


async def test_an_export_continued_after_the_folds_changed_says_so(
    pool: asyncpg.Pool, day: Day, tmp_path: Path
) -> None:
    """The upgrade probe continued an export across an upgrade that changed a fold: the
    directory then held intervals of both meanings, and nothing told them apart."""
    first = await export(pool, tmp_path, until=datetime.fromisoformat(at(2000)))
    assert first.earlier_folds is None and first.folds.startswith("read_models-")
    await pool.execute("UPDATE trellis_projection_format SET format = 'read_models-newer'")

    second = await export(pool, tmp_path)

    assert (second.folds, second.earlier_folds) == ("read_models-newer", first.folds)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["folds"] for e in manifest["domains"][DOMAIN]["exports"]] == [
        first.folds,
        "read_models-newer",
    ]
    newest = [
        p for p in tmp_path.rglob("*.parquet") if str(p.relative_to(tmp_path)) in second.files
    ]
    folds = {pq.read_schema(p).metadata.get(b"trellis.folds") for p in newest}
    assert folds == {None, b"read_models-newer"}  # the events files carry none
