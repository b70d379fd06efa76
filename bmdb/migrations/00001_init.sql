-- The BMDB schema (SPEC §2.2): machines with their tags, and the tables that
-- coordinate the processes working on them (sessions, work, backoff, history).

-- +goose Up

-- A machine exists in the BMDB. The row is never deleted: a decommissioned
-- machine keeps it (with decommissioned_at) so that its history stays attached.
CREATE TABLE machines (
    machine_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now(),
    decommissioned_at timestamptz
);

-- Tags: at most one row per machine in each machine_* table.

-- The machine is backed by a provider's machine. agent_phase is derived from
-- the other tags by triggers (see machine_agent_phase below); it exists only so
-- that the candidate queries can be served from small partial indexes instead of
-- anti-joins over the whole fleet.
CREATE TABLE machine_provided (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    provider text NOT NULL CHECK (provider <> ''),
    provider_id text NOT NULL CHECK (octet_length(provider_id) BETWEEN 1 AND 128),
    provider_reservation_id text NOT NULL DEFAULT '',
    provider_ip_address inet,
    provider_location text NOT NULL DEFAULT '',
    provider_status text NOT NULL DEFAULT 'Unknown' CHECK (provider_status IN (
        'Missing', 'Provisioning', 'ProvisioningFailedPermanent', 'Running', 'Stopped', 'Unknown')),
    -- When the provider last confirmed this row; NULL until the first refresh.
    provider_status_at timestamptz,
    agent_phase text NOT NULL DEFAULT 'AwaitingAgent' CHECK (agent_phase IN (
        'AwaitingAgent', 'AwaitingFirstHeartbeat', 'Heartbeating', 'Installed')),
    -- When agent_phase last changed: candidates are served oldest first, so a
    -- machine that keeps coming back cannot starve one that waits.
    agent_phase_since timestamptz NOT NULL DEFAULT now(),
    -- Moves on every claim of the machine and every change of agent_phase. A
    -- claim locks the row only if the revision its snapshot read is still
    -- current, so a snapshot taken before someone else claimed (or finished)
    -- the machine can never hand it out again.
    revision bigint NOT NULL DEFAULT 0,
    UNIQUE (provider, provider_id)
);

-- The agent was started at agent_started_at and answered with this ed25519 key.
CREATE TABLE machine_agent_started (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    agent_started_at timestamptz NOT NULL,
    agent_public_key bytea NOT NULL CHECK (octet_length(agent_public_key) = 32)
);

-- The agent's last heartbeat arrived at agent_heartbeat_at (database time).
-- watched is true while recovery watches this heartbeat (agent_phase is
-- Heartbeating); it is maintained by triggers and keeps installed machines,
-- whose agents are gone for good, out of the stale-heartbeat index.
CREATE TABLE machine_agent_heartbeat (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    agent_heartbeat_at timestamptz NOT NULL,
    watched boolean NOT NULL DEFAULT false
);

-- The last hardware report (protobuf) and the few values queries need.
CREATE TABLE machine_hardware_report (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    hardware_report_raw bytea NOT NULL,
    reported_at timestamptz NOT NULL DEFAULT now(),
    cpu_threads integer NOT NULL DEFAULT 0 CHECK (cpu_threads >= 0),
    memory_bytes bigint NOT NULL DEFAULT 0 CHECK (memory_bytes >= 0),
    disk_count integer NOT NULL DEFAULT 0 CHECK (disk_count >= 0),
    disk_bytes bigint NOT NULL DEFAULT 0 CHECK (disk_bytes >= 0)
);

-- An OS installation is requested; each new request gets the next generation.
CREATE TABLE machine_os_installation_request (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation bigint NOT NULL CHECK (generation > 0),
    os_installation_request_raw bytea NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now()
);

-- The agent reported on an installation generation.
CREATE TABLE machine_os_installation_report (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation bigint NOT NULL CHECK (generation > 0),
    success boolean NOT NULL,
    error_message text NOT NULL DEFAULT '',
    os_installation_report_raw bytea NOT NULL,
    reported_at timestamptz NOT NULL DEFAULT now()
);

