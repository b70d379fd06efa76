-- The heartbeat timeouts in force, recorded by the recoverers that use
-- them, and the silence of an agent whatever its machine's state (issue 13).
--
-- silence_timeouts: which agents are silent depends on the first heartbeat
-- and heartbeat timeouts, which are the recoverer's configuration. Every
-- recoverer writes the values it uses when it starts (the last writer
-- wins: `shepherd run` processes share the flags, so they agree), and every
-- surface that derives Silent (the CLI, the web UI, the janitor's gauges)
-- reads them from here instead of assuming its own defaults. Without a row
-- (no recoverer ever ran) surfaces use the defaults and say so.
--
-- machine_states gains agent_silent: the machine's agent is silent by the
-- recoverer's definition (the Count...Matching form of the recovery
-- candidate query, as its Silent state already was), whatever state the
-- CASE's precedence shows (Recovering, BackedOff, Quarantined, ...), for a
-- machine the provider neither lost nor stopped. It is what the circuit
-- breaker counts, so the overview can say where the breaker's silent
-- machines are, and what a machine page shows instead of a tag phase of
-- Heartbeating for an agent that no longer heartbeats.
--
-- machine_states is 00014's, split for speed at 100,000 machines (the
-- overview counts the whole fleet on every load) into the precedence of
-- the states (machine_state, the CASE unchanged) and the facts beyond the
-- Provided tag that a state depends on (machine_state_facts: decommission
-- request, backoffs and quarantines, live work, installations, silence),
-- flag rows of one relation grouped by machine. machine_states probes the
-- fleet against the facts once, instead of joining it three times (one of
-- which PostgreSQL built as a hash of all 100,000 machines); the fleet
-- count (FleetMachineStates) counts the machines without facts by their
-- tags alone. A lookup of one machine still pushes the machine id into
-- every part.

-- +goose Up
CREATE TABLE silence_timeouts (
    setting text PRIMARY KEY CHECK (setting IN ('first_heartbeat_timeout', 'heartbeat_timeout')),
    value_ms bigint NOT NULL CHECK (value_ms > 0),
    -- Who wrote it: the recoverer's provider and process.
    provider text NOT NULL,
    written_by text NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now()
);

DROP FUNCTION machine_states(bigint, bigint);
-- machine_state is the precedence of the derived states (SPEC §3.7), the
-- one definition: a machine being decommissioned is shown as that,
-- whatever else is true of it, and so on down to Healthy. A NULL fact is
-- false.
-- +goose StatementBegin
CREATE FUNCTION machine_state(provider_status text, agent_phase text, decommission_requested boolean,
                              quarantined boolean, agent_starting boolean, recovering boolean,
                              install_failed boolean, install_pending boolean, backed_off boolean,
                              silent boolean, installed boolean)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
SELECT CASE
           WHEN decommission_requested THEN 'Decommissioning'
           WHEN provider_status = 'Missing' THEN 'Missing'
           WHEN provider_status = 'Stopped' THEN 'Stopped'
           WHEN quarantined THEN 'Quarantined'
           WHEN agent_starting THEN 'AgentStarting'
           WHEN recovering THEN 'Recovering'
           WHEN install_failed THEN 'InstallFailed'
           WHEN install_pending AND agent_phase = 'Heartbeating' THEN 'Installing'
           WHEN backed_off THEN 'BackedOff'
           WHEN agent_phase = 'AwaitingAgent' THEN 'Provided'
           WHEN silent THEN 'Silent'
           WHEN agent_phase = 'AwaitingFirstHeartbeat' THEN 'AwaitingFirstHeartbeat'
           WHEN installed THEN 'Installed'
           ELSE 'Healthy'
       END
$$;
-- +goose StatementEnd

-- machine_state_facts returns, for each machine of which any is true, the
-- facts beyond the Provided tag that its state depends on: a decommission
-- request, backoffs and quarantines, live work, installations, silence.
-- They are flag rows of a few small relations (small tables, partial
-- indexes) grouped by machine; a caller's machine_id = X is pushed into
-- every part.
-- +goose StatementBegin
CREATE FUNCTION machine_state_facts(first_heartbeat_timeout_ms bigint, heartbeat_timeout_ms bigint)
RETURNS TABLE (
    machine_id uuid,
    decommission_requested boolean,
    quarantined boolean,
    backed_off boolean,
    agent_starting boolean,
    recovering boolean,
    install_failed boolean,
    install_pending boolean,
    installed boolean,
    silent boolean
)
LANGUAGE sql STABLE AS $$
SELECT y.machine_id,
       bool_or(y.flag = 'decommission_requested') AS decommission_requested,
       bool_or(y.flag = 'quarantined') AS quarantined,
       bool_or(y.flag = 'backed_off') AS backed_off,
       bool_or(y.flag = 'agent_starting') AS agent_starting,
       bool_or(y.flag = 'recovering') AS recovering,
       bool_or(y.flag = 'install_failed') AS install_failed,
       bool_or(y.flag = 'install_pending') AS install_pending,
       bool_or(y.flag = 'installed') AS installed,
       bool_or(y.flag = 'silent') AS silent
