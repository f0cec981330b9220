-- The append-only event log, its per-domain stream heads and the request-id table.
-- Objects live in the connection's current schema (search_path), so tests can isolate.

CREATE TABLE trellis_events (
    -- Global order. Appends are serialised (see trellis_append_lock below), so positions become
    -- visible in commit order and a tailing reader never skips a late, lower position. A rolled
    -- back append burns identity values: gaps exist, but they are permanent and never filled.
    position        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id              uuid        NOT NULL UNIQUE,
    domain          text        NOT NULL,
    version         bigint      NOT NULL CHECK (version >= 1),
    type            text        NOT NULL,
    schema_version  integer     NOT NULL CHECK (schema_version >= 1),
    recorded_at     timestamptz NOT NULL,
    actor           text        NOT NULL,
    causation_id    text        NOT NULL,
    correlation_id  text        NOT NULL,
    -- json, not jsonb: the hash covers the exact text, and json keeps it byte for byte.
    data            json        NOT NULL,
    prev_hash       text        NOT NULL CHECK (length(prev_hash) = 64),
    hash            text        NOT NULL CHECK (length(hash) = 64),
    UNIQUE (domain, version)
);

-- One row per domain: where its stream ends. The insert trigger moves it forward only from the
-- exact previous event, so versions are gap-free and the hash chain is linked, whoever writes.
CREATE TABLE trellis_streams (
    domain      text   PRIMARY KEY,
    version     bigint NOT NULL,
    position    bigint NOT NULL,
    hash        text   NOT NULL
);

CREATE FUNCTION trellis_events_chain() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
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

CREATE TRIGGER trellis_events_chain BEFORE INSERT ON trellis_events
    FOR EACH ROW EXECUTE FUNCTION trellis_events_chain();

-- Serialise appends: every insert takes one transaction-scoped advisory lock before any
-- position is drawn, and holds it to commit. So positions commit in order and a reader tailing
-- "position > last seen" can never miss an event that commits late with a lower position (the
-- classic sequence-gap bug). Done in a trigger so no writer can forget it. Group commit keeps
-- the cost of this single lane low: one lock per batch of intents, not per event.
CREATE FUNCTION trellis_events_serialise() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(7420113931);
    RETURN NULL;
END $$;

CREATE TRIGGER trellis_events_serialise BEFORE INSERT ON trellis_events
    FOR EACH STATEMENT EXECUTE FUNCTION trellis_events_serialise();

-- The log is append-only, enforced by the database itself, not by convention.
CREATE FUNCTION trellis_events_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % is not allowed', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'TR002';
END $$;

CREATE TRIGGER trellis_events_no_update BEFORE UPDATE OR DELETE ON trellis_events
    FOR EACH ROW EXECUTE FUNCTION trellis_events_immutable();
CREATE TRIGGER trellis_events_no_truncate BEFORE TRUNCATE ON trellis_events
    FOR EACH STATEMENT EXECUTE FUNCTION trellis_events_immutable();

-- Each committed request_id with its exact reply, written in the same transaction as its events.
-- Scoped by actor (the tenant token or the operator), so one tenant never sees another's answer.
CREATE TABLE trellis_requests (
    domain       text        NOT NULL,
    actor        text        NOT NULL,
    request_id   text        NOT NULL,
    verb         text        NOT NULL,
    body_hash    text        NOT NULL,
    reply        text        NOT NULL,
    position     bigint      NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (domain, actor, request_id)
);

CREATE TRIGGER trellis_requests_no_update BEFORE UPDATE OR DELETE ON trellis_requests
    FOR EACH ROW EXECUTE FUNCTION trellis_events_immutable();
