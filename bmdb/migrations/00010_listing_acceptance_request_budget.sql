-- An operator's acceptance of a suspect provider listing (SPEC §3.2), and
-- the request budgets of provider API accounts (SPEC §5.3).
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

-- A provider API meters requests per account, and several processes use
-- one account: the budget is a token bucket per account, here, that they
-- all take their requests from (bmdb.RequestBudget). It refills by database
-- time. A request takes a token with one UPDATE, which may leave the bucket
-- in debt (tokens < 0): the request then waits until its token is due, so
-- waiting requests of every process queue in the order they asked. A 429
-- from the API pauses the account for every process (paused_until). The
-- account is a digest of the API's URL and token, never the token.

-- +goose Up
CREATE TABLE provider_request_budgets (
    account text PRIMARY KEY CHECK (account <> ''),
    -- Tokens in the bucket at refilled_at; negative when requests have
    -- taken tokens ahead of time.
    tokens double precision NOT NULL,
    refilled_at timestamptz NOT NULL,
    -- No request of the account before this: the API answered 429.
    paused_until timestamptz NOT NULL DEFAULT '-infinity'
);

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
DROP TABLE provider_request_budgets;
