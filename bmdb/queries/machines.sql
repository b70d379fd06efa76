-- The machine list, the machine page and the session list (SPEC §6), for
-- the web UI and the CLI.

-- name: MachineListAll :many
-- MachineListAll is a page of the unfiltered machine list: it walks the
-- primary keys in id order from @after (keyset pagination), stops after
-- one page, and only then works out the state of the machines on it, one
-- machine at a time (OFFSET 0 keeps the planner from merging that into a
-- join that would work out every machine's state first). A page costs the
-- same whatever the fleet size and however many machines are silent.
--
-- States come from machine_states (migration 00005), the definition
-- FleetStates counts by. Its columns are cast where they are read because
-- sqlc does not know the columns of a function in FROM; the casts are
-- no-ops to PostgreSQL.
--
-- A filtered list is another statement (MachineListFiltered), because one
-- plan cannot serve both. Walking the primary key until a page of matches
-- turns up is fast for a common state, and reads the whole fleet in id
-- order, a random heap access per machine, for a rare one; the planner
-- cannot tell the two apart from a CASE it has no statistics for.
WITH listed AS (
    SELECT p.machine_id
    FROM machine_provided p
    UNION ALL
    SELECT d.machine_id
    FROM decommissioned_machines d
    WHERE @include_decommissioned::boolean
),
page AS (
    -- A merge of the two primary keys, read from @after on.
    SELECT l.machine_id
    FROM listed l
    WHERE l.machine_id > @after::uuid
    ORDER BY l.machine_id
    LIMIT @row_limit::integer
)
SELECT pg.machine_id, COALESCE(st.state, 'Decommissioned')::text AS state,
       COALESCE(p.provider, d.provider, '')::text AS provider,
       COALESCE(p.provider_id, d.provider_id, '')::text AS provider_id,
       COALESCE(p.provider_location, d.provider_location, '')::text AS provider_location,
       p.provider_ip_address,
       COALESCE(p.provider_status, '')::text AS provider_status,
       s.agent_started_at, h.agent_heartbeat_at, m.decommissioned_at
FROM page pg
JOIN machines m ON m.machine_id = pg.machine_id
LEFT JOIN machine_provided p ON p.machine_id = pg.machine_id
LEFT JOIN decommissioned_machines d ON d.machine_id = pg.machine_id
LEFT JOIN machine_agent_started s ON s.machine_id = pg.machine_id
LEFT JOIN machine_agent_heartbeat h ON h.machine_id = pg.machine_id
LEFT JOIN LATERAL (
    SELECT ms.state::text AS state
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) ms
    WHERE ms.machine_id::uuid = pg.machine_id
    OFFSET 0
) st ON true
ORDER BY pg.machine_id;

-- name: MachineListWindow :many
-- MachineListWindow looks for a filtered page among the next @window_size
-- machines in id order (from @after), working out each one's state on its
-- own as MachineListAll does, and stops as soon as the page is full. A
-- filter most machines pass (a provider, Healthy) fills a page within a
-- few dozen machines; one few pass does not, and the caller then scans the
-- fleet with MachineListFiltered or MachineListInState. Filters as in
-- MachineListFiltered, and state as in MachineListInState ('' for any).
WITH listed AS (
    SELECT p.machine_id
    FROM machine_provided p
    UNION ALL
    SELECT d.machine_id
    FROM decommissioned_machines d
    WHERE @include_decommissioned::boolean
),
win AS (
    SELECT l.machine_id
    FROM listed l
    WHERE l.machine_id > @after::uuid
    ORDER BY l.machine_id
    LIMIT @window_size::integer
),
page AS (
    SELECT w.machine_id, COALESCE(st.state, 'Decommissioned')::text AS state
    FROM win w
    LEFT JOIN machine_provided p ON p.machine_id = w.machine_id
    LEFT JOIN decommissioned_machines d ON d.machine_id = w.machine_id
    LEFT JOIN LATERAL (
        SELECT ms.state::text AS state
        FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) ms
        WHERE ms.machine_id::uuid = w.machine_id
        OFFSET 0
    ) st ON true
    WHERE (@provider::text = '' OR COALESCE(p.provider, d.provider) = @provider::text)
      AND (@location::text = '' OR COALESCE(p.provider_location, d.provider_location) = @location::text)
      AND (@search::text = ''
           OR w.machine_id BETWEEN sqlc.narg(search_id_from)::uuid AND sqlc.narg(search_id_to)::uuid
           OR p.provider_ip_address = sqlc.narg(search_ip)::inet
           OR p.provider_ip_address <<= sqlc.narg(search_net)::cidr
           OR COALESCE(p.provider_id, d.provider_id) ILIKE @search_pattern::text
           OR starts_with(host(p.provider_ip_address), sqlc.narg(search_ip_prefix)::text))
      AND (@state::text = '' OR COALESCE(st.state, 'Decommissioned') = @state::text)
    ORDER BY w.machine_id
    LIMIT @row_limit::integer
)
SELECT pg.machine_id, pg.state,
       COALESCE(p.provider, d.provider, '')::text AS provider,
       COALESCE(p.provider_id, d.provider_id, '')::text AS provider_id,
       COALESCE(p.provider_location, d.provider_location, '')::text AS provider_location,
       p.provider_ip_address,
       COALESCE(p.provider_status, '')::text AS provider_status,
       s.agent_started_at, h.agent_heartbeat_at, m.decommissioned_at
