"""CompositionService.ReservationDuration: how long a `PreviewReserve` holds what it reserved.

An Administrator may PATCH it (ARCHITECTURE §11); it is kept in a file of its own beside the
accounts file, so a restart keeps it. Redfish writes it as an ISO 8601 duration (`PT300S`);
days, hours, minutes and whole seconds are taken, not years or months, whose length varies.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from trellis.adapters.http.redfish.accounts import write_private
from trellis.engine.core.intents import LEASE_SECONDS_RANGE, RESERVATION_SECONDS

#: The engine's own default for a reserve that names no duration.
DEFAULT_SECONDS = RESERVATION_SECONDS
#: A reservation holds for as long as a lease may run, at most: the engine's own bound.
SECONDS_RANGE = LEASE_SECONDS_RANGE
_DURATION = re.compile(r"P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?")


class _Stored(msgspec.Struct):
    seconds: int


def parse(text: str) -> int | None:
    """The seconds of an ISO 8601 duration such as `PT300S` or `P1DT2H`; None if it is not one
    this service takes."""
    found = _DURATION.fullmatch(text)
    if found is None or text in ("P", "PT") or text.endswith("T"):
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in found.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def text(seconds: int) -> str:
    return f"PT{seconds}S"


class ReservationDuration:
    """The duration in force, read from `path` (DEFAULT_SECONDS when there is none yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds = DEFAULT_SECONDS
        if path.exists():
            self.seconds = msgspec.json.decode(path.read_bytes(), type=_Stored).seconds

    def set(self, seconds: int) -> None:
        write_private(self.path, msgspec.json.encode(_Stored(seconds)))
        self.seconds = seconds
