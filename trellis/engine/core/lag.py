"""Whether each log follower of each domain keeps up (pure, like decide.py: time comes in).

A follower (the projections, the event relay) is **stalled** when the log is ahead of it and it
has not advanced for `stall_s` seconds since it fell behind, and **too far behind** when it
trails the log by more than `max_behind` events. Either makes the engine's health check fail,
naming the domain and the part (ARCHITECTURE §10, Health). A follower that is behind but moving
is neither: it is catching up.

The tracker is fed observations (the log's head and each follower's checkpoint, as versions)
and keeps, per (domain, part), when it last saw the follower move and since when it has been
behind; nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

DEFAULT_STALL_S = 60.0
DEFAULT_MAX_BEHIND = 10_000


class PartHealth(msgspec.Struct, frozen=True, kw_only=True):
    """One follower of one domain, as last observed."""

    domain: str
    part: str  # a projection's name, or relay
    head: int  # the log's last version...
    head_position: int  # ...and its position
    version: int  # the follower's: the last version it applied...
    position: int  # ...and its position
    behind: int  # events
    stalled_s: float  # seconds it has been behind without moving (0: not behind, or moving)
    ok: bool
    reason: str = ""  # why not ok


class _Seen(msgspec.Struct):
    version: int
    moved_at: float
    behind_since: float | None


class LagTracker:
    """Keeps up with the followers' progress; `observe` gives each one's health."""

    def __init__(self, stall_s: float = DEFAULT_STALL_S, max_behind: int = DEFAULT_MAX_BEHIND):
        self.stall_s = stall_s
        self.max_behind = max_behind
        self._seen: dict[tuple[str, str], _Seen] = {}

    def observe(
        self,
        now: float,
        heads: Mapping[str, tuple[int, int]],
        followers: Mapping[tuple[str, str], tuple[int, int]],
    ) -> list[PartHealth]:
        """The health of every (domain, part) in `followers` (version, position), given each
        domain's head (version, position), at monotonic time `now`. Parts no longer observed
        are forgotten."""
        report = []
        for (domain, part), (version, position) in sorted(followers.items()):
            head, head_position = heads.get(domain, (version, position))
            seen = self._seen.get((domain, part))
            if seen is None or version != seen.version:
                seen = _Seen(version=version, moved_at=now, behind_since=None)
                self._seen[(domain, part)] = seen
            behind = max(0, head - version)
            if behind == 0:
                seen.behind_since = None
            elif seen.behind_since is None:
                seen.behind_since = now
            since = seen.behind_since
            stalled_s = 0.0 if since is None else now - max(seen.moved_at, since)
            reason = ""
            if behind and stalled_s >= self.stall_s:
                reason = (
                    f"{part} of domain {domain}: not moved for {stalled_s:.0f} s "
                    f"while the log is {behind} events ahead (at version {version} of {head})"
                )
            elif behind > self.max_behind:
                reason = (
                    f"{part} of domain {domain}: {behind} events behind the log "
                    f"(more than {self.max_behind}; at version {version} of {head})"
                )
            report.append(
                PartHealth(
                    domain=domain,
                    part=part,
                    head=head,
                    head_position=head_position,
                    version=version,
                    position=position,
                    behind=behind,
                    stalled_s=round(stalled_s, 3),
                    ok=not reason,
                    reason=reason,
                )
            )
        for gone in self._seen.keys() - followers.keys():
            del self._seen[gone]
        return report
