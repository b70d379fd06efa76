-- The trigger functions that look up one machine's rows by key plan those
-- lookups as index scans whatever size the tables had when they were planned
-- (issue 17 item 5).
--
-- PL/pgSQL keeps the plan of each statement for the life of the connection
-- (re-planned only when an ANALYZE or a schema change invalidates it). A
-- plan made while a table held a page or two reads the table whole, which
-- is the cheapest way to find a row in a page or two. In a fresh BMDB that
-- takes over a fleet in bulk, the tables grow by thousands of rows within
-- a minute, faster than autovacuum analyzes them (autovacuum_naptime is a
-- minute by default), and the connections that planned early keep scanning:
-- P4's 10,000-machine line updated the watched flag of
-- machine_agent_heartbeat by reading the table whole, about 100 buffers
-- twice per machine.
--
-- enable_seqscan = off, set on the functions, applies while their
-- statements are planned: every one of them finds rows by machine id (and
-- the checks read machines by its primary key), for which an index scan is
-- right at any size. It does not forbid a sequential scan where no index
-- fits; it only makes the planner take an index where one does. A later
-- CREATE OR REPLACE of one of these functions replaces its settings too, and
-- must say SET enable_seqscan = off again.

-- +goose Up
ALTER FUNCTION machine_agent_phase_refresh() SET enable_seqscan = off;
ALTER FUNCTION machine_provided_set_phase() SET enable_seqscan = off;
ALTER FUNCTION work_backoff_hold() SET enable_seqscan = off;
ALTER FUNCTION work_backoff_decommission_hold() SET enable_seqscan = off;
ALTER FUNCTION machine_decommission_request_hold() SET enable_seqscan = off;
ALTER FUNCTION work_machine_check() SET enable_seqscan = off;

-- +goose Down
ALTER FUNCTION machine_agent_phase_refresh() RESET enable_seqscan;
ALTER FUNCTION machine_provided_set_phase() RESET enable_seqscan;
ALTER FUNCTION work_backoff_hold() RESET enable_seqscan;
ALTER FUNCTION work_backoff_decommission_hold() RESET enable_seqscan;
ALTER FUNCTION machine_decommission_request_hold() RESET enable_seqscan;
ALTER FUNCTION work_machine_check() RESET enable_seqscan;
