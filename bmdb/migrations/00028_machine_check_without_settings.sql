-- work_machine_check runs without a setting of its own again (it had
-- enable_seqscan = off from migration 00027).
--
-- A function with settings saves, sets and restores them at every call.
-- The machine check runs on every insert into work and work_history, three
-- times per claim and finish, and P2 measured the cost: PostgreSQL spent
-- 898-961 µs per claim+finish cycle with the setting against 774-890 µs
-- without it, three runs each, alternating. The check reads machines by its
-- primary key, and machines is seldom small when it is planned (the fleet
-- is provided before work starts on it), so the stale plan 00027 guards the
-- other functions against is not worth that price here.

-- +goose Up
ALTER FUNCTION work_machine_check() RESET enable_seqscan;

-- +goose Down
ALTER FUNCTION work_machine_check() SET enable_seqscan = off;
