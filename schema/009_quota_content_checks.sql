-- Quotas per tenant and device kind (issue 9 item 5; engine/quotas.py): the log's content
-- checks (schema/007) learn the two new event types, QuotaSet and QuotaCleared, whose `tenant`
-- is an id (it is the tenant token of intent and view subjects). The function is restated
-- whole with the two lines added; everything else is as 007 has it. A later event type that
-- carries ids adds its lines the same way, in a new file.

CREATE OR REPLACE FUNCTION trellis_event_id_paths(event_type text) RETURNS text[]
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
        WHEN 'QuotaSet' THEN ARRAY['$.tenant']
        WHEN 'QuotaCleared' THEN ARRAY['$.tenant']
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
