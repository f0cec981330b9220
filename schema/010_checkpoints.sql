-- Signed Merkle checkpoints of each domain's log (ARCHITECTURE §6 "Tamper evidence").
-- One row per (domain, tree size): the RFC 9162 root of the domain's first `size` event hashes
-- (base64 of its 32 bytes) and the whole C2SP signed note the engine published on
-- `<prefix>.checkpoints.<domain>`. Rows are written by the engine's checkpointer
-- (adapters/postgres/checkpoints.py) every TRELLIS_CHECKPOINT_EVERY events and on demand.
--
-- A checkpoint is a promise made to the outside world, so it is as permanent as the log:
-- the triggers of schema/001 refuse UPDATE, DELETE and TRUNCATE to everybody, and the
-- engine's role may only read and insert (adapters/postgres/privileges.py, kind LOG).
-- A second checkpoint of the same size is the same checkpoint (signatures are deterministic):
-- writers insert with ON CONFLICT DO NOTHING.
CREATE TABLE trellis_checkpoints (
    domain       text        NOT NULL,
    size         bigint      NOT NULL CHECK (size >= 1),
    root         text        NOT NULL CHECK (length(root) = 44),
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    note         text        NOT NULL,
    PRIMARY KEY (domain, size)
);

CREATE TRIGGER trellis_checkpoints_no_update BEFORE UPDATE OR DELETE ON trellis_checkpoints
    FOR EACH ROW EXECUTE FUNCTION trellis_events_immutable();
CREATE TRIGGER trellis_checkpoints_no_truncate BEFORE TRUNCATE ON trellis_checkpoints
    FOR EACH STATEMENT EXECUTE FUNCTION trellis_events_immutable();
