"""Answers larger than one message come in pages (ARCHITECTURE §10, Size).

A query's answer is one reply on NATS, whose server refuses a message over its max_payload
(1 MiB by default). The answers that grow with a domain (`topology`, `free`, `connections`,
`history`) are cut into pages of at most REPLY_BUDGET bytes: a page holds the items of the
answer's lists, in their order, from the asker's `offset`, and `next` says where the following
page starts (absent on the last). A client asks for each next page with the first page's
position as `at`, so all pages are of one moment, and joins the lists
(adapters/nats/client.py `query_all`). An answer that fits is one page, as before.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec

REPLY_BUDGET = 512 * 1024  # bytes of a page's result, leaving room for the reply's envelope

_encode = msgspec.json.Encoder().encode
R = TypeVar("R", bound=msgspec.Struct)


def paged(result: R, offset: int, budget: int = REPLY_BUDGET) -> R:
    """The page of `result` that starts `offset` items into its lists (fields in order)."""
    names = [f for f in result.__struct_fields__ if isinstance(getattr(result, f), list)]
    lists: list[list[Any]] = [getattr(result, f) for f in names]
    total = sum(len(items) for items in lists)
    whole = len(_encode(result))
    if offset == 0 and whole <= budget:
        return result
    # Items are about alike in size: take as many as the budget holds on average, then fewer
    # until the page fits.
    each = max(1.0, whole / max(1, total))
    count = max(1, math.floor(budget * 0.9 / each))
    while True:
        page = _slice(result, names, lists, offset, count)
        if count == 1 or len(_encode(page)) <= budget:
            return page
        count = max(1, count * 3 // 4)


def _slice(result: R, names: list[str], lists: list[list[Any]], offset: int, count: int) -> R:
    taken: dict[str, list[Any]] = {}
    start, end = offset, offset + count
    for name, items in zip(names, lists, strict=True):
        taken[name] = items[max(0, start) : max(0, end)]
        start, end = start - len(items), end - len(items)
    total = sum(len(items) for items in lists)
    following = offset + count if offset + count < total else msgspec.UNSET
    return msgspec.structs.replace(result, **taken, next=following)
