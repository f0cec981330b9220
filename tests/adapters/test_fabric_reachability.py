"""The fabric manager's reachability (adapters/fabric/redfish/reachability.py): a poll every
few seconds against a service that is down logs its first failure, then a reminder every
`remind_s` with the count of attempts, and one line when it answers again; the health problem
names the domain, the service, since when and the last error."""

from __future__ import annotations

import logging

from trellis.adapters.fabric.redfish.reachability import Reachability

URL = "http://127.0.0.1:8000"
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def test_an_outage_is_said_once_then_reminded_then_said_ended() -> None:
    reach = Reachability(URL, remind_s=300.0)
    assert reach.ok and reach.answered(T0) is None and reach.problem("hall-1") is None

    said = [reach.failed(T0 + 5.0 * i, "GET /redfish/v1/: refused") for i in range(100)]
    lines = [(i, s) for i, s in enumerate(said) if s is not None]
    # The first failure, then one reminder each 300 s (every 60th poll of 5 s): not 100 lines.
    assert [i for i, _ in lines] == [0, 60]
    level, first = lines[0][1]
    assert level == logging.WARNING
    assert first.startswith(f"fabric manager unreachable at {URL}: GET /redfish/v1/: refused")
    assert lines[1][1] == (
        logging.WARNING,
        f"fabric manager still unreachable at {URL} after 300 s (61 attempts): "
        "GET /redfish/v1/: refused",
    )
    assert not reach.ok
    assert reach.problem("hall-1") == (
        f"fabric of domain hall-1: fabric manager unreachable at {URL} since "
        "2027-01-15T08:00:00+00:00: GET /redfish/v1/: refused"
    )

    assert reach.answered(T0 + 542.0) == (
        logging.INFO,
        f"fabric manager reachable again at {URL} after 542 s (100 failed attempts)",
    )
    assert reach.ok and reach.problem("hall-1") is None
    assert reach.answered(T0 + 547.0) is None  # said once

    # A new outage starts over: its first failure is said at once, with its own error.
    level, again = reach.failed(T0 + 600.0, "GET /redfish/v1/: no answer within 5 s") or (0, "")
    assert again.startswith(f"fabric manager unreachable at {URL}: GET /redfish/v1/: no answer")
    assert "since 2027-01-15T08:10:00+00:00" in (reach.problem("hall-1") or "")
