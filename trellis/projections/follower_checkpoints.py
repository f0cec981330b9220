"""The checkpoint row of one named log follower and one domain (trellis_follower_checkpoints,
schema/005), as the sinks that keep a single checkpoint each (the relay, the checkpointer)
read, lock and move it inside their own transactions.

A checkpoint names an event by version and position. A log that lost its tail (a failover to
a standby without it: docs/deployment.md §3) and was written on since holds another event at
that version, at another position, or none: `HELD` says whether it still holds that one, and
`SHARED` finds the last event the log and a follower that went that far still have in common.
"""

from __future__ import annotations

ENSURE = """
INSERT INTO trellis_follower_checkpoints (follower, domain, version, position)
VALUES ($1, $2, 0, 0) ON CONFLICT (follower, domain) DO NOTHING
"""
READ = """
SELECT version, position FROM trellis_follower_checkpoints WHERE follower = $1 AND domain = $2
"""
LOCK = READ + " FOR UPDATE"  # a batch holds it, so two followers of a domain take turns
SAVE = """
UPDATE trellis_follower_checkpoints SET version = $3, position = $4
 WHERE follower = $1 AND domain = $2
"""

#: Whether the log still holds the event the checkpoint row `c` names (one index look-up).
HELD = """(c.version = 0 OR EXISTS (
    SELECT 1 FROM trellis_events e
     WHERE e.domain = c.domain AND e.version = c.version AND e.position = c.position))"""
READ_HELD = f"""
SELECT c.version, c.position, {HELD} AS held FROM trellis_follower_checkpoints c
 WHERE c.follower = $1 AND c.domain = $2
"""
LOCK_HELD = READ_HELD + " FOR UPDATE OF c"
#: The domain's last event at or before position $2: the event there itself when the log still
#: holds it, else the last one before what the log lost (what was written since it lost them
#: has later positions).
SHARED = """
SELECT version, position FROM trellis_events
 WHERE domain = $1 AND position <= $2 ORDER BY position DESC LIMIT 1
"""
