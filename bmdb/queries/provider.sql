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
-- ProvidedList returns every machine of a provider with its provider id
-- and status, for the provisioner to compare with the provider's listing.
SELECT machine_id, provider_id, provider_status
FROM machine_provided
WHERE provider = @provider
ORDER BY provider_id;

-- name: ProvidedSetStatus :execrows
-- ProvidedSetStatus records what the provider said about machines (by
-- provider id) and when.
UPDATE machine_provided
SET provider_status = @provider_status, provider_status_at = now()
WHERE provider = @provider AND provider_id = ANY(@provider_ids::text[]);

-- name: ProvidedUpdate :execrows
-- ProvidedUpdate refreshes the provider's details of one machine.
UPDATE machine_provided
SET provider_status = @provider_status,
    provider_ip_address = sqlc.narg(provider_ip_address)::inet,
    provider_location = @provider_location,
    provider_reservation_id = @provider_reservation_id,
    provider_status_at = now()
WHERE provider = @provider AND provider_id = @provider_id;

-- name: RecoveryRebootsInWindow :one
-- RecoveryRebootsInWindow counts the reboots the recoverer issued for a
-- provider within the window (recoveries that ended as Finished or Failed:
-- both reached the provider) plus those in flight (live Recovery work).
SELECT (
    (SELECT count(*)
     FROM work_history h
     JOIN machine_provided p ON p.machine_id = h.machine_id
     WHERE h.process = 'Recovery' AND h.event IN ('Finished', 'Failed')
       AND h.at > now() - interval '1 millisecond' * @window_ms::bigint
       AND p.provider = @provider)
  + (SELECT count(*)
     FROM work w
     JOIN sessions s ON s.session_id = w.session_id
     JOIN machine_provided p ON p.machine_id = w.machine_id
     WHERE w.process = 'Recovery' AND s.deadline > now() AND s.closed_at IS NULL
       AND p.provider = @provider))::bigint AS reboots;

-- name: ProviderAgentCounts :one
-- ProviderAgentCounts counts a provider's machines, and those with a
-- started, not installed agent, for the recoverer's circuit breaker.
SELECT count(*) AS provided,
       count(*) FILTER (WHERE agent_phase IN ('AwaitingFirstHeartbeat', 'Heartbeating')) AS started
FROM machine_provided
WHERE provider = @provider;

-- name: HostKeyGet :one
SELECT host_key, pinned, recorded_at FROM machine_ssh_host_key WHERE machine_id = @machine_id;

-- name: HostKeyRecord :one
-- HostKeyRecord records a machine's SSH host key unless one is recorded
-- already (trust on first use: the first key wins), and returns the key in
-- force. A pinned key replaces a key recorded on first use.
INSERT INTO machine_ssh_host_key AS k (machine_id, host_key, pinned)
VALUES (@machine_id, @host_key, @pinned)
ON CONFLICT (machine_id) DO UPDATE
SET host_key = EXCLUDED.host_key, pinned = true, recorded_at = now()
WHERE EXCLUDED.pinned AND (NOT k.pinned OR k.host_key <> EXCLUDED.host_key)
RETURNING host_key, pinned;

-- name: HostKeyClear :exec
DELETE FROM machine_ssh_host_key WHERE machine_id = @machine_id;

-- name: MachineByProviderID :one
SELECT machine_id FROM machine_provided WHERE provider = @provider AND provider_id = @provider_id;
