"""What the CLI prints for people never carries a control or bidirectional character raw
(issue 21, finding 6): a reason or label from an older event, or from a foreign message, is
shown escaped, so it cannot reorder or forge a table."""

from __future__ import annotations

import argparse
import json

import pytest

from trellis.adapters.entrypoints import render
from trellis.adapters.entrypoints.cli import talk

EVIL = "acme\u202e-drow-ssap \x1b[2Jcleared\x85"


def test_visible_escapes_every_control_and_bidi_character_in_keys_and_values() -> None:
    shown = render.visible({"reason": EVIL, "labels": {"k\u2066": "v\nw"}, "n": [1, "x\u200f"]})
    assert shown == {
        "reason": "acme\\u202e-drow-ssap \\u001b[2Jcleared\\u0085",
        "labels": {"k\\u2066": "v\\u000aw"},
        "n": [1, "x\\u200f"],
    }
    assert render.visible("plain, é and 中文") == "plain, é and 中文"


@pytest.mark.parametrize("output", ["table", "wide"])
def test_a_reply_is_printed_escaped_and_json_stays_exact(
    output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    reply = {"ok": True, "result": {"text": EVIL}, "position": 3, "replayed": False}
    talk.print_reply(argparse.Namespace(output=output), reply, lambda r, _, wide: r["text"])
    out = capsys.readouterr().out
    assert "\u202e" not in out and "\x1b" not in out and "\\u202e" in out
    error = {"ok": False, "error": {"code": "invalid", "message": EVIL, "details": {}}}
    talk.print_reply(argparse.Namespace(output=output), error, None)
    assert "\u202e" not in capsys.readouterr().err
    talk.print_reply(argparse.Namespace(output="json"), reply, None)
    assert json.loads(capsys.readouterr().out)["text"] == EVIL  # for scripts: the data itself


def test_a_replayed_refusal_says_it_is_the_answer_the_request_id_got_before() -> None:
    first = {"code": "quota", "message": "its quota is 0 gpu", "details": {}}
    again = {**first, "details": {"replayed": True}}

    assert render.error_text(first) == "error [quota]: its quota is 0 gpu"
    assert render.error_text(again).startswith("error [quota]: its quota is 0 gpu (replayed: ")


def test_one_connection_is_counted_as_one() -> None:
    one = {
        "device": "gpu-01",
        "host": "host-01",
        "composition_id": "c-1",
        "tenant": "acme",
        "path": ["host-01", "sw-1", "gpu-01"],
        "links": ["l-1", "l-2"],
        "bandwidth_gbps": 64.0,
        "since": "2026-12-07T21:00:00Z",
        "why": {"request_id": "r-1", "actor": "acme", "position": 3, "reason": "train"},
    }
    text = render.connections_table({"connections": [one]}, {"position": 3})
    assert text.endswith("\n1 connection at position 3"), text
    none = render.connections_table({"connections": []}, {"position": 3})
    assert none.endswith("\n0 connections at position 3"), none


def test_history_names_its_price_the_devices_not_the_slices() -> None:
    """A slice of a 2,048 GiB pool showed 'cost/h 0.8', the whole pool's price: a reader
    multiplying it by the time over-billed the slice fourfold (front-door probe)."""
    interval = {
        "device": "mem-01", "model": "CXL-2.0-pool", "kind": "memory", "host": "host-01",
        "composition_id": "c-1", "tenant": "acme", "start": "2026-12-07T21:00:00Z",
        "end": None, "end_reason": None, "cost_per_hour": 0.8, "bandwidth_gbps": 64.0,
        "capacity_gib": 512.0,
    }  # fmt: skip
    table = render.history_table({"intervals": [interval]}, {"position": 3})
    header = table.splitlines()[0]
    assert "device $/h" in header and "cost/h" not in header, header
    assert table.endswith("\n1 interval at position 3"), table  # not "1 intervals"


def test_answers_asked_at_a_moment_say_which_position_they_stand_at() -> None:
    """`why`, `free` and `blast-radius` --at a time never said which position it came to
    (the auditor probe); connections, history and topology did."""
    reply = {"position": 12}
    why = {"text": "gpu-01 is free.", "chain": []}
    assert render.why_text(why, reply).endswith("\nat position 12")
    free = {"devices": [{"id": "gpu-01", "device_kind": "gpu", "labels": {}}]}
    assert render.free_table(free, reply).endswith("\n1 usable device free at position 12")
    hit = {"compositions": [], "tenants": []}
    assert render.blast_radius_table(hit, reply).endswith("none; at position 12")
