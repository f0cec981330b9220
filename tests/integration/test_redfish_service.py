"""The northbound Redfish service (`trellis up --redfish`, ARCHITECTURE §11, docs/redfish.md)
against a live engine: the read model, compose and release through HTTP checked against the
engine's own `connections` view, Redfish error bodies, tenants, and DMTF's validators."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from harness import Harness, ManualClock, engine_at, serving
from isolation import unique_subject_prefix
from prometheus_client.parser import text_string_to_metric_families
from redfish_http import RedfishHttp
from self_signed import self_signed

from trellis.adapters.embedded.nats_server import EmbeddedNats
from trellis.adapters.fabric.redfish.client import HttpError, RedfishClient
from trellis.adapters.http.redfish import AccountStore, RedfishService, login_guard
from trellis.adapters.http.redfish.reservation_duration import ReservationDuration
from trellis.adapters.http.redfish.serve import RedfishOptions
from trellis.adapters.http.redfish.service import RESERVATION_DURATION_FILE, SESSION_TIMEOUT_FILE
from trellis.adapters.http.redfish.session_timeout import SessionTimeout
from trellis.adapters.nats.auth import Principal, SecureDir
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats

DOMAIN = "hall-1"
FABRIC = json.loads((Path(__file__).parents[2] / "examples" / "fabric.json").read_text())
ADMIN_PASSWORD = "admin-secret-1"
R = "/redfish/v1"
BLOCKS = f"{R}/CompositionService/ResourceBlocks"


def block(node: str) -> dict[str, str]:
    return {"@odata.id": f"{BLOCKS}/{DOMAIN}.{node}"}


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[Harness]:
    options = RedfishOptions(
        accounts=tmp_path / "redfish-accounts.json", admin_password=ADMIN_PASSWORD
    )
    async with serving(nats_url, database_url, pg_schema, subject_prefix, redfish=options) as h:
        reply = await h.client.import_topology(DOMAIN, FABRIC)
        assert reply["ok"], reply
        yield h


@pytest_asyncio.fixture
async def clocked(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[Harness, ManualClock]]:
    """The Redfish service over an engine on a clock the test moves, the fabric imported."""
    clock = ManualClock()
    options = RedfishOptions(
        accounts=tmp_path / "redfish-accounts.json", admin_password=ADMIN_PASSWORD
    )
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, redfish=options, clock=clock
    ) as h:
        assert (await h.client.import_topology(DOMAIN, FABRIC))["ok"]
        assert h.redfish_url is not None
        yield h, clock


@pytest_asyncio.fixture
async def admin(h: Harness) -> RedfishHttp:
    assert h.redfish_url is not None
    return RedfishHttp(h.redfish_url, "admin", ADMIN_PASSWORD)


async def tenant_account(admin: RedfishHttp, name: str, tenant: str, role: str = "Operator"):
    answer = await admin(
        "POST",
        f"{R}/AccountService/Accounts",
        {
            "UserName": name,
            "Password": f"{name}-password",
            "RoleId": role,
            "Oem": {"Trellis": {"Tenant": tenant}},
        },
    )
    assert answer.status == 201, answer
    return admin.as_user(name, f"{name}-password")


async def connections(h: Harness, **query: Any) -> list[dict[str, Any]]:
    reply = await h.client.query(DOMAIN, "connections", query)
    assert reply["ok"], reply
    return list(reply["result"]["connections"])


async def test_serves_the_service_root_without_credentials_and_nothing_else(
    admin: RedfishHttp,
) -> None:
    anonymous = RedfishHttp(admin.base)
    root = await anonymous.get(f"{R}/")
    assert root.status == 200 and root.body["CompositionService"]["@odata.id"]
    assert root.headers["odata-version"] == "4.0"
    # What the service does not do, said rather than left for a client to find out by a 501
    # (the Redfish client probe: $top/$skip and deep operations went unsaid).
    features = root.body["ProtocolFeaturesSupported"]
    assert features["TopSkipQuery"] is False and features["SelectQuery"] is False
    assert features["DeepOperations"] == {"DeepPATCH": False, "DeepPOST": False}
    assert (await admin.get(f"{R}/Systems?$top=1")).status == 501
    assert (await anonymous.get(f"{R}/$metadata")).status == 200
    assert (await anonymous.get(f"{R}/odata")).status == 200
    denied = await anonymous.get(f"{R}/Systems")
    assert denied.status == 401 and "www-authenticate" in denied.headers
    assert (await admin.get(f"{R}/Systems")).status == 200


async def test_composes_specific_blocks_and_releases_them_as_the_engine_sees(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    answer = await acme(
        "POST",
        f"{R}/Systems",
        {"Name": "decode", "Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}},
    )
    assert answer.status == 201, answer
    cid = answer.body["Id"]
    assert answer.headers["location"] == f"{R}/Systems/{cid}"
    rows = await connections(h)
    assert [(r["device"], r["host"], r["composition_id"], r["tenant"]) for r in rows] == [
        ("gpu-002", "host-01", cid, "acme")
    ]
    gpu = await acme.get(f"{BLOCKS}/{DOMAIN}.gpu-002")
    assert gpu.body["CompositionStatus"]["CompositionState"] == "Composed"
    assert gpu.body["Client"] == "acme"
    # The ETag in the body too (@odata.etag), for clients that keep bodies, not headers.
    assert gpu.body["@odata.etag"] == gpu.headers["etag"]
    system = await acme.get(f"{R}/Systems/{cid}")
    assert system.status == 200
    assert system.body["Oem"]["Trellis"]["Paths"]["gpu-002"][0] == "host-01"
    gone = await acme("DELETE", f"{R}/Systems/{cid}")
    assert gone.status == 204, gone
    assert await connections(h) == []
    assert (await acme.get(f"{R}/Systems/{cid}")).status == 404
    gpu = await acme.get(f"{BLOCKS}/{DOMAIN}.gpu-002")
    assert gpu.body["CompositionStatus"]["CompositionState"] == "Unused"


async def test_composes_a_constrained_request_with_a_memory_slice(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    answer = await acme(
        "POST",
        f"{R}/Systems",
        {
            "Name": "constrained",
            "@Redfish.ZoneAffinity": DOMAIN,
            "Processors": {
                "Members": [{"@Redfish.RequestedCount": 2, "ProcessorType": "GPU",
                             "Model": "H100"}]
            },
            "Memory": {"Members": [{"@Redfish.RequestedCount": 1, "CapacityMiB": 64 * 1024}]},
        },
    )  # fmt: skip
    assert answer.status == 201, answer
    cid = answer.body["Id"]
    rows = await connections(h)
    assert sorted(r["device"] for r in rows if r["composition_id"] == cid) == sorted(
        d for d in answer.body["Oem"]["Trellis"]["Paths"]
    )
    kinds = {r["device"].split("-")[0] for r in rows}
    assert kinds == {"gpu", "mem"}
    assert any(link["@odata.id"].endswith(f".{rows[0]['host']}")
               for link in answer.body["Links"]["ResourceBlocks"])  # fmt: skip
    memory = next(r for r in rows if r["device"].startswith("mem"))
    slices = await acme.get(f"{R}/Fabrics/{DOMAIN}/Connections")
    assert slices.body["Members"] == [
        {"@odata.id": f"{R}/Fabrics/{DOMAIN}/Connections/{cid}.{memory['device']}"}
    ]
    zone = await acme.get(f"{R}/Fabrics/{DOMAIN}/Zones/{cid}")
    assert zone.status == 200 and zone.body["ZoneType"] == "ZoneOfEndpoints"
    # What the system holds, as an inventory tool reads a ComputerSystem: its GPUs are its
    # blocks' processors, its slice a Memory of the slice's size (the Redfish client probe).
    held = {p: (await acme.get(f"{R}/Systems/{cid}/{p}")).body["Members"] for p in
            ("Processors", "Memory", "NetworkInterfaces", "Storage")}  # fmt: skip
    gpus = sorted(r["device"] for r in rows if r["device"].startswith("gpu"))
    blocks = [f"{R}/CompositionService/ResourceBlocks/{DOMAIN}.{g}" for g in gpus]
    assert held["Processors"] == [{"@odata.id": f"{b}/Processors/{b.rsplit('/', 1)[1]}"}
                                  for b in blocks]  # fmt: skip
    assert held["Memory"] == [
        {"@odata.id": f"{R}/Systems/{cid}/Memory/{DOMAIN}.{memory['device']}"}
    ]
    assert held["NetworkInterfaces"] == held["Storage"] == []
    for member in held["Processors"]:
        assert (await acme.get(member["@odata.id"])).body["ProcessorType"] == "GPU"
    piece = await acme.get(held["Memory"][0]["@odata.id"])
    assert piece.body["CapacityMiB"] == 64 * 1024, piece
    assert (await acme.get(f"{R}/Systems/{cid}/Storage/NVMe")).status == 404
    others = await tenant_account(admin, "bob", "bolt")
    assert (await others.get(f"{R}/Systems/{cid}/Processors")).status == 404
    # Read only: a 405 names the collection's own methods; a path that is not there is 404
    # whatever the method (the re-check probe got 405 naming the system's DELETE).
    refused = await acme("DELETE", held["Memory"][0]["@odata.id"])
    assert refused.status == 405 and refused.headers["allow"] == "GET, HEAD", refused
    assert (await acme("DELETE", f"{R}/Systems/{cid}/Storage/NVMe")).status == 404
    assert (await acme("POST", f"{R}/Systems/c-0000000000000000/Memory", {})).status == 404


async def test_a_whole_memory_pool_held_reads_as_the_pools_capacity(admin: RedfishHttp) -> None:
    """A pool composed without a capacity is held whole: its Memory read CapacityMiB 0 (the
    re-check probe)."""
    acme = await tenant_account(admin, "alice", "acme")
    made = await acme(
        "POST", f"{R}/Systems", {"Links": {"ResourceBlocks": [block("host-02"), block("mem-02")]}}
    )
    assert made.status == 201, made
    bid = f"{DOMAIN}.mem-02"
    pool = await acme.get(f"{BLOCKS}/{bid}/Memory/{bid}")
    held = await acme.get(f"{R}/Systems/{made.body['Id']}/Memory/{bid}")
    assert held.body["CapacityMiB"] == pool.body["CapacityMiB"] > 0, (held, pool)


async def test_a_composed_systems_drives_are_in_one_storage(admin: RedfishHttp) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    made = await acme(
        "POST",
        f"{R}/Systems",
        {"Links": {"ResourceBlocks": [block("host-01"), block("nvme-01"), block("nic-01")]}},
    )
    assert made.status == 201, made
    cid = made.body["Id"]
    storage = await acme.get(f"{R}/Systems/{cid}/Storage")
    assert storage.body["Members"] == [{"@odata.id": f"{R}/Systems/{cid}/Storage/NVMe"}]
    drives = (await acme.get(f"{R}/Systems/{cid}/Storage/NVMe")).body["Drives"]
    bid = f"{DOMAIN}.nvme-01"
    assert drives == [{"@odata.id": f"{R}/CompositionService/ResourceBlocks/{bid}/Drives/{bid}"}]
    assert (await acme.get(drives[0]["@odata.id"])).body["Protocol"] == "NVMe"
    nics = (await acme.get(f"{R}/Systems/{cid}/NetworkInterfaces")).body["Members"]
    assert len(nics) == 1 and (await acme.get(nics[0]["@odata.id"])).status == 200


async def test_refuses_bad_compositions_with_registry_messages_and_writes_nothing(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    head = (await h.store.head(DOMAIN)).position

    async def post(body: dict[str, Any], **kwargs: Any):
        return await acme("POST", f"{R}/Systems", body, **kwargs)

    twice = await post({"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002"),
                                                     block("gpu-002")]}})  # fmt: skip
    assert (twice.status, twice.messages()) == (400, ["ResourceBlockInvalid"])
    unknown = await post({"Links": {"ResourceBlocks": [block("host-01"), block("gpu-999")]}})
    assert (unknown.status, unknown.messages()) == (400, ["ResourceBlockNotFound"])
    impossible = await post(
        {"Links": {"ResourceBlocks": [block("host-01")]},
         "Processors": {"Members": [{"@Redfish.RequestedCount": 40, "ProcessorType": "GPU"}]}}
    )  # fmt: skip
    assert (impossible.status, impossible.messages()) == (400, ["NoResourceMatch"])
    resolution = impossible.body["error"]["@Message.ExtendedInfo"][0]["Resolution"]
    assert "Funnel" in resolution and "free" in resolution, resolution
    assert (await post({"Links": "x"})).status == 400
    malformed = await acme("POST", f"{R}/Systems", None)
    assert malformed.status == 400
    # Rejected composes are recorded (CompositionRejected) but connect nothing.
    assert await connections(h) == []
    assert (await h.store.head(DOMAIN)).position >= head

    taken = await post({"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}})
    assert taken.status == 201
    in_use = await post({"Links": {"ResourceBlocks": [block("host-02"), block("gpu-002")]}})
    assert (in_use.status, in_use.messages()) == (409, ["ResourceBlockInUse"])
    system = f"{R}/Systems/{taken.body['Id']}"
    stale = await acme("DELETE", system, headers={"If-Match": 'W/"stale"'})
    assert (stale.status, stale.messages()) == (412, ["PreconditionFailed"])
    assert len(await connections(h)) == 1
    current = (await acme.get(system)).headers["etag"]
    assert (await acme("DELETE", system, headers={"If-Match": current})).status == 204


async def test_an_idempotency_key_makes_a_retried_post_one_compose(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    body = {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-001")]}}
    key = {"Idempotency-Key": "retry-me-1"}
    first = await acme("POST", f"{R}/Systems", body, headers=key)
    again = await acme("POST", f"{R}/Systems", body, headers=key)
    assert (first.status, again.status) == (201, 201), again
    assert len(await connections(h)) == 1
    assert again.body["Id"] == first.body["Id"]
    # The same key with another body: refused in the client's own terms (a probe read
    # "request_id 'retry-me-1' was already used", a name no Redfish client sent).
    other = {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    reused = await acme("POST", f"{R}/Systems", other, headers=key)
    assert (reused.status, reused.messages()) == (409, ["ResourceInUse"]), reused
    resolution = reused.body["error"]["@Message.ExtendedInfo"][0]["Resolution"]
    assert resolution.startswith("Idempotency-Key 'retry-me-1' was already used with"), resolution
    assert "request_id" not in resolution


async def test_concurrent_posts_for_one_block_have_one_winner(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    bolt = await tenant_account(admin, "bob", "bolt")
    bodies = [
        {"Links": {"ResourceBlocks": [block(host), block("gpu-003")]}}
        for host in ("host-01", "host-02")
    ]
    answers = await asyncio.gather(
        *(
            client("POST", f"{R}/Systems", bodies[i % 2])
            for i, client in enumerate([acme, bolt] * 4)
        )
    )
    statuses = sorted(a.status for a in answers)
    assert statuses.count(201) == 1, answers
    assert all(400 <= s < 500 for s in statuses if s != 201), statuses
    rows = await connections(h, device="gpu-003")
    assert len(rows) == 1


async def test_a_tenant_sees_only_its_own_systems_and_others_blocks_as_unavailable(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    bolt = await tenant_account(admin, "bob", "bolt")
    viewer = await tenant_account(admin, "carol", "acme", role="ReadOnly")
    mine = await acme(
        "POST", f"{R}/Systems", {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    )
    assert mine.status == 201
    cid = mine.body["Id"]
    assert [m["@odata.id"] for m in (await bolt.get(f"{R}/Systems")).body["Members"]] == []
    assert (await bolt.get(f"{R}/Systems/{cid}")).status == 404
    assert (await bolt("DELETE", f"{R}/Systems/{cid}")).status == 404
    seen = (await bolt.get(f"{BLOCKS}/{DOMAIN}.gpu-002")).body
    assert seen["CompositionStatus"]["CompositionState"] == "Unavailable"
    assert "Client" not in seen and "Pool" not in seen
    assert seen["Links"]["ComputerSystems"] == []
    assert (await bolt.get(f"{R}/Fabrics/{DOMAIN}/Zones")).body["Members"] == []
    # A ReadOnly account of the same tenant reads its systems and may not change them.
    assert (await viewer.get(f"{R}/Systems/{cid}")).status == 200
    assert (await viewer("DELETE", f"{R}/Systems/{cid}")).status == 403
    # The Administrator sees every tenant's and composes for one it names.
    assert (await admin.get(f"{BLOCKS}/{DOMAIN}.gpu-002")).body["Client"] == "acme"
    pair = {"ResourceBlocks": [block("host-02"), block("gpu-001")]}
    nameless = await admin("POST", f"{R}/Systems", {"Links": pair})
    assert nameless.status == 400
    named = await admin(
        "POST", f"{R}/Systems", {"Links": pair, "Oem": {"Trellis": {"Tenant": "bolt"}}}
    )
    assert named.status == 201
    assert [r["tenant"] for r in await connections(h, device="gpu-001")] == ["bolt"]


async def test_accounts_need_a_tenant_and_sessions_carry_a_token(admin: RedfishHttp) -> None:
    refused = await admin(
        "POST",
        f"{R}/AccountService/Accounts",
        {"UserName": "nobody", "Password": "long-enough", "RoleId": "Operator"},
    )
    assert refused.status == 400
    await tenant_account(admin, "alice", "acme")
    anonymous = RedfishHttp(admin.base)
    login = await anonymous(
        "POST",
        f"{R}/SessionService/Sessions",
        {"UserName": "alice", "Password": "alice-password"},
    )
    assert login.status == 201 and login.headers["x-auth-token"]
    token = {"X-Auth-Token": login.headers["x-auth-token"]}
    assert (await anonymous.get(f"{R}/Systems", headers=token)).status == 200
    assert (await anonymous("DELETE", login.headers["location"], headers=token)).status == 204
    assert (await anonymous.get(f"{R}/Systems", headers=token)).status == 401
    bad = await anonymous(
        "POST", f"{R}/SessionService/Sessions", {"UserName": "alice", "Password": "wrong-one"}
    )
    assert bad.status == 401
    # A property a session does not take is refused, as on any other POST (Redfish probe).
    extra = {"UserName": "alice", "Password": "alice-password", "Extra": 1}
    unknown = await anonymous("POST", f"{R}/SessionService/Sessions", extra)
    assert (unknown.status, unknown.messages()) == (400, ["PropertyUnknown"]), unknown
    # ...but annotations are skipped, and Context is the client's own note, kept (re-check).
    noted = {"@odata.type": "#Session.v1_5_0.Session", "Context": "nightly job",
             "UserName": "alice", "Password": "alice-password"}  # fmt: skip
    opened = await anonymous("POST", f"{R}/SessionService/Sessions", noted)
    assert opened.status == 201 and opened.body["Context"] == "nightly job", opened


async def test_the_fabric_drivers_client_logs_in_once_and_again_when_its_session_ends(
    admin: RedfishHttp,
) -> None:
    """The southbound client (adapters/fabric/redfish/client.py) with `auth="session"`,
    against a service that checks: one login, then its token; a session deleted behind its
    back is a 401, answered by logging in again; `close` logs out."""
    client = RedfishClient(admin.base, "admin", ADMIN_PASSWORD, auth="session")
    try:
        assert (await client.get(f"{R}/Systems")).body["Members"] == []
        assert client.requests == 2  # the login, then the read
        (first,) = (await admin.get(f"{R}/SessionService/Sessions")).body["Members"]
        assert (await admin("DELETE", first["@odata.id"])).status == 204
        assert (await client.get(f"{R}/Systems")).body["Members"] == []
        # Refused (401), the login again, the logout of the replaced session (gone: 404,
        # said nothing), the read again.
        assert client.requests == 6
        (second,) = (await admin.get(f"{R}/SessionService/Sessions")).body["Members"]
        assert second != first
    finally:
        await client.close()
    assert (await admin.get(f"{R}/SessionService/Sessions")).body["Members"] == []
    wrong = RedfishClient(admin.base, "admin", "not-the-password", auth="session")
    try:
        with pytest.raises(
            HttpError, match=r"POST /redfish/v1/SessionService/Sessions answered 401"
        ):
            await wrong.get(f"{R}/Systems")
    finally:
        await wrong.close()


async def test_serves_over_tls_when_given_a_certificate_and_key(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    options = RedfishOptions(
        accounts=tmp_path / "accounts.json", admin_password=ADMIN_PASSWORD, cert=cert, key=key
    )
    async with serving(nats_url, database_url, pg_schema, subject_prefix, redfish=options) as h:
        assert h.redfish_url is not None and h.redfish_url.startswith("https://")
        client = RedfishHttp(h.redfish_url, "admin", ADMIN_PASSWORD, verify=False)
        assert (await client.get(f"{R}/")).status == 200
        assert (await client.get(f"{R}/Systems")).status == 200


async def test_dmtfs_redfish_library_composes_and_decomposes(
    h: Harness, admin: RedfishHttp
) -> None:
    redfish = pytest.importorskip("redfish", reason="the redfish extra brings DMTF's library")
    await tenant_account(admin, "alice", "acme")

    def compose_and_release() -> tuple[int, str, int]:
        client = redfish.redfish_client(
            base_url=admin.base, username="alice", password="alice-password"
        )
        client.login(auth="session")
        try:
            made = client.post(
                f"{R}/Systems",
                body={"Links": {"ResourceBlocks": [block("host-02"), block("gpu-004")]}},
            )
            location = made.getheader("Location")
            gone = client.delete(location)
            return made.status, location, gone.status
        finally:
            client.logout()

    # The library is synchronous: it runs in a thread while the engine serves here.
    made_status, location, _ = await asyncio.to_thread(compose_and_release)
    assert made_status == 201 and location.startswith(f"{R}/Systems/")
    assert await connections(h) == []
    history = await h.client.query(DOMAIN, "history", {"id": "gpu-004"})
    assert [i["composition_id"] for i in history["result"]["intervals"]] == [
        location.rsplit("/", 1)[1]
    ]


async def test_sushy_reads_the_composition_service_and_its_blocks(
    h: Harness, admin: RedfishHttp
) -> None:
    sushy = pytest.importorskip("sushy", reason="the redfish extra brings OpenStack's sushy")
    acme = await tenant_account(admin, "alice", "acme")
    made = await acme(
        "POST", f"{R}/Systems", {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    )
    assert made.status == 201

    def read() -> tuple[list[str], dict[str, str], list[str]]:
        from sushy.resources.compositionservice import resourceblock, resourcezone

        conn = sushy.Sushy(
            admin.base + f"{R}/",
            auth=sushy.auth.BasicAuth(username="alice", password="alice-password"),
        )
        service = conn.get_composition_service()
        assert service.service_enabled
        # sushy 5.x's CompositionService.resource_blocks passes its path getter itself, not
        # the path, to the collection; the collections are built with the path here instead.
        blocks = resourceblock.ResourceBlockCollection(
            conn._conn, f"{R}/CompositionService/ResourceBlocks"
        ).get_members()
        states = {b.identity: str(b.composition_status.composition_state) for b in blocks}
        zones = resourcezone.ResourceZoneCollection(
            conn._conn, f"{R}/CompositionService/ResourceZones"
        ).get_members()
        systems = [s.identity for s in conn.get_system_collection().get_members()]
        # A composed system's processors, as sushy reads any system's (the Redfish probe).
        system = conn.get_system(f"{R}/Systems/{systems[0]}")
        assert [str(p.processor_type) for p in system.processors.get_members()] == [
            "ProcessorType.GPU"
        ]
        # sushy refused EventService without its required Actions (the Redfish probe).
        assert conn.get_event_service().service_enabled
        return systems, states, [z.identity for z in zones]

    systems, states, zones = await asyncio.to_thread(read)
    assert systems == [made.body["Id"]]
    assert zones == [DOMAIN]
    assert "composed" in states[f"{DOMAIN}.gpu-002"].lower()
    assert "unused" in states[f"{DOMAIN}.gpu-001"].lower()


async def listen(client: RedfishHttp, box: list[dict[str, Any]], ready: asyncio.Event) -> None:
    """A real SSE client of the event stream: each event's body (with its `id:`) into `box`."""
    host, port = client.base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    sse_id = None
    token = base64.b64encode(f"{client.user}:{client.password}".encode()).decode()
    writer.write(
        f"GET {R}/EventService/SSE HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Basic {token}\r\n\r\n".encode()
    )
    try:
        while True:
            line = await reader.readline()
            if not line:
                return
            if line.startswith(b": Trellis"):  # the stream's first line: it listens
                ready.set()
            if line.startswith(b"id: "):
                sse_id = line[4:].strip().decode()
            if line.startswith(b"data: "):
                box.append({**json.loads(line[6:]), "sse id": sse_id})
    finally:
        writer.close()


