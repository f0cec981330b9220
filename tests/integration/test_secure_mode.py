"""Secure mode against a real nats-server running the generated users, and the real engine.

Each test gets its own nats-server (the permissions name the test's subject prefix), started
from the config adapters/nats/auth.py writes, and an engine that connects as its own identity.
Tenants `acme` and `globex` compose on the same host and pool; whatever acme is told must not
name globex, its compositions, request ids, reasons or labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import pytest_asyncio
from fabrics import expect_error, expect_ok, row_counts
from harness import engine_at, run_cli
from isolation import unique_subject_prefix
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, StreamConfig
from test_crash_safe_servers import listening

from trellis.adapters.bootstrap import RunningEngine
from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.http.fabric_page import token_cookie
from trellis.adapters.nats.auth import (
    NkeyCredentials,
    Principal,
    SecureDir,
    inbox_prefix,
    public_key,
)
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats, until_accepted, until_refused
from trellis.adapters.nats.jetstream import bucket_name, stream_name

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fabric.json"
DOMAIN = "hall-1"
OPERATOR = Principal("operator", "operator")
AUDITOR = Principal("auditor", "auditor")
RELAY = Principal("relay", "relay")
ACME = Principal("tenant", "acme")
GLOBEX = Principal("tenant", "globex")
SLICE = {"kind": "memory", "capacity_gib": 64}


class Conn:
    """A NATS connection as one identity, keeping what the server refused."""

    def __init__(self, nc: NATS, prefix: str):
        self.nc = nc
        self.refused: list[str] = []
        self.client = TrellisClient(nc, prefix=prefix)

    async def on_error(self, exc: Exception) -> None:
        self.refused.append(str(exc).lower())

    async def denied(self, subject: str, body: bytes = b"{}") -> None:
        """Publish `subject` as a request and require the server to refuse it: a permissions
        violation naming it, and no reply."""
        inbox = self.nc.new_inbox()
        replies = await self.nc.subscribe(inbox)
        await self.nc.publish(subject, body, reply=inbox)
        await until(lambda: any(subject.lower() in r for r in self.refused))
        await self.nc.flush()
        assert any("permissions violation for publish" in r for r in self.refused)
        assert replies.pending_msgs == 0
        await replies.unsubscribe()

    async def cannot_subscribe(self, subject: str) -> None:
        sub = await self.nc.subscribe(subject)
        await until(lambda: any(f'subscription to "{subject.lower()}"' in r for r in self.refused))
        await sub.unsubscribe()


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


class Rig:
    def __init__(self, secure: SecureDir, server: EmbeddedNats, running: RunningEngine):
        self.secure = secure
        self.server = server
        self.running = running
        self.prefix = running.subject_prefix
        self._conns: list[NATS] = []

    async def connect(self, who: Principal) -> Conn:
        return await self.connect_with(self.secure.credentials(who))

    async def connect_with(self, creds: NkeyCredentials) -> Conn:
        holder: list[Conn] = []

        async def on_error(exc: Exception) -> None:
            await holder[0].on_error(exc)

        nc = await connect_nats(self.server.url, name="test", credentials=creds, on_error=on_error)
        holder.append(Conn(nc, self.prefix))
        self._conns.append(nc)
        return holder[0]

    async def close(self) -> None:
        for nc in self._conns:
            await nc.close()


@contextlib.asynccontextmanager
async def secured(
    tmp_path: Path, database_url: str, pg_schema: str, page: bool = False
) -> AsyncIterator[Rig]:
    """A secure-mode NATS of this test's own and an engine on it as the engine identity;
    `page`: with the live fabric page, connected as the operator."""
    prefix = unique_subject_prefix()
    secure = SecureDir(tmp_path)
    secure.ensure(prefix, ["acme", "globex"])
    server = EmbeddedNats(tmp_path, config=secure.config_path)
    await asyncio.to_thread(server.start)
    try:
        async with engine_at(
            server.url,
            database_url,
            schema=pg_schema,
            prefix=prefix,
            secure=secure,
            page_at=("127.0.0.1", 0) if page else None,
        ) as running:
            rig = Rig(secure, server, running)
            try:
                yield rig
            finally:
                await rig.close()
    finally:
        await asyncio.to_thread(server.stop)


@pytest_asyncio.fixture
async def rig(tmp_path: Path, database_url: str, pg_schema: str) -> AsyncIterator[Rig]:
    async with secured(tmp_path, database_url, pg_schema) as rig:
        yield rig


async def imported(rig: Rig) -> None:
    operator = await rig.connect(OPERATOR)
    doc = json.loads(EXAMPLE.read_text())
    expect_ok(await operator.client.admin(DOMAIN, "import-topology", doc))


async def compose(conn: Conn, tenant: str, body: dict[str, Any]) -> str:
    result = expect_ok(await conn.client.intent(DOMAIN, tenant, "compose", body))
    cid: str = result["composition_id"]
    return cid


async def test_a_client_without_a_known_identity_gets_nothing(rig: Rig, tmp_path: Path) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(rig.server.url, allow_reconnect=False, connect_timeout=2)
    other = SecureDir(tmp_path / "elsewhere")
    other.ensure(rig.prefix, ["acme"])  # a valid seed, but not one this server knows
    options = other.credentials(ACME).connect_options()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(rig.server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_a_tenant_can_act_only_as_itself(rig: Rig, database_url: str, pg_schema: str) -> None:
    await imported(rig)
    acme, globex = await rig.connect(ACME), await rig.connect(GLOBEX)
    theirs = await compose(globex, "globex", {"host": "host-02", "device_ids": ["gpu-002"]})
    before = await row_counts(database_url, pg_schema)

    compose_as_globex = {"request_id": "r-1", "host": "host-01", "device_ids": ["gpu-001"]}
    await acme.denied(
        f"{rig.prefix}.intent.{DOMAIN}.globex.compose", msgspec.json.encode(compose_as_globex)
    )
    release = {"request_id": "r-2", "composition_id": theirs}
    await acme.denied(f"{rig.prefix}.intent.{DOMAIN}.globex.release", msgspec.json.encode(release))
    await acme.denied(
        f"{rig.prefix}.intent.{DOMAIN}.engine.compose", msgspec.json.encode(compose_as_globex)
    )

    assert await row_counts(database_url, pg_schema) == before  # nothing reached the log
    # Its own subjects work, and another's composition is still not its to release (nor to
    # know of: it is `not_found`, as an unknown id is).
    await compose(acme, "acme", {"host": "host-01", "device_ids": ["gpu-001"]})
    mine = await acme.client.intent(DOMAIN, "acme", "release", {"composition_id": theirs})
    expect_error(mine, "not_found")


async def test_no_tenant_reads_another_tenants_replies(rig: Rig) -> None:
    await imported(rig)
    acme, globex = await rig.connect(ACME), await rig.connect(GLOBEX)
    acme_inbox = inbox_prefix(public_key(rig.secure.credentials(ACME).seed()))
    for snoop in (f"{acme_inbox}.>", "_INBOX.>", ">", f"{rig.prefix}.intent.>"):
        await globex.cannot_subscribe(snoop)

    # A wildcard that the server refused catches nothing while acme is answered.
    refused = await globex.nc.subscribe("_INBOX.>")
    await acme.client.view(DOMAIN, "acme", "topology")
    await compose(acme, "acme", {"host": "host-01", "device_ids": ["gpu-001"]})
    await globex.nc.flush()
    assert refused.pending_msgs == 0


async def test_a_tenant_may_neither_administer_nor_query_everything(rig: Rig) -> None:
    await imported(rig)
    acme = await rig.connect(ACME)
    await acme.denied(f"{rig.prefix}.query.{DOMAIN}.connections")
    await acme.denied(f"{rig.prefix}.admin.{DOMAIN}.drain", b'{"request_id": "d", "id": "sw-r1"}')
    await acme.denied(f"{rig.prefix}.view.{DOMAIN}.globex.connections")


async def test_a_tenants_view_tells_only_its_own_compositions(rig: Rig) -> None:
    await imported(rig)
    acme, globex = await rig.connect(ACME), await rig.connect(GLOBEX)
    operator = await rig.connect(OPERATOR)
    secret = {"labels": {"project": "globex-secret-label"}, "reason": "globex-secret-reason"}
    # globex shares acme's host, switch and memory pool, and has a host of its own.
    theirs = [
        await compose(globex, "globex", {
            "request_id": "globex-secret-rid-1", "host": "host-01",
            "devices": [{"kind": "gpu", "models": ["H100"]}, SLICE], **secret,
        }),
        await compose(globex, "globex", {
            "request_id": "globex-secret-rid-2", "host": "host-03",
            "devices": [SLICE], **secret,
        }),
    ]  # fmt: skip
    mine = await compose(acme, "acme", {
        "host": "host-01", "reason": "acme's own",
        "devices": [{"kind": "gpu", "models": ["A100"]}, SLICE],
    })  # fmt: skip
    head = (await rig.running.store.head(DOMAIN)).position
    assert await rig.running.followers.wait_for("projections", DOMAIN, head)
    composed = expect_ok(await acme.client.view(DOMAIN, "acme", "composition", {"id": mine}))
    gpu, pool = (d["id"] for d in composed["devices"])
    their_gpu = "gpu-002"  # the H100 next to host-01

    def tells_nothing_of_globex(answer: dict[str, Any]) -> Any:
        text = json.dumps(answer)
        for leak in ("globex", *theirs):
            assert leak not in text, f"{leak} in {text}"
        return answer

    # The operator's query sees globex everywhere (so the data is there to leak).
    everyone = expect_ok(await operator.client.query(DOMAIN, "connections"))
    assert {r["tenant"] for r in everyone["connections"]} == {"acme", "globex"}

    # Another's composition is not_found, word for word as an unknown one (which echoes the id
    # asked for, and nothing else).
    for what in ("composition", "why"):
        unknown = await acme.client.view(DOMAIN, "acme", what, {"id": "c-0000000000000000"})
        for cid in theirs:
            hidden = await acme.client.view(DOMAIN, "acme", what, {"id": cid})
            assert hidden == json.loads(json.dumps(unknown).replace("c-0000000000000000", cid))
            assert hidden["error"]["code"] == "not_found"

    rows = expect_ok(await acme.client.view(DOMAIN, "acme", "connections"))["connections"]
    assert {(r["tenant"], r["composition_id"]) for r in rows} == {("acme", mine)}
    assert len(rows) == 2
    asked = await acme.client.view(DOMAIN, "acme", "connections", {"tenant": "globex"})
    assert expect_ok(asked) == {"connections": []}
    on_host = await acme.client.view(DOMAIN, "acme", "connections", {"host": "host-01"})
    assert expect_ok(on_host)["connections"] == rows

    why_theirs = tells_nothing_of_globex(expect_ok(
        await acme.client.view(DOMAIN, "acme", "why", {"id": their_gpu})
    ))  # fmt: skip
    assert why_theirs["connected_to"] == []
    assert why_theirs["text"] == f"{their_gpu} is in use by others; it is healthy."
    assert all(e["type"] in ("TopologyImported",) for e in why_theirs["chain"])
    for shared in ("host-01", "sw-r1", "ocs-1", pool):
        why = tells_nothing_of_globex(expect_ok(
            await acme.client.view(DOMAIN, "acme", "why", {"id": shared})
        ))  # fmt: skip
        assert {r["composition_id"] for r in why["connected_to"]} == {mine}
        assert "in use by others" in why["text"] and mine in why["text"]
    why_mine = expect_ok(await acme.client.view(DOMAIN, "acme", "why", {"id": gpu}))
    assert why_mine == expect_ok(await operator.client.query(DOMAIN, "why", {"id": gpu}))

    for component in ("sw-r1", "ocs-1", pool):
        blast = tells_nothing_of_globex(expect_ok(
            await acme.client.view(DOMAIN, "acme", "blast-radius", {"id": component})
        ))  # fmt: skip
        assert [c["composition_id"] for c in blast["compositions"]] == [mine]
        assert blast["tenants"] == ["acme"]

    topology = expect_ok(await operator.client.query(DOMAIN, "topology"))
    seen = tells_nothing_of_globex(expect_ok(await acme.client.view(DOMAIN, "acme", "topology")))
    assert seen["nodes"] == topology["nodes"] and seen["links"] == topology["links"]
    assert {c["host"] for c in topology["circuits"]} == {"host-01", "host-03"}
    assert {c["host"] for c in seen["circuits"]} == {"host-01"}
    free = await acme.client.view(DOMAIN, "acme", "free")
    assert expect_ok(free) == expect_ok(await operator.client.query(DOMAIN, "free"))

    # Its history is its own intervals only.
    history = expect_ok(await acme.client.view(DOMAIN, "acme", "history", {}))["intervals"]
    assert history and {r["tenant"] for r in history} == {"acme"}
    assert expect_ok(await acme.client.view(DOMAIN, "acme", "history", {"tenant": "globex"})) == {
        "intervals": []
    }
    # A query that has no view is refused, not answered unscoped.
    expect_error(await acme.client.view(DOMAIN, "acme", "no-such-query", {}), "invalid")


async def test_the_operator_administers_and_queries_but_is_no_tenant(rig: Rig) -> None:
    await imported(rig)
    operator = await rig.connect(OPERATOR)
    expect_ok(await operator.client.query(DOMAIN, "connections"))
    body = msgspec.json.encode({"request_id": "o-1", "host": "host-01", "device_ids": ["gpu-001"]})
    await operator.denied(f"{rig.prefix}.intent.{DOMAIN}.acme.compose", body)
    await operator.denied(f"{rig.prefix}.view.{DOMAIN}.acme.connections")
    await operator.cannot_subscribe("_INBOX.>")
    # NATS tooling as the operator finds the engine's micro service; a tenant may not ask it.
    pong = msgspec.json.decode((await operator.nc.request("$SRV.PING.trellis-engine", b"")).data)
    assert pong["name"] == "trellis-engine"
    await (await rig.connect(ACME)).denied("$SRV.PING.trellis-engine")
    # `trellis engines` as the operator: its echo through its own inbox was refused, and the
    # command said NATS had stalled (the day-2 probe).
    engines = await operator.client.engines()
    assert [e["engine"] for e in engines] == [rig.running.engine.identity], engines


async def test_the_auditor_reads_the_queries_stream_and_bucket_and_changes_nothing(
    rig: Rig, database_url: str, pg_schema: str
) -> None:
    await imported(rig)
    acme = await rig.connect(ACME)
    await compose(acme, "acme", {"host": "host-01", "device_ids": ["gpu-001"]})
    head = (await rig.running.store.head(DOMAIN)).position
    auditor = await rig.connect(AUDITOR)
    js = auditor.nc.jetstream()
    events, bucket = stream_name(rig.prefix), bucket_name(rig.prefix)

    expect_ok(await auditor.client.query(DOMAIN, "connections"))
    info = await js.stream_info(events)
    await until_stream_has(js, events, head)
    first = await js.get_msg(events, 1)
    assert json.loads(first.data)["type"] == "TopologyImported"
    read = await js.subscribe(f"{rig.prefix}.events.>", ordered_consumer=True)
    got = await read.next_msg(timeout=5)
    assert json.loads(got.data)["position"] == json.loads(first.data)["position"]
    await read.unsubscribe()
    # A durable cursor, as nats-py makes one given only its durable name (its older API
    # subject), and as newer clients do (by name).
    for durable in (
        ConsumerConfig(durable_name="audit-1"),
        ConsumerConfig(name="audit-2", durable_name="audit-2"),
    ):
        made = await js.add_consumer(events, durable, timeout=5)
        assert made.config.durable_name == durable.durable_name
    kv = await js.key_value(bucket)
    assert (await kv.get(f"{DOMAIN}.device.gpu-001")).value
    watch = await kv.watchall()
    entry = await watch.updates(timeout=5)
    if entry is None:  # nats-py's "no more pending" marker, early (nats.py issue 842)
        entry = await watch.updates(timeout=5)  # the entries follow it then
    assert entry is not None
    await watch.stop()

    before = await row_counts(database_url, pg_schema)
    compose_body = msgspec.json.encode(
        {"request_id": "a-1", "host": "host-02", "device_ids": ["gpu-003"]}
    )
    await auditor.denied(f"{rig.prefix}.intent.{DOMAIN}.acme.compose", compose_body)
    await auditor.denied(
        f"{rig.prefix}.admin.{DOMAIN}.drain", b'{"request_id": "a-2", "id": "sw-r1"}'
    )
    await auditor.denied(f"{rig.prefix}.events.{DOMAIN}.TopologyImported", b"{}")
    await auditor.denied(f"$KV.{bucket}.{DOMAIN}.device.gpu-001", b"{}")
    for api in (
        f"$JS.API.STREAM.DELETE.{events}",
        f"$JS.API.STREAM.PURGE.{events}",
        f"$JS.API.STREAM.UPDATE.{events}",
        f"$JS.API.STREAM.MSG.DELETE.{events}",
        f"$JS.API.STREAM.DELETE.KV_{bucket}",
        "$JS.API.STREAM.CREATE.EVIL",
    ):
        await auditor.denied(api)
    with pytest.raises(Exception):  # noqa: B017  (a timeout: the request never reaches JetStream)
        await js.update_stream(StreamConfig(name=events, subjects=["x.>"]), timeout=0.5)
    assert await row_counts(database_url, pg_schema) == before

    relay_js = (await rig.connect(RELAY)).nc.jetstream()  # the one writer of both
    after = await relay_js.stream_info(events)
    assert after.config.subjects == info.config.subjects
    assert after.state.messages >= info.state.messages
    assert (await (await relay_js.key_value(bucket)).get(f"{DOMAIN}.device.gpu-001")).value


async def until_stream_has(js: Any, stream: str, position: int) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        info = await js.stream_info(stream)
        if info.state.last_seq:
            last = await js.get_msg(stream, info.state.last_seq)
            if json.loads(last.data)["position"] >= position:
                return
        assert asyncio.get_running_loop().time() < deadline, "the relay did not catch up"
        await asyncio.sleep(0.05)


async def test_tenant_add_issues_credentials_while_the_engine_runs(
    rig: Rig, tmp_path: Path
) -> None:
    await imported(rig)
    acme = await rig.connect(ACME)  # connected before the reload, and stays so
    await compose(acme, "acme", {"host": "host-01", "device_ids": ["gpu-001"]})
    newcomer = Principal("tenant", "initech")
    assert not rig.secure.seed_path(newcomer).exists()
    (tmp_path / "endpoints.json").write_text(json.dumps({"nats_url": rig.server.url}))

    code, out, err = await trellis_cli(
        {"TRELLIS_DATA_DIR": str(tmp_path)}, "tenant", "add", "initech"
    )

    assert code == 0, err
    assert "the tenant can connect now" in out
    initech = await rig.connect(newcomer)
    await compose(initech, "initech", {"host": "host-02", "device_ids": ["gpu-002"]})
    await initech.denied(f"{rig.prefix}.intent.{DOMAIN}.acme.compose", b"{}")
    assert acme.nc.is_connected
    await compose(acme, "acme", {"host": "host-01", "device_ids": ["gpu-003"]})
    # Asking again issues nothing new; a name that is no id, or a role's, is refused.
    code, out, _ = await trellis_cli(
        {"TRELLIS_DATA_DIR": str(tmp_path)}, "tenant", "add", "initech"
    )
    assert code == 0 and "already issued" in out
    for bad in ("operator", "a.b", "acme\n", "*"):
        code, _, err = await trellis_cli({"TRELLIS_DATA_DIR": str(tmp_path)}, "tenant", "add", bad)
        # No id at all is a usage mistake (2); a role's name is refused by the issuer (1).
        assert code == (1 if bad == "operator" else 2), err
        assert err.startswith("trellis: ") and len(err.strip().splitlines()) == 1


async def test_tenant_add_with_external_nats_writes_the_file_its_server_includes(
    tmp_path: Path,
) -> None:
    data_dir, server_dir = tmp_path / "data", tmp_path / "nats-server"
    secure = SecureDir(data_dir)
    secure.ensure("trellis")
    # As the note says: the users' file linked beside the server's own config, included there.
    server_dir.mkdir()
    (server_dir / "trellis-auth.conf").symlink_to(secure.config_path)
    server = EmbeddedNats(server_dir, config=server_dir / "trellis-auth.conf")
    await asyncio.to_thread(server.start)
    try:
        env = {"TRELLIS_DATA_DIR": str(data_dir), "TRELLIS_NATS_URL": server.url}
        code, out, err = await trellis_cli(env, "tenant", "add", "acme")
        assert code == 0, err
        assert "NATS is external" in out and 'include "trellis-auth.conf"' in out
        options = secure.credentials(ACME).connect_options()
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGHUP)  # the operator's reload
        # Refused until the reload has run (and, while it runs, dropped mid-handshake): the
        # wait counts both as "not yet", and fails if acme is still refused at its deadline.
        await until_accepted(server.url, secure.credentials(ACME))
    finally:
        await asyncio.to_thread(server.stop)


async def test_tenant_add_on_a_data_dir_not_in_secure_mode_is_refused_and_issues_nothing(
    tmp_path: Path,
) -> None:
    """It issued the identity, said the tenant could connect (the plain server let anyone in),
    and the next plain `trellis up` came up in secure mode, unasked."""
    code, out, err = await trellis_cli({"TRELLIS_DATA_DIR": str(tmp_path)}, "tenant", "add", "acme")
    assert code == 1 and out == "", (out, err)
    assert "is not in secure mode" in err and "trellis up --secure" in err, err
    assert not SecureDir(tmp_path).root.exists()


async def test_tenant_revoke_refuses_the_identity_and_cuts_off_its_connections(
    rig: Rig, tmp_path: Path
) -> None:
    await imported(rig)
    env = {"TRELLIS_DATA_DIR": str(tmp_path)}
    (tmp_path / "endpoints.json").write_text(json.dumps({"nats_url": rig.server.url}))
    code, out, err = await trellis_cli(env, "tenant", "list", "-o", "json")
    assert code == 0, err
    old_key = public_key(rig.secure.credentials(ACME).seed())
    assert json.loads(out) == [
        {"tenant": t.name, "public_key": k, "identity": str(rig.secure.seed_path(t))}
        for t, k in ((ACME, old_key), (GLOBEX, public_key(rig.secure.credentials(GLOBEX).seed())))
    ]
    acme = await rig.connect(ACME)  # connected before the revoke: must be cut off by it
    cid = await compose(acme, "acme", {"host": "host-01", "device_ids": ["gpu-001"]})
    globex = await rig.connect(GLOBEX)

    code, out, err = await trellis_cli(env, "tenant", "revoke", "acme")

    assert code == 0, err
    assert "refuses that identity now" in out and "not released" in out, out
    aside = NkeyCredentials(rig.secure.root / "revoked" / f"acme.{old_key}.nk")
    assert not rig.secure.seed_path(ACME).exists() and aside.path.is_file()
    assert old_key not in rig.secure.config_path.read_text()
    await until(lambda: not acme.nc.is_connected)  # the server closed it at the reload
    await acme.nc.close()  # it would reconnect with whatever tenants/acme.nk holds next
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            rig.server.url, allow_reconnect=False, connect_timeout=2, **aside.connect_options()
        )
    # Others keep their connections and their say; acme's composition is still held.
    assert globex.nc.is_connected
    await compose(globex, "globex", {"host": "host-02", "device_ids": ["gpu-002"]})
    code, out, _ = await trellis_cli(env, "tenant", "list")
    assert code == 0 and "globex" in out and "acme" not in out, out

    # Issued again: a new key; the old one stays refused, and the new one can release.
    code, out, err = await trellis_cli(env, "tenant", "add", "acme")
    assert code == 0 and "issued tenant acme" in out, err
    new_key = public_key(rig.secure.credentials(ACME).seed())
    assert new_key != old_key
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            rig.server.url, allow_reconnect=False, connect_timeout=2, **aside.connect_options()
        )
    again = await rig.connect(ACME)
    expect_ok(await again.client.intent(DOMAIN, "acme", "release", {"composition_id": cid}))


async def test_tenant_revoke_refusals_change_nothing(tmp_path: Path) -> None:
    secure = SecureDir(tmp_path / "data")
    secure.ensure("trellis", ["acme"])
    env = {"TRELLIS_DATA_DIR": str(tmp_path / "data")}

    def files() -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in secure.root.rglob("*") if p.is_file()}

    before = files()
    for name, code, words in [
        ("globex", 1, "not_found: tenant 'globex' has no identity"),
        ("operator", 1, "names an internal identity"),
    ]:
        got, out, err = await trellis_cli(env, "tenant", "revoke", name)
        assert (got, out) == (code, ""), (name, out, err)
        assert err.startswith("trellis: ") and len(err.strip().splitlines()) == 1, err
        assert words in err, err
    assert files() == before
    plain = {"TRELLIS_DATA_DIR": str(tmp_path / "plain")}
    for args in (["revoke", "acme"], ["list"]):
        code, out, err = await trellis_cli(plain, "tenant", *args)
        assert code == 1 and out == "" and "is not in secure mode" in err, (out, err)
    assert not (tmp_path / "plain").exists()


async def test_tenant_revoke_with_external_nats_rewrites_the_file_and_says_to_reload(
    tmp_path: Path,
) -> None:
    data_dir, server_dir = tmp_path / "data", tmp_path / "nats-server"
    secure = SecureDir(data_dir)
    secure.ensure("trellis", ["acme"])
    server_dir.mkdir()
    (server_dir / "trellis-auth.conf").symlink_to(secure.config_path)
    server = EmbeddedNats(server_dir, config=server_dir / "trellis-auth.conf")
    await asyncio.to_thread(server.start)
    try:
        key = public_key(secure.credentials(ACME).seed())
        aside = NkeyCredentials(secure.root / "revoked" / f"acme.{key}.nk")
        env = {"TRELLIS_DATA_DIR": str(data_dir), "TRELLIS_NATS_URL": server.url}
        code, out, err = await trellis_cli(env, "tenant", "revoke", "acme")
        assert code == 0, err
        assert "NATS is external" in out and f"still lets {key} in" in out, out
        await until_accepted(server.url, aside)  # no reload yet: the server still has acme
        assert server.pid is not None
        os.kill(server.pid, signal.SIGHUP)  # the operator's reload
        await until_refused(server.url, aside)
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.slow
async def test_secure_mode_on_a_nats_server_that_lets_anyone_in_does_not_serve(
    tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    """On an external server whose configuration lacks secure mode's users, `trellis up`
    served and said "clients without one are refused" while anonymous clients got in."""
    server = EmbeddedNats(tmp_path / "nats-server")
    await asyncio.to_thread(server.start)
    try:
        env = {
            "TRELLIS_DATA_DIR": str(tmp_path / "data"),
            "TRELLIS_NATS_URL": server.url,
            "TRELLIS_DATABASE_URL": database_url,
            "TRELLIS_DB_SCHEMA": pg_schema,
            "TRELLIS_SUBJECT_PREFIX": unique_subject_prefix(),
        }
        code, out, err = await trellis_cli(env, "up", "--secure")
        assert code == 1 and "lets clients without credentials in" in err, (out, err)
        assert "serving" not in out and "trellis-auth.conf" in err
        assert SecureDir(tmp_path / "data").config_path.is_file()  # to include, as it says
    finally:
        await asyncio.to_thread(server.stop)


async def test_the_cli_connects_as_the_identity_the_data_dir_holds(
    rig: Rig, tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    env = {
        "TRELLIS_DATA_DIR": str(tmp_path),
        "TRELLIS_NATS_URL": rig.server.url,
        "TRELLIS_SUBJECT_PREFIX": rig.prefix,
        "TRELLIS_DOMAIN": DOMAIN,
    }
    code, out, err = await trellis_cli(env, "topology", "import", str(EXAMPLE))
    assert code == 0 and "imported 26 nodes" in out, err  # as the operator
    code, out, err = await trellis_cli(
        env, "compose", "--host", "host-01", "--gpu", "1", "--tenant", "acme", "--json"
    )
    assert code == 0, err  # as acme
    cid = json.loads(out)["composition_id"]
    code, out, _ = await trellis_cli(env, "connections", "--view", "acme", "--json")
    assert code == 0 and json.loads(out)["connections"][0]["composition_id"] == cid

    globex = str(rig.secure.seed_path(GLOBEX))
    refusals = [
        (["release", cid, "--tenant", "acme", "--creds", globex], "permissions violation"),
        (["compose", "--host", "host-01", "--gpu", "1", "--tenant", "nobody"], "no identity"),
        (["why", "gpu-001", "--creds", str(EXAMPLE)], "not an nkey seed"),
        # The stream and the bucket are the operator's and the auditor's to read.
        (["composition", "list", "--creds", globex], "may not read the stream or the bucket"),
        (["watch", "--creds", globex], "may not read the stream or the bucket"),
        # A tenant may not ask the micro service: refused, not "no engine" (the re-check).
        (["engines", "--creds", globex], "permissions violation"),
    ]
    for args, words in refusals:
        code, out, err = await trellis_cli(env, *args)
        assert code == 1 and words in err.lower(), err
        assert err.startswith("trellis: ") and len(err.strip().splitlines()) == 1, err
    # verify reads the log from Postgres and the stream from NATS: a tenant's refusal there is
    # said as NATS's, not blamed on the database.
    database = {"TRELLIS_DATABASE_URL": database_url, "TRELLIS_DB_SCHEMA": pg_schema}
    code, out, err = await trellis_cli({**env, **database}, "verify", "--creds", globex)
    assert code == 2 and "cannot read the database" not in err, (out, err)
    assert "NATS did not answer" in err and "auditor" in err, err
    anonymous = {**env, "TRELLIS_DATA_DIR": str(tmp_path / "empty")}
    code, _, err = await trellis_cli(anonymous, "topology", "show")
    assert code == 1 and "authorization violation" in err.lower()
    assert len(err.strip().splitlines()) == 1, err


async def trellis_cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
    return await run_cli({**base, **env}, *args)


@contextlib.asynccontextmanager
async def trellis_up(env: dict[str, str], *args: str) -> AsyncIterator[str]:
    """`trellis up ARGS` in a process of its own (embedded NATS); yields its first lines once
    it serves, and stops it on exit."""
    data_dir = Path(env["TRELLIS_DATA_DIR"])
    (data_dir / "endpoints.json").unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.cli", "up", *args,
        env={**base, **env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        lines = []
        while not lines or not lines[-1].startswith("serving"):
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, f"trellis up ended: {''.join(lines)}"
            lines.append(line.decode())
        yield "".join(lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 30)


async def anonymous_is_refused(url: str) -> bool:
    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    except nats.errors.Error as exc:
        return "Authorization Violation" in str(exc)
    await nc.close()
    return False


@pytest.mark.slow
async def test_up_secure_issues_identities_and_stays_secure(
    tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    data_dir = tmp_path / "data"
    env = {
        "TRELLIS_DATA_DIR": str(data_dir),
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DB_SCHEMA": pg_schema,
        "TRELLIS_SUBJECT_PREFIX": unique_subject_prefix(),
        "TRELLIS_DOMAIN": DOMAIN,
    }
    secure = SecureDir(data_dir)
    # Before secure mode: a tenant composes anonymously.
    async with trellis_up(env):
        assert not secure.root.exists()
        code, _, err = await trellis_cli(env, "topology", "import", str(EXAMPLE))
        assert code == 0, err
        code, out, err = await trellis_cli(
            env, "compose", "--host", "host-01", "--gpu", "1", "--tenant", "legacy", "--json"
        )
        assert code == 0, err
        held = json.loads(out)["composition_id"]

    async with trellis_up(env, "--secure", "--tenant", "acme") as banner:
        assert "secure mode: NATS identities in" in banner
        url = json.loads((data_dir / "endpoints.json").read_text())["nats_url"]
        # No monitoring port: nats-server's /connz would list every identity's inbox, unasked.
        assert "NATS monitoring" not in banner
        nats_pid = int((data_dir / "nats.pid").read_text())
        assert listening(nats_pid) == {("127.0.0.1", int(url.rsplit(":", 1)[1]))}
        # Issuing legacy's identity reloaded the server; serving means that reload is done:
        # legacy is let in at its first try, and no client is dropped by the reload any more.
        legacy = secure.credentials(Principal("tenant", "legacy")).connect_options()
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=10, **legacy)
        await nc.close()
        assert await anonymous_is_refused(url)
        # The roles, the tenant asked for, and the tenant that held a composition already.
        assert secure.tenants() == ["acme", "legacy"]
        assert secure.root.stat().st_mode & 0o777 == 0o700
        for path in [
            *secure.root.glob("*.nk"),
            *secure.tenants_dir.glob("*.nk"),
            secure.config_path,
        ]:
            assert path.stat().st_mode & 0o777 == 0o600, path
        assert sorted(p.name for p in secure.root.glob("*.nk")) == [
            "auditor.nk", "checkpoints.nk", "engine.nk", "operator.nk", "relay.nk"
        ]  # fmt: skip
        code, _, err = await trellis_cli(env, "release", held, "--tenant", "legacy")
        assert code == 0, err
        code, out, err = await trellis_cli(env, "tenant", "add", "globex")
        assert code == 0 and "the tenant can connect now" in out, err
        code, _, err = await trellis_cli(
            env, "compose", "--host", "host-02", "--gpu", "1", "--tenant", "globex"
        )
        assert code == 0, err

    # Once secured, a data dir stays so without the flag.
    async with trellis_up(env) as banner:
        assert "secure mode" in banner
        url = json.loads((data_dir / "endpoints.json").read_text())["nats_url"]
        assert await anonymous_is_refused(url)
        code, out, err = await trellis_cli(env, "connections", "--view", "globex", "--json")
        assert code == 0, err
        assert {r["tenant"] for r in json.loads(out)["connections"]} == {"globex"}


def read(url: str, token: str | None = None) -> bytes:
    with urllib.request.urlopen(with_token(url, token), timeout=10) as response:
        body: bytes = response.read()
        return body


def with_token(url: str, token: str | None) -> urllib.request.Request:
    """A request carrying the page's token as the browser keeps it: in its cookie."""
    headers = {"Cookie": f"{token_cookie(url)}={token}"} if token else {}
    return urllib.request.Request(url, headers=headers)


