-- name: ProviderLeaseAcquire :one
-- ProviderLeaseAcquire gives the provisioning lease of a provider to the
-- session if it is free (never held, or held by a session that is not alive
-- any more) or already the session's. No row: someone else holds it.
INSERT INTO provider_state AS ps (provider, lease_session_id, lease_acquired_at)
SELECT @provider::text, @session_id::uuid, now()
WHERE EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = @session_id AND s.deadline > now() AND s.closed_at IS NULL)
ON CONFLICT (provider) DO UPDATE
SET lease_session_id = EXCLUDED.lease_session_id, lease_acquired_at = EXCLUDED.lease_acquired_at
WHERE ps.lease_session_id IS NULL
   OR ps.lease_session_id = EXCLUDED.lease_session_id
   OR NOT EXISTS (
        SELECT 1 FROM sessions s
        WHERE s.session_id = ps.lease_session_id AND s.deadline > now() AND s.closed_at IS NULL)
RETURNING ps.lease_acquired_at;

-- name: ProviderLeaseRelease :exec
UPDATE provider_state
SET lease_session_id = NULL, lease_acquired_at = NULL
WHERE provider = @provider AND lease_session_id = @session_id::uuid;

-- name: ProviderStateLock :exec
-- ProviderStateLock creates the provider's row if needed and locks it until
-- the end of the transaction, to serialise decisions about the provider.
INSERT INTO provider_state (provider) VALUES (@provider)
ON CONFLICT (provider) DO UPDATE SET provider = EXCLUDED.provider;

-- name: ProvidedList :many
-- ProvidedList returns every machine of a provider with what the BMDB holds
-- of the provider's details, for the provisioner and the updater to compare
-- with the provider's listing.
SELECT machine_id, provider_id, provider_status, provider_ip_address,
       provider_location, provider_reservation_id
FROM machine_provided
WHERE provider = @provider
ORDER BY provider_id;

-- name: ProvidedSetStatus :execrows
-- ProvidedSetStatus records a status the provider gave machines (by
-- provider id). Only machines whose status differs are written, so
-- provider_status_at keeps saying since when a machine has its status.
UPDATE machine_provided
SET provider_status = @provider_status, provider_status_at = now()
WHERE provider = @provider AND provider_id = ANY(@provider_ids::text[])
  AND provider_status <> @provider_status;

-- name: ProvidedUpdateMany :execrows
-- ProvidedUpdateMany refreshes the provider's details of many machines in
-- one statement: the arrays are parallel, one element per machine (by
-- provider id; an empty ip_address means unknown). Rows whose details are
-- already those given are not written, so a pass over an unchanged fleet
-- writes nothing; provider_status_at moves only when the status changes.
UPDATE machine_provided p
SET provider_status = u.status,
    provider_ip_address = NULLIF(u.ip_address, '')::inet,
    provider_location = u.location,
    provider_reservation_id = u.reservation_id,
    provider_status_at = CASE WHEN p.provider_status <> u.status THEN now() ELSE p.provider_status_at END
FROM (
    -- Set-returning functions in one select list run in lockstep: this is
    -- unnest(a, b, ...) in a form sqlc understands.
    SELECT unnest(@provider_ids::text[]) AS provider_id,
           unnest(@statuses::text[]) AS status,
           unnest(@ip_addresses::text[]) AS ip_address,
           unnest(@locations::text[]) AS location,
           unnest(@reservation_ids::text[]) AS reservation_id
) AS u
WHERE p.provider = @provider AND p.provider_id = u.provider_id
  AND (p.provider_status, p.provider_ip_address, p.provider_location, p.provider_reservation_id)
      IS DISTINCT FROM (u.status, NULLIF(u.ip_address, '')::inet, u.location, u.reservation_id);

-- name: ProvidedStatusExists :one
-- ProvidedStatusExists reports whether any machine of a provider has one of
-- the statuses; the updater asks it to choose its period. It is served from
-- machine_provided_provider_status and stops at the first match.
SELECT EXISTS (
    SELECT 1 FROM machine_provided
    WHERE provider = @provider AND provider_status = ANY(@statuses::text[])
)::boolean AS found;