async def test_the_event_stream_tells_each_account_only_what_it_may_see(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    bolt = await tenant_account(admin, "bob", "bolt")
    service = (await acme.get(f"{R}/EventService")).body
    assert service["ServerSentEventUri"] == f"{R}/EventService/SSE"

    seen: dict[str, list[dict[str, Any]]] = {"admin": [], "acme": [], "bolt": []}
    ready = {name: asyncio.Event() for name in seen}
    tasks = [
        asyncio.create_task(listen(client, seen[name], ready[name]))
        for name, client in (("admin", admin), ("acme", acme), ("bolt", bolt))
    ]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready.values())), 10)
    made = await acme(
        "POST", f"{R}/Systems", {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    )
    assert made.status == 201
    # Its GPU fails and recovers: impaired, then activated again, a change of a system the
    # client has (a probe's inventory saw that activation announced as a second creation).
    for health in ("failed", "healthy"):
        fault = {"component": "gpu-002", "state": health}
        assert (await h.client.admin(DOMAIN, "report-fault", fault))["ok"]
    assert (await acme("DELETE", f"{R}/Systems/{made.body['Id']}")).status == 204
    system = f"{R}/Systems/{made.body['Id']}"

    def records(name: str) -> list[tuple[str, str]]:
        """The stream's records about systems (the import's fabric event may still be on its
        way to the streams when they open: every account sees that one)."""
        return [
            (e["MessageId"].rsplit(".", 1)[-1], e["OriginOfCondition"]["@odata.id"])
            for event in seen[name]
            for e in event["Events"]
            if e["OriginOfCondition"]["@odata.id"].startswith(f"{R}/Systems/")
        ]

    expected = [
        ("ResourceCreated", system),
        ("ResourceChanged", system),  # impaired
        ("ResourceChanged", system),  # activated again
        ("ResourceRemoved", system),
    ]
    for _ in range(100):
        if records("admin") == expected and records("acme") == expected:
            break
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert records("admin") == expected
    assert records("acme") == expected
    assert records("bolt") == []
    # An event's id is the log's name for it, the same after a restart: <domain>.<position>.
    for event in seen["admin"]:
        (what,) = event["Events"]
        oem = what["Oem"]["Trellis"]
        assert event["sse id"] == event["Id"] == f"{oem['Domain']}.{oem['Position']}", event
        # What the schema requires of every record (the Redfish probe found both missing).
        assert (what["MemberId"], what["EventType"]) == ("0", "Other"), what


async def test_a_read_only_service_refuses_writes_and_still_reads(
    h: Harness, tmp_path: Path
) -> None:
    """Secure mode's service (bootstrap passes writes=False there) reads, and says why not."""
    store = AccountStore(tmp_path / "ro-accounts.json")
    store.ensure_admin(ADMIN_PASSWORD)
    service = RedfishService(
        h.client.nc, store, h.store.domains, prefix=h.client.prefix, writes=False
    )
    await service.start()
    try:
        admin = RedfishHttp(service.url, "admin", ADMIN_PASSWORD)
        body = {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]},
                "Oem": {"Trellis": {"Tenant": "acme"}}}  # fmt: skip
        refused = await admin("POST", f"{R}/Systems", body)
        assert refused.status == 501
        assert "secure mode" in refused.body["error"]["@Message.ExtendedInfo"][0]["Resolution"]
        assert await connections(h) == []
        assert (await admin.get(f"{BLOCKS}/{DOMAIN}.gpu-002")).status == 200
    finally:
        await service.close()