FROM page pg
JOIN machines m ON m.machine_id = pg.machine_id
LEFT JOIN machine_provided p ON p.machine_id = pg.machine_id
LEFT JOIN decommissioned_machines d ON d.machine_id = pg.machine_id
LEFT JOIN machine_agent_started s ON s.machine_id = pg.machine_id
LEFT JOIN machine_agent_heartbeat h ON h.machine_id = pg.machine_id
ORDER BY pg.machine_id;

-- name: MachineListFiltered :many
-- MachineListFiltered is a page of the machine list filtered by provider,
-- location and search, in any state. It scans the fleet once and sorts
-- the matches by id (OFFSET 0 keeps the planner from turning the scan into
-- a primary key walk, see MachineListAll), then works out the states of
-- one page as MachineListAll does: a predictable scan, a few milliseconds
-- per 10,000 machines, for every filter.
--
-- Search (lower case) matches a machine id prefix (the ids between
-- search_id_from and search_id_to), the IP address (search_ip exactly,
-- search_net as a network, search_ip_prefix as a prefix of its text) or a
-- substring of the provider id (search_pattern, '%' + the escaped search +
-- '%'); the Go side sets the parameters that apply. The five filtered
-- statements here apply the same filters; a test holds their answers to
-- each other.
WITH listed AS (
    SELECT p.machine_id, p.provider, p.provider_id, p.provider_location, p.provider_ip_address
    FROM machine_provided p
    UNION ALL
    SELECT d.machine_id, d.provider, d.provider_id, d.provider_location, NULL::inet
    FROM decommissioned_machines d
    WHERE @include_decommissioned::boolean
),
matched AS (
    SELECT l.machine_id
    FROM listed l
    WHERE l.machine_id > @after::uuid
      AND (@provider::text = '' OR l.provider = @provider::text)
      AND (@location::text = '' OR l.provider_location = @location::text)
      AND (@search::text = ''
           OR l.machine_id BETWEEN sqlc.narg(search_id_from)::uuid AND sqlc.narg(search_id_to)::uuid
           OR l.provider_ip_address = sqlc.narg(search_ip)::inet
           OR l.provider_ip_address <<= sqlc.narg(search_net)::cidr
           OR l.provider_id ILIKE @search_pattern::text
           OR starts_with(host(l.provider_ip_address), sqlc.narg(search_ip_prefix)::text))
    OFFSET 0
),
page AS (
    SELECT mt.machine_id
    FROM matched mt
    ORDER BY mt.machine_id
    LIMIT @row_limit::integer
)
SELECT pg.machine_id, COALESCE(st.state, 'Decommissioned')::text AS state,
       COALESCE(p.provider, d.provider, '')::text AS provider,
       COALESCE(p.provider_id, d.provider_id, '')::text AS provider_id,
       COALESCE(p.provider_location, d.provider_location, '')::text AS provider_location,
       p.provider_ip_address,
       COALESCE(p.provider_status, '')::text AS provider_status,
       s.agent_started_at, h.agent_heartbeat_at, m.decommissioned_at
FROM page pg
JOIN machines m ON m.machine_id = pg.machine_id
LEFT JOIN machine_provided p ON p.machine_id = pg.machine_id
LEFT JOIN decommissioned_machines d ON d.machine_id = pg.machine_id
LEFT JOIN machine_agent_started s ON s.machine_id = pg.machine_id
LEFT JOIN machine_agent_heartbeat h ON h.machine_id = pg.machine_id
LEFT JOIN LATERAL (
    SELECT ms.state::text AS state
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) ms
    WHERE ms.machine_id::uuid = pg.machine_id
    OFFSET 0
) st ON true
ORDER BY pg.machine_id;

