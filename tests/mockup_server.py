"""DMTF's Redfish Mockup Server (third_party/dmtf/redfish-mockup-server/) as a test's fabric
manager: started on a free 127.0.0.1 port, readiness polled with a deadline, stopped,
paused (SIGSTOP: a fabric manager that no longer answers) and resumed.

What the server does (read from its code, redfishMockupServer.py 1.2.6): it serves a folder of
`index.json` files (`-S`: short form, no `/redfish/v1` folder level); POST to a collection
stores the body as a new member (its `Id` when given and free, else the next number) and
answers 204 with `Location`; PATCH merges the body into the resource (objects key by key,
anything else replaced; null is stored as null) and answers 204; DELETE forgets the resource
and takes it out of its collection; PUT is 405. Everything lives in the process's memory: a
restart serves the folder as it was. It is one thread (a slow request holds up every other),
HTTP/1.0 (a connection per request), checks no credentials, gives no ETags and ignores
`If-Match`; an action answers 204 and changes nothing, except `SubmitTestEvent`, which POSTs an
event to every subscription whose `EventTypes` hold its type. `-t SECONDS` delays every answer.
A GET with `$expand` or `$top` rewrites what the server holds, so nothing here sends either.

`etag=True` runs it under tests/etag_mockup_server.py, the thin wrapper that adds what it lacks
(ETags, `If-Match` with 412 and, `strict`, 428; 201 for a POST; injected error answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trellis.adapters.embedded.process import (
    PortTakenError,
    free_port,
    moving_if_taken,
    port_is_free,
)

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "third_party/dmtf/redfish-mockup-server/redfishMockupServer.py"
WRAPPER = Path(__file__).resolve().parent / "etag_mockup_server.py"
MOCKUPS = REPO / "third_party/dmtf/redfish-mockups/mockups"
READY_WITHIN_S = 20.0
RESTART_ATTEMPTS = 10


class ServerExited(RuntimeError):
    """The server process ended before it answered."""


class MockupServer:
    """One Mockup Server process serving `tree`.

    Args:
        tree: A short-form mockup folder.
        latency: Seconds the server waits before every answer (its `-t`).
        timed: Take the wait from the `time.json` files of the tree where there are some
            (its `-T`: `{"POST_Time": 0.5}` beside an `index.json` slows POSTs there).
        etag: Run it under the wrapper that adds ETags and `If-Match`.
        strict: (with `etag`) a change without `If-Match` is 428.
        created: (with `etag`) a POST answers 201, not 204.
    """

    def __init__(
        self,
        tree: Path,
        *,
        latency: float = 0.0,
        timed: bool = False,
        etag: bool = False,
        strict: bool = False,
        created: bool = False,
        log: Path | None = None,
    ) -> None:
        self.tree = tree
        self.latency = latency
        self.timed = timed
        self.etag = etag
        self.strict = strict
        self.created = created
        self.log = log
        self.port = free_port()
        self._has_run = False
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MockupServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        # A first start chooses another port when the one offered was taken meanwhile.
        if not self._has_run:
            moving_if_taken(
                self._start_once, self._choose_port, may_move=True, what="Mockup Server"
            )
            self._has_run = True
            return
        # A restart keeps its port (the engine knows it). While the server was down, a client's
        # connection may have held that port for a moment (a connect from the port's own
        # number to it meets itself, TCP's simultaneous open): so wait for the port.
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except (PortTakenError, ServerExited):
                if attempt == RESTART_ATTEMPTS:
                    raise
                time.sleep(0.5)

    def _choose_port(self, _: PortTakenError) -> None:
        self.port = free_port()

    def _start_once(self) -> None:
        args = ["-H", "127.0.0.1", "-p", str(self.port), "-S", "-D", str(self.tree)]
        if self.latency:
            args += ["-t", str(self.latency)]
        if self.timed:
            args.append("-T")
        if self.etag:
            wrapper = [str(WRAPPER)]
            wrapper += ["--strict"] if self.strict else []
            wrapper += ["--created"] if self.created else []
            command = [sys.executable, *wrapper, "--", *args]
        else:
            command = [sys.executable, str(SERVER), *args]
        out = self.log.open("ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            command, cwd=SERVER.parent, stdout=out, stderr=out, start_new_session=True
        )
        deadline = time.monotonic() + READY_WITHIN_S
        while True:
            try:
                self.get("/redfish/v1/")
                return
            except (OSError, urllib.error.URLError):
                exited = self.proc.poll() is not None
                if exited and not port_is_free(self.port):
                    self.stop()
                    raise PortTakenError(f"port 127.0.0.1:{self.port} is taken") from None
                if exited or time.monotonic() > deadline:
                    self.stop()
                    failure = ServerExited if exited else RuntimeError
                    raise failure(f"the Mockup Server on {self.tree} did not come up") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        # Once reaped, its pid (its group's id) may be another process's: signal it only while
        # it is unreaped (a zombie still holds the pid).
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)  # a paused one cannot end otherwise
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: it accepts connections (the kernel does) and answers nothing."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    # -- a person at the fabric manager --------------------------------------------------------

    def get(self, uri: str) -> Any:
        with urllib.request.urlopen(self.url + uri, timeout=5) as answer:
            return json.loads(answer.read())

    def members(self, uri: str) -> list[str]:
        return [m["@odata.id"] for m in self.get(uri).get("Members", [])]

    def patch(self, uri: str, body: dict[str, Any]) -> int:
        return self._send("PATCH", uri, body)

    def post(self, uri: str, body: dict[str, Any]) -> int:
        return self._send("POST", uri, body)

    def delete(self, uri: str) -> int:
        return self._send("DELETE", uri, None)

    def _send(self, method: str, uri: str, body: dict[str, Any] | None) -> int:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            self.url + uri, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        if self.etag and method in ("PATCH", "DELETE"):
            request.add_header("If-Match", self.etag_of(uri))
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)

    def etag_of(self, uri: str) -> str:
        with urllib.request.urlopen(self.url + uri, timeout=5) as answer:
            return str(answer.headers["ETag"])

    def fail_next(self, status: int, method: str, contains: str = "", times: int = 1) -> None:
        """(with `etag`) the next `times` requests of `method` whose path contains `contains`
        are answered `status`, changing nothing."""
        assert self.etag, "faults come from the wrapper"
        self.post(
            "/_trellis/faults",
            {"status": status, "method": method, "contains": contains, "times": times},
        )


class _InThreads:
    """A MockupServer's helpers as coroutines, each call in a thread (see `at`)."""

    def __init__(self, server: MockupServer) -> None:
        self._server = server

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._server, name)
        return lambda *args, **kwargs: asyncio.to_thread(call, *args, **kwargs)


