-- The event relay's checkpoint (adapters/event_relay.py): how far the log has been published to
-- a JetStream stream, one row per stream name. Kept apart from trellis_checkpoints on purpose:
-- those belong to projections that can be truncated and rebuilt at will, while this one is a
-- promise about a system outside the database ("everything up to here is in the stream").
-- The relay locks its row (FOR UPDATE) while it publishes a batch, so relays in several engine
-- instances take turns and the stream never receives a batch twice.
CREATE TABLE trellis_relay_checkpoints (
    stream    text   PRIMARY KEY,
    position  bigint NOT NULL CHECK (position >= 0)
);