-- name: MachineListInState :many
-- MachineListInState is MachineListFiltered for machines in one derived
-- state: the scan works out every machine's state (machine_states, set
-- based: one pass over machine_provided and a few hash joins).
WITH listed AS (
    SELECT s.machine_id::uuid AS machine_id, s.provider::text AS provider, s.provider_id::text AS provider_id,
           s.provider_location::text AS provider_location, s.provider_ip_address::inet AS provider_ip_address,
           s.state::text AS state
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) s
    UNION ALL
    SELECT d.machine_id, d.provider, d.provider_id, d.provider_location, NULL::inet, 'Decommissioned'
    FROM decommissioned_machines d
    WHERE @include_decommissioned::boolean
),
matched AS (
    SELECT l.machine_id, l.state
    FROM listed l
    WHERE l.machine_id > @after::uuid
      AND l.state = @state::text
      AND (@provider::text = '' OR l.provider = @provider::text)
      AND (@location::text = '' OR l.provider_location = @location::text)
      AND (@search::text = ''
           OR l.machine_id BETWEEN sqlc.narg(search_id_from)::uuid AND sqlc.narg(search_id_to)::uuid
           OR l.provider_ip_address = sqlc.narg(search_ip)::inet
           OR l.provider_ip_address <<= sqlc.narg(search_net)::cidr
           OR l.provider_id ILIKE @search_pattern::text
           OR starts_with(host(l.provider_ip_address), sqlc.narg(search_ip_prefix)::text))
    OFFSET 0
),
page AS (
    SELECT mt.machine_id, mt.state
    FROM matched mt
    ORDER BY mt.machine_id
    LIMIT @row_limit::integer
)
SELECT pg.machine_id, pg.state,
       COALESCE(p.provider, d.provider, '')::text AS provider,
       COALESCE(p.provider_id, d.provider_id, '')::text AS provider_id,
       COALESCE(p.provider_location, d.provider_location, '')::text AS provider_location,
       p.provider_ip_address,
       COALESCE(p.provider_status, '')::text AS provider_status,
       s.agent_started_at, h.agent_heartbeat_at, m.decommissioned_at
FROM page pg
JOIN machines m ON m.machine_id = pg.machine_id
LEFT JOIN machine_provided p ON p.machine_id = pg.machine_id
LEFT JOIN decommissioned_machines d ON d.machine_id = pg.machine_id
LEFT JOIN machine_agent_started s ON s.machine_id = pg.machine_id
LEFT JOIN machine_agent_heartbeat h ON h.machine_id = pg.machine_id
ORDER BY pg.machine_id;

-- name: MachineListInFactState :many
-- MachineListInFactState is MachineListInState for a state that only a
-- machine with facts beyond its Provided tag can be in (Silent, BackedOff,
-- Quarantined, Recovering, ...; bmdb.factStates): it works out the state of
-- those machines only (machine_state_facts, a few hundred in a running
-- fleet, through small tables and partial indexes), by the one definition
-- (machine_state, migration 00018), instead of every machine's.
WITH listed AS (
    SELECT p.machine_id, p.provider, p.provider_id, p.provider_location, p.provider_ip_address,
           machine_state(p.provider_status, p.agent_phase, x.decommission_requested::boolean, x.quarantined::boolean,
                         x.agent_starting::boolean, x.recovering::boolean, x.install_failed::boolean,
                         x.install_pending::boolean, x.backed_off::boolean, x.silent::boolean, x.installed::boolean) AS state
    FROM machine_state_facts(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) x
    JOIN machine_provided p ON p.machine_id = x.machine_id::uuid
),
matched AS (
    SELECT l.machine_id, l.state
    FROM listed l
    WHERE l.machine_id > @after::uuid
      AND l.state = @state::text
      AND (@provider::text = '' OR l.provider = @provider::text)
      AND (@location::text = '' OR l.provider_location = @location::text)
      AND (@search::text = ''
           OR l.machine_id BETWEEN sqlc.narg(search_id_from)::uuid AND sqlc.narg(search_id_to)::uuid
           OR l.provider_ip_address = sqlc.narg(search_ip)::inet
           OR l.provider_ip_address <<= sqlc.narg(search_net)::cidr
           OR l.provider_id ILIKE @search_pattern::text
           OR starts_with(host(l.provider_ip_address), sqlc.narg(search_ip_prefix)::text))
    OFFSET 0
),
page AS (
    SELECT mt.machine_id, mt.state
    FROM matched mt
    ORDER BY mt.machine_id
    LIMIT @row_limit::integer
)
SELECT pg.machine_id, pg.state,
       COALESCE(p.provider, d.provider, '')::text AS provider,
       COALESCE(p.provider_id, d.provider_id, '')::text AS provider_id,
       COALESCE(p.provider_location, d.provider_location, '')::text AS provider_location,
       p.provider_ip_address,
       COALESCE(p.provider_status, '')::text AS provider_status,
       s.agent_started_at, h.agent_heartbeat_at, m.decommissioned_at
