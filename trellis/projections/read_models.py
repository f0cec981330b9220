"""engine.service.ports.ReadModels over the projection tables: the `composition`, `connections`,
`why` and `history` queries (ARCHITECTURE §4), live and at any past moment.

Every answer is built from rows in a fixed order, so the same rows always give the same answer,
`text` included, as the Structs of engine/core/results.py (the contract's shapes). The rows come
from a RowReader: the live tables, or the projections folded in memory up to a past event
(projections/past.py), so an answer at a past moment is the answer the live tables gave then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Protocol

import asyncpg
import msgspec

from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.records import Head
from trellis.engine.core.results import (
    ChainEntry,
    ComposedDevice,
    CompositionResult,
    Connection,
    Impairment,
    Interval,
    Requested,
    WhyKind,
    WhyResult,
)
from trellis.engine.core.views import IN_USE_BY_OTHERS, may_see, split_rows
from trellis.engine.service.follower import DomainLog, Failure
from trellis.engine.service.ports import Reserved, SnapshotStore
from trellis.projections.base import iso
from trellis.projections.history import Window, interval_query, last_ended_query
from trellis.projections.past import fold_past
from trellis.projections.sink import SINK_NAME, default_projections
from trellis.projections.table import Row

_json = msgspec.json.Decoder().decode

_CONNECTION_COLUMNS = (
    "device, host, composition_id, tenant, path, bandwidth_gbps, capacity_gib, since, why"
)

_COMPOSITION = """
SELECT composition_id, tenant, host, state, labels, reason, request_id, created_at, expires_at,
       devices, impaired_by, chain
  FROM proj_compositions
 WHERE domain = $1 AND composition_id = ANY($2::text[])
 ORDER BY composition_id COLLATE "C"
"""

_COMPONENT = """
SELECT id, kind, health, drained, detail, chain
  FROM proj_components
 WHERE domain = $1 AND id = $2
"""

# Which connection rows a `why` target is part of, by the kind of target.
_CONNECTED_BY_KIND = {
    "device": "device = $2",
    "host": "host = $2",
    "composition": "composition_id = $2",
    # Links and passed-through nodes: jsonb containment, served by the GIN indexes.
    "link": "links @> jsonb_build_array($2::text)",
    "switch": "path @> jsonb_build_array($2::text)",
    "ocs": "path @> jsonb_build_array($2::text)",
}
# Sorted as Python sorts text (by code point), so answers at past moments, folded in memory
# (projections/past.py), list rows in the same order whatever the database's collation.
_CONNECTION_ORDER = ' ORDER BY host COLLATE "C", composition_id COLLATE "C", device COLLATE "C"'

# jsonb stores object keys in its own order; the Structs list them in the contract's.
_convert = msgspec.convert

_CHECKPOINTS = """
SELECT min(position) FROM trellis_follower_checkpoints
 WHERE follower = ANY($1::text[]) AND domain = $2
