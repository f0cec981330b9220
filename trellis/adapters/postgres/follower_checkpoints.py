"""The checkpoint row of one named log follower and one domain (trellis_follower_checkpoints,
schema/005), as the sinks that keep a single checkpoint each (the relay, the checkpointer)
read, lock and move it inside their own transactions."""

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