-- name: ProviderUpdateLeaseAcquire :one
-- ProviderUpdateLeaseAcquire gives the update lease of a provider to the
-- session if it is free (never held, or held by a session that is not alive
-- any more) or already the session's. No row: someone else holds it. It is
-- independent of the provisioning lease.
INSERT INTO provider_state AS ps (provider, update_lease_session_id, update_lease_acquired_at)
SELECT @provider::text, @session_id::uuid, now()
WHERE EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = @session_id AND s.deadline > now() AND s.closed_at IS NULL)
ON CONFLICT (provider) DO UPDATE
SET update_lease_session_id = EXCLUDED.update_lease_session_id,
    update_lease_acquired_at = EXCLUDED.update_lease_acquired_at
WHERE ps.update_lease_session_id IS NULL
   OR ps.update_lease_session_id = EXCLUDED.update_lease_session_id
   OR NOT EXISTS (
        SELECT 1 FROM sessions s
        WHERE s.session_id = ps.update_lease_session_id AND s.deadline > now() AND s.closed_at IS NULL)
RETURNING ps.update_lease_acquired_at;

-- name: ProviderUpdateLeaseRelease :exec
UPDATE provider_state
SET update_lease_session_id = NULL, update_lease_acquired_at = NULL
WHERE provider = @provider AND update_lease_session_id = @session_id::uuid;

-- name: ProviderUpdateConfirm :exec
-- ProviderUpdateConfirm records that an updater pass applied a listing of
-- the provider it believed.
INSERT INTO provider_state AS ps (provider, update_confirmed_at) VALUES (@provider, now())
ON CONFLICT (provider) DO UPDATE SET update_confirmed_at = EXCLUDED.update_confirmed_at;

-- name: ProviderUpdateConfirmedAt :one
SELECT update_confirmed_at FROM provider_state WHERE provider = @provider;

-- name: RecoveryRebootsInWindow :one
-- RecoveryRebootsInWindow counts the restarts (every rung of the recovery
-- ladder but agent) admitted for a provider's machines within the window
-- (recovery_admissions), however their work ended (Finished, Failed,
-- Canceled, Expired or still in flight), except those whose request
-- certainly never reached the machine. A claim that was not admitted yet
-- counts nothing.
SELECT count(*)
FROM recovery_admissions a
WHERE a.provider = @provider AND a.reached AND a.rung <> 'agent'
  AND a.admitted_at > now() - interval '1 millisecond' * @window_ms::bigint;

-- name: ProviderAgentCounts :one
-- ProviderAgentCounts counts a provider's machines, and those with a
-- started, not installed agent, for the recoverer's circuit breaker. A
-- Missing or Stopped machine counts as provided, not as started: its agent
-- cannot heartbeat, and it is never silent.
SELECT count(*) AS provided,
       count(*) FILTER (WHERE agent_phase IN ('AwaitingFirstHeartbeat', 'Heartbeating')
                          AND provider_status NOT IN ('Missing', 'Stopped')) AS started
FROM machine_provided
WHERE provider = @provider;

-- name: HostKeyGet :one
SELECT host_key, pinned, recorded_at, offered_host_key, offered_at
FROM machine_ssh_host_key WHERE machine_id = @machine_id;

-- name: HostKeyRecord :one
-- HostKeyRecord records a machine's SSH host key unless one is recorded
-- already (trust on first use: the first key wins), and returns the key in
-- force. A pinned key replaces a key recorded on first use, and forgets a
-- key offered instead of the old one.
INSERT INTO machine_ssh_host_key AS k (machine_id, host_key, pinned)
VALUES (@machine_id, @host_key, @pinned)
ON CONFLICT (machine_id) DO UPDATE
SET host_key = EXCLUDED.host_key, pinned = true, recorded_at = now(), offered_host_key = NULL, offered_at = NULL
WHERE EXCLUDED.pinned AND (NOT k.pinned OR k.host_key <> EXCLUDED.host_key)
RETURNING host_key, pinned;

-- name: HostKeyOffer :execrows
-- HostKeyOffer keeps the key a machine presented instead of the one in
-- force, for an operator to accept. No row: no key is in force, or the
-- offered key is the one in force.
UPDATE machine_ssh_host_key
SET offered_host_key = @offered_host_key, offered_at = now()
WHERE machine_id = @machine_id AND host_key <> @offered_host_key;

-- name: HostKeyLock :one
-- HostKeyLock reads a machine's host keys and locks them until the end of
-- the transaction, for an operator's accept.
SELECT host_key, pinned, offered_host_key, offered_at
FROM machine_ssh_host_key WHERE machine_id = @machine_id
FOR UPDATE;

