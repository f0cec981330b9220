"""A server as a child process: started once, polled until ready, stopped idempotently.

The generic half of the embedded servers (nats_server.py, postgres_server.py) and of the
cluster's nodes (cluster.py). A server is a plain child process bound to 127.0.0.1 on a port
fixed at construction, so ``stop()`` followed by ``start()`` brings the same server back at the
same URL with the same data (tests restart them mid-run). Only a first start may move: a port
the OS chose for us can be taken before the server binds it (by another server, or as a client
connection's source port), and then the server chooses again instead of failing. Its output
is appended to its log file; readiness is polled with a deadline, never slept, and a server
that exits or does not become ready is reported with the tail of that log.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import platformdirs

__all__ = [
    "HOST",
    "ChildProcess",
    "EmbeddedServerDied",
    "EmbeddedServerError",
    "PortTakenError",
    "default_data_dir",
    "free_port",
    "log_tail",
    "moving_if_taken",
    "port_is_free",
]

_log = logging.getLogger(__name__)

HOST = "127.0.0.1"

_POLL_INTERVAL_S = 0.05
_START_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 20.0
# How often a first start chooses fresh ports when one it chose was taken in the meantime.
_PORT_ATTEMPTS = 3


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be found, started or stopped."""


class EmbeddedServerDied(EmbeddedServerError):
    """An embedded server that served exited under the engine (a kill, a crash, the OOM
    killer): `trellis up` stops and says so (docs/operations.md)."""


class PortTakenError(EmbeddedServerError):
    """A port the server was to listen on is bound by another process (`port`, when known)."""

    def __init__(self, message: str, port: int | None = None) -> None:
        super().__init__(message)
        self.port = port


class DataDirInUse(EmbeddedServerError):
    """Another process holds the data dir's embedded servers (starting or serving)."""


#: Held (flock) for as long as a process runs embedded servers on the data dir.
SERVERS_LOCK = "servers.lock"


