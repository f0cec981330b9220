"""Which keys two versions of a map differ in: the reference of ``ext._diff_c``.

The engine's state evolves by copies that share every entry an event did not touch, so the
entries an event replaced are the ones that are not the very same object before and after.
Only those are compared (entries may be deep structs, or not hashable at all); one rebuilt equal
(a re-import rebuilds every node it keeps) did not change.
"""

from __future__ import annotations

from collections.abc import Hashable
from itertools import compress
from operator import is_not
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)

_ABSENT = object()


def changed_keys(before: dict[K, Any], after: dict[K, Any]) -> set[K]:
    """The keys added, dropped, or whose entry in `after` is another object and not equal."""
    if before is after:
        return set()
    replaced = before.keys() ^ after.keys()
    # A key dropped from `after` reads as None here; it is in `replaced` already.
    replaced.update(
        compress(before.keys(), map(is_not, before.values(), map(after.get, before.keys())))
    )
    return {k for k in replaced if before.get(k, _ABSENT) != after.get(k, _ABSENT)}
