-- The updater (SPEC §3.5) refreshes what providers say about their machines.
-- It makes one pass at a time per provider, across processes, under a lease
-- of its own: the provisioner's lease (00002) must not hold it up, nor it the
-- provisioner, so the two run side by side.
--
-- A pass writes only the machines whose details changed, so an unchanged
-- fleet of 100,000 machines costs one read and no writes. What a per-row
-- "last confirmed" time would say is kept once per provider instead
-- (update_confirmed_at), and provider_status_at says since when a machine has
-- had its status.

-- +goose Up
ALTER TABLE provider_state
    -- The session holding the update lease; free when NULL or when that
    -- session is no longer alive.
    ADD COLUMN update_lease_session_id uuid,
    ADD COLUMN update_lease_acquired_at timestamptz,
    -- When an updater pass last applied a listing of the provider it
    -- believed: every machine of the provider that is not Missing had the
    -- details the BMDB holds at that time.
    ADD COLUMN update_confirmed_at timestamptz;

COMMENT ON COLUMN machine_provided.provider_status_at IS
    'When provider_status was recorded or last changed: the machine has had this status since then. '
    'provider_state.update_confirmed_at says when the provider last confirmed it.';

-- +goose Down
COMMENT ON COLUMN machine_provided.provider_status_at IS NULL;
ALTER TABLE provider_state
    DROP COLUMN update_confirmed_at,
    DROP COLUMN update_lease_acquired_at,
    DROP COLUMN update_lease_session_id;
