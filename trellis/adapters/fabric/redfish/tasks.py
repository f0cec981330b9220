"""How a Redfish task's answer reads (DMTF DSP0266, "Asynchronous operations").

A service may answer a change with `202 Accepted` and a `Location`: the operation runs on, and
that URI says how it ends. Services name one of two things there:
- a *task monitor* (the specification's way): `202` while the task runs, then the status and
  body the operation would have answered at once (a create's `201` with `Location`);
- a *Task* resource (older services): `200` with a `Task` body whose `TaskState` runs on until
  `Completed` (the created resource in `Links.CreatedResources`) or an end that failed.

This module only reads one answer; the client polls (client.py).
"""

from __future__ import annotations

import msgspec

#: A Task in one of these states has not ended (DSP0266's TaskState, Task_v1 CSDL).
RUNNING_STATES = frozenset(
    {"New", "Starting", "Running", "Suspended", "Interrupted", "Pending", "Stopping",
     "Service", "Cancelling"}
)  # fmt: skip


class Running(msgspec.Struct, frozen=True):
    """The task has not ended; `retry_after` is the service's hint in seconds, if it gave one."""

    retry_after: float | None


class Ended(msgspec.Struct, frozen=True):
    """The operation's own answer: its status, headers (lower-cased) and body."""

    status: int
    headers: dict[str, str]
    body: bytes


class TaskFailedState(msgspec.Struct, frozen=True):
    """A Task that ended other than `Completed` (`Exception`, `Killed`, `Cancelled`)."""

    state: str
    message: str


def read_answer(
    status: int, headers: dict[str, str], body: bytes
) -> Running | Ended | TaskFailedState:
    """What one GET of a task's `Location` says. A 503 (the service busy, or restarting) says
    nothing of the task: it is asked again, as a running one is."""
    if status in (202, 503):
        return Running(retry_after_s(headers))
    task = _task(body) if status == 200 else None
    if task is None:
        return Ended(status, headers, body)  # a monitor hands back the operation's answer
    state = task.get("TaskState")
    if state in RUNNING_STATES:
        return Running(retry_after_s(headers))
    if state != "Completed":
        return TaskFailedState(str(state), _first_message(task))
    created = _created(task)
    if created is None:  # completed, but what it made is not named here
        return Ended(200, {k: v for k, v in headers.items() if k != "location"}, b"")
    return Ended(201, {**headers, "location": created}, b"")


def _task(body: bytes) -> dict[str, object] | None:
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    kind = doc.get("@odata.type")
    return doc if isinstance(kind, str) and kind.startswith("#Task.") else None


def _created(task: dict[str, object]) -> str | None:
    links = task.get("Links")
    made = links.get("CreatedResources") if isinstance(links, dict) else None
    first = made[0] if isinstance(made, list) and made else None
    uri = first.get("@odata.id") if isinstance(first, dict) else None
    return uri if isinstance(uri, str) else None


def _first_message(task: dict[str, object]) -> str:
    messages = task.get("Messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    text = first.get("Message") if isinstance(first, dict) else None
    return str(text) if text else ""


def retry_after_s(headers: dict[str, str]) -> float | None:
    """`Retry-After` in seconds; an HTTP date (also allowed) is not worth parsing here."""
    value = headers.get("retry-after", "")
    return float(value) if value.isdigit() else None
