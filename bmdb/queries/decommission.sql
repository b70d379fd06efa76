-- name: MachineDecommission :one
-- MachineDecommission takes a machine out of the fleet in one statement
-- (SPEC §3.8): it deletes every live tag (Provided, AgentStarted,
-- AgentHeartbeat, hardware report, installation request and report, SSH
-- host key, decommission request) and every backoff of the machine, keeps
-- what the Provided tag and the request said in decommissioned_machines,
-- and sets machines.decommissioned_at. The machines row and its history
-- stay; so does the last agent key, so that the agent can be told to stop
-- (HeartbeatRetired). Data-modifying CTEs all run to completion, read or not. No row: the
-- machine has no Provided tag (unknown, or decommissioned already).
WITH provided AS (
    DELETE FROM machine_provided p
    WHERE p.machine_id = @machine_id
    RETURNING p.machine_id, p.provider, p.provider_id, p.provider_reservation_id, p.provider_location
),
request AS (
    DELETE FROM machine_decommission_request d
    WHERE d.machine_id = @machine_id
    RETURNING d.requested_at, d.requested_by, d.reason
),
agent_started AS (
    DELETE FROM machine_agent_started t WHERE t.machine_id = @machine_id RETURNING t.machine_id, t.agent_public_key
),
agent_heartbeat AS (
    DELETE FROM machine_agent_heartbeat t WHERE t.machine_id = @machine_id RETURNING t.machine_id
),
hardware_report AS (
    DELETE FROM machine_hardware_report t WHERE t.machine_id = @machine_id RETURNING t.machine_id
),
installation_request AS (
    DELETE FROM machine_os_installation_request t WHERE t.machine_id = @machine_id RETURNING t.machine_id
),
installation_report AS (
    DELETE FROM machine_os_installation_report t WHERE t.machine_id = @machine_id RETURNING t.machine_id
),
host_key AS (
    DELETE FROM machine_ssh_host_key t WHERE t.machine_id = @machine_id RETURNING t.machine_id
),
backoffs AS (
    DELETE FROM work_backoff t WHERE t.machine_id = @machine_id RETURNING t.machine_id
),
recorded AS (
    INSERT INTO decommissioned_machines (machine_id, provider, provider_id, provider_reservation_id,
                                         provider_location, requested_at, requested_by, reason, released,
                                         agent_public_key)
    SELECT p.machine_id, p.provider, p.provider_id, p.provider_reservation_id, p.provider_location,
           r.requested_at, COALESCE(r.requested_by, ''), COALESCE(r.reason, ''), @released::boolean,
           a.agent_public_key
    FROM provided p
    LEFT JOIN request r ON true
    LEFT JOIN agent_started a ON true
    RETURNING machine_id
),
marked AS (
    UPDATE machines m
    SET decommissioned_at = now()
    FROM recorded rc
    WHERE m.machine_id = rc.machine_id
    RETURNING m.decommissioned_at
)
SELECT p.provider, p.provider_id, mk.decommissioned_at,
       ((SELECT count(*) FROM agent_started) + (SELECT count(*) FROM agent_heartbeat)
        + (SELECT count(*) FROM hardware_report) + (SELECT count(*) FROM installation_request)
        + (SELECT count(*) FROM installation_report) + (SELECT count(*) FROM host_key)
        + (SELECT count(*) FROM backoffs) + (SELECT count(*) FROM request))::bigint AS tags_deleted
FROM provided p
CROSS JOIN marked mk;

-- name: DecommissionedGet :one
-- DecommissionedGet returns the record of a decommissioned machine.
SELECT d.machine_id, m.decommissioned_at, d.provider, d.provider_id, d.provider_reservation_id,
       d.provider_location, d.requested_at, d.requested_by, d.reason, d.released
FROM decommissioned_machines d
JOIN machines m ON m.machine_id = d.machine_id
WHERE d.machine_id = @machine_id;

-- name: DecommissionedProviderIDs :many
-- DecommissionedProviderIDs returns the provider ids a provider's
-- decommissioned machines had; the provisioner never takes them into the
-- fleet again.
SELECT DISTINCT provider_id
FROM decommissioned_machines
WHERE provider = @provider
ORDER BY provider_id;
