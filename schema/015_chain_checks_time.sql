-- One pass per event for the chain and the time check (issue 26: the log's triggers cost a third
-- of the intent path's throughput at 64 clients, docs/benchmarks.md).
--
-- schema/012-013's time check was a trigger of its own: a plpgsql call per event that joined
-- the stream's head to its event to read the predecessor's time, just before the chain trigger
-- read and moved the same head. The head now keeps its event's time, and the chain trigger
-- moves it only forward in time, in the same UPDATE. What is refused, and with which code, is
-- unchanged: content (TR003, schema/007), then fenced (TR004), then recorded before its
-- predecessor (TR005, only for an event that follows the head), then a conflict (TR001).

ALTER TABLE trellis_streams ADD COLUMN recorded_at timestamptz;
-- Heads written before this migration learn their event's time. Only the chain trigger may
-- change trellis_streams (schema/003), so its guard stands aside for this one statement.
ALTER TABLE trellis_streams DISABLE TRIGGER trellis_streams_guard;
UPDATE trellis_streams s SET recorded_at = e.recorded_at
  FROM trellis_events e
 WHERE e.position = s.position;
ALTER TABLE trellis_streams ENABLE TRIGGER trellis_streams_guard;
ALTER TABLE trellis_streams ALTER COLUMN recorded_at SET NOT NULL;

DROP TRIGGER trellis_events_b_time ON trellis_events;
DROP FUNCTION trellis_events_check_time();

CREATE OR REPLACE FUNCTION trellis_events_chain() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    head record;
BEGIN
    PERFORM trellis_check_fence(NEW.domain, NEW.fence);
    IF NEW.version = 1 THEN
        IF NEW.prev_hash <> repeat('0', 64) THEN
            RAISE EXCEPTION 'first event of % must follow the genesis hash', NEW.domain
                USING ERRCODE = 'TR001';
        END IF;
        INSERT INTO trellis_streams (domain, version, position, hash, recorded_at)
            VALUES (NEW.domain, 1, NEW.position, NEW.hash, NEW.recorded_at)
            ON CONFLICT (domain) DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'domain % already has events', NEW.domain USING ERRCODE = 'TR001';
        END IF;
        RETURN NEW;
    END IF;
    UPDATE trellis_streams
       SET version = NEW.version, position = NEW.position, hash = NEW.hash,
           recorded_at = NEW.recorded_at
     WHERE domain = NEW.domain AND version = NEW.version - 1 AND hash = NEW.prev_hash
       AND recorded_at <= NEW.recorded_at;
    IF NOT FOUND THEN
        -- Say why: an event that follows the head but goes back in time is refused as such;
        -- anything else lost a race or does not link (a conflict).
        SELECT version, recorded_at INTO head FROM trellis_streams WHERE domain = NEW.domain;
        IF head.version = NEW.version - 1 AND NEW.recorded_at < head.recorded_at THEN
            RAISE EXCEPTION 'event % of % is recorded at %, before its predecessor (%)',
                NEW.version, NEW.domain, NEW.recorded_at, head.recorded_at
                USING ERRCODE = 'TR005';
        END IF;
        RAISE EXCEPTION 'event % of % does not follow the stream head', NEW.version, NEW.domain
            USING ERRCODE = 'TR001';
    END IF;
    RETURN NEW;
END $$;

-- As schema/006 and 008 require of any restatement: the owner's rights, names pinned.
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION trellis_events_chain() SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
END $$;
REVOKE ALL ON FUNCTION trellis_events_chain() FROM PUBLIC;
