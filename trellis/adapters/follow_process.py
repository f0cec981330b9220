"""The log followers in a process of their own (TRELLIS_FOLLOWERS=process).

The engine's intake and writers then have its event loop and its core to themselves: the
projections, the event relay and the checkpoints (engine/service/follower.py) run in the follower
process, `python -P -m trellis.adapters.entrypoints.follow`. Two pieces live on the engine's side:

- `CommitSignal`, the engine's stand-in for its followers: after each commit it publishes an
  empty core NATS message on `<prefix>.internal.committed.<domain>` (at most one every 20 ms),
  which wakes that domain's followers over there. A lost signal costs at most the follower's
  poll interval: it looks at the log every second anyway.
- `FollowerProcess`, which starts the follower process with the engine's endpoints in its
  environment, restarts it with backoff (logged) whenever it exits, and stops it (SIGTERM, then
  SIGKILL after a grace period) when the engine stops.

The counters the followers keep over there (the relay's foreign messages) reach the engine's
/metrics over a pipe each process gets (`CountReport`): a line per change, with that process's
total of the series. The engine adds what a total grew by to its own counter of the same name
and labels, as inline followers count, so its series never go back when a process is restarted
and a lost line costs nothing that the next one of the series does not carry.

Nothing is lost when the process dies: every sink moves its checkpoint in the transaction that
applies a batch, so the next process resumes where the last one's last commit ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import BinaryIO

import msgspec
from nats.aio.client import Client as NATS

from trellis.engine.service.follower import DomainLog, Followers

log = logging.getLogger("trellis.follow")

ENTRY_MODULE = "trellis.adapters.entrypoints.follow"
#: The environment variable naming the data dir whose secure/ holds the identities the
#: follower process connects as (secure mode: the relay's and the checkpoints').
SECURE_DATA_DIR_ENV = "TRELLIS_FOLLOWER_SECURE_DATA_DIR"
#: The engine's pid: the follower process exits when it is no longer its parent.
PARENT_ENV = "TRELLIS_FOLLOWER_PARENT"
#: The file descriptor of the pipe the follower process reports its counters on.
REPORT_FD_ENV = "TRELLIS_FOLLOWER_REPORT_FD"
#: Seconds before a report the pipe had no room for is written again.
REPORT_RETRY_S = 0.1
RESTART_FIRST_S = 0.25
RESTART_MAX_S = 10.0
#: A process that ran this long before it exited starts the backoff over.
STEADY_S = 30.0
STOP_GRACE_S = 10.0
#: Seconds between the commit signals the engine sends (commits meanwhile wait for the next).
SIGNAL_EVERY_S = 0.02


def committed_subject(prefix: str, domain: str = "*") -> str:
    """The internal subject the engine signals a commit of `domain` on (`*`: any domain)."""
    return f"{prefix}.internal.committed.{domain}"


class CommitSignal(Followers):
    """The engine's followers when they run in the follower process: none here; a commit
    publishes the wake-up signal instead: at once when none went out in the last
    SIGNAL_EVERY_S, else once that time is up, each domain once however many commits it made
    meanwhile. The follower process gathers commits that long anyway, and every signal is a
    send on the intent path's event loop."""

    def __init__(self, log: DomainLog, nc: NATS, prefix: str):
        super().__init__(log, [])
        self._nc = nc
        self._prefix = prefix
        self._pending: set[str] = set()
        self._scheduled = False
        self._sent_at = -SIGNAL_EVERY_S
        self._sending: set[asyncio.Task[None]] = set()

    def notify(self, domain: str) -> None:
        self._pending.add(domain)
        if not self._scheduled:
            self._scheduled = True
            loop = asyncio.get_running_loop()
            loop.call_at(max(loop.time(), self._sent_at + SIGNAL_EVERY_S), self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        self._sent_at = asyncio.get_running_loop().time()
        domains, self._pending = self._pending, set()
        task = asyncio.create_task(self._send(domains))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, domains: set[str]) -> None:
        try:
            for domain in domains:
                await self._nc.publish(committed_subject(self._prefix, domain), b"")
        except Exception as exc:  # NATS away: the follower's poll finds the commit anyway
            log.debug("commit signal not sent: %r", exc)


