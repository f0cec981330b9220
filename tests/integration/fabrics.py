"""Small fabric documents for the integration tests, and probes that read the log directly.

`fabric()` is the standard little hall: one host, one PCIe switch, one OCS with a few ports and
devices of several kinds, some cabled to the switch and some to OCS ports. The node and link
helpers build single entries in the wire format of ARCHITECTURE §4, so tests can add, change or
drop a piece of the standard doc without spelling out every field.
"""

from __future__ import annotations

import copy
from typing import Any

import asyncpg

from trellis.engine.core.errors import ERROR_CODES

Doc = dict[str, Any]


def host(id: str, **labels: str) -> Doc:
    return {"id": id, "kind": "host", **({"labels": labels} if labels else {})}


def switch(id: str, latency_ns: int = 150) -> Doc:
    return {"id": id, "kind": "switch", "latency_ns": latency_ns}


def ocs(id: str, ports: int = 8, latency_ns: int = 30) -> Doc:
    return {"id": id, "kind": "ocs", "ports": ports, "latency_ns": latency_ns}


def device(id: str, device_kind: str = "gpu", **attrs: Any) -> Doc:
    if device_kind == "memory":
        attrs.setdefault("capacity_gib", 512)
    return {"id": id, "kind": "device", "device_kind": device_kind, **attrs}


def gpu(id: str, model: str = "H100", generation: int = 9, **attrs: Any) -> Doc:
    return device(id, "gpu", vendor="nvidia", model=model, generation=generation, **attrs)


def link(
    id: str,
    a: str,
    b: str,
    *,
    a_port: int | None = None,
    b_port: int | None = None,
    capacity_gbps: float = 256,
    latency_ns: int = 50,
) -> Doc:
    doc: Doc = {"id": id, "a": a, "b": b, "capacity_gbps": capacity_gbps, "latency_ns": latency_ns}
    if a_port is not None:
        doc["a_port"] = a_port
    if b_port is not None:
        doc["b_port"] = b_port
    return doc


def fabric(ocs_ports: int = 8) -> Doc:
    """host-01 — sw-1 — ocs-1 (ports 0..ocs_ports-1) with a GPU of two generations, a memory
    pool, a NIC and an NVMe drive. OCS ports 0..3 are cabled, the rest are free."""
    return {
        "nodes": [
            host("host-01", rack="r1"),
            switch("sw-1"),
            ocs("ocs-1", ports=ocs_ports),
            gpu("gpu-01", labels={"rack": "r3"}, memory_gib=80, cost_per_hour=2.5),
            gpu("gpu-02", model="A100", generation=8, memory_gib=40),
            device("mem-01", "memory", capacity_gib=2048),
            device("nic-01", "nic"),
            device("nvme-01", "nvme", capacity_gib=4096),
        ],
        "links": [
            link("l-host", "host-01", "sw-1"),
            link("l-uplink", "sw-1", "ocs-1", b_port=0),
            link("l-gpu-01", "gpu-01", "ocs-1", b_port=1, capacity_gbps=64),
            link("l-gpu-02", "ocs-1", "gpu-02", a_port=2, capacity_gbps=64),
            link("l-nvme", "nvme-01", "ocs-1", b_port=3, capacity_gbps=32),
            link("l-mem", "sw-1", "mem-01", capacity_gbps=128),
            link("l-nic", "sw-1", "nic-01", capacity_gbps=100),
        ],
    }


def ids(doc: Doc) -> set[str]:
    """Every node and link id in a doc."""
    return {n["id"] for n in doc["nodes"]} | {lk["id"] for lk in doc["links"]}


def edited(doc: Doc) -> Doc:
    """A deep copy to change without touching the original."""
    return copy.deepcopy(doc)


# ---- probes: the log as the database holds it ----


