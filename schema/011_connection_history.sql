-- Connection history (issue 10 item 5; projections/history.py): who held which device when,
-- the table behind "GPU-hours by tenant" and the `history` query. Like every projection it
-- holds nothing the log does not and is rebuilt by replaying it.

-- One row per interval a device was bound to a composition. It opens when the device is
-- reserved for the composition (DevicesReserved, or DeviceReplaced for the stand-in): from
-- then on nobody else can have it, so that is when a bill starts charging. It closes when the
-- composition is released, its lease expires, its compose fails, or the device is replaced.
-- A device that leaves a composition and comes back later opens a second interval, hence
-- start_position in the key.
CREATE TABLE proj_history_intervals (
    domain          text             NOT NULL,
    composition_id  text             NOT NULL,
    device          text             NOT NULL,
    start_position  bigint           NOT NULL,  -- the event that opened it
    kind            text             NOT NULL,  -- gpu, memory, nic, nvme, accelerator
    model           text,
    host            text             NOT NULL,
    tenant          text             NOT NULL,
    started_at      timestamptz      NOT NULL,
    ended_at        timestamptz,                -- null while the device is held
    end_position    bigint,
    end_reason      text             CHECK (end_reason IN
                                         ('released', 'lease_expired', 'failed', 'replaced')),
    bandwidth_gbps  double precision NOT NULL,
    capacity_gib    double precision,           -- the memory slice; null for whole devices
    cost_per_hour   double precision,           -- as agreed when it was reserved
    PRIMARY KEY (domain, composition_id, device, start_position),
    CHECK ((ended_at IS NULL) = (end_reason IS NULL) AND (ended_at IS NULL) = (end_position IS NULL))
);

CREATE INDEX proj_history_intervals_device ON proj_history_intervals (domain, device, started_at);
CREATE INDEX proj_history_intervals_host ON proj_history_intervals (domain, host, started_at);
CREATE INDEX proj_history_intervals_tenant ON proj_history_intervals (domain, tenant, started_at);
CREATE INDEX proj_history_intervals_start ON proj_history_intervals (domain, started_at);

-- Every composition's life: who asked for it, on which host, when it was requested, became
-- active and ended, and how. The intervals take tenant and host from here; the Parquet export
-- writes it as its compositions table.
CREATE TABLE proj_history_compositions (
    domain              text        NOT NULL,
    composition_id      text        NOT NULL,
    tenant              text        NOT NULL,
    host                text        NOT NULL,
    state               text        NOT NULL
                        CHECK (state IN ('pending', 'active', 'impaired', 'released', 'failed')),
    requested_at        timestamptz NOT NULL,
    requested_position  bigint      NOT NULL,
    activated_at        timestamptz,            -- the first activation
    activated_position  bigint,
    ended_at            timestamptz,
    end_position        bigint,
    end_reason          text        CHECK (end_reason IN ('released', 'lease_expired', 'failed')),
    failure_reason      text,                   -- CompositionFailed's reason
    PRIMARY KEY (domain, composition_id)
);

-- The attributes a bill needs of each device, from the topology events: v1 bindings did not
-- record them (engine/upcast.py), so the interval takes them from here.
CREATE TABLE proj_history_devices (
    domain         text             NOT NULL,
    device         text             NOT NULL,
    kind           text             NOT NULL,
    model          text,
    cost_per_hour  double precision,
    PRIMARY KEY (domain, device)
);