async def test_in_secure_mode_each_tenants_intents_go_under_its_own_identity(
    tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    """The service reads as the operator and sends acme's compose and release over acme's
    own NATS identity; a tenant never issued one is refused, and nothing is written for it."""
    prefix = unique_subject_prefix()
    secure = SecureDir(tmp_path)
    secure.ensure(prefix, ["acme"])
    server = EmbeddedNats(tmp_path, config=secure.config_path)
    await asyncio.to_thread(server.start)
    options = RedfishOptions(accounts=tmp_path / "accounts.json", admin_password=ADMIN_PASSWORD)
    try:
        async with engine_at(
            server.url, database_url, schema=pg_schema, prefix=prefix, secure=secure,
            redfish=options,
        ) as running:  # fmt: skip
            operator = await connect_nats(
                server.url, credentials=secure.credentials(Principal("operator", "operator"))
            )
            try:
                client = TrellisClient(operator, prefix=prefix)
                assert (await client.import_topology(DOMAIN, FABRIC))["ok"]
                admin = RedfishHttp(str(running.redfish_url), "admin", ADMIN_PASSWORD)
                acme = await tenant_account(admin, "alice", "acme")
                globex = await tenant_account(admin, "gary", "globex")
                pair = {"ResourceBlocks": [block("host-01"), block("gpu-002")]}
                made = await acme("POST", f"{R}/Systems", {"Links": pair})
                assert made.status == 201, made
                rows = (await client.query(DOMAIN, "connections", {}))["result"]["connections"]
                assert [(r["device"], r["tenant"]) for r in rows] == [("gpu-002", "acme")]
                refused = await globex(
                    "POST",
                    f"{R}/Systems",
                    {"Links": {"ResourceBlocks": [block("host-02"), block("gpu-001")]}},
                )
                assert refused.status == 403, refused
                assert (await acme("DELETE", made.headers["location"])).status == 204
                rows = (await client.query(DOMAIN, "connections", {}))["result"]["connections"]
                assert rows == []
            finally:
                await operator.close()
    finally:
        await asyncio.to_thread(server.stop)


COMPOSE = f"{R}/CompositionService/Actions/CompositionService.Compose"
RESERVATIONS = f"{R}/CompositionService/CompositionReservations"


def compose_action(request_type: str, *nodes: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"RequestFormat": "Manifest", "RequestType": request_type, **extra}
    if nodes:
        request = {"Links": {"ResourceBlocks": [block(n) for n in nodes]}}
        stanza = {"StanzaType": "ComposeSystem", "StanzaId": "one", "Request": request}
        body["Manifest"] = {"Stanzas": [stanza]}
    return body


def apply_reservation(rid: str) -> dict[str, Any]:
    return {"RequestFormat": "Manifest", "RequestType": "Apply", "ReservationId": rid}


async def reservations(h: Harness, **query: Any) -> list[dict[str, Any]]:
    reply = await h.client.query(DOMAIN, "reservations", query)
    assert reply["ok"], reply
    return list(reply["result"]["reservations"])


async def test_compose_action_previews_reserves_and_applies_a_reservation(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    service = await acme.get(f"{R}/CompositionService")
    assert service.body["ReservationDuration"] == "PT300S"
    assert service.body["Actions"]["#CompositionService.Compose"]["target"] == COMPOSE
    preview = await acme("POST", COMPOSE, compose_action("Preview", "host-01", "gpu-002"))
    assert preview.status == 200, preview
    stanza = preview.body["Manifest"]["Stanzas"][0]
    assert stanza["Response"]["Links"]["ResourceBlocks"] == [block("host-01"), block("gpu-002")]
    assert "ReservationId" not in preview.body
    assert await reservations(h) == [] and await connections(h) == []

    reserved = await acme("POST", COMPOSE, compose_action("PreviewReserve", "host-01", "gpu-002"))
    assert reserved.status == 200, reserved
    rid = reserved.body["ReservationId"]
    assert [r["reservation_id"] for r in await reservations(h, tenant="acme")] == [rid]
    assert await connections(h) == []
    held = await acme.get(f"{RESERVATIONS}/{rid}")
    assert held.status == 200, held
    assert held.body["Client"] == "acme"
    assert held.body["ReservedResourceBlocks"] == [block("host-01"), block("gpu-002")]
    assert held.body["Manifest"]["Stanzas"] == [{"StanzaType": "ComposeSystem", "StanzaId": rid}]
    listed = await acme.get(RESERVATIONS)
    assert [m["@odata.id"] for m in listed.body["Members"]] == [f"{RESERVATIONS}/{rid}"]
    gpu = await acme.get(f"{BLOCKS}/{DOMAIN}.gpu-002")
    # To its reserver a reserved block reads Reserved and stays Unused, out of the FreePool
    # (ARCHITECTURE §11); it read Unavailable, as to everyone else.
    assert gpu.body["CompositionStatus"]["Reserved"] is True
    assert gpu.body["CompositionStatus"]["CompositionState"] == "Unused"
    assert gpu.body["Pool"] == "Unassigned" and "Client" not in gpu.body
    free = await acme.get(f"{R}/CompositionService/FreePool")
    assert block("gpu-002") not in free.body["Members"] and block("gpu-003") in free.body["Members"]
    # Reserved is taken: a plain POST /Systems of the device is refused, naming it.
    taken = await acme(
        "POST", f"{R}/Systems", {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    )
    assert taken.status == 409, taken

    # ARCHITECTURE §11's own form: an Apply of a reservation needs no RequestFormat.
    applied = await acme("POST", COMPOSE, {"RequestType": "Apply", "ReservationId": rid})
    assert applied.status == 200, applied
    system = applied.body["Manifest"]["Stanzas"][0]["Response"]
    cid = system["Id"]
    rows = await connections(h)
    assert [(r["device"], r["host"], r["composition_id"], r["tenant"]) for r in rows] == [
        ("gpu-002", "host-01", cid, "acme")
    ]
    assert await reservations(h) == []
    assert (await acme.get(f"{RESERVATIONS}/{rid}")).status == 404
    assert (await acme.get(f"{R}/Systems/{cid}")).status == 200
    gpu = await acme.get(f"{BLOCKS}/{DOMAIN}.gpu-002")
    assert gpu.body["CompositionStatus"]["Reserved"] is False

    direct = await acme("POST", COMPOSE, compose_action("Apply", "host-02", "gpu-003"))
    assert direct.status == 200, direct
    assert {r["device"] for r in await connections(h)} == {"gpu-002", "gpu-003"}


async def test_an_administrator_sets_the_reservation_duration_and_it_outlives_the_service(
    h: Harness, admin: RedfishHttp, tmp_path: Path
) -> None:
    """ARCHITECTURE §11: ReservationDuration is a property an Administrator may PATCH; it was
    fixed at PT300S and the PATCH was 405."""
    service = f"{R}/CompositionService"
    acme = await tenant_account(admin, "alice", "acme")
    before = await admin.get(service)
    assert before.body["ReservationDuration"] == "PT300S"
    assert "PATCH" in before.headers["allow"]
    assert (await acme("PATCH", service, {"ReservationDuration": "PT600S"})).status == 403
    stale = await admin("PATCH", service, {"ReservationDuration": "PT600S"},
                        headers={"If-Match": 'W/"stale"'})  # fmt: skip
    assert stale.status == 412, stale
    for value, status, name in [
        ("ten minutes", 400, "PropertyValueFormatError"),
        ("P1M", 400, "PropertyValueFormatError"),  # months vary in length
        (True, 400, "PropertyValueTypeError"),
        (0, 400, "PropertyValueOutOfRange"),
        ("PT0S", 400, "PropertyValueOutOfRange"),
    ]:
        refused = await admin("PATCH", service, {"ReservationDuration": value})
        assert refused.status == status, refused
        assert refused.body["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(name)
    refused = await admin("PATCH", service, {"ServiceEnabled": False})
    assert refused.status == 400 and "PropertyNotWritable" in str(refused.body), refused
    assert (await admin.get(service)).body == before.body  # none of those changed anything

    # §11 speaks of seconds: a whole number of them is taken beside Redfish's ISO 8601.
    seconds = await admin("PATCH", service, {"ReservationDuration": 450})
    assert seconds.status == 200 and seconds.body["ReservationDuration"] == "PT450S", seconds
    patched = await admin("PATCH", service, {"ReservationDuration": "PT10M"},
                          headers={"If-Match": seconds.headers["etag"]})  # fmt: skip
    assert patched.status == 200 and patched.body["ReservationDuration"] == "PT600S", patched
    made = await acme("POST", COMPOSE, compose_action("PreviewReserve", "host-01", "gpu-002"))
    assert made.status == 200, made
    (held,) = await reservations(h, tenant="acme")
    made_at, expires_at = (datetime.fromisoformat(held[k]) for k in ("made_at", "expires_at"))
    assert expires_at - made_at == timedelta(seconds=600)
    # A service started again on the same accounts file holds it too.
    kept = ReservationDuration(tmp_path / RESERVATION_DURATION_FILE)
    assert kept.seconds == 600


async def test_compose_action_refuses_bad_requests_with_registry_messages(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    for body, status, name in [
        # An action's parameter, missing, is ActionParameterMissing (was PropertyMissing).
        ({"RequestType": "Preview"}, 400, "ActionParameterMissing"),
        (compose_action("Sideways", "host-01", "gpu-002"), 400, "PropertyValueNotInList"),
        (compose_action("Preview"), 400, "ActionParameterMissing"),
        (compose_action("Apply", ReservationId="rsv-0000000000000000"), 404, "ResourceNotFound"),
        # The registry's EmptyManifest (a probe got PropertyValueFormatError and PropertyMissing).
        (compose_action("Preview") | {"Manifest": {"Stanzas": []}}, 400, "EmptyManifest"),
        (compose_action("Preview") | {"Manifest": {}}, 400, "EmptyManifest"),
        (
            compose_action("Preview")
            | {"Manifest": {"Stanzas": [{"StanzaType": "ComposeSystem"}]}},
            400,
            "EmptyManifest",
        ),
    ]:
        answer = await acme("POST", COMPOSE, body)
        assert answer.status == status, answer
        info = answer.body["error"]["@Message.ExtendedInfo"]
        assert info[0]["MessageId"].endswith(name), info
    assert (await acme.get(COMPOSE)).status == 405
    assert await reservations(h) == [] and await connections(h) == []


async def test_a_tenant_sees_and_applies_only_its_own_reservations(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    zeta = await tenant_account(admin, "zed", "zeta")
    made = await acme("POST", COMPOSE, compose_action("PreviewReserve", "host-01", "gpu-002"))
    assert made.status == 200, made
    rid = made.body["ReservationId"]
    assert (await zeta.get(RESERVATIONS)).body["Members"] == []
    assert (await zeta.get(f"{RESERVATIONS}/{rid}")).status == 404
    stolen = await zeta("POST", COMPOSE, apply_reservation(rid))
    assert stolen.status == 404, stolen
    assert (await zeta("DELETE", f"{RESERVATIONS}/{rid}")).status == 404
    # Composing the reserved block: acme is told the reservation to apply (a probe got only
    # ResourceBlockInUse); zeta only that the block is in use, no reservation named to it.
    blocks = {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    own = await acme("POST", f"{R}/Systems", blocks)
    assert (own.status, own.messages()) == (409, ["SpecifiedResourceAlreadyReserved"]), own
    extended = own.body["error"]["@Message.ExtendedInfo"][0]
    assert extended["MessageArgs"] == [f"{DOMAIN}.gpu-002", rid], extended
    assert extended["Resolution"].startswith(f"Apply reservation {rid} "), extended
    other = await zeta("POST", f"{R}/Systems", blocks)
    assert (other.status, other.messages()) == (409, ["ResourceBlockInUse"]), other
    assert rid not in json.dumps(other.body)
    # The block is taken for everyone but acme, and only acme (and the Administrator) is told
    # it is reserved: to zeta it is Unavailable, like another tenant's.
    gpu = await zeta.get(f"{BLOCKS}/{DOMAIN}.gpu-002")
    assert gpu.body["CompositionStatus"]["Reserved"] is False
    assert gpu.body["CompositionStatus"]["CompositionState"] == "Unavailable"
    seen = await admin.get(f"{BLOCKS}/{DOMAIN}.gpu-002")
    assert seen.body["CompositionStatus"]["Reserved"] is True
    assert seen.body["CompositionStatus"]["CompositionState"] == "Unused"
    assert (await admin.get(RESERVATIONS)).body["Members"] == [
        {"@odata.id": f"{RESERVATIONS}/{rid}"}
    ]
    assert await connections(h) == []
    cancelled = await acme("DELETE", f"{RESERVATIONS}/{rid}")
    assert cancelled.status == 204, cancelled
    assert await reservations(h) == []


async def test_an_expired_reservation_is_refused_naming_it_and_nothing_is_created(
    clocked: tuple[Harness, ManualClock],
) -> None:
    h, clock = clocked
    acme = await tenant_account(RedfishHttp(h.redfish_url, "admin", ADMIN_PASSWORD),
                                "alice", "acme")  # fmt: skip
    made = await acme("POST", COMPOSE, compose_action("PreviewReserve", "host-01", "gpu-002"))
    assert made.status == 200, made
    rid = made.body["ReservationId"]
    clock.advance(301)
    await h.engine.expire_due_leases()
    refused = await acme("POST", COMPOSE, apply_reservation(rid))
    assert refused.status == 409, refused
    info = refused.body["error"]["@Message.ExtendedInfo"]
    assert rid in json.dumps(info) and "expired" in json.dumps(info), info
    assert await connections(h) == []
    assert (await acme.get(RESERVATIONS)).body["Members"] == []
    gpu = await acme.get(f"{BLOCKS}/{DOMAIN}.gpu-002")
    assert gpu.body["CompositionStatus"]["Reserved"] is False


async def test_the_event_stream_tells_a_reservations_tenant_and_administrators_of_it(
    clocked: tuple[Harness, ManualClock],
) -> None:
    """ARCHITECTURE §11: a reservation is a resource (CompositionReservations/<id>); made, it is
    ResourceCreated, and applied, cancelled or expired, ResourceRemoved, to its tenant's
    accounts and Administrators only. The stream said nothing of reservations before."""
    h, clock = clocked
    admin = RedfishHttp(h.redfish_url, "admin", ADMIN_PASSWORD)
    acme = await tenant_account(admin, "alice", "acme")
    bolt = await tenant_account(admin, "bob", "bolt")
    seen: dict[str, list[dict[str, Any]]] = {"admin": [], "acme": [], "bolt": []}
    ready = {name: asyncio.Event() for name in seen}
    tasks = [
        asyncio.create_task(listen(client, seen[name], ready[name]))
        for name, client in (("admin", admin), ("acme", acme), ("bolt", bolt))
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready.values())), 10)

        async def reserve() -> str:
            made = await acme(
                "POST", COMPOSE, compose_action("PreviewReserve", "host-01", "gpu-002")
            )
            assert made.status == 200, made
            return str(made.body["ReservationId"])

        cancelled = await reserve()
        assert (await acme("DELETE", f"{RESERVATIONS}/{cancelled}")).status == 204
        applied = await reserve()
        answer = await acme("POST", COMPOSE, apply_reservation(applied))
        assert answer.status == 200, answer
        cid = answer.body["Manifest"]["Stanzas"][0]["Response"]["Id"]
        assert (await acme("DELETE", f"{R}/Systems/{cid}")).status == 204
        expired = await reserve()
        clock.advance(301)
        await h.engine.expire_due_leases()

        def records(name: str) -> list[tuple[str, str]]:
            return [
                (e["MessageId"].rsplit(".", 1)[-1], e["OriginOfCondition"]["@odata.id"])
                for event in seen[name]
                for e in event["Events"]
                if e["OriginOfCondition"]["@odata.id"].startswith(RESERVATIONS)
            ]

        expected = [
            (message, f"{RESERVATIONS}/{rid}")
            for rid in (cancelled, applied, expired)
            for message in ("ResourceCreated", "ResourceRemoved")
        ]
        for _ in range(100):
            if records("admin") == expected and records("acme") == expected:
                break
            await asyncio.sleep(0.1)
        assert records("admin") == expected
        assert records("acme") == expected
        assert records("bolt") == []
        kinds = [
            e["Oem"]["Trellis"]["EventType"]
            for event in seen["acme"]
            for e in event["Events"]
            if e["OriginOfCondition"]["@odata.id"].startswith(RESERVATIONS)
        ]
        assert kinds == [
            "ReservationMade", "ReservationCancelled", "ReservationMade",
            "ReservationApplied", "ReservationMade", "ReservationExpired",
        ]  # fmt: skip
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_an_administrator_sets_the_session_timeout_and_it_outlives_the_service(
    h: Harness, admin: RedfishHttp, tmp_path: Path
) -> None:
    """SessionService.SessionTimeout is ReadWrite in the CSDL (30 to 86,400 s); it was fixed at
    1,800 s and the PATCH was 405."""
    service = f"{R}/SessionService"
    acme = await tenant_account(admin, "alice", "acme")
    reader = await tenant_account(admin, "rita", "acme", role="ReadOnly")
    before = await admin.get(service)
    assert before.body["SessionTimeout"] == 1800
    assert "PATCH" in before.headers["allow"]
    for account in (acme, reader):
        assert (await account("PATCH", service, {"SessionTimeout": 600})).status == 403
    stale = await admin("PATCH", service, {"SessionTimeout": 600},
                        headers={"If-Match": 'W/"stale"'})  # fmt: skip
    assert stale.status == 412, stale
    for value, name in [
        (29, "PropertyValueOutOfRange"),
        (86401, "PropertyValueOutOfRange"),
        ("600", "PropertyValueTypeError"),
        (True, "PropertyValueTypeError"),
        (600.5, "PropertyValueTypeError"),
    ]:
        refused = await admin("PATCH", service, {"SessionTimeout": value})
        assert refused.status == 400, refused
        info = refused.body["error"]["@Message.ExtendedInfo"]
        assert info[0]["MessageId"].endswith(name) and "SessionTimeout" in str(info), info
    refused = await admin("PATCH", service, {"ServiceEnabled": False})
    assert refused.status == 400 and "PropertyNotWritable" in str(refused.body), refused
    assert (await admin.get(service)).body == before.body  # none of those changed anything

    patched = await admin("PATCH", service, {"SessionTimeout": 30},
                          headers={"If-Match": before.headers["etag"]})  # fmt: skip
    assert patched.status == 200 and patched.body["SessionTimeout"] == 30, patched
    assert (await acme.get(service)).body["SessionTimeout"] == 30
    assert patched.headers["etag"] != before.headers["etag"]
    # A service started again keeps it (tests/adapters/test_redfish_accounts.py: sessions
    # time out after it).
    kept = SessionTimeout(AccountStore(tmp_path / "redfish-accounts.json"),
                          tmp_path / SESSION_TIMEOUT_FILE)  # fmt: skip
    assert kept.seconds == 30


async def test_an_account_create_names_what_is_missing_or_not_in_the_list(
    admin: RedfishHttp,
) -> None:
    """A POST to Accounts without a tenant (Operator, ReadOnly), UserName or Password is
    PropertyMissing naming it, and a RoleId not among the roles PropertyValueNotInList listing
    them; they were a generic PropertyValueFormatError. Nothing is made."""
    accounts = f"{R}/AccountService/Accounts"
    before = (await admin.get(accounts)).body["Members"]
    full = {"UserName": "nobody", "Password": "long-enough", "RoleId": "Operator",
            "Oem": {"Trellis": {"Tenant": "acme"}}}  # fmt: skip
    tenant = "Oem/Trellis/Tenant"
    for body, wanted in [
        ({k: v for k, v in full.items() if k != "Oem"}, [("PropertyMissing", tenant)]),
        ({**full, "RoleId": "ReadOnly", "Oem": {"Trellis": {}}},
         [("PropertyMissing", tenant)]),
        ({k: v for k, v in full.items() if k != "UserName"}, [("PropertyMissing", "UserName")]),
        ({k: v for k, v in full.items() if k != "Password"}, [("PropertyMissing", "Password")]),
        ({"RoleId": "Operator"}, [("PropertyMissing", "UserName"), ("PropertyMissing", "Password"),
                                  ("PropertyMissing", tenant)]),
        ({k: v for k, v in full.items() if k != "RoleId"}, [("PropertyMissing", "RoleId")]),
        ({**full, "RoleId": "Root"}, [("PropertyValueNotInList", "RoleId")]),
    ]:  # fmt: skip
        refused = await admin("POST", accounts, body)
        assert refused.status == 400, (body, refused)
        info = refused.body["error"]["@Message.ExtendedInfo"]
        got = [(i["MessageId"], i["MessageArgs"][-1]) for i in info]
        assert got == [(f"Base.1.19.{name}", where) for name, where in wanted], (body, info)
    listed = await admin("POST", accounts, {**full, "RoleId": "Root"})
    (info,) = listed.body["error"]["@Message.ExtendedInfo"]
    assert "Administrator, Operator, ReadOnly" in info["Resolution"], info
    assert (await admin.get(accounts)).body["Members"] == before


async def test_a_flood_of_wrong_passwords_is_throttled_and_proven_credentials_never_wait(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    """Every wrong password cost a hash in a small pool every login shares: a flood from one
    address held other tenants' logins for seconds (hostile-tenant probe). Past a budget of
    failures (per user name at an address, and per address) a login is answered 429 without a
    hash; credentials already proven are answered from memory; all show on /metrics."""
    options = RedfishOptions(
        accounts=tmp_path / "redfish-accounts.json", admin_password=ADMIN_PASSWORD
    )
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        redfish=options,
        metrics_at=("127.0.0.1", 0),
    ) as h:
        assert h.redfish_url is not None and h.metrics_url is not None
        admin = RedfishHttp(h.redfish_url, "admin", ADMIN_PASSWORD)
        alice = await tenant_account(admin, "alice", "acme")
        assert (await alice.get(f"{R}/Systems")).status == 200  # proven by a hash
        bob = await tenant_account(admin, "bob", "bolt")  # never proven yet
        guesser = RedfishHttp(h.redfish_url)
        assert (await guesser.get(f"{R}/Systems")).status == 401  # no credentials at all
        sessions = f"{R}/SessionService/Sessions"
        # The burst, then one more a second: on a loaded machine, where ten hashes take more
        # than a second, a guess or two more than the burst may pass before the refusals.
        checked = 0
        while (
            throttled := await guesser.as_user("alice", "not-it").get(f"{R}/Systems")
        ).status == 401:
            checked += 1
            assert checked <= 2 * login_guard.USER_BURST, "never throttled"
        assert checked >= login_guard.USER_BURST
        assert throttled.status == 429 and int(throttled.headers["retry-after"]) == 1
        assert throttled.messages() == ["ServiceTemporarilyUnavailable"], throttled
        login = {"UserName": "alice", "Password": "not-the-password"}
        assert (await guesser("POST", sessions, login)).status == 429
        # The same address: what was proven is served with no hash; another user's right
        # password is checked (every local client is 127.0.0.1: one guesser must not lock
        # them all out; the re-check probe).
        assert (await alice.get(f"{R}/Systems")).status == 200
        assert (await bob.get(f"{R}/Systems")).status == 200
        # Made-up user names, each new: limited by the address's own budget (which refills
        # ten a second meanwhile, each check taking a hash's time).
        made_up = 0
        while made_up < 3 * login_guard.ADDRESS_BURST:
            wrong = guesser.as_user(f"nobody{made_up}", "not-the-password")
            answer = await wrong.get(f"{R}/Systems")
            if answer.status == 429:
                break
            assert answer.status == 401, answer
            made_up += 1
        assert answer.status == 429, answer
        assert made_up >= login_guard.ADDRESS_BURST - login_guard.USER_BURST
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"{h.metrics_url}/metrics").read().decode()
        )
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        refused = "trellis_redfish_logins_refused_total"
        assert samples[(refused, (("reason", "credentials"),))] == login_guard.USER_BURST + made_up
        assert samples[(refused, (("reason", "throttled"),))] == 3
        assert samples[(refused, (("reason", "missing"),))] == 1
        answers = "trellis_redfish_requests_total"
        assert samples[(answers, (("method", "GET"), ("status", "429")))] == 2
        assert samples[(answers, (("method", "POST"), ("status", "429")))] == 1
        assert samples[(answers, (("method", "GET"), ("status", "200")))] >= 3
