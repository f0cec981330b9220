"""How many failed logins a client may make: a burst, then a few a second.

Every password check costs a hash of tens of milliseconds in a small pool of hashing threads
(accounts.py), shared by every client. A flood of wrong passwords, or of made-up user names,
from one address filled that queue and held every other client's login behind it for seconds
(the hostile-tenant probe: 4-6 s). So failures are budgeted twice, and past either budget a
login is answered 429 without a hash until it refills:

- per address and user name, 10 at once then one a second: guessing one user's password is
  slow, and someone guessing on the same host (every local client shares 127.0.0.1) leaves
  other users' logins alone;
- per address, 50 at once then ten a second: made-up user names are free to invent, and ten
  hashes a second keep the hashing threads mostly free for everyone else.

Whether a user name exists changes neither budget (that would tell a guesser which names do).
Credentials already proven are answered from memory and never reach here
(accounts.AccountStore.proven); a success takes nothing from a budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

from trellis.engine.core.throttle import Bucket, RateLimit, refilled, take

#: Failures per address and user name at once, and how fast that budget refills (a second).
USER_BURST = 10
USER_REFILL_PER_S = 1.0
#: Failures per address, whatever the user name.
ADDRESS_BURST = 50
ADDRESS_REFILL_PER_S = 10.0
#: Budgets remembered at most, per kind; past that, those whole again are forgotten first.
_REMEMBERED = 4096


class _Budgets:
    """Token buckets (engine/core/throttle.py) by key: a failure takes a token, and a login is
    checked only while its bucket holds one."""

    def __init__(self, burst: int, refill_per_s: float, clock: Callable[[], float]) -> None:
        self._limit = RateLimit(per_second=refill_per_s, burst=burst)
        self._clock = clock
        self._buckets: dict[Hashable, Bucket] = {}

    def wait_s(self, key: Hashable) -> int:
        left = self._left(key)
        return 0 if left >= 1 else max(1, math.ceil((1 - left) / self._limit.per_second))

    def failed(self, key: Hashable) -> None:
        if len(self._buckets) >= _REMEMBERED and key not in self._buckets:
            self._forget()
        self._buckets[key], _ = take(self._buckets.get(key), self._clock(), self._limit)

    def _left(self, key: Hashable) -> float:
        limit = self._limit
        bucket = refilled(self._buckets.get(key), self._clock(), limit.per_second, limit.burst)
        return bucket.tokens

    def _forget(self) -> None:
        """Room for one more: the budgets whole again, else those nearest to whole (never the
        emptiest: a flood from many addresses must not reset the throttled ones)."""
        whole = [k for k in self._buckets if self._left(k) >= self._limit.burst]
        if not whole:
            fullest = sorted(self._buckets, key=self._left, reverse=True)
            whole = fullest[: len(self._buckets) // 2]
        for key in whole:
            del self._buckets[key]


class LoginGuard:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._users = _Budgets(USER_BURST, USER_REFILL_PER_S, clock)
        self._addresses = _Budgets(ADDRESS_BURST, ADDRESS_REFILL_PER_S, clock)

    def wait_s(self, address: str, user_name: str) -> int:
        """0 when a password of `user_name` may be checked for `address` now, else the whole
        seconds until it may."""
        return max(self._users.wait_s((address, user_name)), self._addresses.wait_s(address))

    def failed(self, address: str, user_name: str) -> None:
        """One failed login from `address` as `user_name`."""
        self._users.failed((address, user_name))
        self._addresses.failed(address)
