-- name: FleetMachineStates :many
-- FleetMachineStates counts every provided machine per provider, location
-- and derived state (SPEC §3.7) for the janitor's fleet gauges, with the
-- hardware totals of those machines (from the columns extracted from their
-- hardware reports) in the same pass over the fleet. The state is
-- machine_states' (migration 00005), the one definition FleetStates and
-- the machine views read too; it reads machine_provided once and hash-joins
-- small relations, and so does the join with the hardware reports, so the
-- query stays fast at 100,000 machines. Its columns are cast because sqlc
-- does not know the columns of a function in FROM (no-ops to PostgreSQL).
-- Decommissioned machines have no Provided tag and are not counted: they
-- left the fleet. silent_agents counts the machines of each state whose
-- agent is silent (machine_states' agent_silent, migration 00018): the
-- machines the recovery circuit breaker counts as silent, wherever the
-- state's precedence puts them.
WITH ms AS (
    SELECT s.machine_id::uuid AS machine_id, s.provider::text AS provider, s.provider_location::text AS location, s.state::text AS state,
           s.agent_silent::boolean AS agent_silent
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) s
)
SELECT ms.provider, ms.location, ms.state, count(*) AS machines,
       count(*) FILTER (WHERE ms.agent_silent) AS silent_agents,
       count(hw.machine_id) AS hardware_machines,
       COALESCE(sum(hw.memory_bytes), 0)::float8 AS memory_bytes,
       COALESCE(sum(hw.cpu_threads), 0)::float8 AS cpu_threads
FROM ms
LEFT JOIN machine_hardware_report hw ON hw.machine_id = ms.machine_id
GROUP BY ms.provider, ms.location, ms.state
ORDER BY ms.provider, ms.location, ms.state;

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
