-- Two changes to what "silent" means (issue 10, items 22 and 10).
--
-- 1. An installed machine is watched like any other. "Installed" used to be
--    an agent phase that took the machine out of agent start and recovery
--    for good, so a machine that rebooted into its new OS and never
--    heartbeated again stayed "Installed" for ever. The agent phase now
--    follows the agent's tags only; a successful installation is shown as
--    the derived state Installed while the agent is healthy, and a silent
--    installed machine is Silent and recovered (rebooted, then taken over
--    again) like any other.
--
-- 2. Silence that overlaps the callback server's own inability to record
--    heartbeats does not count. Each callback server registers a
--    heartbeat_recorders row under its session and checks in every second;
--    ok_since is when it last started recording successfully (its start, or
--    the first success after a failed batch or check-in). A machine is
--    silent only if no recorder was impaired within the heartbeat timeout:
--    none (re)started recording within it, none alive has missed its
--    check-ins (it cannot write now), and none died without closing its
--    session within it. With no recorders at all (no callback server ever
--    ran against this BMDB) silence counts as before.

-- +goose Up
DROP TRIGGER machine_os_installation_request_phase ON machine_os_installation_request;
DROP TRIGGER machine_os_installation_report_phase ON machine_os_installation_report;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION machine_agent_phase(m uuid) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN NOT EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = m) THEN 'AwaitingAgent'
        WHEN NOT EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = m) THEN 'AwaitingFirstHeartbeat'
        ELSE 'Heartbeating'
    END
$$;
-- +goose StatementEnd

UPDATE machine_provided SET agent_phase = machine_agent_phase(machine_id), agent_phase_since = now(), revision = revision + 1
WHERE agent_phase = 'Installed';
UPDATE machine_agent_heartbeat h SET watched = true
FROM machine_provided p
WHERE p.machine_id = h.machine_id AND p.agent_phase = 'Heartbeating' AND NOT h.watched;

ALTER TABLE machine_provided DROP CONSTRAINT machine_provided_agent_phase_check;
ALTER TABLE machine_provided ADD CONSTRAINT machine_provided_agent_phase_check
    CHECK (agent_phase IN ('AwaitingAgent', 'AwaitingFirstHeartbeat', 'Heartbeating'));

CREATE TABLE heartbeat_recorders (
    session_id uuid PRIMARY KEY REFERENCES sessions (session_id) ON DELETE CASCADE,
    ok_since timestamptz NOT NULL DEFAULT now(),
    checked_at timestamptz NOT NULL DEFAULT now()
);

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION machine_states(first_heartbeat_timeout_ms bigint, heartbeat_timeout_ms bigint)
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
           WHEN i.failed THEN 'InstallFailed'
           WHEN i.pending AND p.agent_phase = 'Heartbeating' THEN 'Installing'
           WHEN f.backed_off THEN 'BackedOff'
           WHEN p.agent_phase = 'AwaitingAgent' THEN 'Provided'
           WHEN o.machine_id IS NOT NULL OR hs.machine_id IS NOT NULL THEN 'Silent'
           WHEN p.agent_phase = 'AwaitingFirstHeartbeat' THEN 'AwaitingFirstHeartbeat'
           WHEN i.installed THEN 'Installed'
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
-- Every installation request, with what its report (of the same
-- generation) says: failed, installed, or neither yet (pending).
LEFT JOIN (
    SELECT q.machine_id,
           coalesce(r.generation = q.generation AND NOT r.success, false) AS failed,
           coalesce(r.generation = q.generation AND r.success, false) AS installed,
           r.generation IS DISTINCT FROM q.generation AS pending
    FROM machine_os_installation_request q
    LEFT JOIN machine_os_installation_report r ON r.machine_id = q.machine_id
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
      AND NOT EXISTS (
          SELECT 1 FROM heartbeat_recorders r JOIN sessions rs ON rs.session_id = r.session_id
          WHERE rs.closed_at IS NULL
            AND (r.ok_since > now() - interval '1 millisecond' * heartbeat_timeout_ms
                 OR (rs.deadline > now() - interval '1 millisecond' * heartbeat_timeout_ms
                     AND (rs.deadline <= now() OR r.checked_at < now() - interval '5 seconds'))))
) o ON o.machine_id = p.machine_id
-- The second arm: a watched (Heartbeating) agent's last heartbeat is older
-- than the heartbeat timeout.
LEFT JOIN (
    SELECT h.machine_id
    FROM machine_agent_heartbeat h
    WHERE h.watched
      AND h.agent_heartbeat_at < now() - interval '1 millisecond' * heartbeat_timeout_ms
      AND NOT EXISTS (
          SELECT 1 FROM heartbeat_recorders r JOIN sessions rs ON rs.session_id = r.session_id
          WHERE rs.closed_at IS NULL
            AND (r.ok_since > now() - interval '1 millisecond' * heartbeat_timeout_ms
                 OR (rs.deadline > now() - interval '1 millisecond' * heartbeat_timeout_ms
                     AND (rs.deadline <= now() OR r.checked_at < now() - interval '5 seconds'))))
) hs ON hs.machine_id = p.machine_id
$$;
-- +goose StatementEnd

-- +goose Down
SELECT 'irreversible: Installed is no longer an agent phase';
