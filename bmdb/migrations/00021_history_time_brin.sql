-- work_history's time index becomes a BRIN index (issue 17, P2).
--
-- A claim + finish cycle writes two history rows, and each row's entries
-- in the table's btree indexes are WAL records that every commit waits to
-- flush: the btree on at alone was about 130 of the cycle's 1,830 bytes.
-- History is appended in time order (at is the inserting transaction's
-- now()), so a block range summary of at narrows a time range down as well
-- as the btree did, and appending to the table's last, not yet summarized
-- range writes nothing to the index: summaries are written when a range is
-- full (autosummarize) or by vacuum. A time range now reads whole block
-- ranges at its two ends (at most 2 x 128 pages more than the rows in the
-- range), whatever the size of the history.
--
-- CREATE INDEX summarizes every range, the table's last, partial one too
-- (on an empty table: the first), and each row appended to a summarized
-- range with a later at than the summary moves the summary: a WAL record,
-- about 60 bytes a cycle until that range is full (9,600 rows). So the
-- migration drops the last range's summary, leaving it as a range being
-- filled is in an index long in use: unsummarized until the next one
-- starts.
--
-- work_history_process_at stays a btree: a process filter must find the
-- rows of a rare process without reading the rows of the others, and those
-- rows need not be clustered (a bloom BRIN on process read the whole table
-- for a process with one row in a thousand; the btree reads its rows).
--
-- work_history_recovery_at goes: nothing reads it since the recoverer's
-- breaker counts recovery_admissions (migration 00011), and each recovery
-- history row paid an entry in it.

-- +goose Up
DROP INDEX work_history_at;
DROP INDEX work_history_recovery_at;
CREATE INDEX work_history_at ON work_history USING brin (at) WITH (autosummarize = on);
SELECT brin_desummarize_range('work_history_at',
    GREATEST(pg_relation_size('work_history') / current_setting('block_size')::bigint - 1, 0));

-- +goose Down
DROP INDEX work_history_at;
CREATE INDEX work_history_recovery_at ON work_history (at) WHERE process = 'Recovery';
CREATE INDEX work_history_at ON work_history (at);
