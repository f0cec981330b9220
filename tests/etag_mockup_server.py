"""DMTF's Redfish Mockup Server with what a real fabric manager has and it lacks: a thin
wrapper for the Redfish driver's tests, run as `python etag_mockup_server.py [--strict]
[--created] -- <redfishMockupServer.py arguments>`.

It subclasses the server's request handler, unchanged otherwise (third_party/ stays as
copied), to add:
- an `ETag` on every GET of a single resource: a hash of what the server holds;
- `If-Match` on PATCH and DELETE: a tag that is not the current one is 412, and nothing
  changes; with `--strict`, a change without `If-Match` is 428;
- with `--created`, a POST that made a member answers 201 (the server says 204);
- injected answers: POST `/_trellis/faults` `{"status", "method", "contains", "times"}` makes
  the next `times` requests of that method whose path contains `contains` answer `status`,
  changing nothing (a fabric manager's 5xx, a 412 from someone else's change).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, ClassVar

SERVER = Path(__file__).resolve().parents[1] / "third_party/dmtf/redfish-mockup-server"
sys.path.insert(0, str(SERVER))

import redfishMockupServer as mockup  # noqa: E402  (the path is set just above)

STRICT = "--strict" in sys.argv
CREATED = "--created" in sys.argv


class Faults:
    pending: ClassVar[list[dict[str, Any]]] = []


class WithETags(mockup.RfMockupServer):  # type: ignore[misc]
    def _current(self) -> tuple[bool, Any]:
        return self.get_cached_link(self.construct_path(self.path, "index.json"))  # type: ignore[no-any-return]

    def _etag(self) -> str | None:
        found, payload = self._current()
        if not found or not isinstance(payload, dict):
            return None
        held = {k: v for k, v in payload.items() if k != "@Redfish.Copyright"}
        digest = hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:16]
        return f'"{digest}"'

    def _injected(self, method: str) -> bool:
        for fault in Faults.pending:
            if fault["method"] == method and fault["contains"] in self.path:
                fault["times"] -= 1
                if fault["times"] <= 0:
                    Faults.pending.remove(fault)
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                self.send_response(fault["status"])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True
        return False

    def _precondition_fails(self) -> bool:
        tag, wanted = self._etag(), self.headers.get("If-Match")
        status = None
        if wanted is None and STRICT and tag is not None:
            status = 428
        elif wanted is not None and tag is not None and wanted != tag:
            status = 412
        if status is None:
            return False
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def do_GET(self) -> None:
        if self._injected("GET"):
            return
        self._tag = self._etag() if "?" not in self.path else None
        super().do_GET()

    def end_headers(self) -> None:
        tag = getattr(self, "_tag", None)
        if tag is not None and self.command == "GET":
            self.send_header("ETag", tag)
        super().end_headers()

    def do_PATCH(self) -> None:
        if self._injected("PATCH") or self._precondition_fails():
            return
        super().do_PATCH()

    def do_DELETE(self) -> None:
        if self._injected("DELETE") or self._precondition_fails():
            return
        super().do_DELETE()

    def do_POST(self) -> None:
        if self.path == "/_trellis/faults":
            length = int(self.headers.get("content-length") or 0)
            Faults.pending.append(json.loads(self.rfile.read(length)))
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self._injected("POST"):
            return
        super().do_POST()

    def send_response(self, code: int, message: str | None = None) -> None:
        if CREATED and code == 204 and self.command == "POST" and "/Actions/" not in self.path:
            code = 201
        super().send_response(code, message)


if __name__ == "__main__":
    mockup.RfMockupServer = WithETags
    sys.argv = [sys.argv[0], *sys.argv[sys.argv.index("--") + 1 :]]
    mockup.main()
