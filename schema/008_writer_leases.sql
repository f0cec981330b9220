-- One writer per domain, fenced (engine/service.py, adapters/postgres/leases.py).
--
-- An engine writes a domain only while it holds the domain's lease. Each acquisition after the
-- lease lapsed draws a new epoch, and every event carries the epoch of the writer that
-- appended it: the chain trigger refuses an event whose epoch is not the domain's current one,
-- or whose lease has run out, checked under the lease row's lock. So an ex-writer (paused past
-- its lease, then resumed) can never commit, even with a batch it decided before the pause,
-- and an auditor can see which writer epoch appended each event. Times are the database's
-- (clock_timestamp()), so no two engine clocks are compared.

-- Engines that are up, for spreading domains over them; a heartbeat older than its lease
-- time means the engine is gone. An engine limited to some domains (TRELLIS_DOMAINS) takes no
-- part in spreading the others.
CREATE TABLE trellis_engines (
    id            text        PRIMARY KEY,
    name          text        NOT NULL,
    serves_all    boolean     NOT NULL,
    started_at    timestamptz NOT NULL,
    heartbeat_at  timestamptz NOT NULL
);

CREATE TABLE trellis_writer_leases (
    domain      text        PRIMARY KEY,
    holder      text        NOT NULL,  -- trellis_engines.id
    epoch       bigint      NOT NULL CHECK (epoch >= 1),
    expires_at  timestamptz NOT NULL
);

-- The writer epoch an event or a stored answer was committed under (NULL: before leases).
ALTER TABLE trellis_events ADD COLUMN fence bigint;
ALTER TABLE trellis_requests ADD COLUMN fence bigint;

CREATE FUNCTION trellis_check_fence(target text, fence bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    lease record;
BEGIN
    -- FOR SHARE: a takeover (which updates the row) waits for this append to end, so an
    -- append either commits before the new epoch exists, and the new writer reads it, or it is
    -- refused.
    SELECT epoch, expires_at INTO lease FROM trellis_writer_leases WHERE domain = target FOR SHARE;
    IF NOT FOUND THEN
        RETURN;  -- a domain no engine has leased yet (tools, a first import racing its lease)
    END IF;
    IF fence IS DISTINCT FROM lease.epoch OR lease.expires_at <= clock_timestamp() THEN
        RAISE EXCEPTION 'domain % is fenced: an append with writer epoch % while epoch % holds the lease until %',
            target, coalesce(fence::text, 'none'), lease.epoch, lease.expires_at
            USING ERRCODE = 'TR004';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION trellis_events_chain() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM trellis_check_fence(NEW.domain, NEW.fence);
    IF NEW.version = 1 THEN
        IF NEW.prev_hash <> repeat('0', 64) THEN
            RAISE EXCEPTION 'first event of % must follow the genesis hash', NEW.domain
                USING ERRCODE = 'TR001';
        END IF;
        INSERT INTO trellis_streams (domain, version, position, hash)
            VALUES (NEW.domain, 1, NEW.position, NEW.hash)
            ON CONFLICT (domain) DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'domain % already has events', NEW.domain USING ERRCODE = 'TR001';
        END IF;
    ELSE
        UPDATE trellis_streams
           SET version = NEW.version, position = NEW.position, hash = NEW.hash
         WHERE domain = NEW.domain AND version = NEW.version - 1 AND hash = NEW.prev_hash;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'event % of % does not follow the stream head', NEW.version, NEW.domain
                USING ERRCODE = 'TR001';
        END IF;
    END IF;
    RETURN NEW;
END $$;

-- An answer stored without events (an idempotent no-op) is an acknowledgement too: fenced alike.
CREATE FUNCTION trellis_requests_fence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM trellis_check_fence(NEW.domain, NEW.fence);
    RETURN NEW;
END $$;

CREATE TRIGGER trellis_requests_fence BEFORE INSERT ON trellis_requests
    FOR EACH ROW EXECUTE FUNCTION trellis_requests_fence();

-- As schema/006 set it: the chain trigger runs with its owner's rights, names pinned to this
-- schema (pg_temp last), so the engine's role needs neither UPDATE on trellis_streams nor any
-- right on the leases to be checked against them.
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION trellis_events_chain() SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
    EXECUTE format(
        'ALTER FUNCTION trellis_requests_fence() SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
    EXECUTE format(
        'ALTER FUNCTION trellis_check_fence(text, bigint) SET search_path = %I, pg_temp',
        current_schema());
END $$;
REVOKE ALL ON FUNCTION trellis_events_chain() FROM PUBLIC;
REVOKE ALL ON FUNCTION trellis_requests_fence() FROM PUBLIC;
REVOKE ALL ON FUNCTION trellis_check_fence(text, bigint) FROM PUBLIC;
