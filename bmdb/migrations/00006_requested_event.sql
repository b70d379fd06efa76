-- +goose Up
-- Operators' requests (decommission, OS installation) are part of a
-- machine's audit trail: history gets a Requested event for them.
ALTER TABLE work_history DROP CONSTRAINT work_history_event_check;
ALTER TABLE work_history ADD CONSTRAINT work_history_event_check CHECK (event IN (
    'Started', 'Finished', 'Failed', 'Canceled', 'Expired', 'Quarantined', 'Reset', 'Requested'));

-- +goose Down
DELETE FROM work_history WHERE event = 'Requested';
ALTER TABLE work_history DROP CONSTRAINT work_history_event_check;
ALTER TABLE work_history ADD CONSTRAINT work_history_event_check CHECK (event IN (
    'Started', 'Finished', 'Failed', 'Canceled', 'Expired', 'Quarantined', 'Reset'));
