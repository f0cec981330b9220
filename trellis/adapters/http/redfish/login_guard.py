"""How many failed logins one client address may make: a burst, then a few a second.

Every password check costs a hash of tens of milliseconds in a small pool of hashing threads
(accounts.py), shared by every client. A flood of wrong passwords, or of made-up user names,
from one address filled that queue and held every other client's login behind it for seconds
(the hostile-tenant probe: 4-6 s). Past its budget an address is answered 429 without a hash,
until the budget refills; credentials already proven are answered from memory and never wait
here (accounts.AccountStore.proven). By address, not by user name: made-up names are free to
invent. A budget is for guesses, not for users: each failure takes one, a success none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: Failures an address may make at once, and how fast its budget refills (one per second): a
#: person who mistypes a few times never meets it, a script guessing passwords does.
FAILURE_BURST = 10
REFILL_PER_S = 1.0
#: Addresses remembered at most; past that, those whose budget is whole again are forgotten.
_ADDRESSES = 4096


class LoginGuard:
    def __init__(
        self,
        burst: int = FAILURE_BURST,
        refill_per_s: float = REFILL_PER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._burst = burst
        self._refill = refill_per_s
        self._clock = clock
        self._budgets: dict[str, tuple[float, float]] = {}  # address: (failures left, when)

    def wait_s(self, address: str) -> int:
        """0 when `address` may try a password now, else the whole seconds until it may."""
        left = self._left(address)
        if left >= 1:
            return 0
        return max(1, math.ceil((1 - left) / self._refill))

    def failed(self, address: str) -> None:
        """One failed login from `address`."""
        if len(self._budgets) >= _ADDRESSES and address not in self._budgets:
            self._forget_whole()
        self._budgets[address] = (self._left(address) - 1, self._clock())

    def _left(self, address: str) -> float:
        known = self._budgets.get(address)
        if known is None:
            return float(self._burst)
        left, when = known
        return min(float(self._burst), left + (self._clock() - when) * self._refill)

    def _forget_whole(self) -> None:
        whole = [a for a in self._budgets if self._left(a) >= self._burst]
        for address in whole or list(self._budgets)[: _ADDRESSES // 2]:
            del self._budgets[address]
