-- A writer woken after a takeover is fenced before its events' times are judged (issue 25:
-- a paused engine must give up quietly). Row triggers fire in name order, so schema/012's
-- time check ran before the chain trigger's fence check and judged a stale writer's events
-- against its successor's: refused as content, where the writer must hear "fenced" and the
-- client "resend". The time check now leaves an event that does not follow the stream's head
-- to the chain trigger (a conflict, or fenced), and checks the fence itself before it refuses.
CREATE OR REPLACE FUNCTION trellis_events_check_time() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    head_version bigint;
    previous timestamptz;
BEGIN
    SELECT s.version, e.recorded_at INTO head_version, previous
      FROM trellis_streams s JOIN trellis_events e ON e.position = s.position
     WHERE s.domain = NEW.domain;
    IF previous IS NOT NULL AND head_version = NEW.version - 1 AND NEW.recorded_at < previous THEN
        PERFORM trellis_check_fence(NEW.domain, NEW.fence);
        RAISE EXCEPTION 'event % of % is recorded at %, before its predecessor (%)',
            NEW.version, NEW.domain, NEW.recorded_at, previous
            USING ERRCODE = 'TR005';
    END IF;
    RETURN NEW;
END $$;

-- Like the chain trigger (schema/006, 008): its owner's rights, names pinned to this schema,
-- so the engine's role needs no right on the leases to be checked against them.
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION trellis_events_check_time() SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
END $$;
REVOKE ALL ON FUNCTION trellis_events_check_time() FROM PUBLIC;
