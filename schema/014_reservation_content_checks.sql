-- Reservations (issue 23; engine/core/reservations.py): the log's content checks (schema/007,
-- restated in 009) learn the four new event types, ReservationMade, ReservationApplied,
-- ReservationCancelled and ReservationExpired, whose reservation ids, tenants, hosts and
-- device bindings are ids (they become KV keys, `<domain>.reservation.<id>`). The function is
-- restated whole with those lines added; everything else is as 009 has it.

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
        WHEN 'ReservationMade' THEN ARRAY['$.reservation_id', '$.tenant', '$.host',
            '$.request.host ? (@ != null)', '$.request.device_ids[*]', '$.devices[*].device',
            '$.devices[*].path[*]', '$.devices[*].links[*]', '$.devices[*].circuits[*].ocs']
        WHEN 'ReservationApplied' THEN ARRAY['$.reservation_id', '$.composition_id']
        WHEN 'ReservationCancelled' THEN ARRAY['$.reservation_id']
        WHEN 'ReservationExpired' THEN ARRAY['$.reservation_id']
        ELSE ARRAY[]::text[]
    END)
$$;
