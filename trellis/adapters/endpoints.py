"""Discovery through endpoints.json: a running `trellis up` writes where its servers listen (the
embedded ones take random ports) into the data dir, and local clients (the CLI, export, the
audit's verify) read it when the environment names no server."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trellis.adapters.embedded.process import default_data_dir
from trellis.adapters.embedded.watchdog import alive, started_at
from trellis.adapters.settings import Settings

ENDPOINTS_FILE = "endpoints.json"


def write_endpoints(settings: Settings, nats_url: str, database_url: str) -> Path:
    """Tell local CLI clients where a running engine listens (the embedded ports are random).
    Readable by this user only: the database URL carries the engine role's password."""
    path = (settings.data_dir or default_data_dir()) / ENDPOINTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # The start time tells this process from a later one given its pid (pids wrap).
    pid = os.getpid()
    endpoints = {
        "nats_url": nats_url,
        "database_url": database_url,
        "pid": pid,
        "started": started_at(pid),
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file may have been created more open
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**endpoints, "subject_prefix": settings.subject_prefix}))
    return path


def _endpoints(settings: Settings) -> dict[str, Any] | None:
    """What a local `trellis up` wrote, if that engine still runs; a file left by one that
    was killed is stale and ignored: its pid runs no more, is a zombie not yet reaped, or is
    another process's now (another start time; a file without one, from an older version, is
    taken at its pid's word)."""
    path = (settings.data_dir or default_data_dir()) / ENDPOINTS_FILE
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(written, dict):
        return None
    pid, started = written.get("pid"), written.get("started")
    if isinstance(pid, int) and not _running(pid, started):
        return None
    return written


def _running(pid: int, started: object) -> bool:
    if not _PROC.exists():  # no /proc to read start times from: the pid's word
        return alive(pid)
    now = started_at(pid)
    return now is not None and (not isinstance(started, int) or now == started)


_PROC = Path("/proc/self/stat")


def running_engine_pid(settings: Settings) -> int | None:
    """The pid of the `trellis up` serving from this data dir, when one runs."""
    written = _endpoints(settings)
    pid = written.get("pid") if written else None
    return pid if isinstance(pid, int) and pid != os.getpid() else None


def find_endpoint(settings: Settings, name: str) -> str | None:
    """`name` ("nats_url" or "database_url") from the environment, else from what a local
    `trellis up` that still runs wrote, else None."""
    configured: str | None = getattr(settings, name)
    if configured:
        return configured
    written = _endpoints(settings)
    value = written.get(name) if written else None
    return str(value) if value is not None else None
