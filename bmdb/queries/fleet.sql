-- name: FleetStates :many
-- FleetStates counts a provider's machines per derived state (SPEC §3.7),
-- computed from tags on every call and never stored. The order of the CASE
-- is the precedence: a machine being decommissioned is shown as that,
-- whatever else is true of it, and so on down to Healthy.
WITH m AS (
    SELECT
        CASE
            WHEN d.machine_id IS NOT NULL THEN 'Decommissioning'
            WHEN p.provider_status = 'Missing' THEN 'Missing'
            WHEN EXISTS (SELECT 1 FROM work_backoff b
                         WHERE b.machine_id = p.machine_id AND b.quarantined_at IS NOT NULL) THEN 'Quarantined'
            WHEN EXISTS (SELECT 1 FROM work w JOIN sessions s ON s.session_id = w.session_id
                         WHERE w.machine_id = p.machine_id AND w.process = 'AgentStart'
                           AND s.deadline > now() AND s.closed_at IS NULL) THEN 'AgentStarting'
            WHEN EXISTS (SELECT 1 FROM work w JOIN sessions s ON s.session_id = w.session_id
                         WHERE w.machine_id = p.machine_id AND w.process = 'Recovery'
                           AND s.deadline > now() AND s.closed_at IS NULL) THEN 'Recovering'
            WHEN p.agent_phase = 'Installed' THEN 'Installed'
            WHEN q.generation IS NOT NULL AND r.generation = q.generation AND NOT r.success THEN 'InstallFailed'
            WHEN q.generation IS NOT NULL AND r.generation IS DISTINCT FROM q.generation
                 AND p.agent_phase = 'Heartbeating' THEN 'Installing'
            WHEN EXISTS (SELECT 1 FROM work_backoff b
                         WHERE b.machine_id = p.machine_id AND b.backoff_until > now()) THEN 'BackedOff'
            WHEN p.agent_phase = 'AwaitingAgent' THEN 'Provided'
            WHEN p.agent_phase = 'AwaitingFirstHeartbeat'
                 AND s.agent_started_at >= now() - interval '1 millisecond' * @first_heartbeat_timeout_ms::bigint
                 THEN 'AwaitingFirstHeartbeat'
            WHEN p.agent_phase = 'AwaitingFirstHeartbeat' THEN 'Silent'
            WHEN h.agent_heartbeat_at < now() - interval '1 millisecond' * @heartbeat_timeout_ms::bigint THEN 'Silent'
            ELSE 'Healthy'
        END AS state
    FROM machine_provided p
    LEFT JOIN machine_decommission_request d ON d.machine_id = p.machine_id
    LEFT JOIN machine_agent_started s ON s.machine_id = p.machine_id
    LEFT JOIN machine_agent_heartbeat h ON h.machine_id = p.machine_id
    LEFT JOIN machine_os_installation_request q ON q.machine_id = p.machine_id
    LEFT JOIN machine_os_installation_report r ON r.machine_id = p.machine_id
    WHERE p.provider = @provider
)
SELECT m.state::text AS state, count(*) AS machines
FROM m
GROUP BY m.state
ORDER BY m.state;
