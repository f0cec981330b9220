"""Every HTTP endpoint answers only to its own address (ARCHITECTURE §10; issue 21, finding 3).

A hostile web page can make its own name resolve to 127.0.0.1 (DNS rebinding) and have the
operator's browser read the fabric page and its API. Its requests still carry its own name as
the Host, so the page, its API, its event stream and /metrics refuse them (421); a browser
request from a page of another origin is refused too (403). In secure mode the page, which
reads as the operator, serves only a browser that was given the token `trellis up` printed.
"""

from __future__ import annotations

import asyncio
import http.client
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from fabrics import expect_ok, fabric
from harness import Harness, serving
from redfish_http import raw_exchange
from test_secure_mode import secured

from trellis.adapters.http.fabric_page import token_cookie

DOMAIN = "hall-1"
LOOPBACK = ("127.0.0.1", 0)
PATHS = ["/", "/page.js", f"/api/topology?domain={DOMAIN}", "/events"]


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url,
        database_url,
        pg_schema,
        subject_prefix,
        page_at=LOOPBACK,
        metrics_at=LOOPBACK,
        allowed_hosts=["trellis.example", "Proxy.Example:8443"],
    ) as harness:
        expect_ok(await harness.client.admin(DOMAIN, "import-topology", fabric()))
        yield harness


def get(url: str, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    """GET `path` from the server at `url` with exactly these extra headers (Host included
    when given); the status, headers and the first bytes of the body."""
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read(2048)
    finally:
        conn.close()


def authority(url: str) -> str:
    return url.removeprefix("http://")


async def ask(url: str, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return await asyncio.to_thread(get, url, path, **headers)


@pytest.mark.parametrize("server", ["page", "metrics"])
async def test_a_host_that_is_not_the_servers_is_misdirected(h: Harness, server: str) -> None:
    url = h.page_url if server == "page" else h.metrics_url
    assert url is not None
    port = url.rsplit(":", 1)[1]
    paths = PATHS if server == "page" else ["/metrics", "/healthz"]
    for path in paths:
        for host in (f"attacker.example:{port}", "attacker.example", f"localhost:{port}", ""):
            status, _, body = await ask(url, path, Host=host)
            assert status == 421, (path, host, body)
        # Its own address, and a name given to it (with or without the port), are served.
        for host in (authority(url), "trellis.example", f"trellis.example:{port}"):
            if path == "/events":
                continue  # a stream: served, checked below
            status, _, _ = await ask(url, path, Host=host)
            assert status == 200, (path, host)


async def status_of(url: str, request_line: str, *headers: str) -> int:
    """The status a raw request (a request line and header lines) gets from the server."""
    lines = "".join(f"{header}\r\n" for header in headers)
    answer = await raw_exchange(url, f"{request_line}\r\n{lines}\r\n".encode())
    return int(answer.split(b" ", 2)[1])


async def test_a_name_allowed_with_its_port_is_served_at_that_port_only(h: Harness) -> None:
    assert h.page_url is not None
    port = h.page_url.rsplit(":", 1)[1]
    assert await status_of(h.page_url, "GET / HTTP/1.1", "Host: proxy.example:8443") == 200
    for host in (f"proxy.example:8443:{port}", f"proxy.example:{port}", "proxy.example"):
        assert await status_of(h.page_url, "GET / HTTP/1.1", f"Host: {host}") == 421, host


async def test_two_hosts_a_bad_target_or_a_foreign_absolute_target_are_refused(
    h: Harness,
) -> None:
    assert h.page_url is not None
    own = f"Host: {authority(h.page_url)}"
    for request_line, headers, status in [
        ("GET / HTTP/1.1", ("Host: evil.example", own), 400),
        ("GET / HTTP/1.1", (own, "Host: evil.example"), 400),
        ("GET //[ HTTP/1.1", (own,), 400),
        ("GET * HTTP/1.1", (own,), 400),
        ("GET http://evil.example/ HTTP/1.1", (own,), 421),
        (f"GET http://{authority(h.page_url)}/page.js HTTP/1.1", ("Host: evil.example",), 200),
    ]:
        assert await status_of(h.page_url, request_line, *headers) == status, request_line


async def test_head_on_the_event_stream_is_headers_only(h: Harness) -> None:
    assert h.page_url is not None
    request = f"HEAD /events HTTP/1.1\r\nHost: {authority(h.page_url)}\r\n\r\n"
    answer = await raw_exchange(h.page_url, request.encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head, answer
    assert body == b""


async def test_a_page_of_another_origin_may_not_read_the_stream_or_the_api(h: Harness) -> None:
    assert h.page_url is not None
    own = authority(h.page_url)
    for path in PATHS:
        status, _, _ = await ask(h.page_url, path, Host=own, Origin="http://attacker.example")
        assert status == 403, path
    # An origin is its scheme too: the page is served over http, so its own pages' are http.
    for origin in (f"https://{own}", f"ftp://{own}", own, f"http://{own}.evil", "null"):
        status, _, _ = await ask(h.page_url, "/events", Host=own, Origin=origin)
        assert status == 403, origin
    # A name given with --allow-host may be a proxy in front that ends TLS: https too.
    port = own.rsplit(":", 1)[1]
    for origin in (f"http://trellis.example:{port}", "https://trellis.example"):
        status, _, _ = await ask(h.page_url, "/page.js", Host=own, Origin=origin)
        assert status == 200, origin
    for origin in ("https://proxy.example:8443", "http://proxy.example:8443"):
        status, _, _ = await ask(h.page_url, "/page.js", Host=own, Origin=origin)
        assert status == 200, origin
    for origin in ("https://proxy.example", f"ftp://trellis.example:{port}"):
        status, _, _ = await ask(h.page_url, "/page.js", Host=own, Origin=origin)
        assert status == 403, origin
    status, _, body = await ask(
        h.page_url, "/api/topology?domain=hall-1", Host=own, Origin=f"http://{own}"
    )
    assert status == 200 and b'"ok":true' in body


async def test_in_secure_mode_the_page_serves_only_the_browser_given_its_token(
    tmp_path: Path, database_url: str, pg_schema: str
) -> None:
    async with secured(tmp_path, database_url, pg_schema, page=True) as rig:
        url, token = rig.running.page_url, rig.running.page_token
        assert url is not None and token
        own, name = authority(url), token_cookie(url)
        # Cookies are shared across a host's ports: each page's cookie is named for its port,
        # so a token kept for another engine's page on this machine does not open this one.
        assert name == f"trellis_page_{url.rsplit(':', 1)[1]}"
        for path in PATHS:
            assert (await ask(url, path, Host=own))[0] == 401, path
            cookie = f"{name}=not-{token}"
            assert (await ask(url, path, Host=own, Cookie=cookie))[0] == 401, path
            cookie = f"trellis_page={token}"
            assert (await ask(url, path, Host=own, Cookie=cookie))[0] == 401, path
        # The printed address carries the token: it becomes a cookie scripts cannot read.
        status, headers, _ = await ask(url, f"/?token={token}", Host=own)
        assert status == 302 and headers["Location"] == "/"
        # Only the token leaves the address: a bookmarked domain stays.
        status, headers, _ = await ask(url, f"/?domain=hall-2&token={token}&x=", Host=own)
        assert status == 302 and headers["Location"] == "/?domain=hall-2&x=", headers
        assert headers["Set-Cookie"] == (f"{name}={token}; HttpOnly; SameSite=Strict; Path=/")
        for path in PATHS[:3]:
            cookie = f"other=1; {name}={token}"
            assert (await ask(url, path, Host=own, Cookie=cookie))[0] == 200, path
