-- Decommission (SPEC §3.8) and the janitor (SPEC §3.6).
--
-- A decommissioned machine keeps its machines row, with decommissioned_at
-- (00001), so that its history stays attached; its live tags are deleted,
-- Provided included, so it leaves every candidate query and the fleet
-- counts. What the Provided tag said is kept here instead: an operator can
-- still see where the machine was, and the provisioner never takes a
-- provider id of a decommissioned machine into the fleet again (a static
-- inventory keeps listing a machine it cannot release).

-- +goose Up
CREATE TABLE decommissioned_machines (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id),
    provider text NOT NULL,
    provider_id text NOT NULL,
    provider_reservation_id text NOT NULL DEFAULT '',
    provider_location text NOT NULL DEFAULT '',
    -- The operator's request, as it was when the decommissioner acted on it.
    requested_at timestamptz,
    requested_by text NOT NULL DEFAULT '',
    reason text NOT NULL DEFAULT '',
    -- Whether the provider released the machine (deleted the device, freed
    -- the slot); false for providers that cannot, which only forget it.
    released boolean NOT NULL
);
-- The provisioner looks up a provider's decommissioned ids on every pass.
-- Not unique: a provider may hand out an id again, and every machine that
-- had it keeps its record.
CREATE INDEX decommissioned_machines_provider_id ON decommissioned_machines (provider, provider_id);

-- The janitor sweeps tags that raced with a decommission (a heartbeat batch
-- that authenticated just before it) off recently decommissioned machines;
-- the index keeps that proportional to recent decommissions.
CREATE INDEX machines_decommissioned_at ON machines (decommissioned_at) WHERE decommissioned_at IS NOT NULL;

-- +goose Down
DROP INDEX machines_decommissioned_at;
DROP TABLE decommissioned_machines;
