-- Projections: read models folded from trellis_events by projections/runner.py.
-- Every table here can be truncated and rebuilt from the log (ProjectionRunner.rebuild), so none
-- of them holds anything the log does not. The runner writes each batch's rows and its
-- checkpoint in one transaction; the checkpoint row is also the lock that keeps two runners
-- (two engine instances) from folding the same batch twice.

-- How far each projection has folded the global log (eventsourcing's tracking table).
CREATE TABLE trellis_checkpoints (
    name      text   PRIMARY KEY,
    position  bigint NOT NULL CHECK (position >= 0)
);

-- ---- compositions projection ----

-- One row per composition ever requested. Released and failed ones stay (their state changes),
-- so the `composition` and `why` queries can answer for them after the fact.
CREATE TABLE proj_compositions (
    domain            text        NOT NULL,
    composition_id    text        NOT NULL,
    tenant            text        NOT NULL,
    host              text        NOT NULL,
    state             text        NOT NULL
                      CHECK (state IN ('pending', 'active', 'impaired', 'released', 'failed')),
    labels            jsonb       NOT NULL,
    reason            text        NOT NULL,
    request_id        text        NOT NULL,
    created_at        timestamptz NOT NULL,
    expires_at        timestamptz,
    -- [{id, kind, path, hops, latency_ns, bandwidth_gbps, capacity_gib}], the compose result's shape
    devices           jsonb       NOT NULL,
    -- [{component, reason}] in the order the faults arrived
    impaired_by       jsonb       NOT NULL,
    -- [{type, position, time, actor, request_id}]: every event about this composition
    chain             jsonb       NOT NULL,
    updated_position  bigint      NOT NULL,
    PRIMARY KEY (domain, composition_id)
);

-- ---- connections projection: what is connected to what, and why ----

-- One row per device bound to a live composition; rows leave when the composition does.
-- The key starts with the composition so a release finds its rows by prefix.
CREATE TABLE proj_connections (
    domain          text             NOT NULL,
    composition_id  text             NOT NULL,
    device          text             NOT NULL,
    host            text             NOT NULL,
    tenant          text             NOT NULL,
    path            jsonb            NOT NULL,  -- node ids, host first
    links           jsonb            NOT NULL,  -- link ids in path order
    bandwidth_gbps  double precision NOT NULL,
    capacity_gib    double precision,           -- the memory slice; null for whole devices
    since           timestamptz      NOT NULL,  -- recorded_at of the DevicesReserved
    why             jsonb            NOT NULL,  -- {request_id, actor, reason, labels, constraints, position}
    PRIMARY KEY (domain, composition_id, device)
);

CREATE INDEX proj_connections_host ON proj_connections (domain, host);
CREATE INDEX proj_connections_tenant ON proj_connections (domain, tenant);
CREATE INDEX proj_connections_device ON proj_connections (domain, device);
-- `why` for a link, switch or OCS asks which paths contain it: jsonb containment, GIN-indexed.
CREATE INDEX proj_connections_path ON proj_connections USING gin (path jsonb_path_ops);
CREATE INDEX proj_connections_links ON proj_connections USING gin (links jsonb_path_ops);

-- The request behind each live composition, kept by the connections projection itself (not
-- read from proj_compositions) so each projection folds, checkpoints and rebuilds on its own.
CREATE TABLE proj_connection_requests (
    domain          text  NOT NULL,
    composition_id  text  NOT NULL,
    host            text  NOT NULL,
    tenant          text  NOT NULL,
    why             jsonb NOT NULL,
    PRIMARY KEY (domain, composition_id)
);

-- ---- devices projection ----

-- One row per pooled device: its attributes, health and who holds it.
CREATE TABLE proj_devices (
    domain           text             NOT NULL,
    device           text             NOT NULL,
    device_kind      text             NOT NULL,
    vendor           text,
    model            text,
    generation       bigint,
    memory_gib       double precision,
    capacity_gib     double precision,  -- divisible capacity (memory pools, NVMe)
    cost_per_hour    double precision,
    labels           jsonb            NOT NULL,
    health           text             NOT NULL CHECK (health IN ('healthy', 'degraded', 'failed')),
    drained          boolean          NOT NULL,
    owner            text,              -- composition holding the whole device, or null
    memory_used_gib  double precision,  -- GiB sliced out of a memory pool; null for other kinds
    PRIMARY KEY (domain, device)
);

CREATE INDEX proj_devices_owner ON proj_devices (domain, owner) WHERE owner IS NOT NULL;

-- Every node and link of the fabric with its health marks and the events that set them, so
-- `why` knows idle hosts and links too and can say what happened to a free device.
CREATE TABLE proj_components (
    domain   text    NOT NULL,
    id       text    NOT NULL,
    kind     text    NOT NULL CHECK (kind IN ('host', 'switch', 'ocs', 'device', 'link')),
    health   text    NOT NULL CHECK (health IN ('healthy', 'degraded', 'failed')),
    drained  boolean NOT NULL,
    detail   text    NOT NULL,
    chain    jsonb   NOT NULL,  -- the latest topology events about it, oldest first
    PRIMARY KEY (domain, id)
);

-- What each composition holds of each device, so a release gives back exactly that
-- (a memory slice is subtracted, a whole device loses its owner).
CREATE TABLE proj_device_holds (
    domain          text             NOT NULL,
    composition_id  text             NOT NULL,
    device          text             NOT NULL,
    capacity_gib    double precision,  -- the slice; null when the device is held whole
    PRIMARY KEY (domain, composition_id, device)
);