def first_snapshot(url: str, token: str | None = None) -> dict[str, Any]:
    """The `snapshot` message a fabric page's /events stream opens with."""
    with urllib.request.urlopen(with_token(f"{url}/events", token), timeout=10) as stream:
        for line in stream:
            if line.startswith(b"event: snapshot"):
                snapshot: dict[str, Any] = json.loads(stream.readline().removeprefix(b"data: "))
                return snapshot
    raise AssertionError("the stream ended without a snapshot")


async def test_the_fabric_page_connects_as_the_operator_and_sees_every_tenant(
    tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    async with secured(tmp_path, database_url, pg_schema, page=True) as rig:
        running = rig.running
        await imported(rig)
        ids = {
            await compose(await rig.connect(who), who.name, {"host": "host-01", "devices": [SLICE]})
            for who in (ACME, GLOBEX)
        }
        assert running.page_url is not None
        keys = {f"{DOMAIN}.composition.{cid}" for cid in ids}
        deadline = asyncio.get_running_loop().time() + 10
        # The page's operator identity watches the bucket: both tenants' compositions.
        token = running.page_token
        assert token is not None
        while not keys <= set(
            (await asyncio.to_thread(first_snapshot, running.page_url, token))["values"]
        ):
            assert asyncio.get_running_loop().time() < deadline, "not in the snapshot"
            await asyncio.sleep(0.1)
        topology = await asyncio.to_thread(
            read, f"{running.page_url}/api/topology?domain={DOMAIN}", token
        )
        assert json.loads(topology)["ok"] is True
