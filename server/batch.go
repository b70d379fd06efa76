package server

import (
	"context"
	"errors"
	"time"

	"github.com/shepherd/shepherd/bmdb"
)

// batcher writes heartbeats that arrive together in one statement. Each of
// its flushers takes everything queued (up to maxBatch) as soon as it is
// free, so batches grow with the load and a lone heartbeat waits for no one.
//
// Heartbeats come in two queues. Those of a (machine, key) pair the server
// has seen accepted go to the verified queue, which is served first; all
// others (a new agent's first heartbeats, and anything an unauthenticated
// client sends) go to a bounded queue served with what room is left in a
// batch. A client flooding the server with requests of keys the BMDB does
// not know can therefore slow down only other unknown keys, never the
// agents of the fleet, and a full queue refuses at once instead of letting
// requests pile up in memory.
type batcher struct {
	db           *bmdb.DB
	verified     chan *pendingBeat
	unverified   chan *pendingBeat
	maxBatch     int
	flushers     int
	flushTimeout time.Duration
	metrics      *metrics
	failed       func() // told about every batch the database failed
}

type pendingBeat struct {
	hb bmdb.Heartbeat
	// done receives the result of a heartbeat whose submitter waits for it
	// (a TLS handler); buffered, so a flusher never blocks on a gone
	// handler.
	done chan beatResult
	// then, if set, is called with the result instead, by the flusher
	// that wrote the batch (a datagram: nothing waits for it, so no
	// goroutine is parked per heartbeat in flight). It must not block.
	then beatCallback
}

// beatCallback receives the result of a heartbeat nothing waits for.
type beatCallback interface {
	beatDone(beatResult)
}

// finish hands p its result.
func (p *pendingBeat) finish(r beatResult) {
	if p.then != nil {
		p.then.beatDone(r)
		return
	}
	p.done <- r
}

type beatResult struct {
	res bmdb.HeartbeatResult
	err error
}

var (
	errStopped = errors.New("callback server is stopping")
	// errBusy means the queue of unverified heartbeats is full.
	errBusy = errors.New("callback server is busy")
)

func newBatcher(db *bmdb.DB, maxBatch, flushers int, flushTimeout time.Duration, m *metrics, failed func()) *batcher {
	return &batcher{
		db:           db,
		verified:     make(chan *pendingBeat, 4*maxBatch),
		unverified:   make(chan *pendingBeat, maxBatch),
		maxBatch:     maxBatch,
		flushers:     flushers,
		flushTimeout: flushTimeout,
		metrics:      m,
		failed:       failed,
	}
}

// submit records one heartbeat and waits for its result. A verified
// heartbeat waits for room in its queue; an unverified one is refused with
// errBusy if its queue is full. unbatched writes it in a statement of its
// own instead (the benchmark's baseline).
func (b *batcher) submit(ctx context.Context, hb bmdb.Heartbeat, verified, unbatched bool) (bmdb.HeartbeatResult, error) {
	if unbatched {
		b.metrics.batchSize.Observe(1)
		res, err := b.db.RecordHeartbeats(ctx, []bmdb.Heartbeat{hb})
		if err != nil {
			return bmdb.HeartbeatResult{}, err
		}
		return res[0], nil
	}
	p := &pendingBeat{hb: hb, done: make(chan beatResult, 1)}
	if err := b.enqueue(ctx, p, verified); err != nil {
		return bmdb.HeartbeatResult{}, err
	}
	select {
	case r := <-p.done:
		return r.res, r.err
	case <-ctx.Done():
		return bmdb.HeartbeatResult{}, ctx.Err()
	}
}

// enqueue queues p for the next batch without waiting for its result: a
// verified heartbeat waits for room in its queue (until ctx ends), an
// unverified one is refused with errBusy if its queue is full. Once enqueue
// returns nil, p is finished exactly once, by a flusher, or by run as the
// batcher stops.
func (b *batcher) enqueue(ctx context.Context, p *pendingBeat, verified bool) error {
	if verified {
		select {
		case b.verified <- p:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	select {
	case b.unverified <- p:
		return nil
	default:
		return errBusy
	}
}

// run runs the flushers until ctx ends, then fails whatever is still queued.
func (b *batcher) run(ctx context.Context) {
	done := make(chan struct{})
	for range b.flushers {
		go func() {
			defer func() { done <- struct{}{} }()
			b.flush(ctx)
		}()
	}
	for range b.flushers {
		<-done
	}
	for {
		select {
		case p := <-b.verified:
			p.finish(beatResult{err: errStopped})
		case p := <-b.unverified:
			p.finish(beatResult{err: errStopped})
		default:
			return
		}
	}
}

// next waits for the first heartbeat of a batch, verified ones first.
func (b *batcher) next(ctx context.Context) (*pendingBeat, bool) {
	select {
	case p := <-b.verified:
		return p, true
	default:
	}
	select {
	case <-ctx.Done():
		return nil, false
	case p := <-b.verified:
		return p, true
	case p := <-b.unverified:
		return p, true
	}
}

func (b *batcher) flush(ctx context.Context) {
	batch := make([]*pendingBeat, 0, b.maxBatch)
	hbs := make([]bmdb.Heartbeat, 0, b.maxBatch)
	for {
		batch, hbs = batch[:0], hbs[:0]
		p, ok := b.next(ctx)
		if !ok {
			return
		}
		batch = append(batch, p)
	fill:
		for len(batch) < b.maxBatch {
			select {
			case p := <-b.verified:
				batch = append(batch, p)
				continue
			default:
			}
			select {
			case p := <-b.unverified:
				batch = append(batch, p)
			default:
				break fill
			}
		}
		for _, p := range batch {
			hbs = append(hbs, p.hb)
		}
		b.metrics.batchSize.Observe(float64(len(batch)))
		// The batch is written even if the server is stopping meanwhile
		// (its handlers are waiting for it), but never for longer than the
		// flush timeout: a database that stopped answering must not hold
		// the batch, or the server's shutdown, for minutes.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.flushTimeout)
		res, err := b.db.RecordHeartbeats(fctx, hbs)
		cancel()
		if err != nil {
			b.failed()
		}
		for i, p := range batch {
			if err != nil {
				p.finish(beatResult{err: err})
			} else {
				p.finish(beatResult{res: res[i]})
			}
		}
	}
}
