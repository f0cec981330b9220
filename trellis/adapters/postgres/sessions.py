"""What each Trellis session with Postgres is for, said as its `application_name`.

An operator looking at `pg_stat_activity` (or at a log line whose `log_line_prefix` has `%a`)
sees which part of Trellis holds each session: the engine's appends, its leases, a follower's
projections, relay or audit trail, the follower process's reads of the log, or a command.
"""

from __future__ import annotations

from collections.abc import Mapping

ENGINE = "trellis engine"  # the engine's appends and its reads of the log
LEASES = "trellis leases"  # the writer leases, on a pool of their own
PROJECTIONS = "trellis projections"  # the projections' folds: live, or `projections rebuild`
RELAY = "trellis relay"  # the event relay's checkpoint
AUDIT = "trellis audit"  # the audit trail's signed checkpoints
FOLLOWER = "trellis follower"  # the follower process's reads of the log
MIGRATIONS = "trellis migrations"  # the owner's session that migrates the schema
COMMAND = "trellis cli"  # a command run by hand: the log it reads, export, verify
DEFAULT = "trellis"

#: The sessions that follow the log (what the follower process holds, by default).
FOLLOWERS = (PROJECTIONS, RELAY, AUDIT, FOLLOWER)
#: The sessions of the engine's own work on the intent path.
ENGINE_SESSIONS = (ENGINE, LEASES)

#: What a session of each purpose sets besides its name. The projections find rows by key in
#: tables that grow from empty by orders of magnitude while one session lasts. asyncpg keeps
#: its prepared statements, and Postgres would soon reuse one plan for each (its generic plan),
#: made for the size the table had then: made on an empty table, it scanned the whole table
#: for the keys, or walked another index over a whole domain, for as long as the session
#: lasted. Planned at each run, a statement follows the table's size.
SETTINGS: Mapping[str, Mapping[str, str]] = {
    PROJECTIONS: {"plan_cache_mode": "force_custom_plan"},
}