-- name: HostKeyAccept :exec
-- HostKeyAccept makes the offered key the machine's recorded key.
UPDATE machine_ssh_host_key
SET host_key = offered_host_key, pinned = false, recorded_at = now(), offered_host_key = NULL, offered_at = NULL
WHERE machine_id = @machine_id AND offered_host_key IS NOT NULL;

-- name: HostKeyAcceptHistory :exec
-- HostKeyAcceptHistory records an accepted host key in history: a Reset of
-- @process (agent start) always, and of each of @processes whose backoff or
-- quarantine it clears, so that they try the machine again at once. The
-- cause says which key replaced which and who asked.
WITH cleared AS (
    DELETE FROM work_backoff
    WHERE machine_id = @machine_id AND process = ANY(@processes::text[])
    RETURNING process
)
INSERT INTO work_history (machine_id, process, event, cause)
SELECT @machine_id, p.process, 'Reset', @cause
FROM (SELECT @process::text AS process UNION SELECT process FROM cleared) AS p;

-- name: HostKeyClear :execrows
-- HostKeyClear forgets the host key a machine's first use recorded (and any
-- key offered instead), for a reinstall: the reinstalled machine's first
-- key is trusted again. A pinned key stays: it is the provider's to change.
DELETE FROM machine_ssh_host_key WHERE machine_id = @machine_id AND NOT pinned;

-- name: MachineByProviderID :one
SELECT machine_id FROM machine_provided WHERE provider = @provider AND provider_id = @provider_id;

-- name: ProviderListingAccept :one
-- ProviderListingAccept records that the next suspect listing of a provider
-- lacking at most max_missing machines is to be believed, until valid_until
-- (database time); it replaces an earlier acceptance.
INSERT INTO provider_state AS ps (provider, listing_accept_max_missing, listing_accept_by, listing_accept_at, listing_accept_until)
VALUES (@provider::text, @max_missing::integer, @accepted_by::text, now(),
        now() + make_interval(secs => @valid_for_seconds::float8))
ON CONFLICT (provider) DO UPDATE
SET listing_accept_max_missing = EXCLUDED.listing_accept_max_missing,
    listing_accept_by = EXCLUDED.listing_accept_by,
    listing_accept_at = EXCLUDED.listing_accept_at,
    listing_accept_until = EXCLUDED.listing_accept_until
RETURNING ps.listing_accept_at::timestamptz AS accepted_at, ps.listing_accept_until::timestamptz AS accepted_until;

-- name: ProviderListingAcceptanceTake :one
-- ProviderListingAcceptanceTake takes the provider's acceptance if it
-- covers a listing lacking `missing` machines and has not lapsed: it clears
-- it (one suspect listing per acceptance) and returns what it said. No row:
-- no such acceptance.
WITH taken AS (
    SELECT s.provider, s.listing_accept_max_missing, s.listing_accept_by, s.listing_accept_at, s.listing_accept_until
    FROM provider_state s
    WHERE s.provider = @provider::text AND s.listing_accept_max_missing >= @missing::integer
      AND s.listing_accept_until > now()
    FOR UPDATE
)
UPDATE provider_state ps
SET listing_accept_max_missing = NULL, listing_accept_by = NULL, listing_accept_at = NULL, listing_accept_until = NULL
FROM taken
WHERE ps.provider = taken.provider
RETURNING taken.listing_accept_max_missing::integer AS max_missing, taken.listing_accept_by::text AS accepted_by,
          taken.listing_accept_at::timestamptz AS accepted_at, taken.listing_accept_until::timestamptz AS accepted_until;

-- name: MachinesWithProviderID :many
-- MachinesWithProviderID finds the machines, live or decommissioned, that
-- have the provider id at any provider, for commands that take a machine by
-- its provider id. The indexes lead with the provider, so this reads each
-- table once: it serves one operator's command, not a loop.
SELECT p.machine_id, p.provider, false AS decommissioned
FROM machine_provided p
WHERE p.provider_id = @provider_id
UNION ALL
SELECT d.machine_id, d.provider, true AS decommissioned
FROM decommissioned_machines d
WHERE d.provider_id = @provider_id
ORDER BY 2, 3, 1;
