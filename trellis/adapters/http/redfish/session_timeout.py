"""SessionService.SessionTimeout: how long a session lives without use.

An Administrator may PATCH it (the CSDL has it ReadWrite, 30 to 86,400 s); it is kept in a file
of its own beside the accounts file, as CompositionService.ReservationDuration is, so a restart
keeps it. It is applied to the account store, whose sessions read it at each use.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from trellis.adapters.http.redfish.accounts import AccountStore, write_private


class _Stored(msgspec.Struct):
    seconds: int


class SessionTimeout:
    """The timeout in force for `store`'s sessions, read from `path` (the store's own default
    when there is none yet)."""

    def __init__(self, store: AccountStore, path: Path) -> None:
        self.store = store
        self.path = path
        if path.exists():
            store.session_timeout_s = msgspec.json.decode(path.read_bytes(), type=_Stored).seconds

    @property
    def seconds(self) -> int:
        return self.store.session_timeout_s

    def set(self, seconds: int) -> None:
        write_private(self.path, msgspec.json.encode(_Stored(seconds)))
        self.store.session_timeout_s = seconds
