"""The CLI's tables and one-line answers keep one style: lowercase headers, no line that ends in
spaces, and the reply's log position in what an intent prints (docs/operations.md, `-o`)."""

from __future__ import annotations

from typing import Any

import pytest

from trellis.adapters.entrypoints import render

RESERVATION = {
    "reservation_id": "r-1",
    "tenant": "acme",
    "host": "host-01",
    "devices": [{"id": "gpu-001"}],
    "expires_at": "2026-12-01T10:00:00.123456+00:00",
    "made_at": "2026-12-01T09:00:00.123456+00:00",
    "request_id": "q-1",
    "reason": "",
}


@pytest.mark.parametrize("wide", [False, True], ids=["table", "wide"])
def test_reservation_list_has_lowercase_headers_as_every_table(wide: bool) -> None:
    """They were UPPERCASE, alone among the CLI's tables."""
    text = render.reservations_table({"reservations": [RESERVATION]}, {"position": 7}, wide)
    header = text.splitlines()[0]
    assert header == header.lower() and header.startswith("reservation  tenant  host"), text


@pytest.mark.parametrize("over", [False, True], ids=["under", "over"])
def test_quota_show_ends_no_line_in_spaces(over: bool) -> None:
    """Its last column has no header and, with nobody over quota, no cell: the rule under the
    header ended in two spaces."""
    row = {
        "tenant": "acme",
        "kind": "gpu",
        "limit": {"count": 8, "capacity_gib": None},
        "held": {"count": 1},
        "over": over,
    }
    text = render.quota_table({"quotas": [row]}, {"position": 21})
    assert [line for line in text.splitlines() if line != line.rstrip()] == [], text


def test_extend_says_the_position_its_reply_was_recorded_at() -> None:
    result = {"composition_id": "c-1", "expires_at": "2026-12-01T10:00:00+00:00"}
    assert render.extend_summary(result, {"position": 12}) == (
        "composition c-1 extended at position 12: now expires at 2026-12-01T10:00:00+00:00"
    )


def test_an_impaired_composition_names_what_impairs_it_in_either_shape() -> None:
    """`composition get -o wide` on an impaired composition crashed (TypeError: sequence item
    0: expected str instance, dict found): the composition query's impaired_by holds
    Impairment objects, `composition list`'s holds component ids."""
    device = {
        "id": "gpu-004", "kind": "gpu", "path": ["host-01", "gpu-004"], "hops": 1,
        "latency_ns": 100, "bandwidth_gbps": 25.0,
    }  # fmt: skip
    got = {
        "composition_id": "c-1", "host": "host-01", "state": "impaired", "expires_at": None,
        "devices": [device], "tenant": "acme",
        "impaired_by": [{"component": "ocs-1:3", "reason": "failed: los"}],
    }  # fmt: skip
    text = render.compose_summary(got, {"position": 9}, wide=True)
    assert "impaired by: ocs-1:3 (failed: los)" in text, text
    listed = {
        "id": "c-1", "tenant": "acme", "host": "host-01", "state": "impaired",
        "devices": [device], "impaired_by": ["ocs-1:3"],
    }  # fmt: skip
    assert "ocs-1:3" in render.composition_rows([listed], wide=True)


def test_a_refusal_names_the_compositions_and_reservations_in_the_way() -> None:
    """`remove gpu-004` said `in use by 1 live composition(s)` without naming it, though the
    reply's details did."""
    error = {
        "code": "conflict",
        "message": "gpu-004 in use by 1 live composition(s)",
        "details": {"in_use": ["gpu-004"], "compositions": ["c-7"]},
    }
    assert render.error_text(error).splitlines()[1:] == ["compositions: c-7"]
    error = {
        "code": "conflict",
        "message": "gpu-004 reserved by 2 live reservation(s)",
        "details": {"reserved": ["gpu-004"], "reservations": ["r-1", "r-2"]},
    }
    assert render.error_text(error).splitlines()[1:] == ["reservations: r-1, r-2"]


