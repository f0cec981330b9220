"""The reply envelope (ARCHITECTURE §3) in two pieces around its position, as the event
store completes a stored answer in the statement that draws the position."""

from __future__ import annotations

import msgspec
import pytest

from trellis.engine.core import replies


@pytest.mark.parametrize("position", [0, 7, 35, 12_345_678_901])
@pytest.mark.parametrize(
    "result",
    [b"{}", b'{"position":4611686018427387904,"n":[1,2,3]}', b'{"text":"position 99"}'],
)
def test_the_pieces_around_a_position_make_the_whole_answer(result: bytes, position: int) -> None:
    head, tail = replies.ok_around_position(result)
    whole = head + str(position).encode() + tail
    assert whole == replies.ok(result, position)
    decoded = msgspec.json.decode(whole)
    assert decoded["position"] == position and decoded["result"] == msgspec.json.decode(result)


def test_a_replay_is_marked_on_a_success_and_in_the_details_of_a_refusal() -> None:
    done = msgspec.json.decode(replies.as_replayed(replies.ok(b'{"id":"c-1"}', 7)))
    refused = replies.error("quota", "its quota is 0 gpu", {"kind": "gpu"})

    assert done == {"ok": True, "result": {"id": "c-1"}, "position": 7, "replayed": True}
    assert msgspec.json.decode(replies.as_replayed(refused)) == {
        "ok": False,
        "error": {
            "code": "quota",
            "message": "its quota is 0 gpu",
            "details": {"kind": "gpu", "replayed": True},
        },
    }
