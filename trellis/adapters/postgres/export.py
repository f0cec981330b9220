"""Parquet export of the log, the connection history and the compositions (issue 10 item 6).

An auditor takes the history into their own tools (DuckDB, pandas, Spark) with
`trellis export --parquet DIR`. Layout of DIR (hive-style, so `read_parquet('DIR/events/**')`
sees `domain` and `day` as columns):

    events/domain=<d>/day=<YYYY-MM-DD>/part-<first>-<last>.parquet   the log, one row per event
    history/domain=<d>/part-<first>-<last>.parquet       intervals that ended in that range
    compositions/domain=<d>/part-<first>-<last>.parquet  compositions that ended in that range
    open/domain=<d>/as_of=<last>/history.parquet         intervals still open at <last>
    open/domain=<d>/as_of=<last>/compositions.parquet    compositions still live at <last>
    trellis-export.json                                  what has been exported, per domain

<first> and <last> are log positions (20 digits, so names sort in log order). An export
appends: it covers each domain from the position after the last one exported (the manifest
says which) up to the log's head, or the last event at or before `until`; `since` skips
events before it in a domain's first export only. On a domain the manifest already holds, a
`since` that would skip events after its last position is refused (SinceWouldSkip, before
anything is written): those events would be in no file, and every later export would carry
on past them. Files are written once and never rewritten (the manifest, written last, is
the commit point of each domain's export), so a row is in exactly one file: an event in the
part that covers its position, an interval or a composition in the part where it ended.
What is still open at an export's end is in that export's `open/` snapshot (as of its last
position: ends after it are not shown); a later export has a newer one, so readers take the
highest `as_of` per domain.

An export appends only to the chain it holds: before a domain's next part, the log's event at
the exported chain head (version and hash, which the manifest records) must still be there,
and the next event must follow it. A log whose tail was replaced since (a failover to a
standby that lacked it, or a rewrite) is a fork of the export; that domain is refused
(`DomainExport.diverged` says why) and nothing is written for it, so no version is ever in
the export twice.

The history and compositions come from the history projection (projections/history.py). An
export never goes past what that projection has folded, so the three tables always describe
the same stretch of the log; a domain whose projection lags is exported up to where it is.

Every file carries key-value metadata: the domain, the export's first and last position, the
chain head at the last one (version and hash) and, if the deployment keeps signed Merkle
checkpoints (trellis_checkpoints), the latest checkpoint that covers no more than the export:
its size and root as its signed note states them, and the note itself, so the exported hashes
can be checked against what was signed, offline, with the deployment's verifier key. A stored
checkpoint whose row disagrees with its own note (the table was edited) is named in
`DomainExport.checkpoint_problem`, and the files carry no checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pyarrow as pa
import pyarrow.parquet as pq

from trellis.engine.core.checkpoints import NoteError, stated

MANIFEST = "trellis-export.json"
FORMAT = 1
_BATCH_ROWS = 50_000  # events per file at most: bounded memory, files of a few MB

_TIME = pa.timestamp("us", tz="UTC")

EVENTS = pa.schema(
    [
        ("position", pa.int64()),
        ("version", pa.int64()),
        ("time", _TIME),
        ("domain", pa.string()),
        ("id", pa.string()),
        ("type", pa.string()),
        ("schema_version", pa.int64()),
        ("actor", pa.string()),
        ("causation", pa.string()),
        ("correlation", pa.string()),
        ("prev_hash", pa.string()),
        ("hash", pa.string()),
        ("data", pa.string()),  # the stored JSON text, byte for byte what the hash covers
    ]
)

HISTORY = pa.schema(
    [
        ("domain", pa.string()),
        ("device", pa.string()),
        ("kind", pa.string()),
        ("model", pa.string()),
        ("host", pa.string()),
        ("composition_id", pa.string()),
        ("tenant", pa.string()),
        ("start", _TIME),
        ("end", _TIME),
        ("end_reason", pa.string()),
        ("bandwidth_gbps", pa.float64()),
        ("capacity_gib", pa.float64()),
        ("cost_per_hour", pa.float64()),
        ("start_position", pa.int64()),
        ("end_position", pa.int64()),
    ]
)

COMPOSITIONS = pa.schema(
    [
        ("domain", pa.string()),
        ("composition_id", pa.string()),
        ("tenant", pa.string()),
        ("host", pa.string()),
        ("state", pa.string()),  # pending, active, released, failed
        ("requested_at", _TIME),
        ("activated_at", _TIME),
        ("ended_at", _TIME),
        ("end_reason", pa.string()),  # released, lease_expired, failed
        ("failure_reason", pa.string()),
        ("requested_position", pa.int64()),
        ("activated_position", pa.int64()),
        ("end_position", pa.int64()),
    ]
)

#: `trellis.source` of the files not made of the log's rows.
INTERVALS_SOURCE = "projection proj_history_intervals"
LIVES_SOURCE = "projection proj_history_compositions"

_EVENTS_SQL = """
SELECT position, version, recorded_at AS time, domain, id::text AS id, type, schema_version,
       actor, causation_id AS causation, correlation_id AS correlation, prev_hash, hash,
       data::text AS data
  FROM trellis_events
 WHERE domain = $1 AND position > $2 AND position <= $3
 ORDER BY position
