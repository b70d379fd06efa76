// Package server is the agent callback server (SPEC §4.5): it serves the
// heartbeat RPC over TLS, authenticates every agent by the key of its client
// certificate against the machine's AgentStarted tag, records heartbeats in
// batches, stores the reports agents send, and hands out pending
// installation requests. Agents it has granted a key send their other
// heartbeats as UDP datagrams ("Heartbeat datagrams" below).
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
// # Heartbeat datagrams
//
// The design that meets both is a heartbeat that needs no connection: a
// UDP datagram (package pulse, 84 bytes) carrying the machine id, the
// agent's public key, a counter and the newest installation generation the
// agent knows, authenticated with a MAC under a key the server hands the
// agent over TLS and binds to the machine's current agent key. TLS stays
// for reports, installation requests and agents that do not speak
// datagrams, which keeps old agents working.
//
// The grant. A TLS heartbeat the BMDB accepts is answered with a
// DatagramGrant: the key K = pulse.DeriveKey(secret, machine id, agent key
// of the client certificate), the server's UDP port (Config.DatagramListen,
// by default the TLS address over UDP) and the machine's stored datagram
// counter as the floor. The secret is 32 random bytes in the BMDB
// (bmdb.DB.DatagramSecret), the same for every callback server, so a
// datagram may reach any of them; a server reads it as it starts (in the
// background if the database is down then: until it has it, it grants
// nothing and ignores datagrams, and agents keep to TLS). With
// Config.NoDatagrams there is no UDP socket and no grant.
//
// The path of a datagram. Two reader goroutines read the socket into
// buffers of their own; the server parses the request, derives K from the
// request's own machine id and agent key, checks the MAC, and submits the
// heartbeat, with its counter, to the batcher that writes TLS heartbeats
// (the queue of verified keys if the server has seen that key accepted,
// else the bounded one, which refuses when full). Nothing waits per
// datagram: the heartbeat travels in a pooled datagramBeat, and the flusher
// that wrote its batch seals and sends the reply from a callback, so the
// server holds no goroutine, connection or buffer per agent between
// heartbeats, and none per heartbeat in flight but the pooled struct. The
// reply echoes the counter:
//
//   - recorded, with the heartbeat interval: accepted, and no installation
//     newer than the one the agent knows is pending;
//   - call-tls: accepted, but a newer installation is pending; or refused
//     though authentic (an agent key that is no longer the machine's, a
//     replayed counter, a decommissioned machine, content the database
//     refused). The agent's TLS heartbeat then gets the full answer: the
//     installation request, a new grant, Unauthenticated or
//     PermissionDenied;
//   - retry-later, with the retry pushback: the heartbeat could not be
//     recorded (the database failed, the queue of unverified keys is full,
//     the server is stopping). TLS would cost a handshake for the same
//     failure.
//
// When datagrams go unanswered the agent (agent package) sends them again
// after a back-off while the server answered within two intervals, so
// that a stalled server does not get every agent's handshake at once, and
// then calls over TLS. A path that passes TCP but not UDP (a firewall, a
// port mapping of the TLS port alone) shows as two grants in a row whose
// datagrams all went unanswered while the TLS call right after got through
// at once (a server that is down fails that call too): the agent then
// ignores grants, keeping its TLS connection, for half an hour, doubling
// to eight hours while it lasts, and logs why once. Such agents cost the
// server a kept connection each; opening UDP, or Config.NoDatagrams,
// settles it.
//
// As the server stops, its readers stop first (a read deadline, not a
// close, so that the replies of the heartbeats in flight can still be
// sent), then the batcher finishes or fails what it holds, answering each
// datagram, and then the socket is closed.
//
// Why it is safe (SPEC §8 R6, R9). Only callback servers hold the secret,
// so only they can compute a K; an agent learns only its own, over an
// authenticated TLS connection, and K binds both the machine id and the
// agent key:
//
//   - a datagram without a valid key: the MAC does not match the K the
//     server derives, and the datagram is dropped;
//   - another machine's id: an agent holds K(its machine, its key). Naming
//     another machine (with its own key or the other's) changes the K the
//     server derives, so the MAC fails. Even a datagram MACed correctly
//     (the secret leaked) is refused by the BMDB, which records a
//     heartbeat only if the agent key is the machine's current one, in
//     the statement that writes it;
//   - a key from before a recovery: the old grant's MAC still verifies,
//     since K depends only on the secret and the pair, but the BMDB
//     refuses the key, which a recovery replaced, so nothing is recorded
//     and the agent is told to call over TLS, where it is Unauthenticated;
//   - replays: the BMDB records a datagram only if its counter is above
//     the one stored for the machine, which it then becomes, under the row
//     lock, so a copy of a datagram, or an older one, is refused
//     (reason replayed) even when several servers receive it at once. A
//     recovery deletes the stored counter with the agent key, and the new
//     agent's new key gives new Ks, so old datagrams stay worthless.
//
// No amplification: a reply (33 bytes) is shorter than its request (84),
// and only an authentic request is answered, so a forged source address
// gets less than the forger sent, and only by replaying captured
// datagrams. No oracle: a datagram that is not an authentic request
// (wrong size, malformed, bad MAC) gets no answer at all, the same for
// every way of being wrong, so a prober learns nothing about which machine
// ids or keys exist; it is counted (shepherd_server_heartbeats_rejected_total,
// reasons invalid_argument, too_large, bad_mac) and logged at the bounded
// rate of the server's other rejections, never with a key or the secret.
// The answers to authentic datagrams tell their sender, who holds K,
// nothing it could not learn over TLS.
//
// Cost. Per datagram, the server makes three HMAC-SHA256 computations
// (derive, verify, seal), two system calls (read, send) and its share of
// a batch; BenchmarkDatagramPath has the part without the database. P1
// and P5 of `make bench` measure it against the transport ceiling. A full
// `make bench` on the quiet 2-core machine, 2026-11-27 (commit 5ad8bb0):
//
//	P1 heartbeats_per_s value=44350 limit=75387 limit_ratio=0.588 transport_ceiling=94234 transport_server_cpu_us=9.04 agents=1000 mean_batch=133 server_cpu_us=16.83 postgres_cpu_us=12.65 loadgen_cpu_us=13.12
//	P1 heartbeats_per_s value=50062 limit=75387 limit_ratio=0.664 agents=10000 mean_batch=998 server_cpu_us=15.01 postgres_cpu_us=10.17 loadgen_cpu_us=13.62
//	P5 rss_mb value=192 baseline=264 peak_mb=267 fds=33 baseline_fds=29 goroutines=61.00 baseline_goroutines=61.00 agents=15000 machines=100000
//
// against 74.5 and 85.5 µs of server CPU and 27.9 and 53.3 µs of
// PostgreSQL CPU per heartbeat over kept TLS connections in the same kind
// of run, and 842 MB, 15,028 descriptors and 45,057 goroutines with 15,000
// agents connected. The server now holds nothing per agent: P5's RSS with
// 15,000 agents heartbeating is within the noise of the process with none
// (the components' first passes over the fleet move it by more), and
// descriptors and goroutines are the idle process's. The rate is still
// short of 0.8 of the transport-only ceiling, which is the same sockets
// and MACs without the BMDB: on two shared cores every microsecond the
// real path adds (the batch, PostgreSQL) is taken from the ceiling's
// budget; the server's profile is about half system calls, one read and
// one send per datagram (recvmmsg and sendmmsg would halve them).
package server
