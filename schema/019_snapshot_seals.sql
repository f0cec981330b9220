-- Snapshots are sealed (engine/service/snapshots.py): whoever may write this table may rewrite
-- a body so that it still decodes, and any digest kept beside it, so a snapshot is trusted only
-- with the writer's signature, by the checkpoint key that lives outside the database, over its
-- domain, kind, version, position, chain hash, format and the SHA-256 of its body. The signature
-- lines of that signed note are kept here. Rows from before this migration have none and are
-- skipped (a fold starts from an older sealed one, or from the log): snapshots are disposable.
ALTER TABLE trellis_snapshots ADD COLUMN signature text;
