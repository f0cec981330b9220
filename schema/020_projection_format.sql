-- The folds the projection tables were written with (projections/past.py `format_of`: the
-- fold revision and every table's shape). An engine that starts with other folds (an upgrade
-- that changed one) rebuilds the tables from the log before it follows it
-- (projections/sink.py `rebuild_if_folds_changed`), rather than serve, export and verify rows
-- an older fold wrote beside rows its own fold writes. One row.
CREATE TABLE trellis_projection_format (
    only_row  boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    format    text        NOT NULL,
    set_at    timestamptz NOT NULL DEFAULT now()
);
