"""engine.ports.ReadModels over the projection tables: the `composition`, `connections` and
`why` queries (ARCHITECTURE §4).

Every answer is built from rows in a fixed order, so the same tables always give the same
answer, `text` included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import asyncpg
import msgspec

from engine.follower import Failure
from engine.views import IN_USE_BY_OTHERS, may_see, split_rows
from projections.base import iso
from projections.sink import SINK_NAME

_json = msgspec.json.Decoder().decode

_CONNECTION_COLUMNS = (
    "device, host, composition_id, tenant, path, bandwidth_gbps, capacity_gib, since, why"
)

_COMPOSITION = """
SELECT composition_id, tenant, host, state, labels, reason, request_id, created_at, expires_at,
       devices, impaired_by, chain
  FROM proj_compositions
 WHERE domain = $1 AND composition_id = ANY($2::text[])
 ORDER BY composition_id
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

# jsonb stores object keys in its own order; answers list them in the order the contract does.
_CHAIN_KEYS = ("type", "position", "time", "actor", "request_id")
_DEVICE_KEYS = ("id", "kind", "path", "hops", "latency_ns", "bandwidth_gbps", "capacity_gib")
_WHY_KEYS = ("request_id", "actor", "reason", "labels", "constraints", "position")
_CONSTRAINT_KEYS = ("max_hops", "max_latency_ns", "isolation", "labels")
_IMPAIRED_KEYS = ("component", "reason")

_CHECKPOINTS = """
SELECT min(position) FROM trellis_follower_checkpoints
 WHERE follower = ANY($1::text[]) AND domain = $2
"""


class Waiter(Protocol):
    """What can tell when a sink has applied a domain up to a position, and what holds it up
    (engine.follower.Followers)."""

    async def wait_for(
        self, sink: str, domain: str, position: int, timeout: float = 5.0
    ) -> bool: ...

    def failures(self) -> list[Failure]: ...


