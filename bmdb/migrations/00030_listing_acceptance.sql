-- An operator's acceptance of a suspect provider listing (SPEC §3.2).
--
-- The provisioner and the updater do not believe a listing that lacks an
-- implausible share of the provider's machines. When the machines really
-- are gone (a rack returned, a project cleaned up), every listing from then
-- on is suspect, and the passes change nothing until an operator says so:
-- `shepherd provider accept-listing --provider P --max-missing N` records
-- here that the next suspect listing lacking at most N machines is right.
-- The first pass that finds such a listing takes the acceptance (clears
-- these columns) and acts on the listing; an acceptance no pass took by
-- listing_accept_until lapses, so that it cannot vouch for a later, unrelated
-- bad listing.

-- +goose Up
ALTER TABLE provider_state
    ADD COLUMN listing_accept_max_missing integer CHECK (listing_accept_max_missing > 0),
    ADD COLUMN listing_accept_by text,
    ADD COLUMN listing_accept_at timestamptz,
    ADD COLUMN listing_accept_until timestamptz;

-- +goose Down
ALTER TABLE provider_state
    DROP COLUMN listing_accept_until,
    DROP COLUMN listing_accept_at,
    DROP COLUMN listing_accept_by,
    DROP COLUMN listing_accept_max_missing;