"""


class Waiter(Protocol):
    """What can tell when a sink has applied a domain up to a position, and what holds it up
    (engine.service.follower.Followers)."""

    async def wait_for(
        self, sink: str, domain: str, position: int, timeout: float = 5.0
    ) -> bool: ...

    def failures(self) -> list[Failure]: ...


class RowReader(Protocol):
    """The projection rows the answers are built from (jsonb columns decoded): the live tables
    (_TableReader), or a fold in memory at a past moment (projections/past.py)."""

    async def compositions(self, domain: str, ids: Sequence[str]) -> list[Row]:
        """proj_compositions rows of `ids`, by composition id."""
        ...

    async def component(self, domain: str, component_id: str) -> Row | None:
        """The proj_components row of a node or link."""
        ...

    async def connections(self, domain: str, filters: dict[str, str]) -> list[Row]:
        """proj_connections rows whose columns equal `filters`, by host, composition, device."""
        ...

    async def connected(self, domain: str, kind: str, target: str) -> list[Row]:
        """The connection rows a `why` target of `kind` is part of, in the same order."""
        ...

    async def intervals(self, domain: str, window: Window) -> list[Row]:
        """proj_history_intervals rows in `window`, by start position and device."""
        ...

    async def last_ended(self, domain: str, device: str) -> Row | None:
        """The proj_history_intervals row of `device` that ended last; None if none did."""
        ...


class Answers:
    """`composition`, `connections`, `why` and `history` built from one RowReader: the same
    code answers live and at a past moment, so the two cannot tell it differently."""

    def __init__(self, reader: RowReader):
        self._reader = reader

    async def composition(self, domain: str, composition_id: str) -> CompositionResult | None:
        """The compose result (composition_id, host, state, expires_at, devices) plus tenant,
        labels, reason, request_id, created_at, impaired_by and chain; None if unknown."""
        rows = await self._compositions(domain, [composition_id])
        return rows[0] if rows else None

    async def connections(
        self,
        domain: str,
        *,
        host: str | None = None,
        tenant: str | None = None,
        device: str | None = None,
    ) -> list[Connection]:
        """One row per connected device, filtered by every filter given."""
        filters = {"host": host, "tenant": tenant, "device": device}
        given = {column: value for column, value in filters.items() if value is not None}
        return [_connection(r) for r in await self._reader.connections(domain, given)]

    async def why(
        self,
        domain: str,
        target: str,
        *,
        viewer: str | None = None,
        reserved: Reserved | None = None,
    ) -> WhyResult | None:
        """What `target` (a device, host, switch, OCS, link or composition) is connected to,
        the events that made it so, and one sentence saying it; None if the id is unknown.

        With `viewer` (a tenant's view, engine/core/views.py) only that tenant's connections and
        their events are told; what others hold is only "in use by others", and another
        tenant's composition is unknown (None)."""
        reader = self._reader
        own = await self._compositions(domain, [target])
        if own and not may_see(own[0].tenant, viewer):
            return None
        component = None if own else await reader.component(domain, target)
        kind: WhyKind
        if own:
            kind = "composition"
        elif component is not None:
            kind = component["kind"]  # a node's kind, or "link"
        else:
            return None
        rows = await reader.connected(domain, kind, target)
        connected, others = split_rows([_connection(r) for r in rows], viewer)
        cids = sorted({c.composition_id for c in connected})
        compositions = own or await self._compositions(domain, cids)
        states = {c.composition_id: c for c in compositions}
        chains = [c.chain for c in compositions]
        if component is not None:
            chains.append(_chain(component["chain"]))
        last = None
        if kind == "device" and not rows:
            # It holds nothing: the events that gave it to its last holder and let it go say
            # why, if the viewer may see whose it was.
            last = await reader.last_ended(domain, target)
            if last is not None and may_see(last["tenant"], viewer):
                ended = await self._compositions(domain, [last["composition_id"]])
                ends = (last["start_position"], last["end_position"])
                # An expired lease's interval ends at the release LeaseExpired causes: both.
                expired = last["end_reason"] == "lease_expired"
                chains += [
                    [
                        e
                        for c in ended
                        for e in c.chain
                        if e.position in ends or (expired and e.type == "LeaseExpired")
                    ]
                ]
            else:
                last = None
        if own:
            text = _composition_text(own[0])
        elif component is None:
            raise AssertionError("a target is a composition or a component")
        elif kind == "device":
            text = (
                _reserved_text(target, reserved, component, viewer, last)
                if reserved is not None and not rows
                else _device_text(target, connected, states, component, others, last)
            )
        elif kind == "host":
            text = _host_text(target, connected, states, component, others)
        else:
            text = _carrier_text(target, connected, component, others)
        return WhyResult(
            id=target, kind=kind, connected_to=connected, chain=_merged(chains), text=text
        )

    async def history(
        self,
        domain: str,
        *,
        id: str | None = None,
        tenant: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> list[Interval]:
        """The intervals of `id` (a device, host or composition) and `tenant` that overlap
        [since, until], ends included (an interval still open reaches into every later
        window); in the order they began."""
        window = Window(id=id, tenant=tenant, since=since, until=until)
        return [_interval(r) for r in await self._reader.intervals(domain, window)]

    async def _compositions(self, domain: str, ids: list[str]) -> list[CompositionResult]:
        if not ids:
            return []
        return [_composition(r) for r in await self._reader.compositions(domain, ids)]


class _TableReader:
    """RowReader over the live projection tables, on one connection (a `why` reads in one
    repeatable-read snapshot, so its sentence, rows and chain agree) or on the pool."""

    def __init__(self, db: asyncpg.Pool | asyncpg.Connection):
        self._db = db

    async def compositions(self, domain: str, ids: Sequence[str]) -> list[Row]:
        return [_decoded(r) for r in await self._db.fetch(_COMPOSITION, domain, list(ids))]

    async def component(self, domain: str, component_id: str) -> Row | None:
        record = await self._db.fetchrow(_COMPONENT, domain, component_id)
        return _decoded(record) if record is not None else None

    async def connections(self, domain: str, filters: dict[str, str]) -> list[Row]:
        # Only the filters given become conditions, so each query can use its index.
        where = "".join(f" AND {column} = ${i}" for i, column in enumerate(filters, 2))
        records = await self._db.fetch(
            f"SELECT {_CONNECTION_COLUMNS} FROM proj_connections WHERE domain = $1{where}"
            + _CONNECTION_ORDER,
            domain,
            *filters.values(),
        )
        return [_decoded(r) for r in records]

    async def connected(self, domain: str, kind: str, target: str) -> list[Row]:
        records = await self._db.fetch(
            f"SELECT {_CONNECTION_COLUMNS} FROM proj_connections"
            f" WHERE domain = $1 AND {_CONNECTED_BY_KIND[kind]}" + _CONNECTION_ORDER,
            domain,
            target,
        )
        return [_decoded(r) for r in records]

    async def intervals(self, domain: str, window: Window) -> list[Row]:
        return [dict(r) for r in await self._db.fetch(*interval_query(domain, window))]

    async def last_ended(self, domain: str, device: str) -> Row | None:
        record = await self._db.fetchrow(*last_ended_query(domain, device))
        return None if record is None else dict(record)


class PostgresReadModels(Answers):
    """The query side of the projections: live, and at past moments (projections/past.py).

    Args:
        pool: asyncpg pool whose search_path holds the projection tables.
        followers: answers `wait_for` when the projections are folded in this process;
            without them, `wait_for` watches the checkpoints table (another process folds).
        projections: the checkpoint names `wait_for` watches without followers.
        log: the event log, for answers at past moments.
        snapshots: where folds at past moments may start (None: from the first event).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        followers: Waiter | None = None,
        *,
        projections: Sequence[str] = ("compositions", "connections", "devices", "history"),
        log: DomainLog | None = None,
        snapshots: SnapshotStore | None = None,
    ):
        self._pool = pool
        self._followers = followers
        self._names = list(projections)
        super().__init__(_TableReader(pool))
        self._log = log
        self._snapshots = snapshots

    async def wait_for(self, domain: str, position: int, timeout: float = 5.0) -> bool:
        """Block until the domain's projections include `position`; False if that took too
        long."""
        if self._followers is not None:
            return await self._followers.wait_for(SINK_NAME, domain, position, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            reached = await self._pool.fetchval(_CHECKPOINTS, self._names, domain)
            if reached is not None and reached >= position:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(0.02, max(0.0, deadline - loop.time())))

    def holdup(self, domain: str) -> Failure | None:
        """What keeps the domain's projections from following its log, if anything."""
        if self._followers is None:
            return None
        return next(
            (f for f in self._followers.failures() if (f.sink, f.domain) == (SINK_NAME, domain)),
            None,
        )

    async def why(
        self,
        domain: str,
        target: str,
        *,
        viewer: str | None = None,
        reserved: Reserved | None = None,
    ) -> WhyResult | None:
        # One repeatable-read snapshot for every read, so the sentence, the rows and the
        # chain agree.
        snapshot = {"isolation": "repeatable_read", "readonly": True}
        async with self._pool.acquire() as conn, conn.transaction(**snapshot):
            answers = Answers(_TableReader(conn))
            return await answers.why(domain, target, viewer=viewer, reserved=reserved)

    async def past(self, domain: str, head: Head) -> Answers:
        """The answers as they stood right after the domain's event at `head`."""
        if self._log is None:
            raise RuntimeError("these read models were given no log to fold past moments from")
        reader = await fold_past(
            self._pool, self._log, self._snapshots, default_projections(), domain, head
        )
        # Rows that ended before the snapshot are read from the live tables: after a rebuild
        # they may not be back yet.
        if reader.since and not await self.wait_for(domain, reader.since):
            raise IntentRejected("unavailable", "projections are behind the log; retry")
        return Answers(reader)


def _decoded(record: asyncpg.Record) -> Row:
    row = dict(record)
    for column in ("labels", "devices", "impaired_by", "chain", "path", "links", "why"):
        if column in row:
            row[column] = _json(row[column])
    return row


# ---- rows ----


def _connection(row: Row) -> Connection:
    return Connection(
        device=row["device"],
        host=row["host"],
        composition_id=row["composition_id"],
        tenant=row["tenant"],
        path=row["path"],
        bandwidth_gbps=row["bandwidth_gbps"],
        capacity_gib=row["capacity_gib"],
        since=_time(row["since"]),
        why=_convert(row["why"], Requested),
    )


def _interval(row: Row) -> Interval:
    return Interval(
        device=row["device"],
        kind=row["kind"],
        model=row["model"],
        host=row["host"],
        composition_id=row["composition_id"],
        tenant=row["tenant"],
        start=_time(row["started_at"]),
        end=iso(row["ended_at"]),
        end_reason=row["end_reason"],
        bandwidth_gbps=row["bandwidth_gbps"],
        capacity_gib=row["capacity_gib"],
        cost_per_hour=row["cost_per_hour"],
        start_position=row["start_position"],
        end_position=row["end_position"],
    )


def _time(at: datetime) -> str:
    text = iso(at)
    assert text is not None, "a start is never null"
    return text


def _chain(entries: list[dict[str, Any]]) -> list[ChainEntry]:
    return _convert(entries, list[ChainEntry])


def _composition(row: Row) -> CompositionResult:
    return CompositionResult(
        composition_id=row["composition_id"],
        host=row["host"],
        state=row["state"],
        expires_at=row["expires_at"],
        devices=_convert(row["devices"], list[ComposedDevice]),
        tenant=row["tenant"],
        labels=row["labels"],
        reason=row["reason"],
        request_id=row["request_id"],
        created_at=row["created_at"],
        impaired_by=_convert(row["impaired_by"], list[Impairment]),
        chain=_chain(row["chain"]),
    )


def _merged(chains: Iterable[list[ChainEntry]]) -> list[ChainEntry]:
    """Several chains as one, in log order, each event once."""
    by_position = {entry.position: entry for chain in chains for entry in chain}
    return [by_position[p] for p in sorted(by_position)]


# ---- sentences ----


def _device_text(
    device: str,
    connected: list[Connection],
    states: dict[str, CompositionResult],
    component: Row,
    others: bool = False,
    last: Row | None = None,
) -> str:
    marks = _marks(component)
    if not connected:
        if others:
            return f"{device} is {IN_USE_BY_OTHERS}; it is {marks}."
        was = "" if last is None else _last_held(last)
        return f"{device} is connected to nothing; it is free and {marks}{was}."
    clauses = []
    for c in connected:
        share = f" with {_num(c.capacity_gib)} GiB" if c.capacity_gib is not None else ""
        clauses.append(
            f"{c.host}{share} {_via(c.path)} in composition {c.composition_id}"
            f" for tenant {c.tenant} since {c.since}"
            f"{_impaired(states.get(c.composition_id))}, {_requested(c.why)}"
        )
    note = "" if marks == "healthy" else f"; the device is {marks}"
    return f"{device} is connected to {'; and to '.join(clauses)}{_also(others)}{note}."


def _reserved_text(
    device: str, reserved: Reserved, component: Row, viewer: str | None, last: Row | None
) -> str:
    """A device no composition holds and a live reservation does: not free. Whose it is, to
    whom may see it; else only that others hold it."""
    marks = _marks(component)
    if not may_see(reserved.tenant, viewer):
        return f"{device} is reserved by others; it is {marks}."
    was = "" if last is None else _last_held(last)
    return (
        f"{device} is connected to nothing; it is reserved for tenant {reserved.tenant} by"
        f" {reserved.reservation_id} until {iso(reserved.expires_at)} and is {marks}{was}."
    )


# How the last interval of a device that holds nothing ended (EndReason).
_LET_GO = {
    "released": "when the composition was released",
    "lease_expired": "when the composition's lease expired",
    "failed": "when the composition failed",
    "replaced": "when another device replaced it there",
}


def _last_held(last: Row) -> str:
    """A clause for what last held a device, and how that ended."""
    return (
        f"; it was last connected to {last['host']} in composition {last['composition_id']}"
        f" for tenant {last['tenant']} until {iso(last['ended_at'])},"
        f" {_LET_GO.get(last['end_reason'], 'when that ended')}"
    )


def _host_text(
    host: str,
    connected: list[Connection],
    states: dict[str, CompositionResult],
    component: Row,
    others: bool = False,
) -> str:
    marks = _marks(component)
    if not connected:
        if others:
            return f"{host} is {IN_USE_BY_OTHERS}; it is {marks}."
        return f"{host} is connected to nothing; it is {marks}."
    clauses = []
    for cid, rows in _by_composition(connected):
        first = rows[0]
        clauses.append(
            f"{_and([r.device for r in rows])} in composition {cid}"
            f" for tenant {first.tenant} since {min(r.since for r in rows)}"
            f"{_impaired(states.get(cid))}, {_requested(first.why)}"
        )
    note = "" if marks == "healthy" else f"; the host is {marks}"
    return f"{host} is connected to {'; and to '.join(clauses)}{_also(others)}{note}."


def _carrier_text(
    target: str, connected: list[Connection], component: Row, others: bool = False
) -> str:
    """A link, switch or OCS: whose paths pass it."""
    marks = _marks(component)
    if not connected:
        if others:
            return f"{target} carries only paths {IN_USE_BY_OTHERS}; it is {marks}."
        return f"{target} carries nothing; it is {marks}."
    clauses = [
        f"{rows[0].host} to {_and([r.device for r in rows])} in composition {cid}"
        f" for tenant {rows[0].tenant}"
        for cid, rows in _by_composition(connected)
    ]
    paths = "; and from ".join(clauses)
    return f"{target} carries the paths from {paths}{_also(others)}; it is {marks}."


def _also(others: bool) -> str:
    """In a tenant's view: a clause saying others hold more of it, and nothing about them."""
    return f", and it is also {IN_USE_BY_OTHERS}" if others else ""


def _composition_text(row: CompositionResult) -> str:
    cid, devices = row.composition_id, _and([d.id for d in row.devices]) or "nothing"
    why = _requested(
        Requested(
            actor=row.chain[0].actor if row.chain else row.tenant,
            request_id=row.request_id,
            reason=row.reason,
        )
    )
    head = f"composition {cid} of tenant {row.tenant}"
    since = _time(row.created_at)
    until = row.chain[-1].time if row.chain else since
    if row.state == "released":
        return (
            f"{head} connected {row.host} to {devices} from {since} until {until}, {why};"
            " it is released."
        )
    if row.state == "failed":
        return (
            f"{head} was to connect {row.host} to {devices}, {why}, but the fabric could"
            f" not establish it and it failed at {until}; nothing of it is held."
        )
    if row.state == "pending":
        return (
            f"{head} is connecting {row.host} to {devices} since {since}, {why}; the fabric"
            " is being programmed."
        )
    impaired = _impaired_by(row)
    state = f"it is impaired by {impaired}" if impaired else f"it is {row.state}"
    return f"{head} connects {row.host} to {devices} since {since}, {why}; {state}."


def _requested(why: Requested) -> str:
    text = f"requested by {why.actor} (request {why.request_id})"
    return f"{text}: {why.reason}" if why.reason else text


def _impaired(composition: CompositionResult | None) -> str:
    """A clause for a connection whose composition is impaired, else nothing."""
    impaired = _impaired_by(composition)
    return f", impaired by {impaired}" if impaired else ""


def _impaired_by(composition: CompositionResult | None) -> str:
    if not composition or composition.state != "impaired":
        return ""
    return _and(sorted({i.component for i in composition.impaired_by}))


def _marks(component: Row) -> str:
    health = component["health"]
    text = (
        f"{health} ({component['detail']})"
        if health != "healthy" and component["detail"]
        else health
    )
    return f"{text} and drained" if component["drained"] else text


def _via(path: list[str]) -> str:
    inner = path[1:-1]
    return f"over {', '.join(inner)}" if inner else "over a direct link"


def _by_composition(rows: list[Connection]) -> list[tuple[str, list[Connection]]]:
    groups: dict[str, list[Connection]] = {}
    for row in rows:
        groups.setdefault(row.composition_id, []).append(row)
    return sorted(groups.items())


def _and(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"


def _num(value: float) -> str:
    return f"{value:g}"