"""
_ENDED_INTERVALS = """
SELECT domain, device, kind, model, host, composition_id, tenant, started_at AS start,
       ended_at AS "end", end_reason, bandwidth_gbps, capacity_gib, cost_per_hour,
       start_position, end_position
  FROM proj_history_intervals
 WHERE domain = $1 AND end_position > $2 AND end_position <= $3
 ORDER BY end_position, start_position, device
"""
_OPEN_INTERVALS = """
SELECT domain, device, kind, model, host, composition_id, tenant, started_at AS start,
       NULL::timestamptz AS "end", NULL AS end_reason, bandwidth_gbps, capacity_gib,
       cost_per_hour, start_position, NULL::bigint AS end_position
  FROM proj_history_intervals
 WHERE domain = $1 AND start_position <= $2 AND (end_position IS NULL OR end_position > $2)
 ORDER BY start_position, device
"""
_ENDED_COMPOSITIONS = """
SELECT domain, composition_id, tenant, host, state, requested_at, activated_at, ended_at,
       end_reason, failure_reason, requested_position, activated_position, end_position
  FROM proj_history_compositions
 WHERE domain = $1 AND end_position > $2 AND end_position <= $3
 ORDER BY end_position
"""
# As of position $2: activation after it has not happened yet, and nothing has ended. The
# row's own state (`impaired` too) is the state at $2 only when the projection stands there
# ($3); an export cut earlier by --until says `active` for an activated one.
_LIVE_COMPOSITIONS = """
SELECT domain, composition_id, tenant, host,
       CASE WHEN activated_position > $2 OR activated_position IS NULL THEN 'pending'
            WHEN $3 AND state = 'impaired' THEN 'impaired'
            ELSE 'active' END AS state,
       requested_at,
       CASE WHEN activated_position <= $2 THEN activated_at END AS activated_at,
       NULL::timestamptz AS ended_at, NULL AS end_reason, NULL AS failure_reason,
       requested_position,
       CASE WHEN activated_position <= $2 THEN activated_position END AS activated_position,
       NULL::bigint AS end_position
  FROM proj_history_compositions
 WHERE domain = $1 AND requested_position <= $2 AND (end_position IS NULL OR end_position > $2)
 ORDER BY requested_position
