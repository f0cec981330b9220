-- Least privilege: the engine's role may only read and append the log (grants in
-- adapters/postgres/privileges.py, given by the schema's owner after the migrations).
--
-- trellis_streams is the chain trigger's own bookkeeping, so the trigger runs with its owner's
-- rights (SECURITY DEFINER) and the engine's role needs no INSERT or UPDATE there. A function
-- that runs with another role's rights must not resolve names through the caller's search_path
-- (the caller could put a table of its own first), so it is pinned to this schema, with pg_temp
-- last. Any later CREATE OR REPLACE of trellis_events_chain must restate both.
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION trellis_events_chain() SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
END $$;

-- Nobody calls it but the trigger (which needs no EXECUTE privilege to fire).
REVOKE ALL ON FUNCTION trellis_events_chain() FROM PUBLIC;