FROM page pg
JOIN machines m ON m.machine_id = pg.machine_id
LEFT JOIN machine_provided p ON p.machine_id = pg.machine_id
LEFT JOIN decommissioned_machines d ON d.machine_id = pg.machine_id
LEFT JOIN machine_agent_started s ON s.machine_id = pg.machine_id
LEFT JOIN machine_agent_heartbeat h ON h.machine_id = pg.machine_id
ORDER BY pg.machine_id;

-- name: MachineCount :one
-- MachineCount counts what MachineListFiltered lists, all pages together.
WITH listed AS (
    SELECT p.machine_id, p.provider, p.provider_id, p.provider_location, p.provider_ip_address
    FROM machine_provided p
    UNION ALL
    SELECT d.machine_id, d.provider, d.provider_id, d.provider_location, NULL::inet
    FROM decommissioned_machines d
    WHERE @include_decommissioned::boolean
)
SELECT count(*)
FROM listed l
WHERE (@provider::text = '' OR l.provider = @provider::text)
  AND (@location::text = '' OR l.provider_location = @location::text)
  AND (@search::text = ''
       OR l.machine_id BETWEEN sqlc.narg(search_id_from)::uuid AND sqlc.narg(search_id_to)::uuid
       OR l.provider_ip_address = sqlc.narg(search_ip)::inet
       OR l.provider_ip_address <<= sqlc.narg(search_net)::cidr
       OR l.provider_id ILIKE @search_pattern::text
       OR starts_with(host(l.provider_ip_address), sqlc.narg(search_ip_prefix)::text));

-- name: MachineCountInState :one
-- MachineCountInState counts what MachineListInState lists.
WITH listed AS (
    SELECT s.machine_id::uuid AS machine_id, s.provider::text AS provider, s.provider_id::text AS provider_id,
           s.provider_location::text AS provider_location, s.provider_ip_address::inet AS provider_ip_address,
           s.state::text AS state
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) s
    UNION ALL
    SELECT d.machine_id, d.provider, d.provider_id, d.provider_location, NULL::inet, 'Decommissioned'
    FROM decommissioned_machines d
    WHERE @include_decommissioned::boolean
)
SELECT count(*)
FROM listed l
WHERE l.state = @state::text
  AND (@provider::text = '' OR l.provider = @provider::text)
  AND (@location::text = '' OR l.provider_location = @location::text)
  AND (@search::text = ''
       OR l.machine_id BETWEEN sqlc.narg(search_id_from)::uuid AND sqlc.narg(search_id_to)::uuid
       OR l.provider_ip_address = sqlc.narg(search_ip)::inet
       OR l.provider_ip_address <<= sqlc.narg(search_net)::cidr
       OR l.provider_id ILIKE @search_pattern::text
       OR starts_with(host(l.provider_ip_address), sqlc.narg(search_ip_prefix)::text));

