-- The log's content checks (schema/007, restated in 016) in one pass for a plain event, refusing
-- exactly what they refused (issue 26: the log's triggers run inside the append's lock, and on
-- the engine's own events they were four fifths of a 45-event append's time in the database;
-- docs/benchmarks.md).
--
-- The check made a dozen PL/pgSQL steps per event: a subquery (EXISTS over the ids) that ran
-- the executor for each event, a subtransaction for the cast of the data, a jsonpath parsed
-- from text for each place ids live, and a walk of the whole document for numbers beyond int64.
-- Now the trigger asks one question of an event first, in its WHEN condition: is it plainly
-- fine (trellis_event_plainly_fine)? Its ids are collected through jsonpaths parsed once
-- (trellis_event_id_jsonpaths), the numbers are walked only when the text holds 19 digits in a
-- row or a digit before an exponent (a number beyond int64 needs one or the other), and the
-- data is cast without a subtransaction. Only an event that is not plainly fine gets the whole
-- check, unchanged from 016, which raises the same refusals naming the same places, or lets it
-- through. The question may err only towards asking: everything it lets through, the whole
-- check would have.
--
-- The places each event type carries ids are listed once, below; both functions that read them
-- are made from that list (trellis_event_id_paths, restated from 014 unchanged, names a place
-- in a refusal; trellis_event_id_jsonpaths collects the ids).

DO $do$
DECLARE
    as_text text := '';
    as_jsonpath text := '';
    line record;
BEGIN
    FOR line IN SELECT * FROM (VALUES
        ('TopologyImported', ARRAY['$.nodes[*].id', '$.links[*].id', '$.links[*].a',
            '$.links[*].b', '$.added[*]', '$.updated[*]', '$.removed[*]']),
        ('NodeAdded', ARRAY['$.node.id']),
        ('LinkAdded', ARRAY['$.link.id', '$.link.a', '$.link.b']),
        ('ComponentRemoved', ARRAY['$.component', '$.links[*]']),
        ('ComponentDrained', ARRAY['$.component']),
        ('ComponentUndrained', ARRAY['$.component']),
        ('ComponentFaulted', ARRAY['$.component']),
        ('ComponentRecovered', ARRAY['$.component']),
        ('QuotaSet', ARRAY['$.tenant']),
        ('QuotaCleared', ARRAY['$.tenant']),
        ('CompositionRequested', ARRAY['$.composition_id', '$.tenant', '$.host',
            '$.request.host ? (@ != null)', '$.request.device_ids[*]']),
        ('CompositionRejected', ARRAY['$.tenant', '$.request.host ? (@ != null)',
            '$.request.device_ids[*]']),
        ('DevicesReserved', ARRAY['$.composition_id', '$.devices[*].device',
            '$.devices[*].path[*]', '$.devices[*].links[*]', '$.devices[*].circuits[*].ocs']),
        ('CircuitCreated', ARRAY['$.ocs', '$.host']),
        ('CircuitRemoved', ARRAY['$.ocs', '$.host']),
        ('PathEstablished', ARRAY['$.composition_id', '$.device', '$.path[*]']),
        ('CompositionActivated', ARRAY['$.composition_id']),
        ('CompositionImpaired', ARRAY['$.composition_id', '$.component']),
        ('PathRerouted', ARRAY['$.composition_id', '$.device', '$.old_path[*]',
            '$.binding.device', '$.binding.path[*]', '$.binding.links[*]',
            '$.binding.circuits[*].ocs']),
        ('DeviceReplaced', ARRAY['$.composition_id', '$.old_device', '$.binding.device',
            '$.binding.path[*]', '$.binding.links[*]', '$.binding.circuits[*].ocs']),
        ('LeaseExtended', ARRAY['$.composition_id']),
        ('LeaseExpired', ARRAY['$.composition_id']),
        ('CompositionReleased', ARRAY['$.composition_id']),
        ('CompositionFailed', ARRAY['$.composition_id']),
        ('ReservationMade', ARRAY['$.reservation_id', '$.tenant', '$.host',
            '$.request.host ? (@ != null)', '$.request.device_ids[*]', '$.devices[*].device',
            '$.devices[*].path[*]', '$.devices[*].links[*]', '$.devices[*].circuits[*].ocs']),
        ('ReservationApplied', ARRAY['$.reservation_id', '$.composition_id']),
        ('ReservationCancelled', ARRAY['$.reservation_id']),
        ('ReservationExpired', ARRAY['$.reservation_id'])
    ) AS places(event_type, paths) LOOP
        as_text := as_text || format(E'\n        WHEN %L THEN %L::text[]', line.event_type, line.paths);
        as_jsonpath := as_jsonpath
            || format(E'\n        WHEN %L THEN %L::jsonpath[]', line.event_type, line.paths);
    END LOOP;
    EXECUTE format($f$
CREATE OR REPLACE FUNCTION trellis_event_id_paths(event_type text) RETURNS text[]
LANGUAGE sql IMMUTABLE AS $body$
    SELECT CASE event_type%s
        ELSE ARRAY[]::text[]
    END
$body$
$f$, as_text);
    -- The same places as jsonpath constants, parsed when a plan is made, not once per event.
    EXECUTE format($f$
CREATE FUNCTION trellis_event_id_jsonpaths(event_type text) RETURNS jsonpath[]
LANGUAGE sql IMMUTABLE AS $body$
    SELECT CASE event_type%s
        ELSE ARRAY[]::jsonpath[]
    END
$body$
$f$, as_jsonpath);
END $do$;

