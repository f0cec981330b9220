"""Which engine should write which domain: rendezvous hashing with balanced loads.

Every engine computes the same answer from the same inputs (the live engines and the domains
the log holds), so no coordinator is needed: each claims what is placed on it and hands over
what is placed elsewhere, through the fenced writer leases.

Plain rendezvous hashing (each domain on its highest-scoring engine) moves few domains when an
engine comes or goes, but its loads are only balanced on average: 24 domains over 3 engines
can land 12, 7, 5. Here each engine has a quota, `len(domains) // len(engines)` plus one for
the first `len(domains) % len(engines)` engines (by id), so the quotas add up to the domains
exactly and every engine ends within one of every other. Domains are placed in order of their
best score, each on its highest-scoring engine with room left: a domain keeps its engine unless
that engine is full, so joins and leaves still move few domains. `cap` bounds any engine's
share (an operator's limit); the domains beyond every engine's cap are placed nowhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def score(engine: str, domain: str) -> bytes:
    """How much `domain` wants `engine` (larger wins): the rendezvous hash of the pair."""
    return hashlib.sha256(f"{engine}/{domain}".encode()).digest()


def spread(domains: Iterable[str], engines: Iterable[str], cap: int = 0) -> dict[str, str]:
    """domain -> engine for every domain that has a place; `cap` > 0 limits each engine."""
    names = sorted(set(engines))
    wanted = sorted(set(domains))
    if not names:
        return {}
    each, extra = divmod(len(wanted), len(names))
    room = {e: each + (1 if i < extra else 0) for i, e in enumerate(names)}
    if cap > 0:
        room = {e: min(r, cap) for e, r in room.items()}
        # Room taken from an engine by the cap goes to the others, up to their caps.
        spare = len(wanted) - sum(room.values())
        for e in names:
            if spare <= 0:
                break
            more = min(cap - room[e], spare)
            room[e] += more
            spare -= more
    ranked = {d: _ranked(names, d) for d in wanted}
    placed: dict[str, str] = {}
    # The domains whose first choice is strongest go first, so a domain keeps its engine
    # unless stronger claims filled it.
    for domain in sorted(wanted, key=lambda d: score(ranked[d][0], d), reverse=True):
        for engine in ranked[domain]:
            if room[engine] > 0:
                room[engine] -= 1
                placed[domain] = engine
                break
    return placed


def _ranked(engines: list[str], domain: str) -> list[str]:
    """`engines` from the one `domain` wants most to the one it wants least."""
    return sorted(engines, key=lambda e: score(e, domain), reverse=True)