def test_a_drain_s_summary_says_what_moved_where() -> None:
    """The reply's `moved`: a replaced device names its stand-in, a reroute its new path."""
    result = {
        "component": "gpu-003",
        "changed": True,
        "health": "healthy",
        "drained": True,
        "compositions": ["c-1", "c-2"],
        "moved": [
            {"composition_id": "c-1", "device": "gpu-003", "to": "gpu-010",
             "path": ["host-01", "sw-1", "gpu-010"], "links": ["l-1", "l-10"]},
            {"composition_id": "c-2", "device": "gpu-004", "to": "gpu-004",
             "path": ["host-02", "sw-2", "gpu-004"], "links": ["l-2b", "l-4"]},
        ],
    }  # fmt: skip
    said = render.component_summary(result, {"position": 9}, verb="drain").splitlines()
    assert said == [
        "gpu-003: healthy, drained",
        "compositions touched: c-1, c-2",
        "  c-1: gpu-003 replaced by gpu-010 (path host-01 > sw-1 > gpu-010; links l-1, l-10)",
        # Over the same nodes, another cable: what moved is in the links.
        "  c-2: gpu-004 rerouted (path host-02 > sw-2 > gpu-004; links l-2b, l-4)",
        "active now: c-1, c-2",
        "at position 9",
    ]


def test_an_undrain_says_which_compositions_it_mended_and_which_it_could_not() -> None:
    """An operator's probe: `undrain sw-r2` said only 'compositions touched' of the one it
    brought back to active."""
    result = {
        "component": "sw-r2",
        "changed": True,
        "health": "healthy",
        "drained": False,
        "compositions": ["c-1", "c-2"],
        "impaired": ["c-2"],
    }
    said = render.component_summary(result, {"position": 9}, verb="undrain").splitlines()
    assert said[-3:] == ["active now: c-1", "left impaired: c-2", "at position 9"]


def test_an_undrain_of_a_failed_component_says_what_would_clear_it() -> None:
    """The ops probe's `undrain gpu-001` (failed, not drained) said only 'already so'."""
    result = {"component": "gpu-001", "changed": False, "health": "failed", "drained": False}
    said = render.component_summary(result, {"position": 4}, verb="undrain")
    assert said.splitlines()[0] == (
        "gpu-001: already so, nothing changed"
        " (it is failed: `trellis report-fault gpu-001 --state healthy` clears that)"
    )
    # Drained and failed: the undrain changes the mark, and it is still failed.
    undrained = {**result, "changed": True}
    assert render.component_summary(undrained, {"position": 5}, verb="undrain").startswith(
        "gpu-001: failed (it is failed: `trellis report-fault gpu-001 --state healthy` clears"
    )
    healthy = {**result, "health": "healthy"}
    assert render.component_summary(healthy, {"position": 4}, verb="undrain").startswith(
        "gpu-001: already so, nothing changed\n"
    )


@pytest.mark.parametrize(
    ("show", "result"),
    [
        (
            render.release_summary,
            {"composition_id": "c-1", "devices": ["g"], "circuits_removed": []},
        ),
        (render.extend_summary, {"composition_id": "c-1", "expires_at": "2026-12-07T13:00:00Z"}),
    ],
)
def test_a_replayed_release_or_extend_says_so(show: Any, result: dict[str, Any]) -> None:
    """The SRE probe resent a timed-out release with its request id: it printed as if done
    again; a compose said "(replayed)"."""
    assert "(replayed)" in show(result, {"position": 9, "replayed": True})
    assert "(replayed)" not in show(result, {"position": 9})


def test_a_released_composition_says_when_it_ended_not_a_lease() -> None:
    """The verify probe's `composition get` of a released composition said "released
    (expires: no lease)" over its devices, as if live; its chain has the release."""
    result = {
        "composition_id": "c-1",
        "host": "host-01",
        "state": "released",
        "expires_at": None,
        "devices": [],
        "chain": [
            {"type": "CompositionRequested", "position": 2, "time": "2026-12-07T12:00:00Z"},
            {"type": "CompositionReleased", "position": 9, "time": "2026-12-07T12:05:00Z"},
        ],
    }
    head = render.compose_summary(result, {"position": 11}).splitlines()[0]
    assert head == (
        "composition c-1 on host-01: released (since 2026-12-07T12:05:00Z, position 9;"
        " it held the devices below) at position 11"
    )
    live = {**result, "state": "active", "expires_at": "2026-12-07T13:00:00Z"}
    assert "(expires: 2026-12-07T13:00:00Z)" in render.compose_summary(live, {"position": 11})
