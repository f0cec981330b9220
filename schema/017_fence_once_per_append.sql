-- The writer fence (schema/008) checked once per append and domain, not once per event
-- (issue 26: the log's triggers run inside the append's lock, so their time per event bounds
-- a busy domain's rate; docs/benchmarks.md).
--
-- The chain trigger looked the lease up, FOR SHARE, before every event it linked: a batch of
-- 13 events read and locked the same lease row 13 times, some 10 µs an event. The lease is now
-- checked by a statement trigger, once per domain among the appended rows, before the append
-- can commit and under the same lock, so what it guarantees is unchanged: an append either
-- commits before a new epoch exists, and the new writer reads it, or it is refused. A row that
-- does not link still hears "fenced" first (schema/013: a paused writer must give up quietly):
-- the chain trigger checks the fence before it raises a time (TR005) or conflict (TR001)
-- refusal. Stored answers (trellis_requests_fence) keep their row check, which runs before the
-- unique key of a resent answer is tested.

CREATE OR REPLACE FUNCTION trellis_events_chain() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    head record;
BEGIN
    IF NEW.version = 1 THEN
        IF NEW.prev_hash <> repeat('0', 64) THEN
            PERFORM trellis_check_fence(NEW.domain, NEW.fence);
            RAISE EXCEPTION 'first event of % must follow the genesis hash', NEW.domain
                USING ERRCODE = 'TR001';
        END IF;
        INSERT INTO trellis_streams (domain, version, position, hash, recorded_at)
            VALUES (NEW.domain, 1, NEW.position, NEW.hash, NEW.recorded_at)
            ON CONFLICT (domain) DO NOTHING;
        IF NOT FOUND THEN
            PERFORM trellis_check_fence(NEW.domain, NEW.fence);
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
        PERFORM trellis_check_fence(NEW.domain, NEW.fence);
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

-- After the rows, before the commit: a refusal here rolls the whole append back.
CREATE FUNCTION trellis_events_fence() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    writer record;
BEGIN
    FOR writer IN SELECT DISTINCT domain, fence FROM appended LOOP
        PERFORM trellis_check_fence(writer.domain, writer.fence);
    END LOOP;
    RETURN NULL;
END $$;

CREATE TRIGGER trellis_events_fence AFTER INSERT ON trellis_events
    REFERENCING NEW TABLE AS appended
    FOR EACH STATEMENT EXECUTE FUNCTION trellis_events_fence();

-- As schema/006 and 008 require of the log's functions: the owner's rights, names pinned.
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION trellis_events_chain() SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
    EXECUTE format(
        'ALTER FUNCTION trellis_events_fence() SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
END $$;
REVOKE ALL ON FUNCTION trellis_events_chain() FROM PUBLIC;
REVOKE ALL ON FUNCTION trellis_events_fence() FROM PUBLIC;