async def fetch(database_url: str, schema: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    """Run one query inside `schema` on a connection of its own."""
    conn = await asyncpg.connect(database_url, server_settings={"search_path": schema})
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def row_counts(database_url: str, schema: str) -> tuple[int, int]:
    """(events, stored request ids) in the schema."""
    rows = await fetch(
        database_url,
        schema,
        "SELECT (SELECT count(*) FROM trellis_events) AS e,"
        " (SELECT count(*) FROM trellis_requests) AS r",
    )
    return rows[0]["e"], rows[0]["r"]


async def event_types(database_url: str, schema: str, domain: str) -> list[str]:
    """The domain's event types in version order."""
    rows = await fetch(
        database_url,
        schema,
        "SELECT type FROM trellis_events WHERE domain = $1 ORDER BY version",
        domain,
    )
    return [r["type"] for r in rows]


# ---- reply envelopes ----


def check_envelope(reply: dict[str, Any]) -> None:
    """Exactly one of the two reply shapes of ARCHITECTURE §3, with a known error code."""
    if reply.get("ok") is True:
        assert set(reply) == {"ok", "result", "position", "replayed"}, reply
        assert isinstance(reply["position"], int) and reply["position"] >= 0, reply
        assert isinstance(reply["replayed"], bool), reply
    else:
        assert reply.get("ok") is False and set(reply) == {"ok", "error"}, reply
        error = reply["error"]
        assert set(error) == {"code", "message", "details"}, reply
        assert error["code"] in ERROR_CODES, reply
        assert isinstance(error["message"], str) and error["message"], reply
        assert isinstance(error["details"], dict), reply


def expect_ok(reply: dict[str, Any]) -> Any:
    """The result of a success reply (fails the test with the whole reply otherwise)."""
    assert reply.get("ok") is True, reply
    assert set(reply) == {"ok", "result", "position", "replayed"}, reply
    return reply["result"]


def expect_error(reply: dict[str, Any], code: str) -> dict[str, Any]:
    """The error body of a failure reply with `code`, which carries a readable message."""
    assert reply.get("ok") is False, reply
    assert set(reply) == {"ok", "error"}, reply
    error: dict[str, Any] = reply["error"]
    assert error["code"] == code, reply
    assert isinstance(error["message"], str) and len(error["message"]) > 5, reply
    return error


def hall(racks: int = 8, hosts: int = 4, leaves: int = 4, gpus_per_leaf: int = 16) -> Doc:
    """A hall as outside load tests build it: racks of a spine switch, hosts and leaf switches
    of GPUs (four models), the spines joined by one OCS. Hosts are `r<R>-h<H>`."""
    models = [("A100", 8), ("H100", 9), ("H200", 9), ("B200", 10)]
    nodes: list[Doc] = [ocs("ocs-1", ports=racks)]
    links: list[Doc] = []
    for r in range(racks):
        spine = f"r{r}-spine"
        nodes.append(switch(spine))
        links.append(link(f"{spine}-up", spine, "ocs-1", b_port=r, capacity_gbps=400))
        for h in range(hosts):
            nodes.append(host(f"r{r}-h{h}", rack=f"r{r}"))
            links.append(link(f"r{r}-h{h}-l", f"r{r}-h{h}", spine, capacity_gbps=128))
        for leaf_no in range(leaves):
            leaf = f"r{r}-leaf{leaf_no}"
            nodes.append(switch(leaf))
            links.append(link(f"{leaf}-l", spine, leaf, capacity_gbps=256))
            for g in range(gpus_per_leaf):
                model, generation = models[g % len(models)]
                gpu_id = f"{leaf}-g{g}"
                nodes.append(gpu(gpu_id, model=model, generation=generation))
                links.append(link(f"{gpu_id}-l", leaf, gpu_id, capacity_gbps=64))
    return {"nodes": nodes, "links": links}


def one_switch(gpus: int) -> Doc:
    """`host-01` and `gpus` H100s (`gpu-00`...) behind one switch: composes need no circuit,
    and as many can be held at once as there are GPUs."""
    nodes: list[Doc] = [host("host-01"), switch("sw-1")]
    links: list[Doc] = [link("l-host", "host-01", "sw-1", capacity_gbps=400)]
    for i in range(gpus):
        nodes.append(gpu(f"gpu-{i:02d}"))
        links.append(link(f"l-gpu-{i:02d}", "sw-1", f"gpu-{i:02d}", capacity_gbps=64))
    return {"nodes": nodes, "links": links}
