package server

import (
	"context"
	"errors"

	"github.com/shepherd/shepherd/bmdb"
)

// batcher writes heartbeats that arrive together in one transaction. Each of
// its flushers takes everything queued (up to maxBatch) as soon as it is
// free, so batches grow with the load and a lone heartbeat waits for no one.
type batcher struct {
	db       *bmdb.DB
	queue    chan *pendingBeat
	maxBatch int
	flushers int
	metrics  *metrics
}

type pendingBeat struct {
	hb   bmdb.Heartbeat
	done chan beatResult // buffered: a flusher never blocks on a gone handler
}

type beatResult struct {
	res bmdb.HeartbeatResult
	err error
}

var errStopped = errors.New("callback server is stopping")

func newBatcher(db *bmdb.DB, maxBatch, flushers int, m *metrics) *batcher {
	return &batcher{db: db, queue: make(chan *pendingBeat, 4*maxBatch), maxBatch: maxBatch, flushers: flushers, metrics: m}
}

// submit records one heartbeat and waits for its result. unbatched writes
// it in a transaction of its own instead (the benchmark's baseline).
func (b *batcher) submit(ctx context.Context, hb bmdb.Heartbeat, unbatched bool) (bmdb.HeartbeatResult, error) {
	if unbatched {
		b.metrics.batchSize.Observe(1)
		res, err := b.db.RecordHeartbeats(ctx, []bmdb.Heartbeat{hb})
		if err != nil {
			return bmdb.HeartbeatResult{}, err
		}
		return res[0], nil
	}
	p := &pendingBeat{hb: hb, done: make(chan beatResult, 1)}
	select {
	case b.queue <- p:
	case <-ctx.Done():
		return bmdb.HeartbeatResult{}, ctx.Err()
	}
	select {
	case r := <-p.done:
		return r.res, r.err
	case <-ctx.Done():
		return bmdb.HeartbeatResult{}, ctx.Err()
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
		case p := <-b.queue:
			p.done <- beatResult{err: errStopped}
		default:
			return
		}
	}
}

func (b *batcher) flush(ctx context.Context) {
	batch := make([]*pendingBeat, 0, b.maxBatch)
	hbs := make([]bmdb.Heartbeat, 0, b.maxBatch)
	for {
		batch, hbs = batch[:0], hbs[:0]
		select {
		case <-ctx.Done():
			return
		case p := <-b.queue:
			batch = append(batch, p)
		}
	fill:
		for len(batch) < b.maxBatch {
			select {
			case p := <-b.queue:
				batch = append(batch, p)
			default:
				break fill
			}
		}
		for _, p := range batch {
			hbs = append(hbs, p.hb)
		}
		b.metrics.batchSize.Observe(float64(len(batch)))
		// The batch is written even if the server is stopping meanwhile:
		// its handlers are waiting for it.
		res, err := b.db.RecordHeartbeats(context.WithoutCancel(ctx), hbs)
		for i, p := range batch {
			if err != nil {
				p.done <- beatResult{err: err}
			} else {
				p.done <- beatResult{res: res[i]}
			}
		}
	}
}