"""


class ExportError(Exception):
    """The export cannot be made (no log there, a manifest this code cannot read)."""


class SinceWouldSkip(ExportError):
    """`since` would leave a gap after what the export already holds: the command line's to
    change (drop `since`, or export into a new directory)."""

    def __init__(self, out: Path, gaps: list[tuple[str, int, int, int]]):
        said = "; ".join(
            f"positions {first}-{last} of {domain} (the export holds up to {held})"
            for domain, held, first, last in gaps
        )
        super().__init__(
            f"--since would skip {said}, which would then be in no file of {out}: each "
            "domain's export continues after the last position its manifest records"
        )
        self.hint = (
            "drop --since to continue where the export stopped, or export into a new directory"
        )


@dataclass
class DomainExport:
    """What one export wrote for one domain."""

    domain: str
    first_position: int = 0
    last_position: int = 0
    events: int = 0
    history: int = 0
    compositions: int = 0
    files: list[str] = field(default_factory=list)
    held_back: int | None = None  # the log's head, when the history projection lags behind it
    chain_head_version: int = 0  # the chain head at last_position
    chain_head_hash: str = ""
    diverged: str | None = None  # why the log no longer continues the export: nothing written
    checkpoint_problem: str | None = None  # why the files carry no checkpoint though one is stored
    folds: str = ""  # the projection folds its history and compositions rows come from
    earlier_folds: str | None = None  # other folds wrote this directory's earlier rows


async def export_parquet(
    pool: asyncpg.Pool,
    out: Path,
    *,
    domains: Sequence[str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[DomainExport]:
    """Append what is new in the log of `domains` (default: all) to the export in `out`.

    Raises:
        ExportError: no Trellis log in the pool's schema, or `out` holds a manifest of
            another format.
        SinceWouldSkip: `since` would skip events after those a domain's export holds;
            nothing is written.
    """
    manifest = _read_manifest(out)
    async with pool.acquire() as conn:
        if await conn.fetchval("SELECT to_regclass('trellis_events')") is None:
            raise ExportError("no Trellis event log in this database schema")
        known = [r["domain"] for r in await conn.fetch("SELECT domain FROM trellis_streams")]
        wanted = sorted(known) if domains is None else list(domains)
        missing = sorted(set(wanted) - set(known))
        if missing:
            raise ExportError(f"the log has no domain {', '.join(map(repr, missing))}")
        if since is not None:
            await _refuse_gaps(conn, out, manifest, wanted, since)
        done = []
        for domain in wanted:
            state = manifest["domains"].setdefault(domain, {"last_position": 0, "exports": []})
            _remove_leftovers(out, domain, state)
            # One snapshot per domain: log, projection and checkpoints as of the same moment.
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                result = await _export_domain(conn, out, domain, state, since, until)
            if result.events and result.diverged is None:
                state["last_position"] = result.last_position
                state["exports"].append(_manifest_entry(result))
                _write_json(out / MANIFEST, manifest)
            done.append(result)
    return done


async def _refuse_gaps(
    conn: asyncpg.Connection,
    out: Path,
    manifest: dict[str, Any],
    domains: list[str],
    since: datetime,
) -> None:
    """Raise SinceWouldSkip if `since` skips events of a domain after its exported ones."""
    gaps = []
    for domain in domains:
        held = manifest["domains"].get(domain, {}).get("last_position", 0)
        if not held:
            continue  # its first export: it starts at `since`
        skipped = await conn.fetchrow(
            "SELECT min(position) AS first, max(position) AS last FROM trellis_events"
            " WHERE domain = $1 AND position > $2 AND recorded_at < $3",
            domain,
            held,
            since,
        )
        if skipped["first"] is not None:
            gaps.append((domain, held, skipped["first"], skipped["last"]))
    if gaps:
        raise SinceWouldSkip(out, gaps)


async def _export_domain(
    conn: asyncpg.Connection,
    out: Path,
    domain: str,
    state: dict[str, Any],
    since: datetime | None,
    until: datetime | None,
) -> DomainExport:
    result = DomainExport(domain)
    after: int = state["last_position"]
    if after:
        result.diverged = await _divergence(conn, out, domain, state)
        if result.diverged is not None:
            return result
    if since is not None and not after:  # a domain exported before: _refuse_gaps checked it
        first = await conn.fetchval(
            "SELECT min(position) FROM trellis_events WHERE domain = $1 AND recorded_at >= $2",
            domain,
            since,
        )
        if first is None:
            return result
        after = max(after, first - 1)
    head = await conn.fetchval(
        "SELECT max(position) FROM trellis_events WHERE domain = $1 AND position > $2"
        " AND ($3::timestamptz IS NULL OR recorded_at <= $3)",
        domain,
        after,
        until,
    )
    if head is None:
        return result
    folded = await conn.fetchval(
        "SELECT position FROM trellis_follower_checkpoints"
        " WHERE follower = 'history' AND domain = $1",
        domain,
    )
    last = min(head, folded or 0)
    if last < head:
        result.held_back = head
    if last <= after:
        return result
    chain = await conn.fetchrow(
        "SELECT version, hash FROM trellis_events WHERE domain = $1 AND position = $2",
        domain,
        last,
    )
    result.chain_head_version, result.chain_head_hash = chain["version"], chain["hash"]
    meta = {
        "trellis.format": str(FORMAT),
        "trellis.domain": domain,
        "trellis.first_position": str(after + 1),
        "trellis.last_position": str(last),
        "trellis.chain_head_version": str(chain["version"]),
        "trellis.chain_head_hash": chain["hash"],
    }
    checkpoint, result.checkpoint_problem = await _checkpoint(conn, domain, chain["version"])
    meta.update(checkpoint)
    # The folds the projection rows were written with (schema/020): an upgrade that changed
    # one (an interval's end position, say) leaves earlier files of the other meaning.
    result.folds = await conn.fetchval("SELECT format FROM trellis_projection_format") or ""
    if state["exports"] and state["exports"][-1].get("folds") != result.folds:
        result.earlier_folds = state["exports"][-1].get("folds") or "an older version"
    part = f"part-{after + 1:020d}-{last:020d}.parquet"

    def write(
        path: Path, schema: pa.Schema, rows: list[dict[str, Any]], source: str = "log"
    ) -> None:
        folds = {"trellis.folds": result.folds} if source != "log" else {}
        _write_parquet(out / path, schema, rows, {**meta, "trellis.source": source, **folds})
        result.files.append(str(path))

    events: list[dict[str, Any]] = []
    async for record in conn.cursor(_EVENTS_SQL, domain, after, last, prefetch=5000):
        row = dict(record)
        if events and (len(events) >= _BATCH_ROWS or _day(events[0]) != _day(row)):
            result.events += _write_events(out, domain, events, meta, result)
            events = []
        events.append(row)
    if events:
        result.events += _write_events(out, domain, events, meta, result)
    result.first_position, result.last_position = after + 1, last

    ended = [dict(r) for r in await conn.fetch(_ENDED_INTERVALS, domain, after, last)]
    lives = [dict(r) for r in await conn.fetch(_ENDED_COMPOSITIONS, domain, after, last)]
    result.history, result.compositions = len(ended), len(lives)
    # Rows of the history projection, not of the log: the chain head and the checkpoint in
    # their metadata vouch for the events files; `trellis verify` checks the projection.
    write(Path("history", f"domain={domain}", part), HISTORY, ended, INTERVALS_SOURCE)
    write(Path("compositions", f"domain={domain}", part), COMPOSITIONS, lives, LIVES_SOURCE)
    snapshot = Path("open", f"domain={domain}", f"as_of={last:020d}")
    write(
        snapshot / "history.parquet",
        HISTORY,
        _rows(await conn.fetch(_OPEN_INTERVALS, domain, last)),
        INTERVALS_SOURCE,
    )
    write(
        snapshot / "compositions.parquet",
        COMPOSITIONS,
        _rows(await conn.fetch(_LIVE_COMPOSITIONS, domain, last, last == folded)),
        LIVES_SOURCE,
    )
    return result


async def _divergence(
    conn: asyncpg.Connection, out: Path, domain: str, state: dict[str, Any]
) -> str | None:
    """Why the log no longer continues the chain the export of `domain` holds, or None: its
    event at the exported head must have the exported hash, and its first event after the
    exported positions must follow that head."""
    version, hash_ = _exported_head(out, state)
    after: int = state["last_position"]
    exported = f"{domain}: the export ends at version {version} (position {after}, {_short(hash_)})"
    held = await conn.fetchrow(
        "SELECT position, hash FROM trellis_events WHERE domain = $1 AND version = $2",
        domain,
        version,
    )
    if held is None:
        head = await conn.fetchrow(
            "SELECT version, position FROM trellis_streams WHERE domain = $1", domain
        )
        return (
            f"{exported}, but the log holds no version {version}: it ends at version "
            f"{head['version']} (position {head['position']})"
        )
    if held["hash"] != hash_:
        return (
            f"{exported}, but the log's version {version} is another event (position "
            f"{held['position']}, {_short(held['hash'])})"
        )
    following = await conn.fetchrow(
        "SELECT version, position, prev_hash FROM trellis_events"
        " WHERE domain = $1 AND position > $2 ORDER BY position LIMIT 1",
        domain,
        after,
    )
    if following is None or (following["version"], following["prev_hash"]) == (version + 1, hash_):
        return None
    return (
        f"{exported}, but the log's next event is version {following['version']} (position "
        f"{following['position']}), which follows {_short(following['prev_hash'])}"
    )


def _short(hash_: str) -> str:
    return f"hash {hash_[:16]}…"


def _exported_head(out: Path, state: dict[str, Any]) -> tuple[int, str]:
    """The chain head (version, hash) at the end of a domain's last export."""
    entry = state["exports"][-1]
    if "chain_head_version" in entry:
        return int(entry["chain_head_version"]), str(entry["chain_head_hash"])
    # A manifest written before it recorded the head: every file of the export carries it.
    try:
        meta = pq.read_schema(out / entry["files"][0]).metadata
    except (OSError, pa.ArrowException) as exc:
        raise ExportError(
            f"cannot read the chain head the export of {out} ends at: {exc}"
        ) from None
    return int(meta[b"trellis.chain_head_version"]), meta[b"trellis.chain_head_hash"].decode()