-- The SSH host key seen on first use, or pinned by the provider.
CREATE TABLE machine_ssh_host_key (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    host_key bytea NOT NULL CHECK (octet_length(host_key) > 0),
    pinned boolean NOT NULL DEFAULT false,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- An operator asked for the machine to leave the fleet.
CREATE TABLE machine_decommission_request (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    requested_at timestamptz NOT NULL DEFAULT now(),
    requested_by text NOT NULL DEFAULT '',
    reason text NOT NULL DEFAULT ''
);

-- Coordination.

-- A running component instance. It is alive while deadline > now() and
-- closed_at IS NULL; the lease is renewed by moving the deadline.
CREATE TABLE sessions (
    session_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    component text NOT NULL CHECK (component <> ''),
    hostname text NOT NULL DEFAULT '',
    pid integer NOT NULL DEFAULT 0,
    version text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    lease_ms bigint NOT NULL CHECK (lease_ms > 0),
    deadline timestamptz NOT NULL,
    closed_at timestamptz
);
CREATE INDEX sessions_open_deadline ON sessions (deadline) WHERE closed_at IS NULL;

-- The kinds of work. machine_exclusive processes act on the machine itself
-- (agent start, recovery, reinstall, decommission): at most one of them may hold
-- a machine at a time, which the work table enforces through the composite
-- foreign key and the partial unique index below.
CREATE TABLE processes (
    process text PRIMARY KEY,
    machine_exclusive boolean NOT NULL,
    UNIQUE (process, machine_exclusive)
);
INSERT INTO processes (process, machine_exclusive) VALUES
    ('AgentStart', true),
    ('Recovery', true),
    ('Reinstall', true),
    ('Decommission', true),
    ('ProviderUpdate', false);

-- Machine M is being worked by process P under session S. The primary key makes
-- a second claim by the same process impossible; work_machine_exclusive makes a
-- second machine-touching process impossible.
CREATE TABLE work (
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    process text NOT NULL,
    machine_exclusive boolean NOT NULL,
    session_id uuid NOT NULL REFERENCES sessions (session_id),
    started_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (machine_id, process),
    FOREIGN KEY (process, machine_exclusive) REFERENCES processes (process, machine_exclusive)
);
CREATE UNIQUE INDEX work_machine_exclusive ON work (machine_id) WHERE machine_exclusive;
-- No other indexes: work holds only in-flight claims, a few hundred rows at
-- most, and every index costs an insert and a delete on each claim.

-- Process P may not touch machine M until backoff_until. last_interval_ms is the
-- un-jittered interval the next failure grows from; attempts counts failures in
-- a row. A quarantined row excludes the machine from P until an operator resets it.
CREATE TABLE work_backoff (
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    process text NOT NULL REFERENCES processes (process),
    backoff_until timestamptz NOT NULL,
    cause text NOT NULL,
    last_interval_ms bigint NOT NULL CHECK (last_interval_ms >= 0),
    attempts integer NOT NULL CHECK (attempts >= 1),
    quarantined_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (machine_id, process)
);
CREATE INDEX work_backoff_process_until ON work_backoff (process, backoff_until);
CREATE INDEX work_backoff_quarantined ON work_backoff (process) WHERE quarantined_at IS NOT NULL;

-- Append-only audit of every work transition. session_id has no foreign key:
-- sessions are deleted after their retention period, history keeps the id.
CREATE TABLE work_history (
    history_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    machine_id uuid NOT NULL REFERENCES machines (machine_id),
    process text NOT NULL REFERENCES processes (process),
    event text NOT NULL CHECK (event IN (
        'Started', 'Finished', 'Failed', 'Canceled', 'Expired', 'Quarantined', 'Reset')),
    at timestamptz NOT NULL DEFAULT now(),
    session_id uuid,
    cause text NOT NULL DEFAULT ''
);
CREATE INDEX work_history_machine ON work_history (machine_id, history_id);
CREATE INDEX work_history_process_at ON work_history (process, at);
CREATE INDEX work_history_at ON work_history (at);

-- Derived agent phase.
--
-- "Installed" has one definition, here: the current installation request has a
-- successful report of the same generation. A failed report does not count, so
-- a machine whose installation failed stays under agent start and recovery, and
-- an operator retries by requesting a new generation (SPEC §2.6).
--
-- machine_agent_phase is the only place that turns tags into a phase; the
-- triggers below call it whenever one of its inputs changes and store the result
-- on machine_provided (and the watched flag on machine_agent_heartbeat), so the
-- candidate queries read small partial indexes. Heartbeat updates do not fire
-- them: only the first heartbeat (an INSERT) changes the phase.

-- +goose StatementBegin
CREATE FUNCTION machine_agent_phase(m uuid) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN EXISTS (
            SELECT 1
            FROM machine_os_installation_request q
            JOIN machine_os_installation_report r
              ON r.machine_id = q.machine_id AND r.generation = q.generation AND r.success
            WHERE q.machine_id = m) THEN 'Installed'
        WHEN NOT EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = m) THEN 'AwaitingAgent'
        WHEN NOT EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = m) THEN 'AwaitingFirstHeartbeat'
        ELSE 'Heartbeating'
    END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION machine_agent_phase_refresh() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    m uuid;
    phase text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        m := OLD.machine_id;
    ELSE
        m := NEW.machine_id;
    END IF;
    phase := machine_agent_phase(m);
    UPDATE machine_provided SET agent_phase = phase, agent_phase_since = now(), revision = revision + 1
     WHERE machine_id = m AND agent_phase IS DISTINCT FROM phase;
    UPDATE machine_agent_heartbeat SET watched = (phase = 'Heartbeating')
     WHERE machine_id = m AND watched IS DISTINCT FROM (phase = 'Heartbeating');
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION machine_provided_set_phase() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.agent_phase := machine_agent_phase(NEW.machine_id);
    NEW.agent_phase_since := now();
    RETURN NEW;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER machine_provided_phase BEFORE INSERT ON machine_provided
    FOR EACH ROW EXECUTE FUNCTION machine_provided_set_phase();