#: A counter's name, its label values, and by how much it grew.
Counted = Callable[[str, tuple[str, ...], int], None]
#: One line of a report: a counter's name, its label values, the process's total of them.
_Line = tuple[str, tuple[str, ...], int]
_decode_line = msgspec.json.Decoder(_Line).decode
_encode_line = msgspec.json.Encoder().encode


class CountReport:
    """The follower process's side of the pipe: each counter's total in this process, written
    as a line whenever it changes. The pipe does not block: a line it has no room for (the
    engine's loop busy) is written again shortly, then with the series' latest total."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self._fd: int | None = fd
        self._totals: dict[tuple[str, tuple[str, ...]], int] = {}
        self._unsent: dict[tuple[str, tuple[str, ...]], None] = {}  # ordered: a set in order
        self._retrying = False

    @classmethod
    def from_env(cls) -> CountReport | None:
        """The report the engine asked for in REPORT_FD_ENV; None when run by hand."""
        fd = os.environ.get(REPORT_FD_ENV, "")
        if not fd.isdigit():
            return None
        try:
            return cls(int(fd))
        except OSError as exc:
            log.warning("counters not reported: fd %s: %s", fd, exc)
            return None

    def foreign_message(self, consumer: str, domain: str) -> None:
        """A ForeignMessages on_skip: as EngineMetrics.foreign_message counts it."""
        self.count("trellis_foreign_messages", (consumer, domain))

    def count(self, name: str, labels: tuple[str, ...]) -> None:
        key = (name, labels)
        self._totals[key] = self._totals.get(key, 0) + 1
        self._unsent[key] = None
        self._flush()

    def _flush(self) -> None:
        self._retrying = False
        while self._unsent and self._fd is not None:
            key = next(iter(self._unsent))
            line = _encode_line((*key, self._totals[key])) + b"\n"
            try:
                os.write(self._fd, line)  # under PIPE_BUF: all of it or nothing
            except BlockingIOError:
                if not self._retrying:
                    self._retrying = True
                    asyncio.get_running_loop().call_later(REPORT_RETRY_S, self._flush)
                return
            except OSError as exc:  # the engine is gone: nobody to report to
                log.debug("counters no longer reported: %r", exc)
                self._fd = None
                return
            del self._unsent[key]


class FollowerProcess:
    """The follower process, kept running: restarted with backoff whenever it exits.

    Args:
        env: its whole environment (TRELLIS_* endpoints and settings, see follower_env).
        counted: told what each of the process's counters grew by (CountReport), as the
            engine's metrics count it; None: the process reports none.
    """

    def __init__(self, env: Mapping[str, str], counted: Counted | None = None):
        self._env = dict(env)
        self._counted = counted
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def __aenter__(self) -> FollowerProcess:
        """Started; stopped on leaving. A start cancelled while the process is being spawned
        (Ctrl-C early in `trellis up`) stops it too: it was left running, and said its engine
        was gone after the engine had said it stopped."""
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the process (and its keeper); returns once it was spawned."""
        self._task = asyncio.create_task(self._keep(), name="follower-process")
        await self._started.wait()

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM (it drains and exits), SIGKILL if it is not gone after `grace` seconds;
        a process still being spawned is waited for first, then stopped so."""
        self._stopping = True
        if self._task is not None and not (self._started.is_set() or self._task.done()):
            spawned = asyncio.ensure_future(self._started.wait())
            try:
                await asyncio.wait([spawned, self._task], return_when=asyncio.FIRST_COMPLETED)
            finally:
                spawned.cancel()
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                log.warning("the follower process ignored SIGTERM for %.0f s; killing it", grace)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        delay = RESTART_FIRST_S
        while not self._stopping:
            report, write_end, env = -1, -1, self._env
            try:
                if self._counted is not None:
                    report, write_end = os.pipe()
                    env = {**env, REPORT_FD_ENV: str(write_end)}
                try:
                    # A session of its own, as the embedded servers have: a terminal's Ctrl-C
                    # is the engine's to act on, and the engine stops this process in its
                    # turn. -P: not the working dir first on sys.path, whose trellis/ (a
                    # clone's parent dir) it imported instead, and so failed and was
                    # restarted for ever.
                    self.process = await asyncio.create_subprocess_exec(
                        sys.executable, "-P", "-m", ENTRY_MODULE, env=env,
                        start_new_session=True, pass_fds=(write_end,) if write_end >= 0 else (),
                    )  # fmt: skip
                finally:
                    if write_end >= 0:
                        os.close(write_end)  # the child's copy alone: EOF when it is gone
            except BaseException as exc:
                if report >= 0:
                    os.close(report)
                if not isinstance(exc, OSError):
                    raise
                log.warning("cannot start the follower process: %s", exc)
            else:
                self._started.set()
                if self._stopping:  # stop() came while this one was being spawned
                    self.process.terminate()
                began = loop.time()
                reading = (  # the file closes the pipe's end even if the task never starts
                    asyncio.create_task(
                        self._read_report(os.fdopen(report, "rb", buffering=0)),
                        name="follower-report",
                    )
                    if report >= 0
                    else None
                )
                try:
                    code = await self.process.wait()
                    if reading is not None:  # what it wrote before it went is counted too
                        await asyncio.wait_for(asyncio.shield(reading), STOP_GRACE_S)
                except TimeoutError:
                    pass  # a child of its own holds the pipe open: its counts are lost
                finally:
                    if reading is not None:
                        reading.cancel()
                if self._stopping:
                    return
                if loop.time() - began > STEADY_S:
                    delay = RESTART_FIRST_S
                log.warning(
                    "the follower process (pid %d) exited with %s; restarting in %.2g s",
                    self.process.pid,
                    code,
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)
            self.restarts += 1

    async def _read_report(self, pipe: BinaryIO) -> None:
        """Add what each of one process's counters grew by, until its end of the pipe closes."""
        assert self._counted is not None
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        totals: dict[tuple[str, tuple[str, ...]], int] = {}  # this process's, from 0
        try:
            async for line in reader:
                try:
                    name, labels, total = _decode_line(line)
                except msgspec.DecodeError as exc:
                    log.warning("the follower process reported %r: %s", line[:200], exc)
                    continue
                grew = total - totals.get((name, labels), 0)
                if grew > 0:
                    totals[name, labels] = total
                    self._counted(name, labels, grew)
        except ValueError as exc:  # a line past the reader's limit: not the report's
            log.warning("the follower process's counters are no longer read: %s", exc)
        finally:
            transport.close()


