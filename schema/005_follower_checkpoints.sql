-- Per-domain checkpoints of the log followers (engine/follower.py): how far each projection
-- (projections/sink.py) and the event relay (adapters/nats/relay.py, follower 'relay:<stream>')
-- have applied each domain, by the version and position of the last event applied. Followers
-- run one per domain, so one domain's trouble never holds up another's read models or feed.
-- A follower locks its row (FOR UPDATE) for the length of a batch: two followers of the same
-- domain (another engine instance, a rebuild) take turns and never apply a batch twice.
CREATE TABLE trellis_follower_checkpoints (
    follower  text   NOT NULL,
    domain    text   NOT NULL,
    version   bigint NOT NULL CHECK (version >= 0),
    position  bigint NOT NULL CHECK (position >= 0),
    PRIMARY KEY (follower, domain)
);

-- The global checkpoints before this one carry over: every event at or below a follower's
-- global position was applied, so each domain's checkpoint is its last event there.
INSERT INTO trellis_follower_checkpoints (follower, domain, version, position)
SELECT c.name, e.domain, max(e.version), max(e.position)
  FROM trellis_checkpoints c JOIN trellis_events e ON e.position <= c.position
 GROUP BY c.name, e.domain;

INSERT INTO trellis_follower_checkpoints (follower, domain, version, position)
SELECT 'relay:' || r.stream, e.domain, max(e.version), max(e.position)
  FROM trellis_relay_checkpoints r JOIN trellis_events e ON e.position <= r.position
 GROUP BY r.stream, e.domain;

DROP TABLE trellis_checkpoints;
DROP TABLE trellis_relay_checkpoints;