-- name: MachineGet :one
-- MachineGet reads one machine and its tags. machine_states is inlined and
-- the machine id pushed into it, so this reads primary key entries only.
WITH ms AS (
    SELECT s.machine_id::uuid AS machine_id, s.state::text AS state, s.agent_silent::boolean AS agent_silent
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) s
)
SELECT m.machine_id, m.created_at, m.decommissioned_at,
       -- Every machine is either provided or decommissioned; one with
       -- neither is backed by no provider machine, which is what Missing
       -- tells an operator.
       COALESCE(ms.state, CASE WHEN m.decommissioned_at IS NOT NULL THEN 'Decommissioned' ELSE 'Missing' END)::text AS state,
       (p.machine_id IS NOT NULL)::boolean AS provided,
       COALESCE(p.provider, d.provider, '')::text AS provider,
       COALESCE(p.provider_id, d.provider_id, '')::text AS provider_id,
       COALESCE(p.provider_reservation_id, d.provider_reservation_id, '')::text AS provider_reservation_id,
       p.provider_ip_address,
       COALESCE(p.provider_location, d.provider_location, '')::text AS provider_location,
       COALESCE(p.provider_status, '')::text AS provider_status,
       p.provider_status_at,
       COALESCE(p.agent_phase, '')::text AS agent_phase,
       COALESCE(ms.agent_silent, false)::boolean AS agent_silent,
       s.agent_started_at, s.agent_public_key,
       h.agent_heartbeat_at,
       hw.hardware_report_raw, hw.reported_at AS hardware_reported_at,
       q.generation AS request_generation, q.os_installation_request_raw AS request_raw, q.requested_at,
       q.requested_by AS installation_requested_by,
       r.generation AS report_generation, r.success AS report_success, r.error_message AS report_error,
       r.os_installation_report_raw AS report_raw, r.reported_at AS installation_reported_at,
       k.host_key, COALESCE(k.pinned, false)::boolean AS host_key_pinned, k.recorded_at AS host_key_recorded_at,
       k.offered_host_key, k.offered_at AS host_key_offered_at,
       -- The request, or what the decommission record kept of it.
       (dr.machine_id IS NOT NULL)::boolean AS decommission_requested,
       dr.requested_at AS decommission_requested_at,
       d.requested_at AS decommissioned_request_at,
       COALESCE(dr.requested_by, d.requested_by, '')::text AS decommission_requested_by,
       COALESCE(dr.reason, d.reason, '')::text AS decommission_reason
FROM machines m
LEFT JOIN ms ON ms.machine_id = m.machine_id
LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
LEFT JOIN decommissioned_machines d ON d.machine_id = m.machine_id
LEFT JOIN machine_agent_started s ON s.machine_id = m.machine_id
LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
LEFT JOIN machine_hardware_report hw ON hw.machine_id = m.machine_id
LEFT JOIN machine_os_installation_request q ON q.machine_id = m.machine_id
LEFT JOIN machine_os_installation_report r ON r.machine_id = m.machine_id
LEFT JOIN machine_ssh_host_key k ON k.machine_id = m.machine_id
LEFT JOIN machine_decommission_request dr ON dr.machine_id = m.machine_id
WHERE m.machine_id = @machine_id;

-- name: MachineLiveWork :many
-- MachineLiveWork lists the work held on a machine by live sessions; work
-- of a dead session is free and about to be expired.
SELECT w.process, w.session_id, s.component, w.started_at
FROM work w
JOIN sessions s ON s.session_id = w.session_id
WHERE w.machine_id = @machine_id AND s.deadline > now() AND s.closed_at IS NULL
ORDER BY w.started_at, w.process;

-- name: MachineBackoffs :many
-- MachineBackoffs lists a machine's backoffs, past ones included (they set
-- how long the next failure waits), each saying whether it is in force.
SELECT b.process, b.backoff_until, b.cause, b.last_interval_ms, b.attempts, b.quarantined_at, b.updated_at,
       (b.quarantined_at IS NOT NULL OR b.backoff_until > now())::boolean AS active
FROM work_backoff b
WHERE b.machine_id = @machine_id
ORDER BY b.process;

-- name: SessionListWithWork :many
-- SessionListWithWork lists sessions, newest first, with how much work
-- each holds; only live ones unless include_dead.
SELECT s.session_id, s.component, s.hostname, s.pid, s.version, s.created_at, s.lease_ms, s.deadline, s.closed_at,
       (s.deadline > now() AND s.closed_at IS NULL)::boolean AS alive,
       COALESCE(wc.work, 0)::bigint AS work
FROM sessions s
LEFT JOIN (
    SELECT w.session_id, count(*) AS work FROM work w GROUP BY w.session_id
) wc ON wc.session_id = s.session_id
WHERE @include_dead::boolean OR (s.deadline > now() AND s.closed_at IS NULL)
ORDER BY s.created_at DESC, s.session_id
LIMIT @row_limit::integer;


-- name: MachinePowerState :one
-- MachinePowerState is the last look at a machine's power through its BMC.
SELECT bmc, state, state_at, error_class, error_message, checked_at
FROM machine_power_state
WHERE machine_id = @machine_id;