def follower_env(
    *,
    nats_url: str,
    database_url: str,
    schema: str | None,
    prefix: str,
    checkpoint_key: str,
    checkpoint_every: int,
    snapshot_every: int,
    stream_limits: tuple[int, float, int, int],
    secure_data_dir: str | None,
    event_loop: str,
    gather_s: float,
) -> dict[str, str]:
    """The follower process's environment: this one's, with the engine's resolved endpoints
    and settings in place of any TRELLIS_* variable it had; `event_loop`: the kind of loop it
    runs on (adapters/event_loop.py), the engine's own; `gather_s`: how long its followers
    gather commits into a pass (TRELLIS_FOLLOW_GATHER_MS), the engine's setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")}
    max_bytes, max_age, replicas, marker_ttl = stream_limits
    env |= {
        PARENT_ENV: str(os.getpid()),
        "TRELLIS_NATS_URL": nats_url,
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_SUBJECT_PREFIX": prefix,
        "TRELLIS_CHECKPOINT_KEY": checkpoint_key,
        "TRELLIS_CHECKPOINT_EVERY": str(checkpoint_every),
        "TRELLIS_SNAPSHOT_EVERY": str(snapshot_every),
        "TRELLIS_EVENTS_MAX_BYTES": str(max_bytes),
        "TRELLIS_EVENTS_MAX_AGE": repr(max_age),
        "TRELLIS_JS_REPLICAS": str(replicas),
        "TRELLIS_KV_MARKER_TTL": str(marker_ttl),
        "TRELLIS_EVENT_LOOP": event_loop,
        "TRELLIS_FOLLOW_GATHER_MS": repr(gather_s * 1000),
    }
    if schema:
        env["TRELLIS_DB_SCHEMA"] = schema
    if "TRELLIS_SCHEMA_DIR" in os.environ:  # the migrations this engine checked the log against
        env["TRELLIS_SCHEMA_DIR"] = os.environ["TRELLIS_SCHEMA_DIR"]
    if secure_data_dir:
        env[SECURE_DATA_DIR_ENV] = secure_data_dir
    return env
