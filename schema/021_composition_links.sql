-- The links of each device's path in a composition's row ({device: [link ids]}): with the
-- devices' node paths, what lies on its paths, so a repair that mends some of them stops
-- naming what it moved off in `impaired_by` (projections/compositions.py), as the engine's
-- state does. The new column changes the tables' format: the engine's first start rebuilds
-- the projections from the log (schema/020), which fills it.
ALTER TABLE proj_compositions ADD COLUMN links jsonb NOT NULL DEFAULT '{}';
