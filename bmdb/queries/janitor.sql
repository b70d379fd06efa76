-- name: FleetMachineStates :many
-- FleetMachineStates counts every provided machine per provider, location
-- and derived state (SPEC §3.7) for the janitor's fleet gauges and the
-- overview, by the one definition of the state, machine_state (migration
-- 00018), which machine_states and so the machine views apply too. It is
-- shaped for 100,000 machines: most machines have no fact beyond their
-- Provided tag (machine_state_facts: no backoff, work, installation,
-- silence), and their state follows from the tag alone, so the fleet is
-- counted by one aggregate over machine_provided, less the machines with
-- facts, which are counted one by one with their facts (a few hundred, read
-- through small tables and partial indexes). silent_agents counts the
-- machines of each state whose agent is silent (machine_states'
-- agent_silent): the machines the recovery circuit breaker counts as
-- silent, wherever the state's precedence puts them. Columns are cast
-- because sqlc does not know the columns of a function in FROM (no-ops to
-- PostgreSQL). Decommissioned machines have no Provided tag and are not
-- counted: they left the fleet.
WITH facts AS (
    SELECT p.provider, p.provider_location AS location, p.provider_status, p.agent_phase,
           machine_state(p.provider_status, p.agent_phase, x.decommission_requested::boolean, x.quarantined::boolean,
                         x.agent_starting::boolean, x.recovering::boolean, x.install_failed::boolean,
                         x.install_pending::boolean, x.backed_off::boolean, x.silent::boolean, x.installed::boolean) AS state,
           (x.silent::boolean AND p.provider_status NOT IN ('Missing', 'Stopped')) AS agent_silent
    FROM machine_state_facts(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) x
    JOIN machine_provided p ON p.machine_id = x.machine_id::uuid
),
tags AS (
    SELECT p.provider, p.provider_location AS location, p.provider_status, p.agent_phase, count(*) AS machines
    FROM machine_provided p
    GROUP BY p.provider, p.provider_location, p.provider_status, p.agent_phase
),
facts_by_tag AS (
    SELECT f.provider, f.location, f.provider_status, f.agent_phase, count(*) AS machines
    FROM facts f
    GROUP BY f.provider, f.location, f.provider_status, f.agent_phase
),
counted AS (
    SELECT t.provider, t.location,
           machine_state(t.provider_status, t.agent_phase, false, false, false, false, false, false, false, false, false) AS state,
           t.machines - COALESCE(b.machines, 0) AS machines, 0::bigint AS silent_agents
    FROM tags t
    LEFT JOIN facts_by_tag b ON b.provider = t.provider AND b.location = t.location
         AND b.provider_status = t.provider_status AND b.agent_phase = t.agent_phase
    UNION ALL
    SELECT f.provider, f.location, f.state, 1::bigint, (CASE WHEN f.agent_silent THEN 1 ELSE 0 END)::bigint
    FROM facts f
)
SELECT c.provider::text AS provider, c.location::text AS location, c.state::text AS state,
       sum(c.machines)::bigint AS machines, sum(c.silent_agents)::bigint AS silent_agents
FROM counted c
GROUP BY c.provider, c.location, c.state
HAVING sum(c.machines) > 0
ORDER BY c.provider, c.location, c.state;

-- name: FleetHardware :many
-- FleetHardware totals the hardware reports of the provided machines per
-- provider and location (from the columns extracted from the reports).
SELECT p.provider, p.provider_location AS location, count(*) AS machines,
       COALESCE(sum(hw.memory_bytes), 0)::float8 AS memory_bytes,
       COALESCE(sum(hw.cpu_threads), 0)::float8 AS cpu_threads
FROM machine_hardware_report hw
JOIN machine_provided p ON p.machine_id = hw.machine_id
GROUP BY p.provider, p.provider_location
ORDER BY p.provider, p.provider_location;

-- name: FleetLiveWork :many
-- FleetLiveWork counts work held by live sessions, per process.
SELECT w.process, count(*) AS work
FROM work w
JOIN sessions s ON s.session_id = w.session_id
WHERE s.deadline > now() AND s.closed_at IS NULL
GROUP BY w.process
ORDER BY w.process;

-- name: FleetBackoffs :many
-- FleetBackoffs counts, per process, the machines in an active backoff and
-- the quarantined ones (whatever their backoff time says).
SELECT b.process, (b.quarantined_at IS NOT NULL)::boolean AS quarantined, count(*) AS backoffs
FROM work_backoff b
WHERE b.quarantined_at IS NOT NULL OR b.backoff_until > now()
GROUP BY b.process, (b.quarantined_at IS NOT NULL)
ORDER BY b.process, quarantined;

-- name: FleetDecommissioned :many
-- FleetDecommissioned counts decommissioned machines per provider.
SELECT provider, count(*) AS machines
FROM decommissioned_machines
GROUP BY provider
ORDER BY provider;

-- name: DecommissionedTagsSweep :one
-- DecommissionedTagsSweep deletes tags of machines decommissioned within the
-- window. A heartbeat batch that authenticated an agent just before its
-- machine was decommissioned can still write the heartbeat (and reports)
-- after the decommission committed: the machines row it references stays.
-- Such stray rows can only appear shortly after a decommission, so only
-- recent ones are looked at (machines_decommissioned_at).
WITH recent AS (
    SELECT m.machine_id
    FROM machines m
    WHERE m.decommissioned_at > now() - interval '1 millisecond' * @window_ms::bigint
),
agent_started AS (
    DELETE FROM machine_agent_started t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
),
agent_heartbeat AS (
    DELETE FROM machine_agent_heartbeat t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
),
hardware_report AS (
    DELETE FROM machine_hardware_report t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
),
installation_request AS (
    DELETE FROM machine_os_installation_request t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
),
installation_report AS (
    DELETE FROM machine_os_installation_report t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
),
host_key AS (
    DELETE FROM machine_ssh_host_key t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
),
request AS (
    DELETE FROM machine_decommission_request t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
),
backoffs AS (
    DELETE FROM work_backoff t USING recent r WHERE t.machine_id = r.machine_id RETURNING t.machine_id
)
SELECT ((SELECT count(*) FROM agent_started) + (SELECT count(*) FROM agent_heartbeat)
        + (SELECT count(*) FROM hardware_report) + (SELECT count(*) FROM installation_request)
        + (SELECT count(*) FROM installation_report) + (SELECT count(*) FROM host_key)
        + (SELECT count(*) FROM request) + (SELECT count(*) FROM backoffs))::bigint AS swept;

-- name: RecoveryHoldsRelease :execrows
-- RecoveryHoldsRelease deletes the ended Recovery backoffs (not
-- quarantines) of machines whose agent heartbeated after the backoff's last
-- failure: the machine came back on its own, and its ended hold would
-- otherwise be read, and skipped, by every recovery claim (migration
-- 00014). It writes history Reset saying so.
WITH released AS (
    DELETE FROM work_backoff b
    USING machine_provided p, machine_agent_heartbeat h
    WHERE p.recovery_held_until IS NOT NULL
      AND p.recovery_held_until <= now()
      AND p.agent_phase IN ('AwaitingFirstHeartbeat', 'Heartbeating')
      AND b.machine_id = p.machine_id AND b.process = 'Recovery' AND b.quarantined_at IS NULL
      AND h.machine_id = p.machine_id AND h.agent_heartbeat_at > b.updated_at
    RETURNING b.machine_id
)
INSERT INTO work_history (machine_id, process, event, cause)
SELECT r.machine_id, 'Recovery', 'Reset', 'backoff released: the agent heartbeats again'
FROM released r;