FROM (
    SELECT d.machine_id, 'decommission_requested' AS flag
    FROM machine_decommission_request d
    UNION ALL
    -- A quarantine counts whatever its backoff time says.
    SELECT b.machine_id, CASE WHEN b.quarantined_at IS NOT NULL THEN 'quarantined' ELSE 'backed_off' END
    FROM work_backoff b
    WHERE b.quarantined_at IS NOT NULL OR b.backoff_until > now()
    UNION ALL
    -- Work of a dead session is free (SPEC §2.3): it does not count.
    SELECT w.machine_id, CASE WHEN w.process = 'AgentStart' THEN 'agent_starting' ELSE 'recovering' END
    FROM work w
    JOIN sessions ss ON ss.session_id = w.session_id
    WHERE w.process IN ('AgentStart', 'Recovery') AND ss.deadline > now() AND ss.closed_at IS NULL
    UNION ALL
    -- Every installation request, with what its report (of the same
    -- generation) says: failed, installed, or neither yet (pending).
    SELECT q.machine_id, CASE WHEN r.generation IS DISTINCT FROM q.generation THEN 'install_pending'
                              WHEN r.success THEN 'installed'
                              ELSE 'install_failed' END
    FROM machine_os_installation_request q
    LEFT JOIN machine_os_installation_report r ON r.machine_id = q.machine_id
    UNION ALL
    -- Silent: the machines the recovery candidate query selects by
    -- tags (its Count...Matching form: a hold does not matter here,
    -- the CASE above shows a machine still held as BackedOff or
    -- Quarantined). The arms read the same partial indexes as the
    -- candidate query; the recorder condition (migration 00013) does
    -- not depend on the machine and is evaluated once.
    SELECT u.machine_id, 'silent'
    FROM (
        -- No heartbeat within the first heartbeat timeout of the start.
        SELECT s.machine_id
        FROM machine_provided p2
        JOIN machine_agent_started s ON s.machine_id = p2.machine_id
        WHERE p2.agent_phase = 'AwaitingFirstHeartbeat'
          AND p2.recovery_held_until IS NULL
          AND p2.agent_phase_since < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
          AND s.agent_started_at < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
        UNION ALL
        -- A watched (Heartbeating, not held) agent's last heartbeat is
        -- older than the heartbeat timeout.
        SELECT h.machine_id
        FROM machine_agent_heartbeat h
        WHERE (CASE WHEN h.watched THEN h.agent_heartbeat_at END) < now() - interval '1 millisecond' * heartbeat_timeout_ms
        UNION ALL
        -- Either, for a machine held by a recovery backoff or quarantine.
        SELECT p3.machine_id
        FROM machine_provided p3
        WHERE p3.agent_phase IN ('AwaitingFirstHeartbeat', 'Heartbeating')
          AND p3.recovery_held_until IS NOT NULL
          AND ((p3.agent_phase = 'AwaitingFirstHeartbeat'
                AND p3.agent_phase_since < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
                AND EXISTS (SELECT 1 FROM machine_agent_started s3 WHERE s3.machine_id = p3.machine_id
                              AND s3.agent_started_at < now() - interval '1 millisecond' * first_heartbeat_timeout_ms))
               OR (p3.agent_phase = 'Heartbeating'
                AND EXISTS (SELECT 1 FROM machine_agent_heartbeat h3 WHERE h3.machine_id = p3.machine_id
                              AND h3.agent_heartbeat_at < now() - interval '1 millisecond' * heartbeat_timeout_ms)))
    ) u
    WHERE NOT (SELECT heartbeat_recording_impaired(heartbeat_timeout_ms))
) y
GROUP BY y.machine_id
$$;
-- +goose StatementEnd

-- machine_states returns every provided machine with its derived state and
-- whether its agent is silent: the Provided tag probed once against the
-- facts.
-- +goose StatementBegin
CREATE FUNCTION machine_states(first_heartbeat_timeout_ms bigint, heartbeat_timeout_ms bigint)
RETURNS TABLE (
    machine_id uuid,
    provider text,
    provider_id text,
    provider_reservation_id text,
    provider_ip_address inet,
    provider_location text,
    provider_status text,
    provider_status_at timestamptz,
    agent_phase text,
    state text,
    agent_silent boolean
)
LANGUAGE sql STABLE AS $$
SELECT p.machine_id, p.provider, p.provider_id, p.provider_reservation_id, p.provider_ip_address,
       p.provider_location, p.provider_status, p.provider_status_at, p.agent_phase,
       machine_state(p.provider_status, p.agent_phase, x.decommission_requested, x.quarantined, x.agent_starting,
                     x.recovering, x.install_failed, x.install_pending, x.backed_off, x.silent, x.installed),
       COALESCE(x.silent, false) AND p.provider_status NOT IN ('Missing', 'Stopped')
FROM machine_provided p
LEFT JOIN machine_state_facts(first_heartbeat_timeout_ms, heartbeat_timeout_ms) x ON x.machine_id = p.machine_id
$$;
-- +goose StatementEnd

-- +goose Down
SELECT 'irreversible';