CREATE TRIGGER machine_agent_started_phase AFTER INSERT OR DELETE ON machine_agent_started
    FOR EACH ROW EXECUTE FUNCTION machine_agent_phase_refresh();
CREATE TRIGGER machine_agent_heartbeat_phase AFTER INSERT OR DELETE ON machine_agent_heartbeat
    FOR EACH ROW EXECUTE FUNCTION machine_agent_phase_refresh();
CREATE TRIGGER machine_os_installation_request_phase AFTER INSERT OR UPDATE OR DELETE ON machine_os_installation_request
    FOR EACH ROW EXECUTE FUNCTION machine_agent_phase_refresh();
CREATE TRIGGER machine_os_installation_report_phase AFTER INSERT OR UPDATE OR DELETE ON machine_os_installation_report
    FOR EACH ROW EXECUTE FUNCTION machine_agent_phase_refresh();

-- Candidate indexes (SPEC §2.6): each serves one arm of a candidate query,
-- holds only the machines that arm can return, and hands them out oldest first.
CREATE INDEX machine_provided_awaiting_agent ON machine_provided (provider, agent_phase_since)
    INCLUDE (machine_id) WHERE agent_phase = 'AwaitingAgent';
CREATE INDEX machine_provided_awaiting_first_heartbeat ON machine_provided (provider, agent_phase_since)
    INCLUDE (machine_id) WHERE agent_phase = 'AwaitingFirstHeartbeat';
CREATE INDEX machine_agent_heartbeat_watched ON machine_agent_heartbeat (agent_heartbeat_at)
    INCLUDE (machine_id) WHERE watched;

-- +goose Down
DROP TABLE work_history;
DROP TABLE work_backoff;
DROP TABLE work;
DROP TABLE processes;
DROP TABLE sessions;
DROP TABLE machine_decommission_request;
DROP TABLE machine_ssh_host_key;
DROP TABLE machine_os_installation_report;
DROP TABLE machine_os_installation_request;
DROP TABLE machine_hardware_report;
DROP TABLE machine_agent_heartbeat;
DROP TABLE machine_agent_started;
DROP TABLE machine_provided;
DROP TABLE machines;
DROP FUNCTION machine_provided_set_phase();
DROP FUNCTION machine_agent_phase_refresh();
DROP FUNCTION machine_agent_phase(uuid);
