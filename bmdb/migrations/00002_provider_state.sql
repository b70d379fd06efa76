-- Per-provider coordination: the provisioner's lease (one reconcile pass at
-- a time per provider, SPEC §3.2) and a row the recoverer locks to admit
-- reboots against the fleet-wide budget (SPEC §3.4) one at a time.

-- +goose Up
CREATE TABLE provider_state (
    provider text PRIMARY KEY CHECK (provider <> ''),
    -- The session holding the provisioning lease; free when NULL or when
    -- that session is no longer alive.
    lease_session_id uuid,
    lease_acquired_at timestamptz
);

-- Reboots in the breaker's window are counted from history; this index
-- keeps that count proportional to the window, not to all history.
CREATE INDEX work_history_recovery_at ON work_history (at) WHERE process = 'Recovery';

-- Provisioner passes list a provider's machines in the BMDB.
CREATE INDEX machine_provided_provider_status ON machine_provided (provider, provider_status);

-- +goose Down
DROP INDEX machine_provided_provider_status;
DROP INDEX work_history_recovery_at;
DROP TABLE provider_state;
