-- The recovery ladder (SPEC §3.4): each admission records the rung it
-- admitted and what the rung returned.
--
-- A silent machine's recovery climbs from the cheapest action to the most
-- drastic: restart the agent over SSH (agent), the provider's in-band
-- reboot (reboot), a power cycle through the BMC (power), the provider's
-- reinstall (reinstall), then quarantine. Every rung taken is a row of
-- recovery_admissions, so the breaker, the streak and the ladder's progress
-- all come from one table. rung says which; result is '' while the rung
-- stands (it was carried out and the machine is being waited for), or what
-- it returned when it failed (failed = true). A rung that failed before
-- reaching the machine (no SSH answer for agent, a dead in-band path for
-- reboot) makes the recoverer climb to the next rung in the same work item.
--
-- agent does not restart the machine, so the circuit breaker does not count
-- it (RecoveryRebootsInWindow); every other rung does.
--
-- A streak used to start at the last admission whose agent incarnation had
-- heartbeated. A climb admits several rungs for that one incarnation, so
-- the streak now starts at the first admission of the last incarnation that
-- had heartbeated (bmdb/queries/recovery.sql); for one rung per incarnation
-- this is the same row. Rows from before this migration are reboots.

-- +goose Up
ALTER TABLE recovery_admissions
    ADD COLUMN rung text NOT NULL DEFAULT 'reboot'
        CHECK (rung IN ('agent', 'reboot', 'power', 'reinstall')),
    ADD COLUMN result text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE recovery_admissions DROP COLUMN result, DROP COLUMN rung;
