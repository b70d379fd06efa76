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

-- heartbeat_recording_impaired says whether silence within the last
-- window_ms is the recorders' doing: a recorder (re)started recording within
-- it, a live one missed its check-ins (every second; 5 s of silence means it
-- cannot write now), or one died without closing its session within it.
-- The recovery candidate query and machine_states (00014) both ask it, as a
-- scalar subquery, once per query.
-- +goose StatementBegin
CREATE FUNCTION heartbeat_recording_impaired(window_ms bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM heartbeat_recorders r JOIN sessions rs ON rs.session_id = r.session_id
        WHERE rs.closed_at IS NULL
          AND (r.ok_since > now() - interval '1 millisecond' * window_ms
               OR (rs.deadline > now() - interval '1 millisecond' * window_ms
                   AND (rs.deadline <= now() OR r.checked_at < now() - interval '5 seconds'))))
$$;
-- +goose StatementEnd

-- machine_states follows in 00014, with the candidate holds.

-- +goose Down
SELECT 'irreversible: Installed is no longer an agent phase';
