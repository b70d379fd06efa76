-- History says why (issue 13).
--
-- Held: a work item a safety limit gave back without acting (the recovery
-- circuit breaker's reboot budget), distinct from Canceled (a shutdown).
-- Installing, Installed, InstallFailed: the outcomes of OS installation
-- requests, written by the heartbeat statement when the request is handed
-- to the agent and when its report arrives, so that an earlier failure
-- survives a new request.
--
-- machine_os_installation_request.requested_by names who asked (the CLI's
-- operator, or the web UI's), one source for every view; delivered_generation
-- is the last generation handed to the agent (history Installing once per
-- generation).
--
-- duration_text formats an interval as Go's time.Duration.String does
-- for whole seconds ("12m3s", "1h0m0s"), for causes written in SQL (the
-- recovery claim's Started row names how long the machine has been silent).
-- dead_session_cause is the cause of the Expired row of work a dead
-- session held: which process it was, and when its lease ran out.

-- +goose Up
ALTER TABLE work_history DROP CONSTRAINT work_history_event_check;
ALTER TABLE work_history ADD CONSTRAINT work_history_event_check CHECK (event IN (
    'Started', 'Finished', 'Failed', 'Canceled', 'Expired', 'Quarantined', 'Reset', 'Requested',
    'Held', 'Installing', 'Installed', 'InstallFailed'));

ALTER TABLE machine_os_installation_request
    ADD COLUMN requested_by text NOT NULL DEFAULT '',
    ADD COLUMN delivered_generation bigint;

-- +goose StatementBegin
CREATE FUNCTION duration_text(d interval) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE
        WHEN s >= 3600 THEN (s / 3600)::text || 'h' || (s % 3600 / 60)::text || 'm' || (s % 60)::text || 's'
        WHEN s >= 60 THEN (s / 60)::text || 'm' || (s % 60)::text || 's'
        ELSE s::text || 's'
    END
    FROM (SELECT GREATEST(floor(extract(epoch FROM d)), 0)::bigint AS s) x
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- utc_text formats a timestamp as RFC 3339 in UTC to the second, as Go's
-- time.RFC3339 does for a UTC time.
CREATE FUNCTION utc_text(t timestamptz) RETURNS text
LANGUAGE sql STABLE STRICT PARALLEL SAFE AS $$
    SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION dead_session_cause(session_id uuid, component text, hostname text, pid integer,
                                   deadline timestamptz, closed_at timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT 'session ' || session_id::text || ' (' || component
           || CASE WHEN hostname <> '' THEN ' on ' || hostname || ', pid ' || pid::text ELSE '' END || ') '
           || CASE WHEN closed_at IS NOT NULL THEN 'was closed at ' || utc_text(closed_at) || ' without ending its work'
                   ELSE 'expired: its lease ran out at ' || utc_text(deadline)
                        || ' (the process stopped renewing it: it died, hung or lost the database)' END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION dead_session_cause(uuid, text, text, integer, timestamptz, timestamptz);
DROP FUNCTION utc_text(timestamptz);
DROP FUNCTION duration_text(interval);
ALTER TABLE machine_os_installation_request DROP COLUMN delivered_generation, DROP COLUMN requested_by;
DELETE FROM work_history WHERE event IN ('Held', 'Installing', 'Installed', 'InstallFailed');
ALTER TABLE work_history DROP CONSTRAINT work_history_event_check;
ALTER TABLE work_history ADD CONSTRAINT work_history_event_check CHECK (event IN (
    'Started', 'Finished', 'Failed', 'Canceled', 'Expired', 'Quarantined', 'Reset', 'Requested'));
