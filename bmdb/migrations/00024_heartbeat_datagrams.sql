-- Heartbeats by datagram (issue 17 item 1): an agent that heartbeated over
-- TLS may send its next heartbeats as UDP datagrams, each carrying a counter
-- and an HMAC under a key derived from heartbeat_datagram_secret (server
-- package). The MAC proves the datagram came from an agent the server gave
-- the key to; it does not prove the datagram is new. So HeartbeatRecord
-- accepts a datagram only if its counter is above the last one accepted for
-- the machine, stored here, and stores it (SPEC §8 R6: a replayed datagram
-- must not pass for a live agent).
--
-- datagram_counter lives on the heartbeat row, and so is deleted with it:
-- the row goes with machine_agent_started (the foreign key of 00008), that
-- is on every recovery, decommission and janitor cleanup, and the next
-- heartbeat starts the counter at 0 again. That reset never revives an old
-- datagram: a datagram is accepted only with the machine's current agent
-- key (the statement joins machine_agent_started), and a new AgentStarted
-- comes with every takeover, which generates a fresh agent key; the MAC key
-- is derived from the agent key too. A datagram of the old agent, whatever
-- its counter, names the old key and is refused. No other path writes the
-- counter back down.
--
-- 0 means no datagram accepted yet; datagram counters start at 1
-- (RecordHeartbeats refuses a negative one before it reaches the database,
-- so the column has no CHECK, which would scan the table to be added).
-- Adding a column with a constant default does not rewrite the table
-- (PostgreSQL 11+). It is in no index, so it does not change which heartbeat updates
-- are HOT (none are: machine_agent_heartbeat_watched and _unwatched name
-- agent_heartbeat_at, which every heartbeat sets).
--
-- heartbeat_datagram_secret holds the one secret every callback server
-- derives the MAC keys from, so that a datagram may reach any of them. It
-- has at most one row (the primary key is the constant true), created by
-- the first server that asks (DB.DatagramSecret). Whoever can read it can
-- forge datagram heartbeats, as whoever can write the BMDB can forge any.

-- +goose Up
ALTER TABLE machine_agent_heartbeat
    ADD COLUMN datagram_counter bigint NOT NULL DEFAULT 0;

CREATE TABLE heartbeat_datagram_secret (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    secret bytea NOT NULL CHECK (length(secret) = 32),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE heartbeat_datagram_secret;
ALTER TABLE machine_agent_heartbeat DROP COLUMN datagram_counter;