def at(server: MockupServer) -> Any:
    """`await at(server).patch(uri, body)`: a person at the fabric manager, from an event loop.
    The server answers one connection at a time, so a blocking call on the loop, while an
    engine on the same loop has a connection open to it, would wait for itself."""
    return _InThreads(server)


def wipe(server: MockupServer) -> None:
    """Take away whatever Trellis left on the server (zones, connections, memory chunks tagged
    `Oem.Trellis`, circuits on OCS ports), so tests that share one server start clean."""
    for fabric in server.members("/redfish/v1/Fabrics"):
        body = server.get(fabric)
        for collection in ("Zones", "Connections"):
            for uri in server.members(body[collection]["@odata.id"]):
                if server.get(uri).get("Oem", {}).get("Trellis"):
                    server.delete(uri)
        for switch in server.members(body["Switches"]["@odata.id"]):
            for port in server.members(switch + "/Ports"):
                if (server.get(port).get("Oem") or {}).get("Trellis", {}).get("CircuitTo"):
                    server.patch(port, {"Oem": {"Trellis": {"CircuitTo": None}}})
    for chassis in server.members("/redfish/v1/Chassis"):
        try:
            pools = server.members(chassis + "/MemoryDomains")
        except urllib.error.HTTPError:
            continue
        for pool in pools:
            for chunk in server.members(pool + "/MemoryChunks"):
                if server.get(chunk).get("Oem", {}).get("Trellis"):
                    server.delete(chunk)