def _write_events(
    out: Path,
    domain: str,
    rows: list[dict[str, Any]],
    meta: dict[str, str],
    result: DomainExport,
) -> int:
    name = f"part-{rows[0]['position']:020d}-{rows[-1]['position']:020d}.parquet"
    path = Path("events", f"domain={domain}", f"day={_day(rows[0])}", name)
    _write_parquet(out / path, EVENTS, rows, {**meta, "trellis.source": "log"})
    result.files.append(str(path))
    return len(rows)


async def _checkpoint(
    conn: asyncpg.Connection, domain: str, version: int
) -> tuple[dict[str, str], str | None]:
    """The metadata of the latest signed checkpoint covering no more than the exported
    events, if the deployment records checkpoints (the table exists from schema/010 on): what
    its note states, and the note. Else none, and why when one is stored: a row whose size or
    root is not its note's was edited, and the note is what was signed."""
    if await conn.fetchval("SELECT to_regclass('trellis_checkpoints')") is None:
        return {}, None
    row = await conn.fetchrow(
        "SELECT size, root, note FROM trellis_checkpoints WHERE domain = $1 AND size <= $2"
        " ORDER BY size DESC LIMIT 1",
        domain,
        version,
    )
    if row is None:
        return {}, None
    size, root, note = row["size"], row["root"], row["note"]
    try:
        signed = stated(note)
    except NoteError as exc:
        return {}, f"the stored checkpoint of {size} events holds no signed note ({exc})"
    signed_root = base64.b64encode(signed.root).decode()
    if (signed.size, signed_root) != (size, root):
        return {}, (
            f"the stored checkpoint of {size} events has root {root}, but its signed note"
            f" states {signed.size} events and root {signed_root}: the checkpoint table was"
            " edited"
        )
    meta = {
        "trellis.checkpoint_size": str(size),
        "trellis.checkpoint_root": root,
        "trellis.checkpoint_note": note,
    }
    return meta, None


