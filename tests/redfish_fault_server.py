"""A small Redfish fabric manager in the test's own process, for the driver's fault tests: it
serves a dict of resources (tests/redfish_trees.py's tree) over HTTP/1.1 in threads of its
own, and answers the requests a test names with whatever the test wants (a 202 with a task
monitor, a redirect, a relative Location, a refusal), which DMTF's Mockup Server cannot.
`as_task` runs the requests a test names as tasks (DSP0266): answered 202 at once, carried out
only when their monitor (or Task resource) has been polled enough.

POST makes the next numbered member and answers 201 with `Location`; PATCH merges (objects key
by key) and answers 204; DELETE forgets the resource and takes it out of its collection; GET
gives an `ETag`, and a stale `If-Match` is 412. The test changes resources directly
(`put`, `delete`, `body`), not over HTTP, so it never waits on the server it runs beside.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Doc = dict[str, Any]


class Fault:
    """The answer to the next `times` requests of `method` whose path contains `contains`
    (`exact`: is it); with `apply`, the request is carried out first and then answered so."""

    def __init__(
        self,
        method: str,
        contains: str,
        status: int,
        *,
        body: Any = None,
        headers: dict[str, str] | None = None,
        times: int = 1,
        apply: bool = False,
        exact: bool = False,
    ) -> None:
        self.method, self.contains, self.status, self.exact = method, contains, status, exact
        self.body, self.headers, self.times, self.apply = body, headers or {}, times, apply


class Task:
    """A request run as a task: carried out at the `polls`-th poll of its `Location` (a task
    monitor, or with `style="task"` a Task resource), and then ending `ends`: "done",
    "failed", "gone" (its monitor answers 404) or "never"."""

    def __init__(
        self,
        method: str,
        contains: str,
        *,
        polls: int = 2,
        style: str = "monitor",
        ends: str = "done",
        retry_after: int | None = None,
    ) -> None:
        self.method, self.contains, self.polls, self.style = method, contains, polls, style
        self.ends, self.retry_after = ends, retry_after
        self.request: tuple[str, bytes, str | None] | None = None  # path, body, If-Match
        self.made: str | None = None  # what a create made ("" for other changes), once done
        self.outcome: Any = None  # the request's own answer, once done

    def location(self, n: int) -> str:
        kind = "Tasks" if self.style == "task" else "TaskMonitors"
        return f"/redfish/v1/TaskService/{kind}/{n}"


class FaultyRedfish:
    """The server; use as a context manager (`url` once entered)."""

    def __init__(self, resources: dict[str, Doc]) -> None:
        self.resources = {_norm(uri): copy.deepcopy(body) for uri, body in resources.items()}
        self.faults: list[Fault] = []
        self.task_specs: list[Task] = []
        self.tasks: dict[str, Task] = {}  # by Location
        self.cancelled: list[str] = []  # the task Locations a client DELETEd
        self.requests: list[tuple[str, str]] = []  # (method, path), as received
        self.lock = threading.RLock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultyRedfish:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fail(self, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.faults.append(Fault(*args, **kwargs))

    def as_task(self, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.task_specs.append(Task(*args, **kwargs))

    def body(self, uri: str) -> Doc:
        with self.lock:
            return copy.deepcopy(self.resources[_norm(uri)])

    def put(self, uri: str, body: Doc, *, member: bool = False) -> None:
        """Set a resource (`member`: and list it in its parent collection)."""
        with self.lock:
            self.resources[_norm(uri)] = body
            if member:
                self.resources[_norm(uri.rsplit("/", 1)[0])]["Members"].append({"@odata.id": uri})

    def delete(self, uri: str) -> None:
        with self.lock:
            self.resources.pop(_norm(uri), None)
            parent = self.resources.get(_norm(uri.rsplit("/", 1)[0]))
            if parent is not None and isinstance(parent.get("Members"), list):
                parent["Members"] = [m for m in parent["Members"] if m.get("@odata.id") != uri]

    def members(self, collection: str) -> list[str]:
        return [m["@odata.id"] for m in self.body(collection)["Members"]]

    def count(self, method: str = "", contains: str = "") -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m.startswith(method) and contains in p)

    # -- serving -----------------------------------------------------------------------------

    def _fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                matches = path == fault.contains if fault.exact else fault.contains in path
                if fault.method == method and matches:
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                    return fault
        return None

    def _task(self, method: str, path: str, raw: bytes, if_match: str | None) -> Any:
        """(status, body, headers) when the request starts or polls a task, else None."""
        with self.lock:
            task = self.tasks.get(path)
            if task is not None:
                if method == "DELETE":
                    self.cancelled.append(path)
                    task.ends = "cancelled"
                    return 204, None, {}
                return self._poll(task)
            for spec in self.task_specs:
                if spec.method == method and spec.contains in path:
                    self.task_specs.remove(spec)
                    spec.request = (path, raw, if_match)
                    location = spec.location(len(self.tasks) + 1)
                    self.tasks[location] = spec
                    headers = {"Location": location}
                    if spec.retry_after is not None:
                        headers["Retry-After"] = str(spec.retry_after)
                    return 202, None, headers
        return None

    def _poll(self, task: Task) -> Any:
        task.polls -= 1
        running = {"@odata.type": "#Task.v1_7_0.Task", "Id": "t", "Name": "t"}
        if task.ends in ("never", "cancelled") or task.polls > 0:
            if task.style == "task":
                return 200, {**running, "TaskState": "Running"}, {}
            return 202, None, {}
        if task.ends == "gone":
            return 404, _error("no such task"), {}
        if task.ends == "failed":
            if task.style == "task":
                messages = [{"MessageId": "Base.1.0.GeneralError", "Message": "switch busy"}]
                return 200, {**running, "TaskState": "Exception", "Messages": messages}, {}
            return 400, _error("switch busy"), {}
        if task.made is None and task.request is not None:
            path, raw, if_match = task.request
            status, body, headers = self._carry_out(task.method, path, raw, if_match)
            task.request = None
            task.made = headers.get("Location", "")
            task.outcome = (status, body, headers)
        if task.style == "task":
            links = {"CreatedResources": [{"@odata.id": task.made}]} if task.made else {}
            return 200, {**running, "TaskState": "Completed", "Links": links}, {}
        return task.outcome

    def _carry_out(self, method: str, path: str, raw: bytes, if_match: str | None) -> Any:
        """(status, body, headers) of the request done for real."""
        with self.lock:
            r = self.resources
            if method == "GET":
                if path not in r:
                    return 404, _error(f"{path} not found"), {}
                return 200, r[path], {"ETag": _etag(r[path])}
            if method == "POST":
                if not isinstance(r.get(path, {}).get("Members"), list):
                    return 405, _error(f"{path} is no collection"), {}
                n = 1
                while f"{path}/{n}" in r:
                    n += 1
                uri = f"{path}/{n}"
                r[uri] = {**json.loads(raw or b"{}"), "@odata.id": uri, "Id": str(n)}
                r[path]["Members"].append({"@odata.id": uri})
                return 201, r[uri], {"Location": uri}
            if path not in r:
                return 404, _error(f"{path} not found"), {}
            if if_match is not None and if_match != _etag(r[path]):
                return 412, _error("the resource changed"), {}
            if method == "PATCH":
                _merge(r[path], json.loads(raw or b"{}"))
                return 204, None, {}
            if method == "DELETE":
                self.delete(path)
                return 204, None, {}
            return 405, _error(f"{method} is not allowed"), {}


def _handler(server: FaultyRedfish) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out apart: no delayed ACK wait

        def log_message(self, *_: object) -> None:
            pass

        def _serve(self) -> None:
            method, path = self.command, _norm(self.path)
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with server.lock:
                server.requests.append((method, self.path))
            fault = server._fault(method, path)
            if fault is not None and not fault.apply:  # before a task's poll: a busy monitor
                self._send(fault.status, fault.body, fault.headers)
                return
            answer = server._task(method, path, raw, self.headers.get("If-Match"))
            if answer is not None:
                self._send(*answer)
                return
            if fault is None or fault.apply:
                answer = server._carry_out(method, path, raw, self.headers.get("If-Match"))
            if fault is not None:
                answer = (fault.status, fault.body, fault.headers)
            assert answer is not None
            self._send(*answer)

        def _send(self, status: int, body: Any, headers: dict[str, str]) -> None:
            data = body if isinstance(body, bytes) else b"" if body is None else None
            if data is None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            if data:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = _serve

    return Handler


def _norm(path: str) -> str:
    path = path.split("?", 1)[0].rstrip("/")
    return "/redfish/v1/" if path == "/redfish/v1" else path


def _etag(body: Doc) -> str:
    return '"' + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12] + '"'


def _merge(into: Doc, change: Doc) -> None:
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _error(message: str) -> Doc:
    return {"error": {"code": "Base.1.0.GeneralError", "message": message}}
