-- name: RequestBudgetTake :one
-- RequestBudgetTake takes a token from an account's bucket for one request
-- (creating the bucket, full, on first use), refilled by database time at
-- rate tokens a second up to burst. The bucket may go into debt: the
-- request then waits wait_seconds for its token to be due. While the
-- account is paused nothing is taken, paused is true, and wait_seconds is
-- the rest of the pause. Concurrent takes queue on the row, and one that
-- waited sees the bucket as the one before it left it; now() is its start,
-- so it is never credited with time it spent waiting (refilled_at only
-- moves forward).
INSERT INTO provider_request_budgets AS b (account, tokens, refilled_at)
VALUES (@account::text, sqlc.arg(burst)::float8 - 1, now())
ON CONFLICT (account) DO UPDATE
SET tokens = CASE WHEN b.paused_until > now() THEN b.tokens
        ELSE LEAST(sqlc.arg(burst)::float8, b.tokens + sqlc.arg(rate)::float8 * GREATEST(0, EXTRACT(EPOCH FROM now() - b.refilled_at)::float8)) - 1
    END,
    refilled_at = CASE WHEN b.paused_until > now() THEN b.refilled_at ELSE GREATEST(b.refilled_at, now()) END
RETURNING (b.paused_until > now())::boolean AS paused,
    GREATEST(0, CASE WHEN b.paused_until > now() THEN EXTRACT(EPOCH FROM b.paused_until - now())::float8
        ELSE EXTRACT(EPOCH FROM b.refilled_at - now())::float8 + GREATEST(0, -b.tokens) / sqlc.arg(rate)::float8
    END)::float8 AS wait_seconds;

-- name: RequestBudgetGiveBack :exec
-- RequestBudgetGiveBack returns a token taken for a request that was never
-- sent (its caller gave up waiting), so that it does not hold up the
-- requests queued after it.
UPDATE provider_request_budgets SET tokens = LEAST(sqlc.arg(burst)::float8, tokens + 1)
WHERE account = @account::text;

-- name: RequestBudgetPause :exec
-- RequestBudgetPause holds every request of the account until seconds from
-- now: the API answered 429. The bucket starts again empty at the end of
-- the pause (debts stay), so that requests queued during it do not all go
-- at once.
INSERT INTO provider_request_budgets AS b (account, tokens, refilled_at, paused_until)
VALUES (@account::text, 0, now() + make_interval(secs => @seconds::float8), now() + make_interval(secs => @seconds::float8))
ON CONFLICT (account) DO UPDATE
SET paused_until = GREATEST(b.paused_until, EXCLUDED.paused_until),
    refilled_at = GREATEST(b.refilled_at, EXCLUDED.refilled_at),
    tokens = LEAST(b.tokens, 0);

-- name: RequestBudgetPausedFor :one
-- RequestBudgetPausedFor is how many seconds the account stays paused; 0
-- if it is not (or has no bucket yet).
SELECT COALESCE((SELECT CASE WHEN paused_until > now() THEN EXTRACT(EPOCH FROM paused_until - now())::float8 ELSE 0 END
                 FROM provider_request_budgets WHERE account = @account::text), 0)::float8 AS seconds;
