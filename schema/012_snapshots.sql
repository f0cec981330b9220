-- Point in time (ARCHITECTURE §4, §6): monotonic recorded_at, a time index, and snapshots.

-- `recorded_at` never decreases along a domain's versions, so "the state at time T" is well
-- defined and time maps to position monotonically. The writer assigns it under its append
-- (engine/writer.py); the log refuses an event that would go back in time, whoever writes.
-- Row triggers of one timing fire in name order: after the content check, before the chain.
CREATE FUNCTION trellis_events_check_time() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    previous timestamptz;
BEGIN
    -- The predecessor is the stream's head (the chain trigger moves it after this one): two
    -- primary-key lookups, whatever the planner thinks of the table's other indexes.
    SELECT e.recorded_at INTO previous
      FROM trellis_streams s JOIN trellis_events e ON e.position = s.position
     WHERE s.domain = NEW.domain;
    IF previous IS NOT NULL AND NEW.recorded_at < previous THEN
        RAISE EXCEPTION 'event % of % is recorded at %, before its predecessor (%)',
            NEW.version, NEW.domain, NEW.recorded_at, previous
            USING ERRCODE = 'TR005';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER trellis_events_b_time BEFORE INSERT ON trellis_events
    FOR EACH ROW EXECUTE FUNCTION trellis_events_check_time();

-- "The domain's last event at or before T" (a time, or a log position), for queries with `at`.
CREATE INDEX trellis_events_domain_time ON trellis_events (domain, recorded_at, version);
CREATE INDEX trellis_events_domain_position ON trellis_events (domain, position);

-- Snapshots of a domain's folds, outside the log and disposable: the state the engine decides
-- on (kind 'state') and the projections' live rows (kind 'read_models'), each as of one event,
-- named by its version, position and chain hash, and checked against the log before use.
-- `format` fingerprints the encoding; a snapshot of another format is ignored, not decoded.
CREATE TABLE trellis_snapshots (
    domain       text        NOT NULL,
    kind         text        NOT NULL CHECK (kind IN ('state', 'read_models')),
    version      bigint      NOT NULL CHECK (version >= 1),
    position     bigint      NOT NULL CHECK (position >= 1),
    hash         text        NOT NULL CHECK (length(hash) = 64),
    format       text        NOT NULL,
    body         bytea       NOT NULL,
    taken_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (domain, kind, version)
);