def _day(row: dict[str, Any]) -> str:
    time: datetime = row["time"]
    return time.astimezone(UTC).strftime("%Y-%m-%d")


def _rows(records: list[asyncpg.Record]) -> list[dict[str, Any]]:
    return [dict(r) for r in records]


def _write_parquet(
    path: Path, schema: pa.Schema, rows: list[dict[str, Any]], meta: dict[str, str]
) -> None:
    """Write one file under its final name (a temporary name first, so no reader ever sees
    half a file). Names are new to the manifest: see `_remove_leftovers`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema.with_metadata(meta))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _read_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.exists():
        return {"format": FORMAT, "domains": {}}
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise ExportError(f"{path} is of export format {manifest.get('format')!r}, not {FORMAT}")
    return manifest


def _manifest_entry(result: DomainExport) -> dict[str, Any]:
    return {
        "first_position": result.first_position,
        "last_position": result.last_position,
        "events": result.events,
        "history": result.history,
        "compositions": result.compositions,
        "chain_head_version": result.chain_head_version,
        "chain_head_hash": result.chain_head_hash,
        "folds": result.folds,
        "files": result.files,
        "exported_at": datetime.now(UTC).isoformat(),
    }


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def _remove_leftovers(out: Path, domain: str, state: dict[str, Any]) -> None:
    """The manifest is the commit point: a domain's files that no entry lists were written by
    an export that did not finish (their range starts after the last one exported), and go
    before this export writes its own, so no range is ever in two files."""
    listed = {out / f for entry in state["exports"] for f in entry["files"]}
    for table in ("events", "history", "compositions", "open"):
        for path in (out / table / f"domain={domain}").rglob("*.parquet"):
            if path not in listed:
                path.unlink()