-- name: MachinePowerStateRecord :one
-- MachinePowerStateRecord records a look at a machine's power: the state if
-- one was read (NULL keeps the last one read through the same BMC, and
-- forgets one read through another), and the error class and message of a
-- check or action that failed ('' clears them). No row: the machine does
-- not exist.
INSERT INTO machine_power_state (machine_id, bmc, state, state_at, error_class, error_message, checked_at)
SELECT m.machine_id, @bmc::text, sqlc.narg(state)::text,
       CASE WHEN sqlc.narg(state)::text IS NOT NULL THEN now() END,
       @error_class::text, @error_message::text, now()
FROM machines m
WHERE m.machine_id = @machine_id
ON CONFLICT (machine_id) DO UPDATE
SET bmc = EXCLUDED.bmc,
    state = CASE WHEN EXCLUDED.state IS NOT NULL THEN EXCLUDED.state
                 WHEN machine_power_state.bmc = EXCLUDED.bmc THEN machine_power_state.state END,
    state_at = CASE WHEN EXCLUDED.state IS NOT NULL THEN EXCLUDED.state_at
                    WHEN machine_power_state.bmc = EXCLUDED.bmc THEN machine_power_state.state_at END,
    error_class = EXCLUDED.error_class,
    error_message = EXCLUDED.error_message,
    checked_at = EXCLUDED.checked_at
RETURNING checked_at;

-- name: MachineListByProviderID :many
-- MachineListByProviderID is a page of the machine list, filtered as
-- MachineListInState (state '' for any), in provider id order: by
-- provider, provider id and machine id, from the machine after the cursor
-- (@after_provider, @after_provider_id, @after; a provider is never '', so
-- '', '', nil starts at the first). Like MachineListInState it scans the
-- fleet once (machine_states, set based) and sorts the matches: a
-- predictable cost per page, whatever the filter.
WITH listed AS (
    SELECT s.machine_id::uuid AS machine_id, s.provider::text AS provider, s.provider_id::text AS provider_id,
           s.provider_location::text AS provider_location, s.provider_ip_address::inet AS provider_ip_address,
           s.state::text AS state
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) s
    UNION ALL
    SELECT d.machine_id, d.provider, d.provider_id, d.provider_location, NULL::inet, 'Decommissioned'
    FROM decommissioned_machines d
    WHERE @include_decommissioned::boolean
),
page AS (
    SELECT l.machine_id, l.state, l.provider, l.provider_id
    FROM listed l
    WHERE (l.provider, l.provider_id, l.machine_id) > (@after_provider::text, @after_provider_id::text, @after::uuid)
      AND (@state::text = '' OR l.state = @state::text)
      AND (@provider::text = '' OR l.provider = @provider::text)
      AND (@location::text = '' OR l.provider_location = @location::text)
      AND (@search::text = ''
           OR l.machine_id BETWEEN sqlc.narg(search_id_from)::uuid AND sqlc.narg(search_id_to)::uuid
           OR l.provider_ip_address = sqlc.narg(search_ip)::inet
           OR l.provider_ip_address <<= sqlc.narg(search_net)::cidr
           OR l.provider_id ILIKE @search_pattern::text
           OR starts_with(host(l.provider_ip_address), sqlc.narg(search_ip_prefix)::text))
    ORDER BY l.provider, l.provider_id, l.machine_id
    LIMIT @row_limit::integer
)
SELECT pg.machine_id, pg.state,
       COALESCE(p.provider, d.provider, '')::text AS provider,
       COALESCE(p.provider_id, d.provider_id, '')::text AS provider_id,
       COALESCE(p.provider_location, d.provider_location, '')::text AS provider_location,
       p.provider_ip_address,
       COALESCE(p.provider_status, '')::text AS provider_status,
       s.agent_started_at, h.agent_heartbeat_at, m.decommissioned_at
FROM page pg
JOIN machines m ON m.machine_id = pg.machine_id
LEFT JOIN machine_provided p ON p.machine_id = pg.machine_id
LEFT JOIN decommissioned_machines d ON d.machine_id = pg.machine_id
LEFT JOIN machine_agent_started s ON s.machine_id = pg.machine_id
LEFT JOIN machine_agent_heartbeat h ON h.machine_id = pg.machine_id
ORDER BY pg.provider, pg.provider_id, pg.machine_id;
