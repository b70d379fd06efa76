-- Recovery admissions and reboot streaks (SPEC §3.4).
--
-- recovery_admissions has one row per reboot the recoverer admitted: the
-- transaction that admits it (bmdb Session.AdmitReboot) verifies that the
-- session is alive and holds the machine's Recovery work, that the machine
-- is still silent, that no reboot of the same agent incarnation (machine,
-- agent_started_at) was admitted already, and that the provider's reboots
-- in the circuit breaker's window leave room, and inserts the row. The
-- breaker counts these rows, whatever became of the work afterwards
-- (Finished, Failed, Canceled, Expired): a crash-looping recoverer cannot
-- exceed the budget, and a claim that was not admitted yet counts nothing.
-- A reboot that certainly never reached the machine (a dial error, a
-- machine gone from the inventory) is marked reached = false and does not
-- count. A failed reboot is marked failed, so that a later claim may try
-- the same incarnation again; otherwise at most one admission per
-- incarnation exists (recovery_admissions_incarnation): one reboot per
-- silence episode, even when the worker that issued it lost its session
-- before it could record the result.
--
-- A machine's reboot streak, the reboots admitted since its agent's last
-- heartbeat, is derived from these rows when a reboot is to be admitted
-- (bmdb/queries/recovery.sql): each admission records whether the
-- incarnation it reboots ever heartbeated (a heartbeat row exists only for
-- the current incarnation), so the streak is the admissions since the last
-- one whose agent had heartbeated, or since an operator's Reset of the
-- machine's Recovery. A machine whose streak reached the recoverer's limit
-- is quarantined instead of being rebooted again: its agent cannot report
-- (a rack that cannot reach the callback server), and rebooting it forever
-- helps nobody. Nothing is added to the heartbeat path.
--
-- Missing and Stopped machines are no longer silent (machine_states is
-- replaced in 00014, with the candidate holds): a machine the provider lost
-- or powered off has no agent to recover, and rebooting it would only fail. They get the derived states
-- Missing and Stopped; the recovery candidate query excludes them too, so
-- that Silent stays exactly the recovery candidates by tags.

-- +goose Up
CREATE TABLE recovery_admissions (
    admission_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    machine_id uuid NOT NULL REFERENCES machines (machine_id),
    provider text NOT NULL,
    -- The session that admitted the reboot; not a foreign key, since the
    -- janitor deletes old sessions.
    session_id uuid,
    -- The agent incarnation being recovered: machine_agent_started's
    -- agent_started_at at admission. NULL only for reboots carried over
    -- from history by this migration.
    agent_started_at timestamptz,
    admitted_at timestamptz NOT NULL DEFAULT now(),
    -- false: the reboot request certainly never reached the machine (or
    -- its provider's API); it does not count against the breaker.
    reached boolean NOT NULL DEFAULT true,
    -- true: the reboot reported an error; a later claim may reboot the
    -- same incarnation again.
    failed boolean NOT NULL DEFAULT false,
    -- The incarnation had heartbeated (its silence came after a heartbeat):
    -- the reboot streak starts with this admission.
    heartbeated boolean NOT NULL DEFAULT false,
    CHECK (reached OR failed)
);
CREATE UNIQUE INDEX recovery_admissions_incarnation ON recovery_admissions (machine_id, agent_started_at)
    WHERE NOT failed;
CREATE INDEX recovery_admissions_window ON recovery_admissions (provider, admitted_at) WHERE reached;
CREATE INDEX recovery_admissions_at ON recovery_admissions (admitted_at);
CREATE INDEX recovery_admissions_machine ON recovery_admissions (machine_id, admitted_at);

-- The reboots of the last day, as the old count saw them (Recovery work
-- that ended Finished or Failed), so that the breaker's window stays honest
-- across the upgrade. They do not block a later reboot of any incarnation.
INSERT INTO recovery_admissions (machine_id, provider, session_id, agent_started_at, admitted_at, reached, failed)
SELECT h.machine_id, p.provider, h.session_id, NULL, h.at, true, true
FROM work_history h
JOIN machine_provided p ON p.machine_id = h.machine_id
WHERE h.process = 'Recovery' AND h.event IN ('Finished', 'Failed') AND h.at > now() - interval '1 day';

-- +goose Down
DROP TABLE recovery_admissions;
