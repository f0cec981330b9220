-- The log's content checks (schema/007) at a third less cost per event, refusing exactly what
-- they refused (issue 26: the log's triggers run inside the append's lock, so their time per
-- event bounds a busy domain's rate; docs/benchmarks.md).
--
-- PostgreSQL's regex engine builds a bounded repeat such as `{1,64}` as 64 copies of its
-- state: on this project's events one match of '^[A-Za-z0-9_-]{1,64}$' took about 10 µs,
-- against 0.6 µs for '^[A-Za-z0-9_-]+$' with a length test. The content check ran three such
-- matches per event, over a third of its time. Each is now an unbounded match and a length
-- test. The check function is restated whole with those lines changed; the rest is as in 007.

CREATE OR REPLACE FUNCTION trellis_is_id(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT value ~ '^[A-Za-z0-9_-]+$' AND length(value) <= 64
$$;

CREATE OR REPLACE FUNCTION trellis_events_check_content() RETURNS trigger LANGUAGE plpgsql AS $$
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
    -- Every id the event carries, in one array: its JSON text must print each element as
    -- "<id characters>" (escaping only ever adds a backslash, which is no id character, so a
    -- newline, a quote, a number, null or a nested value fails), and no element may be longer
    -- than 64.
    FOREACH path IN ARRAY trellis_event_id_paths(NEW.type) LOOP
        ids := ids || jsonb_path_query_array(doc, path::jsonpath);
    END LOOP;
    IF ids::text !~ '^\[("[A-Za-z0-9_-]+"(, "[A-Za-z0-9_-]+")*)?\]$'
       OR EXISTS (SELECT FROM jsonb_array_elements_text(ids) AS id WHERE length(id) > 64) THEN
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
