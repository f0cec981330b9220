-- This log's deployment: an id drawn once, when the schema is made, and kept by a backup and
-- its restore. A Redfish fabric manager records, beside each domain's writer epoch, the
-- deployment that drives it (adapters/fabric/redfish/driver.py), so the engines of another
-- deployment (another log) pointed at the same manager are refused instead of drawing epochs
-- above this one's and undoing each other's work (the southbound probe). One row.
CREATE TABLE trellis_deployment (
    only_row   boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    id         uuid        NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO trellis_deployment DEFAULT VALUES;