-- trellis_is_id as 016 made it, no longer STRICT (its answer for null is null either way), so the
-- planner inlines it into the question below instead of calling it twice per event.
CREATE OR REPLACE FUNCTION trellis_is_id(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT value ~ '^[A-Za-z0-9_-]+$' AND length(value) <= 64
$$;

-- Plainly fine: ids for its domain and actor, no \u escape in its text (only
-- an escape can hold what text cannot: \u0000), no number that could pass int64, and every id
-- it carries printed as "<id characters>", none 65 long (the list's text holds only quotes,
-- commas and spaces besides, so a run of 65 is one id). False says only: ask the whole check.
CREATE FUNCTION trellis_event_plainly_fine(domain text, actor text, event_type text, data json)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    doc jsonb;
    ids jsonb := '[]';
    path jsonpath;
    listed text;
BEGIN
    IF strpos(data::text, '\u') > 0 THEN
        RETURN false;
    END IF;
    doc := data::jsonb;
    FOREACH path IN ARRAY trellis_event_id_jsonpaths(event_type) LOOP
        ids := ids || jsonb_path_query_array(doc, path);
    END LOOP;
    listed := ids::text;
    RETURN trellis_is_id(domain) AND trellis_is_id(actor)
       AND (data::text !~ '[0-9]{19}|[0-9][eE]'
            OR jsonb_path_query_first(doc, 'strict $.** ? (@.type() == "number" '
               '&& (@ > 9223372036854775807 || @ < -9223372036854775808))') IS NULL)
       AND listed ~ '^\[("[A-Za-z0-9_-]+"(, "[A-Za-z0-9_-]+")*)?\]$'
       AND listed !~ '[A-Za-z0-9_-]{65}';
END $$;

-- The whole check (trellis_events_check_content, as schema/016 made it) runs only for an event
-- that is not plainly fine; the trigger keeps its name, so it still runs before the chain's.
DROP TRIGGER trellis_events_a_content ON trellis_events;
CREATE TRIGGER trellis_events_a_content BEFORE INSERT ON trellis_events
    FOR EACH ROW WHEN (NOT trellis_event_plainly_fine(NEW.domain, NEW.actor, NEW.type, NEW.data))
    EXECUTE FUNCTION trellis_events_check_content();
