"""A small HTTP client for the Redfish service's tests (urllib in a thread, so the engine and
the service keep serving on the test's event loop)."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import urllib.error
import urllib.request
from typing import Any, NamedTuple


class Answer(NamedTuple):
    status: int
    headers: dict[str, str]  # names lower-cased
    body: Any  # decoded JSON, or None

    def messages(self) -> list[str]:
        """The MessageIds of an error body's @Message.ExtendedInfo."""
        info = (self.body or {}).get("error", {}).get("@Message.ExtendedInfo", [])
        return [m["MessageId"].rsplit(".", 1)[-1] for m in info]


class RedfishHttp:
    def __init__(
        self,
        base: str,
        user: str | None = None,
        password: str | None = None,
        *,
        verify: bool = True,
    ):
        self.base = base.rstrip("/")
        self.user = user
        self.password = password
        self.verify = verify  # False: accept a self-signed certificate (tests only)

    def as_user(self, user: str, password: str) -> RedfishHttp:
        return RedfishHttp(self.base, user, password, verify=self.verify)

    async def __call__(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        auth: bool = True,
    ) -> Answer:
        return await asyncio.to_thread(self._call, method, path, body, headers or {}, auth)

    async def get(self, path: str, **kwargs: Any) -> Answer:
        return await self("GET", path, **kwargs)

    def _call(
        self, method: str, path: str, body: Any, headers: dict[str, str], auth: bool
    ) -> Answer:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if auth and self.user is not None:
            token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        for name, value in headers.items():
            request.add_header(name, value)
        try:
            context = None if self.verify else ssl._create_unverified_context()
            with urllib.request.urlopen(request, timeout=30, context=context) as response:
                status, raw, got = response.status, response.read(), response.headers
        except urllib.error.HTTPError as exc:
            status, raw, got = exc.code, exc.read(), exc.headers
        text = raw.decode()
        decoded = json.loads(text) if text and text.lstrip().startswith(("{", "[")) else None
        return Answer(status, {k.lower(): v for k, v in got.items()}, decoded)


async def raw_exchange(base: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send `data` as is to the server at `base` and read its answer until it closes; what a
    client sending a request no library would write (or a HEAD on a stream) gets back."""
    host, port = base.split("://", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
