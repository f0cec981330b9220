-- Stored replies are as permanent as the events they answer: without them a resent request_id
-- would be decided and executed a second time. TRUNCATE joins UPDATE and DELETE as refused.
CREATE TRIGGER trellis_requests_no_truncate BEFORE TRUNCATE ON trellis_requests
    FOR EACH STATEMENT EXECUTE FUNCTION trellis_events_immutable();

-- trellis_streams is the chain trigger's bookkeeping. Only that trigger may change it (it runs
-- at trigger depth 2 when it does); a direct UPDATE could otherwise let a later insert skip
-- versions or break the hash chain.
CREATE FUNCTION trellis_streams_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF pg_trigger_depth() < 2 THEN
        RAISE EXCEPTION 'trellis_streams is maintained by the event log: % is not allowed', TG_OP
            USING ERRCODE = 'TR002';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER trellis_streams_guard BEFORE INSERT OR UPDATE OR DELETE ON trellis_streams
    FOR EACH ROW EXECUTE FUNCTION trellis_streams_guard();
CREATE TRIGGER trellis_streams_no_truncate BEFORE TRUNCATE ON trellis_streams
    FOR EACH STATEMENT EXECUTE FUNCTION trellis_events_immutable();
