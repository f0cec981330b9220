"""The Redfish client (adapters/fabric/redfish/client.py): ETags and If-Match against DMTF's
Mockup Server under the wrapper that adds them (tests/etag_mockup_server.py), errors against
the real server stopped or paused, and the HTTP details (chunked bodies, kept-alive
connections, error bodies) against a small server of the test's own."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
import pytest_asyncio
from mockup_server import MOCKUPS, MockupServer

from trellis.adapters.embedded.process import free_port
from trellis.adapters.fabric.redfish.client import (
    HttpError,
    RedfishClient,
    Resource,
    Unreachable,
    service_base,
)
from trellis.adapters.fabric.redfish.discovery import DiscoveryError, discover

ZONE = "/redfish/v1/Fabrics/CXL/Zones/1"


@pytest.fixture(scope="module")
def strict() -> Iterator[MockupServer]:
    with MockupServer(MOCKUPS / "public-cxl", etag=True, strict=True) as server:
        yield server


@pytest_asyncio.fixture
async def client(strict: MockupServer) -> AsyncIterator[RedfishClient]:
    client = RedfishClient(strict.url + "/redfish/v1/")
    yield client
    await client.close()


def test_the_service_url_may_be_given_with_or_without_the_service_root() -> None:
    assert service_base("http://fm:8000") == ("http://fm:8000", "")
    assert service_base("https://fm/redfish/v1/") == ("https://fm", "")
    assert service_base("https://gw/fm/redfish/v1") == ("https://gw", "/fm")
    for bad in ("fm:8000", "ftp://fm", "http://admin:pw@fm"):
        with pytest.raises(ValueError):
            service_base(bad)


async def test_a_read_carries_the_etag_and_a_stale_one_is_refused_with_412(
    client: RedfishClient,
) -> None:
    read = await client.get(ZONE)
    assert read.etag is not None and read.body["ZoneType"] == "ZoneOfEndpoints"
    await client.patch(read, {"Description": "first"})
    with pytest.raises(HttpError) as refused:
        await client.patch(read, {"Description": "second, from a stale read"})
    assert refused.value.status == 412
    assert (await client.get(ZONE)).body["Description"] == "first"


async def test_a_change_without_if_match_is_428_and_update_reads_first(
    client: RedfishClient,
) -> None:
    with pytest.raises(HttpError) as refused:
        await client.patch(Resource(uri=ZONE, body={}, etag=None), {"Description": "blind"})
    assert refused.value.status == 428
    sent = await client.update(ZONE, lambda body: {"Description": "read first"})
    assert sent == {"Description": "read first"}
    assert await client.update(ZONE, lambda body: None) is None  # nothing to change
    assert (await client.get(ZONE)).body["Description"] == "read first"


async def test_update_after_a_concurrent_change_reads_again_and_keeps_both(
    client: RedfishClient, strict: MockupServer
) -> None:
    calls = 0

    def add_mine(body: dict[str, object]) -> dict[str, object]:
        nonlocal calls
        calls += 1
        if calls == 1:  # someone else changes the zone between our read and our PATCH
            strict.patch(ZONE, {"Name": "renamed by someone else"})
        return {"Description": f"mine, from read {calls}"}

    await client.update(ZONE, add_mine)
    after = (await client.get(ZONE)).body
    assert calls == 2, "the 412 made it read again"
    assert after["Name"] == "renamed by someone else"
    assert after["Description"] == "mine, from read 2"


async def test_delete_reads_first_and_spares_what_changed_hands(
    client: RedfishClient, strict: MockupServer
) -> None:
    made = await client.post(
        "/redfish/v1/Fabrics/CXL/Zones", {"Name": "tmp", "Oem": {"Trellis": {"CompositionId": "x"}}}
    )
    taken = await client.delete(made, still=lambda b: b["Oem"]["Trellis"]["CompositionId"] == "y")
    assert taken is False and (await client.get_or_none(made)) is not None
    assert await client.delete(made) is True
    assert await client.get_or_none(made) is None
    assert await client.delete(made) is False  # gone already: nothing to do


async def test_a_post_answered_201_or_204_names_the_new_member(tmp_path: object) -> None:
    for created in (False, True):
        with MockupServer(MOCKUPS / "public-cxl", etag=True, created=created) as server:
            client = RedfishClient(server.url)
            try:
                made = await client.post("/redfish/v1/Fabrics/CXL/Zones", {"Name": "z"})
                assert made == "/redfish/v1/Fabrics/CXL/Zones/4"
                assert (await client.get(made)).body["Name"] == "z"
            finally:
                await client.close()


async def test_a_service_that_is_down_or_silent_is_unreachable_within_the_timeout() -> None:
    refused = RedfishClient(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    with pytest.raises(Unreachable, match=r"Connect call failed|refused"):
        await refused.get("/redfish/v1/")
    with MockupServer(MOCKUPS / "public-cxl") as server:
        client = RedfishClient(server.url, timeout=0.5)
        server.pause()
        started = time.monotonic()
        try:
            with pytest.raises(Unreachable, match=r"no answer within 0\.5 s"):
                await client.get("/redfish/v1/")
        finally:
            server.resume()
            await client.close()
        assert time.monotonic() - started < 2.0


class _LocalService:
    """An HTTP service of the test's own on a free loopback port (its URL once entered);
    `_serve` answers each connection."""

    server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class _TinyService(_LocalService):
    """An HTTP/1.1 service of the test's own: chunked answers, kept-alive connections that it
    closes after one idle answer, and a Redfish error body."""

    def __init__(self) -> None:
        self.connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                path = line.split()[1].decode()
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                if path == "/redfish/v1/broken":
                    body = msgspec.json.encode(
                        {"error": {"@Message.ExtendedInfo": [{"Message": "The fan is on fire."}]}}
                    )
                    writer.write(b"HTTP/1.1 503 Busy\r\nContent-Length: %d\r\n\r\n" % len(body))
                    writer.write(body)
                else:
                    body = msgspec.json.encode({"@odata.id": path, "Name": "x" * 3000})
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for at in range(0, len(body), 1000):
                        part = body[at : at + 1000]
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
                if path == "/redfish/v1/then-close":
                    return  # a kept-alive connection the service drops while the client idles
        finally:
            writer.close()


async def test_chunked_answers_kept_alive_connections_and_error_bodies() -> None:
    service = _TinyService()
    async with service as url:
        client = RedfishClient(url)
        try:
            for _ in range(3):
                assert (await client.get("/redfish/v1/a")).body["Name"] == "x" * 3000
            assert service.connections == 1, "one kept-alive connection for every read"
            await client.get("/redfish/v1/then-close")
            await asyncio.sleep(0.05)
            assert (await client.get("/redfish/v1/b")).body["@odata.id"] == "/redfish/v1/b"
            assert service.connections == 2, "a dropped idle connection is replaced, once"
            with pytest.raises(HttpError, match=r"503: The fan is on fire\.") as failed:
                await client.get("/redfish/v1/broken")
            assert failed.value.status == 503
        finally:
            await client.close()


def test_the_mockup_server_moves_when_its_chosen_port_is_taken_before_it_starts() -> None:
    # The harness's own guard against the race that once failed CI for an embedded server.
    server = MockupServer(MOCKUPS / "public-cxl")
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # bound, as a client's source port is
        with server:
            assert server.port != taken
            assert server.get("/redfish/v1/")["@odata.id"] == "/redfish/v1/"


async def test_a_body_up_to_the_close_is_read_whole_when_it_comes_in_pieces() -> None:
    body = msgspec.json.encode({"@odata.id": "/redfish/v1/", "Name": "x" * 5000})

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body[:1000])
        await writer.drain()
        await asyncio.sleep(0.2)  # the rest comes later, then the close
        writer.write(body[1000:])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    client = RedfishClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        assert (await client.get("/redfish/v1/")).body["Name"] == "x" * 5000
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


class _ForgetfulSessions(_LocalService):
    """A service that issues sessions and then refuses every token (a BMC whose session
    store is broken): each refused request makes the client log in again."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.deleted: list[str] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                method, path = line.split()[0].decode(), line.split()[1].decode()
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                if method == "POST" and path.endswith("/Sessions"):
                    made = f"/redfish/v1/SessionService/Sessions/{len(self.made) + 1}"
                    self.made.append(made)
                    head = f"HTTP/1.1 201 Created\r\nX-Auth-Token: t{len(self.made)}\r\n"
                    writer.write(f"{head}Location: {made}\r\nContent-Length: 0\r\n\r\n".encode())
                elif method == "DELETE" and path in self.made:
                    self.deleted.append(path)
                    writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        finally:
            writer.close()


async def test_a_session_replaced_after_a_401_is_logged_out_not_left_behind() -> None:
    """The re-check probe: 5 refused reads made 6 sessions and deleted 1."""
    service = _ForgetfulSessions()
    async with service as url:
        client = RedfishClient(url, "trellis", "pw", auth="session")
        try:
            for _ in range(3):
                with pytest.raises(HttpError, match="answered 401"):
                    await client.get("/redfish/v1/Systems")
        finally:
            await client.close()
    assert len(service.made) == 4  # the first login, then one again per refused read
    assert sorted(service.deleted) == sorted(service.made)  # each replaced one, then the last


async def test_a_session_login_the_service_cannot_take_is_said_as_such() -> None:
    """A service without SessionService answered the login 404, which was read as the service
    root's own: "has no Redfish service root" (the southbound probe)."""
    with MockupServer(MOCKUPS / "public-cxl-multiswitch", etag=True) as server:
        client = RedfishClient(server.url, "trellis", "pw", auth="session")
        try:
            with pytest.raises(DiscoveryError) as raised:
                await discover(client)
        finally:
            await client.close()
    said = str(raised.value)
    assert "SessionService/Sessions answered" in said and "no Redfish service root" not in said
