// Package server is the agent callback server (SPEC §4.5): it serves the
// heartbeat RPC over TLS, authenticates every agent by the key of its client
// certificate against the machine's AgentStarted tag, records heartbeats in
// batches, stores the reports agents send, and hands out pending
// installation requests.
//
// The RPC is served by grpc-go, whose HTTP/2 transport costs about a third
// less CPU per call than net/http's (measured on the heartbeat path); agents
// call it with connect-go's gRPC client, which keeps their binary small.
//
// # Memory per connection
//
// Agents keep one HTTP/2 connection to the server between heartbeats (the
// agent's client drops it after 5 minutes idle; heartbeats come every 30
// s), so the server holds a connection per agent. P5 of `make bench`
// measures what one costs in `shepherd run --components=all` managing
// 100,000 machines of a static inventory, with 15,000 agents connected
// from another process (this machine allows 20,000 descriptors per
// process). Measured 2026-11-27 on the shared 2-core machine (load
// average about 15 from other work, so CPU figures are high and noisy),
// with grpc-go's default 32 KiB read buffer:
//
//	P5 rss_mb value=1391 baseline=264 ... fds=15028 goroutines=45070 agents=15000 machines=100000
//	P5 memory_per_agent_kb value=76.90
//	P5 rss_mb_extrapolated_100000_agents value=7774 limit=300
//	P5 heartbeats_per_s value=500 server_cpu_us=346 postgres_cpu_us=279 loadgen_cpu_us=291
//	P5 new_connection_server_cpu_us value=327
//
// So 77 KiB of RSS per connected agent, and three goroutines (grpc-go's
// frame reader, writer and keepalive timer, each parked with its own
// stack). The heap profile of that run (inuse_space) shows per connection:
//
//   - grpc-go's read buffer, 32 KiB (bufio.NewReaderSize in newFramer):
//     55 % of the heap in use. grpc-go pools it only on plain TCP
//     connections; on TLS each connection keeps its own for life.
//   - the TLS connection's record buffer (bytes.growSlice, about 2.8
//     KiB), its AES-GCM states (1.5 KiB), the HPACK table (1 KiB), the
//     client's parsed certificate (1 KiB) and grpc-go's transport state
//     and timers, a few KiB together.
//   - no write buffer: grpc-go shares it by default, a connection takes
//     one from a pool to write and gives it back.
//
// The rest of RSS is the goroutine stacks and heap the collector has
// freed but not yet returned (with GOGC=100 the heap may grow to twice
// what is live).
//
// The server therefore sets grpc.ReadBufferSize(0): the HTTP/2 framer
// reads from the TLS connection, which holds the decrypted record it reads
// from anyway, so the buffer saved nothing but a few calls into the TLS
// connection per frame. P5 on the same machine after the change (a
// quieter moment: load average 2 to 10):
//
//	P5 rss_mb value=952 baseline=239 ... fds=15028 goroutines=45059 agents=15000 machines=100000
//	P5 memory_per_agent_kb value=48.66 heap_inuse_kb=34.42 stack_inuse_kb=10.84 goroutines=3.00
//	P5 rss_mb_extrapolated_100000_agents value=4991 limit=300
//	P5 heartbeats_per_s value=500 server_cpu_us=449 postgres_cpu_us=361 loadgen_cpu_us=343
//	P5 new_connection_server_cpu_us value=353
//	P5 tls_handshake_both_ends_cpu_us value=1219
//
// 77 KiB → 49 KiB per connected agent. The CPU figures rose by 18 to 30
// % in all three processes, PostgreSQL and the load generator too, which
// the change does not touch: the machine, not the change. What is left per connection,
// from the heap profile: the TLS record buffer (3 KiB), AES-GCM states
// (2 KiB), write buffers in use or pooled (2 KiB), the parsed client
// certificate (2 KiB), the transport, its three timers and the HPACK
// table (4 KiB), and 11 KiB of goroutine stacks; the rest is the
// collector's headroom.
//
// P1 (back-to-back heartbeats) did not get dearer: run just after each
// other, with the change 11,200 and 8,550 heartbeats/s at 1,000 and
// 10,000 agents, server CPU 76 and 90 µs per heartbeat; without it 6,626
// and 5,633/s, 86 and 87 µs. The rates differ with the machine's load,
// which rose during the second run; the CPU per heartbeat is the same
// within the noise.
//
// # Kept connections or a handshake per heartbeat
//
// Even without the read buffer, a connection per agent is tens of KiB:
// 100,000 kept connections take gigabytes, against P5's 300 MB for the
// whole process, which holds 240 to 264 MB with no agent connected (the
// static inventory, the provider's and the BMDB's listings of 100,000
// machines are the largest items of its heap profile). The other
// way, a connection per heartbeat, costs a TLS 1.3 handshake (the
// development CA's ECDSA P-256 server certificate, the agent's
// self-signed ed25519 one, X25519MLKEM768 key exchange, no session
// resumption) and the HTTP/2 and gRPC set-up, every 30 s per agent: 327
// and 353 µs of server CPU per new connection in the two runs, derived
// from the minute in which P5's agents connect (its CPU less that of the
// heartbeats it carried), and 1.2 ms for a bare handshake with both ends
// in one process
// (P5's tls_handshake_both_ends_cpu_us). At 100,000 agents that is 3,333
// handshakes a second, more than one core for handshakes alone, ten
// times P1's budget of 30 µs per heartbeat. Neither design meets P1 and
// P5 together.
//
// The middle ground was measured too. A server that closes connections
// idle for a few seconds holds a connection only for agents in the middle
// of a heartbeat, but with heartbeats 30 s apart every heartbeat then
// opens a connection: the handshake cost above. Agents that resume their
// TLS session instead pay a PSK handshake, which in Go's TLS 1.3 still
// runs a full key exchange and only skips the certificates:
// tls_handshake_both_ends_cpu_us's resumed_cpu_us, 802 µs against 1,141
// µs for a full handshake in the same run (both ends, loopback, quiet
// machine, 2026-11-27), a saving of 30 %, still tens of times the budget.
//
// Nor can the kept connections meet P1's 30 µs: the transport alone
// (transport_server_cpu_us, a server with this one's TLS and grpc-go
// settings that answers every heartbeat at once, no BMDB) costs the server
// 34 µs per heartbeat in that run, against 71 and 87 µs for the real
// server at 1,000 and 10,000 agents.
//
// # The choice, not yet built
//
// The design that meets both is a heartbeat that needs no connection: a
// UDP datagram carrying the machine id, a counter and the agent's status,
// authenticated with a MAC under a key the server hands the agent over TLS
// (in the heartbeat reply) and binds to the machine's current agent key.
// The server holds no per-agent state but the key (tens of bytes, cached,
// and checked against the BMDB in the batched heartbeat statement, so a
// recovery that replaces the agent key invalidates the old MAC key at
// once); a counter stored with the machine rejects replays; an HMAC costs
// about a microsecond. TLS stays for reports, installation requests (the
// datagram reply tells the agent to call over TLS) and agents that do not
// speak datagrams, which keeps old agents working. Until it is built, the
// server keeps the connection-per-agent design above, which reaches 33 to
// 47 % of the transport ceiling's rate (P1's limit_ratio 0.41 to 0.59,
// against 0.8 of it) and holds about 39 KiB per connected agent (P5).
package server