class PostgresReadModels:
    """The query side of the projections.

    Args:
        pool: asyncpg pool whose search_path holds the projection tables.
        followers: answers `wait_for` when the projections are folded in this process;
            without them, `wait_for` watches the checkpoints table (another process folds).
        projections: the checkpoint names `wait_for` watches without followers.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        followers: Waiter | None = None,
        *,
        projections: Sequence[str] = ("compositions", "connections", "devices"),
    ):
        self._pool = pool
        self._followers = followers
        self._names = list(projections)

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

    async def composition(self, domain: str, composition_id: str) -> dict[str, Any] | None:
        """The compose result (composition_id, host, state, expires_at, devices) plus tenant,
        labels, reason, request_id, created_at, impaired_by and chain; None if unknown."""
        rows = await self._compositions(domain, [composition_id])
        return _composition(rows[0]) if rows else None

    async def connections(
        self,
        domain: str,
        *,
        host: str | None = None,
        tenant: str | None = None,
        device: str | None = None,
    ) -> list[dict[str, Any]]:
        """One row per connected device, filtered by every filter given."""
        filters = {"host": host, "tenant": tenant, "device": device}
        given = [(column, value) for column, value in filters.items() if value is not None]
        # Only the filters given become conditions, so each query can use its index.
        where = "".join(f" AND {column} = ${i}" for i, (column, _) in enumerate(given, 2))
        rows = await self._pool.fetch(
            f"SELECT {_CONNECTION_COLUMNS} FROM proj_connections WHERE domain = $1{where}"
            " ORDER BY host, composition_id, device",
            domain,
            *(value for _, value in given),
        )
        return [_connection(r) for r in rows]

    async def why(
        self, domain: str, target: str, *, viewer: str | None = None
    ) -> dict[str, Any] | None:
        """What `target` (a device, host, switch, OCS, link or composition) is connected to,
        the events that made it so, and one sentence saying it; None if the id is unknown.

        With `viewer` (a tenant's view, engine/views.py) only that tenant's connections and
        their events are told; what others hold is only "in use by others", and another
        tenant's composition is unknown (None)."""
        # One snapshot for every read, so the sentence, the rows and the chain agree.
        snapshot = {"isolation": "repeatable_read", "readonly": True}
        async with self._pool.acquire() as conn, conn.transaction(**snapshot):
            own = await self._compositions(domain, [target], conn)
            if own and not may_see(own[0]["tenant"], viewer):
                return None
            component = None if own else await conn.fetchrow(_COMPONENT, domain, target)
            if own:
                kind = "composition"
            elif component is not None:
                kind = component["kind"]
            else:
                return None
            rows = await conn.fetch(
                f"SELECT {_CONNECTION_COLUMNS} FROM proj_connections"
                f" WHERE domain = $1 AND {_CONNECTED_BY_KIND[kind]}"
                " ORDER BY host, composition_id, device",
                domain,
                target,
            )
            connected, others = split_rows([_connection(r) for r in rows], viewer)
            cids = sorted({c["composition_id"] for c in connected})
            compositions = own or await self._compositions(domain, cids, conn)
        states = {c["composition_id"]: c for c in compositions}
        chains = [c["chain"] for c in compositions]
        if component is not None:
            chains.append(_chain(component["chain"]))
        if own:
            text = _composition_text(own[0])
        elif kind == "device":
            text = _device_text(target, connected, states, component, others)
        elif kind == "host":
            text = _host_text(target, connected, states, component, others)
        else:
            text = _carrier_text(target, connected, component, others)
        return {
            "id": target,
            "kind": kind,
            "connected_to": connected,
            "chain": _merged(chains),
            "text": text,
        }

    async def _compositions(
        self, domain: str, ids: list[str], conn: asyncpg.Connection | None = None
    ) -> list[dict[str, Any]]:
        if not ids:
            return []
        records = await (conn or self._pool).fetch(_COMPOSITION, domain, ids)
        rows = []
        for record in records:
            row = dict(record)
            row["labels"] = _json(row["labels"])
            row["devices"] = [_ordered(d, _DEVICE_KEYS) for d in _json(row["devices"])]
            row["impaired_by"] = [_ordered(i, _IMPAIRED_KEYS) for i in _json(row["impaired_by"])]
            row["chain"] = _chain(row["chain"])
            rows.append(row)
        return rows


# ---- rows ----


def _connection(record: asyncpg.Record) -> dict[str, Any]:
    return {
        "device": record["device"],
        "host": record["host"],
        "composition_id": record["composition_id"],
        "tenant": record["tenant"],
        "path": _json(record["path"]),
        "bandwidth_gbps": record["bandwidth_gbps"],
        "capacity_gib": record["capacity_gib"],
        "since": iso(record["since"]),
        "why": _why(_json(record["why"])),
    }


def _why(why: dict[str, Any]) -> dict[str, Any]:
    if isinstance(why.get("constraints"), dict):
        why["constraints"] = _ordered(why["constraints"], _CONSTRAINT_KEYS)
    return _ordered(why, _WHY_KEYS)


def _chain(text: str) -> list[dict[str, Any]]:
    return [_ordered(e, _CHAIN_KEYS) for e in _json(text)]


def _ordered(obj: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    first = {k: obj[k] for k in keys if k in obj}
    return first | {k: v for k, v in obj.items() if k not in first}


def _composition(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "composition_id": row["composition_id"],
        "host": row["host"],
        "state": row["state"],
        "expires_at": iso(row["expires_at"]),
        "devices": row["devices"],
        "tenant": row["tenant"],
        "labels": row["labels"],
        "reason": row["reason"],
        "request_id": row["request_id"],
        "created_at": iso(row["created_at"]),
        "impaired_by": row["impaired_by"],
        "chain": row["chain"],
    }


def _merged(chains: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several chains as one, in log order, each event once."""
    by_position = {entry["position"]: entry for chain in chains for entry in chain}
    return [by_position[p] for p in sorted(by_position)]


# ---- sentences ----


def _device_text(
    device: str,
    connected: list[dict[str, Any]],
    states: dict[str, dict[str, Any]],
    component: asyncpg.Record,
    others: bool = False,
) -> str:
    marks = _marks(component)
    if not connected:
        if others:
            return f"{device} is {IN_USE_BY_OTHERS}; it is {marks}."
        return f"{device} is connected to nothing; it is free and {marks}."
    clauses = []
    for c in connected:
        share = f" with {_num(c['capacity_gib'])} GiB" if c["capacity_gib"] is not None else ""
        clauses.append(
            f"{c['host']}{share} {_via(c['path'])} in composition {c['composition_id']}"
            f" for tenant {c['tenant']} since {c['since']}"
            f"{_impaired(states.get(c['composition_id']))}, {_requested(c['why'])}"
        )
    note = "" if marks == "healthy" else f"; the device is {marks}"
    return f"{device} is connected to {'; and to '.join(clauses)}{_also(others)}{note}."


def _host_text(
    host: str,
    connected: list[dict[str, Any]],
    states: dict[str, dict[str, Any]],
    component: asyncpg.Record,
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
            f"{_and([r['device'] for r in rows])} in composition {cid}"
            f" for tenant {first['tenant']} since {min(r['since'] for r in rows)}"
            f"{_impaired(states.get(cid))}, {_requested(first['why'])}"
        )
    note = "" if marks == "healthy" else f"; the host is {marks}"
    return f"{host} is connected to {'; and to '.join(clauses)}{_also(others)}{note}."


def _carrier_text(
    target: str, connected: list[dict[str, Any]], component: asyncpg.Record, others: bool = False
) -> str:
    """A link, switch or OCS: whose paths pass it."""
    marks = _marks(component)
    if not connected:
        if others:
            return f"{target} carries only paths {IN_USE_BY_OTHERS}; it is {marks}."
        return f"{target} carries nothing; it is {marks}."
    clauses = [
        f"{rows[0]['host']} to {_and([r['device'] for r in rows])} in composition {cid}"
        f" for tenant {rows[0]['tenant']}"
        for cid, rows in _by_composition(connected)
    ]
    paths = "; and from ".join(clauses)
    return f"{target} carries the paths from {paths}{_also(others)}; it is {marks}."


def _also(others: bool) -> str:
    """In a tenant's view: a clause saying others hold more of it, and nothing about them."""
    return f", and it is also {IN_USE_BY_OTHERS}" if others else ""


def _composition_text(row: dict[str, Any]) -> str:
    cid, devices = row["composition_id"], _and([d["id"] for d in row["devices"]]) or "nothing"
    why = _requested(
        {
            "actor": row["chain"][0]["actor"] if row["chain"] else row["tenant"],
            "request_id": row["request_id"],
            "reason": row["reason"],
        }
    )
    head = f"composition {cid} of tenant {row['tenant']}"
    since = iso(row["created_at"])
    until = row["chain"][-1]["time"] if row["chain"] else since
    if row["state"] == "released":
        return (
            f"{head} connected {row['host']} to {devices} from {since} until {until}, {why};"
            " it is released."
        )
    if row["state"] == "failed":
        return (
            f"{head} was to connect {row['host']} to {devices}, {why}, but the fabric could"
            f" not establish it and it failed at {until}; nothing of it is held."
        )
    if row["state"] == "pending":
        return (
            f"{head} is connecting {row['host']} to {devices} since {since}, {why}; the fabric"
            " is being programmed."
        )
    impaired = _impaired_by(row)
    state = f"it is impaired by {impaired}" if impaired else f"it is {row['state']}"
    return f"{head} connects {row['host']} to {devices} since {since}, {why}; {state}."


def _requested(why: dict[str, Any]) -> str:
    reason = why.get("reason") or ""
    text = f"requested by {why.get('actor')} (request {why.get('request_id')})"
    return f"{text}: {reason}" if reason else text


def _impaired(composition: dict[str, Any] | None) -> str:
    """A clause for a connection whose composition is impaired, else nothing."""
    impaired = _impaired_by(composition)
    return f", impaired by {impaired}" if impaired else ""


def _impaired_by(composition: dict[str, Any] | None) -> str:
    if not composition or composition["state"] != "impaired":
        return ""
    return _and(sorted({i["component"] for i in composition["impaired_by"]}))


def _marks(component: asyncpg.Record) -> str:
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


def _by_composition(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["composition_id"], []).append(row)
    return sorted(groups.items())


def _and(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"


def _num(value: float) -> str:
    return f"{value:g}"
