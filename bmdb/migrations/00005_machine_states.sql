-- Derived machine state (SPEC §3.7), defined once.
--
-- machine_states(first_heartbeat_timeout_ms, heartbeat_timeout_ms) returns
-- every provided machine with its derived state. FleetStates (the gauges),
-- the machine list and the machine page all read it, so a machine counted
-- as Silent is the one the list shows as Silent. It is a function rather
-- than a view because Silent depends on the recovery timeouts; it is one
-- SQL SELECT, so PostgreSQL inlines it into the calling query and pushes
-- the caller's conditions (a machine id, a provider) into it.
--
-- The order of the CASE is the precedence: a machine being decommissioned
-- is shown as that, whatever else is true of it, and so on down to
-- Healthy. Silent is exactly what the recovery candidate query selects by
-- tags (bmdb/candidates/recovery.sql): no heartbeat within the first
-- heartbeat timeout of the start (both the phase and the start older than
-- it), or a watched heartbeat older than the heartbeat timeout.
--
-- Shape, for speed at 100,000 machines whether the fleet is healthy or
-- every agent fell silent at once. The full scans (FleetStates, a filtered
-- list) read machine_provided once and hash-join a few small relations
-- built from small tables and partial indexes: the flags of machines with
-- a decommission request, a quarantine or active backoff, or live
-- AgentStart or Recovery work (grouped, since those tables have a row per
-- process); unfinished and failed installations; silent agents, by the
-- partial indexes the recovery query reads. A lookup of one machine (the
-- caller's machine_id = X is pushed into every part) reads a handful of
-- primary key entries. Decommissioned machines have no Provided tag and
-- are not returned.

-- +goose Up
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
    state text
)
LANGUAGE sql STABLE AS $$
SELECT p.machine_id, p.provider, p.provider_id, p.provider_reservation_id, p.provider_ip_address,
       p.provider_location, p.provider_status, p.provider_status_at, p.agent_phase,
       CASE
           WHEN f.decommission_requested THEN 'Decommissioning'
           WHEN p.provider_status = 'Missing' THEN 'Missing'
           WHEN f.quarantined THEN 'Quarantined'
           WHEN f.agent_starting THEN 'AgentStarting'
           WHEN f.recovering THEN 'Recovering'
           WHEN p.agent_phase = 'Installed' THEN 'Installed'
           WHEN i.failed THEN 'InstallFailed'
           WHEN i.machine_id IS NOT NULL AND p.agent_phase = 'Heartbeating' THEN 'Installing'
           WHEN f.backed_off THEN 'BackedOff'
           WHEN p.agent_phase = 'AwaitingAgent' THEN 'Provided'
           WHEN o.machine_id IS NOT NULL OR hs.machine_id IS NOT NULL THEN 'Silent'
           WHEN p.agent_phase = 'AwaitingFirstHeartbeat' THEN 'AwaitingFirstHeartbeat'
           ELSE 'Healthy'
       END
FROM machine_provided p
LEFT JOIN (
    SELECT x.machine_id,
           bool_or(x.flag = 'decommission_requested') AS decommission_requested,
           bool_or(x.flag = 'quarantined') AS quarantined,
           bool_or(x.flag = 'backed_off') AS backed_off,
           bool_or(x.flag = 'agent_starting') AS agent_starting,
           bool_or(x.flag = 'recovering') AS recovering
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
    ) x
    GROUP BY x.machine_id
) f ON f.machine_id = p.machine_id
-- Requests without a report of their generation (pending), and failed ones.
LEFT JOIN (
    SELECT q.machine_id, (r.generation = q.generation) AS failed
    FROM machine_os_installation_request q
    LEFT JOIN machine_os_installation_report r ON r.machine_id = q.machine_id
    WHERE r.generation IS DISTINCT FROM q.generation OR NOT r.success
) i ON i.machine_id = p.machine_id
-- The first arm of the recovery candidate query: no heartbeat within the
-- first heartbeat timeout of the start.
LEFT JOIN (
    SELECT s.machine_id
    FROM machine_provided p2
    JOIN machine_agent_started s ON s.machine_id = p2.machine_id
    WHERE p2.agent_phase = 'AwaitingFirstHeartbeat'
      AND p2.agent_phase_since < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
      AND s.agent_started_at < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
) o ON o.machine_id = p.machine_id
-- The second arm: a watched (Heartbeating) agent's last heartbeat is older
-- than the heartbeat timeout.
LEFT JOIN machine_agent_heartbeat hs ON hs.machine_id = p.machine_id AND hs.watched
     AND hs.agent_heartbeat_at < now() - interval '1 millisecond' * heartbeat_timeout_ms
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION machine_states(bigint, bigint);
