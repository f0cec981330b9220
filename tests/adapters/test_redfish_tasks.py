"""How one answer of a Redfish task's Location reads (adapters/fabric/redfish/tasks.py)."""

from __future__ import annotations

import json

import pytest

from trellis.adapters.fabric.redfish.tasks import Ended, Running, TaskFailedState, read_answer

TASK = {"@odata.type": "#Task.v1_7_0.Task", "Id": "1", "Name": "compose"}


def task(**fields: object) -> bytes:
    return json.dumps({**TASK, **fields}).encode()


def test_a_monitor_still_running_answers_202_with_its_hint() -> None:
    assert read_answer(202, {"retry-after": "3"}, b"") == Running(3.0)
    assert read_answer(202, {"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, b"") == Running(None)
    # A busy monitor says nothing of its task: asked again, as a running one.
    assert read_answer(503, {"retry-after": "2"}, b"") == Running(2.0)


def test_a_monitor_that_ended_hands_back_the_operations_answer() -> None:
    made = read_answer(201, {"location": "/redfish/v1/Fabrics/F/Zones/4"}, b"{}")
    assert made == Ended(201, {"location": "/redfish/v1/Fabrics/F/Zones/4"}, b"{}")
    refused = read_answer(400, {}, b'{"error": {"message": "no"}}')
    assert isinstance(refused, Ended) and refused.status == 400


@pytest.mark.parametrize("state", ["New", "Starting", "Running", "Pending", "Cancelling"])
def test_a_task_resource_not_yet_ended_is_running(state: str) -> None:
    assert read_answer(200, {}, task(TaskState=state)) == Running(None)


def test_a_completed_task_names_what_it_created_as_a_creation_would() -> None:
    body = task(TaskState="Completed", Links={"CreatedResources": [{"@odata.id": "/z/9"}]})
    assert read_answer(200, {"location": "/t/1"}, body) == Ended(201, {"location": "/z/9"}, b"")
    # Completed without naming anything made: a plain success, no Location to mistake.
    assert read_answer(200, {"location": "/t/1"}, task(TaskState="Completed")) == Ended(
        200, {}, b""
    )


@pytest.mark.parametrize("state", ["Exception", "Killed", "Cancelled"])
def test_a_task_that_ended_otherwise_failed_with_its_first_message(state: str) -> None:
    body = task(TaskState=state, Messages=[{"Message": "port 3 busy"}, {"Message": "later"}])
    assert read_answer(200, {}, body) == TaskFailedState(state, "port 3 busy")


def test_a_200_that_is_no_task_is_the_operations_answer() -> None:
    body = b'{"@odata.type": "#Zone.v1_6_0.Zone"}'
    assert read_answer(200, {}, body) == Ended(200, {}, body)
    assert read_answer(200, {}, b"not json") == Ended(200, {}, b"not json")
