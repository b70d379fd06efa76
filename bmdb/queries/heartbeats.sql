-- name: HeartbeatBatch :many
-- HeartbeatBatch records the heartbeats of many agents in one statement.
-- Each (machine, key) pair is authenticated inside the statement against
-- AgentStarted: only a pair whose key is the machine's current agent key
-- gets its heartbeat recorded, at database time. It returns the ordinals
-- of the accepted pairs (a machine has one current key, so at most one pair
-- per machine) with the machine's pending installation request: the current
-- request if no report of its generation exists yet.
WITH req AS (
    -- Set-returning functions in a select list run in lockstep: row i pairs
    -- the i-th ordinal, id and key.
    SELECT unnest(@ordinals::integer[]) AS ordinal, unnest(@machine_ids::uuid[]) AS machine_id,
           unnest(@public_keys::bytea[]) AS public_key
),
authed AS (
    SELECT r.ordinal, s.machine_id
    FROM req r
    JOIN machine_agent_started s ON s.machine_id = r.machine_id AND s.agent_public_key = r.public_key
),
beat AS (
    INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
    SELECT a.machine_id, now() FROM authed a
    ON CONFLICT (machine_id) DO UPDATE SET agent_heartbeat_at = EXCLUDED.agent_heartbeat_at
    RETURNING machine_id
)
SELECT a.ordinal::integer AS ordinal,
       q.generation AS pending_generation,
       q.os_installation_request_raw AS pending_request
FROM beat b
JOIN authed a ON a.machine_id = b.machine_id
LEFT JOIN machine_os_installation_request q ON q.machine_id = b.machine_id
    AND NOT EXISTS (
        SELECT 1 FROM machine_os_installation_report ir
        WHERE ir.machine_id = q.machine_id AND ir.generation = q.generation);

-- name: HardwareReportBatch :execrows
-- HardwareReportBatch stores the hardware reports of authenticated agents
-- (same authentication as HeartbeatBatch), with the values queries need.
INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, reported_at, cpu_threads, memory_bytes, disk_count, disk_bytes)
SELECT s.machine_id, r.raw, now(), r.cpu_threads, r.memory_bytes, r.disk_count, r.disk_bytes
FROM (
    SELECT unnest(@machine_ids::uuid[]) AS machine_id, unnest(@public_keys::bytea[]) AS public_key,
           unnest(@raws::bytea[]) AS raw, unnest(@cpu_threads::integer[]) AS cpu_threads,
           unnest(@memory_bytes::bigint[]) AS memory_bytes, unnest(@disk_counts::integer[]) AS disk_count,
           unnest(@disk_bytes::bigint[]) AS disk_bytes
) r
JOIN machine_agent_started s ON s.machine_id = r.machine_id AND s.agent_public_key = r.public_key
ON CONFLICT (machine_id) DO UPDATE
SET hardware_report_raw = EXCLUDED.hardware_report_raw,
    reported_at = EXCLUDED.reported_at,
    cpu_threads = EXCLUDED.cpu_threads,
    memory_bytes = EXCLUDED.memory_bytes,
    disk_count = EXCLUDED.disk_count,
    disk_bytes = EXCLUDED.disk_bytes;

-- name: InstallationReportBatch :execrows
-- InstallationReportBatch stores the installation reports of authenticated
-- agents (same authentication as HeartbeatBatch).
INSERT INTO machine_os_installation_report (machine_id, generation, success, error_message, os_installation_report_raw, reported_at)
SELECT s.machine_id, r.generation, r.success, r.error_message, r.raw, now()
FROM (
    SELECT unnest(@machine_ids::uuid[]) AS machine_id, unnest(@public_keys::bytea[]) AS public_key,
           unnest(@generations::bigint[]) AS generation, unnest(@successes::boolean[]) AS success,
           unnest(@error_messages::text[]) AS error_message, unnest(@raws::bytea[]) AS raw
) r
JOIN machine_agent_started s ON s.machine_id = r.machine_id AND s.agent_public_key = r.public_key
ON CONFLICT (machine_id) DO UPDATE
SET generation = EXCLUDED.generation,
    success = EXCLUDED.success,
    error_message = EXCLUDED.error_message,
    os_installation_report_raw = EXCLUDED.os_installation_report_raw,
    reported_at = EXCLUDED.reported_at;

-- name: InstallationGet :one
-- InstallationGet returns the installation request and report of a machine.
SELECT m.machine_id,
       q.generation AS request_generation, q.os_installation_request_raw AS request_raw, q.requested_at,
       r.generation AS report_generation, r.success AS report_success, r.error_message AS report_error,
       r.os_installation_report_raw AS report_raw, r.reported_at
FROM machines m
LEFT JOIN machine_os_installation_request q ON q.machine_id = m.machine_id
LEFT JOIN machine_os_installation_report r ON r.machine_id = m.machine_id
WHERE m.machine_id = @machine_id;

-- name: HardwareReportGet :one
SELECT hardware_report_raw, reported_at, cpu_threads, memory_bytes, disk_count, disk_bytes
FROM machine_hardware_report
WHERE machine_id = @machine_id;
