-- Defence in depth for the boundary validation (issue 9): the log itself refuses, at append, an
-- event that validation should have refused. Downstream, ids become NATS subject tokens and KV
-- keys (relay) and integers land in bigint columns (projections): one event outside those rules
-- once stopped the feed and the read models of every domain. Rows already in the log are not
-- re-checked; a refusal raises TR003, which the store reports as EventRefused.
--
-- An id is a whole string of 1-64 letters, digits, '_' or '-' (ARCHITECTURE §1). In PostgreSQL
-- `$` matches only at the very end of the string, so a trailing newline does not pass.

CREATE FUNCTION trellis_is_id(value text) RETURNS boolean LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT value ~ '^[A-Za-z0-9_-]{1,64}$'
$$;

-- Where each event type carries node and link ids (and the composition ids and tenants typed as
-- ids) in its data, as jsonpath text; engine/events.py is the source. Unknown (future) types get the
-- checks that hold for every event only.
CREATE FUNCTION trellis_event_id_paths(event_type text) RETURNS text[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT (CASE event_type
        WHEN 'TopologyImported' THEN ARRAY['$.nodes[*].id', '$.links[*].id', '$.links[*].a',
            '$.links[*].b', '$.added[*]', '$.updated[*]', '$.removed[*]']
        WHEN 'NodeAdded' THEN ARRAY['$.node.id']
        WHEN 'LinkAdded' THEN ARRAY['$.link.id', '$.link.a', '$.link.b']
        WHEN 'ComponentRemoved' THEN ARRAY['$.component', '$.links[*]']
        WHEN 'ComponentDrained' THEN ARRAY['$.component']
        WHEN 'ComponentUndrained' THEN ARRAY['$.component']
        WHEN 'ComponentFaulted' THEN ARRAY['$.component']
        WHEN 'ComponentRecovered' THEN ARRAY['$.component']
        WHEN 'CompositionRequested' THEN ARRAY['$.composition_id', '$.tenant', '$.host',
            '$.request.host ? (@ != null)', '$.request.device_ids[*]']
        WHEN 'CompositionRejected' THEN ARRAY['$.tenant', '$.request.host ? (@ != null)',
            '$.request.device_ids[*]']
        WHEN 'DevicesReserved' THEN ARRAY['$.composition_id', '$.devices[*].device',
            '$.devices[*].path[*]', '$.devices[*].links[*]', '$.devices[*].circuits[*].ocs']
        WHEN 'CircuitCreated' THEN ARRAY['$.ocs', '$.host']
        WHEN 'CircuitRemoved' THEN ARRAY['$.ocs', '$.host']
        WHEN 'PathEstablished' THEN ARRAY['$.composition_id', '$.device', '$.path[*]']
        WHEN 'CompositionActivated' THEN ARRAY['$.composition_id']
        WHEN 'CompositionImpaired' THEN ARRAY['$.composition_id', '$.component']
        WHEN 'PathRerouted' THEN ARRAY['$.composition_id', '$.device', '$.old_path[*]',
            '$.binding.device', '$.binding.path[*]', '$.binding.links[*]',
            '$.binding.circuits[*].ocs']
        WHEN 'DeviceReplaced' THEN ARRAY['$.composition_id', '$.old_device', '$.binding.device',
            '$.binding.path[*]', '$.binding.links[*]', '$.binding.circuits[*].ocs']
        WHEN 'LeaseExtended' THEN ARRAY['$.composition_id']
        WHEN 'LeaseExpired' THEN ARRAY['$.composition_id']
        WHEN 'CompositionReleased' THEN ARRAY['$.composition_id']
        WHEN 'CompositionFailed' THEN ARRAY['$.composition_id']
        ELSE ARRAY[]::text[]
    END)
$$;

CREATE FUNCTION trellis_events_check_content() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    doc jsonb;
    ids jsonb := '[]';
    path text;
    found jsonb;
BEGIN
    IF NOT trellis_is_id(NEW.domain) THEN
        RAISE EXCEPTION 'event % refused: domain % is not a valid id', NEW.id, to_json(NEW.domain)
            USING ERRCODE = 'TR003';
    END IF;
    IF NOT trellis_is_id(NEW.actor) THEN
        RAISE EXCEPTION 'event % refused: actor % is not a valid id', NEW.id, to_json(NEW.actor)
            USING ERRCODE = 'TR003';
    END IF;
    BEGIN
        doc := NEW.data::jsonb;
    EXCEPTION WHEN untranslatable_character THEN  -- \u0000, which text cannot hold
        RAISE EXCEPTION 'event % refused: its data holds text the log cannot store', NEW.id
            USING ERRCODE = 'TR003';
    END;
    found := jsonb_path_query_first(doc,
        'strict $.** ? (@.type() == "number" '
        '&& (@ > 9223372036854775807 || @ < -9223372036854775808))');
    IF found IS NOT NULL THEN
        RAISE EXCEPTION 'event % refused: % does not fit int64', NEW.id, found
            USING ERRCODE = 'TR003';
    END IF;
    -- Every id the event carries, in one array, checked with one regex over its JSON text: each
    -- element must print as "<1-64 id characters>". Escaping only ever adds a backslash, which
    -- is no id character, so a newline, a quote or any other character fails, as does a number,
    -- null or nested value. (Checking element by element costs about ten times as much.)
    FOREACH path IN ARRAY trellis_event_id_paths(NEW.type) LOOP
        ids := ids || jsonb_path_query_array(doc, path::jsonpath);
    END LOOP;
    IF ids::text !~ '^\[("[A-Za-z0-9_-]{1,64}"(, "[A-Za-z0-9_-]{1,64}")*)?\]$' THEN
        FOREACH path IN ARRAY trellis_event_id_paths(NEW.type) LOOP  -- name the culprit
            found := jsonb_path_query_first(doc, (path
                || ' ? (@.type() != "string" || !(@ like_regex "^[A-Za-z0-9_-]{1,64}$"))')::jsonpath);
            IF found IS NOT NULL THEN
                RAISE EXCEPTION 'event % refused: % at % is not a valid id', NEW.id, found, path
                    USING ERRCODE = 'TR003';
            END IF;
        END LOOP;
    END IF;
    RETURN NEW;
END $$;

-- Row triggers of one timing fire in name order: this one runs before trellis_events_chain
-- moves the stream head (a refusal rolls the whole append back either way).
CREATE TRIGGER trellis_events_a_content BEFORE INSERT ON trellis_events
    FOR EACH ROW EXECUTE FUNCTION trellis_events_check_content();
