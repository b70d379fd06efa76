-- Out-of-band power from the CLI (SPEC §5.5): `shepherd machine power`.
--
-- An operator's power action acts on the machine itself, so it is a
-- machine-exclusive process like agent start, recovery, reinstall and
-- decommission: while it holds a machine none of them can claim it, and it
-- cannot hold a machine one of them holds (work_machine_exclusive).
--
-- machine_power_state keeps the last look at each machine's power through
-- its BMC, so that `machine show` and the machine page can say "power on
-- (checked 2m ago)" without asking the BMC. It is an observation, not a tag:
-- no candidate query reads it, and a decommission leaves it, like history.
-- state is the last state read (NULL if none was ever read through this
-- BMC), state_at when it was read; error_class and error_message say why
-- the last check or action failed ('' when it succeeded); checked_at is the
-- last check or action, good or bad. bmc names the BMC (driver, user,
-- endpoint), never a password.

-- +goose Up
INSERT INTO processes (process, machine_exclusive) VALUES ('Power', true);

CREATE TABLE machine_power_state (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    bmc text NOT NULL CHECK (bmc <> ''),
    state text CHECK (state IN ('on', 'off')),
    state_at timestamptz,
    error_class text NOT NULL DEFAULT '',
    error_message text NOT NULL DEFAULT '',
    checked_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((state IS NULL) = (state_at IS NULL))
);

-- +goose Down
DROP TABLE machine_power_state;
-- Power's history and backoffs go with it: the process no longer exists.
DELETE FROM work WHERE process = 'Power';
DELETE FROM work_backoff WHERE process = 'Power';
DELETE FROM work_history WHERE process = 'Power';
DELETE FROM processes WHERE process = 'Power';