def hold_data_dir(data_dir: Path) -> Callable[[], None]:
    """Take the data dir for this process's embedded servers; the function that lets it go.
    Two `trellis up` started at once on a new data dir both passed the "an engine already
    runs here" check (the first had not written its endpoints yet), and the second then met
    the first one's nats-server on the store and called it a leftover to kill.

    Raises:
        DataDirInUse: another process holds it, named by its pid.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / SERVERS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUse(
            f"another process (pid {holder}) runs or is starting the embedded servers on "
            f"{data_dir}; stop it first, or give this one its own TRELLIS_DATA_DIR"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return lambda: os.close(fd)  # closing lets the lock go; the pid left in it is harmless


def free_port(host: str = HOST) -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it).

    Another process may take it before it is bound; ``start()`` checks again and says so.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def default_data_dir() -> Path:
    """Where the embedded servers keep their data: ``$TRELLIS_DATA_DIR`` or the user data dir."""
    override = os.environ.get("TRELLIS_DATA_DIR")
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_data_dir("trellis"))


def port_is_free(port: int) -> bool:
    """Whether a server could bind ``port`` on 127.0.0.1 now."""
    # SO_REUSEADDR as the servers themselves use it, so a TIME_WAIT left by our own previous run
    # (stop, then restart on the same port) does not count as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a server's log, for an error message."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def moving_if_taken(
    start: Callable[[], None],
    choose_again: Callable[[PortTakenError], None],
    *,
    may_move: bool,
    what: str,
) -> None:
    """Run ``start``; when it raises PortTakenError and ``may_move`` (ports the OS offered,
    never used yet), ``choose_again`` and run it again, up to _PORT_ATTEMPTS times in all.
    ``choose_again`` raises the error it is given when the taken port is not one to move.

    A port the OS offers is free when offered; another process may bind it before the server
    does (a parallel test's server, or a client connection's source port from the same range).
    """
    attempts = _PORT_ATTEMPTS if may_move else 1
    for attempt in range(1, attempts + 1):
        try:
            start()
            return
        except PortTakenError as exc:
            if attempt == attempts:
                raise
            choose_again(exc)
            _log.warning("%s; %s on other ports", exc, what)


def _says_port_taken(log_path: Path, since: int) -> bool:
    """Whether what the server logged from offset ``since`` on says a listen port was taken
    (nats-server and postgres both report the OS's "address already in use")."""
    try:
        with log_path.open("rb") as f:
            f.seek(since)
            return b"address already in use" in f.read().lower()
    except OSError:
        return False


class ChildProcess:
    """A server run as a child process: start once, poll readiness, stop idempotently.

    Subclasses say how (`_command`, `_popen_kwargs`), where it logs (`log_path`), when it
    answers (`_is_ready`) and how it stops (`_request_stop`)."""

    name = "server"
    #: What `_request_stop` sends; the watchdog sends it too when the engine dies.
    stop_signal: int = signal.SIGTERM

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).absolute()
        # Fixed for the object's lifetime so a restart comes back at the same URL.
        self.port: int = port if port is not None else free_port()
        self._chose_ports = port is None
        self._has_run = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        #: Called with each server process's pid the moment it is spawned, before the
        #: readiness wait: the watchdog covers the server from then on.
        self.spawned: Callable[[int], None] | None = None

    # -- to be provided by subclasses -------------------------------------------------------

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def shown_url(self) -> str:
        """`url` as logs and reprs show it: without secrets."""
        return self.url

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Create directories (and whatever else must exist) before the process starts."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _refuse_if_running(self) -> None:
        """Raise EmbeddedServerError when another server still runs on this data dir."""

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        raise NotImplementedError

    def _after_ready(self) -> None:
        """One-off setup once the server answers (e.g. create the database)."""

    def _request_stop(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(self.stop_signal)

    def _ports(self) -> dict[int, bool]:
        """Every port the server listens on, and whether this object chose it (else given)."""
        return {self.port: self._chose_ports}

    def _choose_ports(self) -> None:
        """Choose again the ports this object chose itself (a first start found one taken)."""
        self.port = free_port()

    def _choose_ports_unless_given(self, taken: PortTakenError) -> None:
        """Choose again, unless the port `taken` names was given: that one stays, and so
        does the error. (Unknown which: only when this object chose every port.)"""
        chosen = self._ports()
        movable = chosen.get(taken.port, False) if taken.port is not None else all(chosen.values())
        if not movable:
            raise taken
        self._choose_ports()

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the server process we started is alive."""
        return self._proc is not None and self._proc.poll() is None

    def died(self) -> str | None:
        """When the server this object started has exited without being stopped: how (its
        process is reaped here, so it leaves no zombie), else None."""
        proc = self._proc
        if proc is None:
            return None
        code = proc.poll()
        if code is None:
            return None
        if code < 0:
            try:
                how = f"signal {-code}, {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        else:
            how = f"code {code}"
        return f"embedded {self.name} exited ({how})"

    def died_error(self, how: str) -> EmbeddedServerDied:
        """`how` (from `died`) with its log and that log's last lines, on one line."""
        tail = " | ".join(
            line.strip() for line in log_tail(self.log_path, 3).splitlines() if line.strip()
        )
        return EmbeddedServerDied(f"{how}; its log: {self.log_path}, last lines: {tail}")

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self.running and self._proc is not None else None

    def start(self) -> None:
        """Start the server and block until it answers; a no-op when it already runs.

        Raises:
            EmbeddedServerError: the port is taken, the process exits early or does not become
                ready within the deadline; the message carries the tail of the server's log.
        """
        if self.running:
            return
        # Given ports, and the ports of a server that has run (its URL is known), stay put.
        moving_if_taken(
            self._start_once,
            self._choose_ports_unless_given,
            may_move=not self._has_run,
            what=f"starting {self.name}",
        )
        self._has_run = True

    def _start_once(self) -> None:
        self._proc = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_if_running()
        for port in self._ports():
            if not port_is_free(port):
                raise self._taken(port)
        self._prepare()
        cmd = self._command()
        self._log_file = self.log_path.open("ab")
        log_start = self._log_file.tell()
        _log.info("starting %s: %s", self.name, " ".join(cmd))
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                close_fds=True,
                # A session of its own: a terminal's Ctrl-C reaches the whole foreground
                # group, and a server it stopped under the engine's feet made the engine's
                # own stop fail (exit 70). The engine stops its servers itself, in order, and
                # the watchdog (a session of its own too) when the engine dies.
                start_new_session=True,
                **self._popen_kwargs(),
            )
        except OSError as exc:
            self.stop()
            raise EmbeddedServerError(f"{self.name}: cannot run {cmd[0]}: {exc}") from exc
        self._proc = proc
        if self.spawned is not None:
            self.spawned(proc.pid)
        # Registered before the readiness wait so an interrupted start still cleans up.
        atexit.register(self.stop)
        try:
            self._wait_until(lambda: self._is_ready(proc), proc, "to accept connections", log_start)
            self._after_ready()
        except BaseException:
            self.stop()
            raise
        _log.info("%s ready at %s (pid %d)", self.name, self.shown_url, proc.pid)

    def _taken(self, port: int) -> PortTakenError:
        return PortTakenError(f"{self.name}: port {HOST}:{port} is already in use", port)

    def stop(self) -> None:
        """Stop the server (graceful first, then kill); safe to call repeatedly."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        try:
            if proc is not None and proc.poll() is None:
                self._request_stop(proc)
                try:
                    proc.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    _log.warning("%s did not stop in %ss; killing it", self.name, _STOP_TIMEOUT_S)
                    proc.kill()
                    proc.wait()
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (no shutdown, no flush); safe when stopped.
        ``start()`` brings it back at the same port with whatever its data dir kept."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.stop()

    def _wait_until(
        self,
        ready: Callable[[], bool],
        proc: subprocess.Popen[bytes],
        what: str,
        log_start: int,
    ) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            code = proc.poll()
            if code is not None:
                exited = (
                    f"{self.name} exited with code {code} before it was ready; "
                    f"tail of {self.log_path}:\n{log_tail(self.log_path)}"
                )
                if not _says_port_taken(self.log_path, log_start):
                    raise EmbeddedServerError(exited)
                # The one that is still bound, if it still is, is the one it met.
                taken = [port for port in self._ports() if not port_is_free(port)]
                raise self._taken(taken[0]) if taken else PortTakenError(exited)
            if ready():
                return
            if time.monotonic() > deadline:
                raise EmbeddedServerError(
                    f"{self.name} did not start {what} on {HOST}:{self.port} within "
                    f"{_START_TIMEOUT_S:.0f}s; tail of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"{type(self).__name__}({self.shown_url}, {self.data_dir}, {state})"
