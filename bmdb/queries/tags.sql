-- name: MachineAdd :one
-- MachineAdd creates a machine and its Provided tag in one statement.
WITH m AS (
    INSERT INTO machines DEFAULT VALUES
    RETURNING machine_id
)
INSERT INTO machine_provided (machine_id, provider, provider_id, provider_reservation_id,
                              provider_ip_address, provider_location, provider_status, provider_status_at)
SELECT m.machine_id, @provider, @provider_id, @provider_reservation_id,
       sqlc.narg(provider_ip_address)::inet, @provider_location, @provider_status, now()
FROM m
RETURNING machine_id;

-- name: MachineProvidedGet :one
SELECT machine_id, provider, provider_id, provider_reservation_id, provider_ip_address,
       provider_location, provider_status, provider_status_at, agent_phase
FROM machine_provided
WHERE machine_id = @machine_id;

-- name: AgentStartedSet :exec
INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
VALUES (@machine_id, now(), @agent_public_key)
ON CONFLICT (machine_id) DO UPDATE
SET agent_started_at = EXCLUDED.agent_started_at, agent_public_key = EXCLUDED.agent_public_key;

-- name: AgentStartedGet :one
SELECT agent_started_at, agent_public_key FROM machine_agent_started WHERE machine_id = @machine_id;

-- name: AgentClear :exec
-- AgentClear removes AgentStarted and AgentHeartbeat, which makes the machine
-- an agent-start candidate again (the end of a recovery).
WITH hb AS (
    DELETE FROM machine_agent_heartbeat h WHERE h.machine_id = @machine_id
)
DELETE FROM machine_agent_started s WHERE s.machine_id = @machine_id;

-- name: AgentHeartbeatSet :exec
INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
VALUES (@machine_id, now())
ON CONFLICT (machine_id) DO UPDATE SET agent_heartbeat_at = EXCLUDED.agent_heartbeat_at;

-- name: AgentHeartbeatGet :one
SELECT agent_heartbeat_at FROM machine_agent_heartbeat WHERE machine_id = @machine_id;

-- name: InstallationRequestSet :one
-- InstallationRequestSet stores a new installation request with the next
-- generation for the machine, and who asked for it.
INSERT INTO machine_os_installation_request (machine_id, generation, os_installation_request_raw, requested_by)
VALUES (@machine_id, 1, @request_raw, @requested_by)
ON CONFLICT (machine_id) DO UPDATE
SET generation = machine_os_installation_request.generation + 1,
    os_installation_request_raw = EXCLUDED.os_installation_request_raw,
    requested_by = EXCLUDED.requested_by,
    requested_at = now()
RETURNING generation;

-- name: InstallationReportSet :exec
INSERT INTO machine_os_installation_report (machine_id, generation, success, error_message, os_installation_report_raw)
VALUES (@machine_id, @generation, @success, @error_message, @report_raw)
ON CONFLICT (machine_id) DO UPDATE
SET generation = EXCLUDED.generation,
    success = EXCLUDED.success,
    error_message = EXCLUDED.error_message,
    os_installation_report_raw = EXCLUDED.os_installation_report_raw,
    reported_at = now();

-- name: DecommissionRequestSet :execrows
INSERT INTO machine_decommission_request (machine_id, requested_by, reason)
VALUES (@machine_id, @requested_by, @reason)
ON CONFLICT (machine_id) DO NOTHING;

-- name: HistoryRequested :exec
-- HistoryRequested records an operator's request in the machine's history.
INSERT INTO work_history (machine_id, process, event, cause)
VALUES (@machine_id, @process, 'Requested', @cause);

-- name: MachineDecommissionGet :one
-- MachineDecommissionGet says whether an operator asked for the machine to
-- be decommissioned (the request is open until the decommissioner is done)
-- and whether it was decommissioned.
SELECT EXISTS (SELECT 1 FROM machine_decommission_request r WHERE r.machine_id = @machine_id) AS requested,
       EXISTS (SELECT 1 FROM decommissioned_machines d WHERE d.machine_id = @machine_id) AS decommissioned;
