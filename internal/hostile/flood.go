package hostile

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/google/uuid"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// flood sends KindFlood bursts on one HTTP/2 connection at a time, written
// frame by frame so that it can open more streams than the server allows,
// until ctx ends.
func (h *hostile) flood(ctx context.Context) {
	for ctx.Err() == nil {
		if err := h.limiter.Wait(ctx); err != nil {
			return
		}
		c, err := h.dial(ctx, h.floodTLS, nil)
		if err != nil {
			if ctx.Err() == nil {
				h.tally.error(KindFlood, err)
			}
			continue
		}
		h.floodConn(ctx, c)
	}
}

// floodConn sends bursts on c until the connection fails or ctx ends, and
// closes c.
func (h *hostile) floodConn(ctx context.Context, c net.Conn) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	f, err := newFloodConn(c, h.cfg.Endpoint)
	if err != nil {
		h.tally.error(KindFlood, err)
		return
	}
	for ctx.Err() == nil && !f.goaway && f.nextID < 1<<30 {
		if err := h.limiter.WaitN(ctx, h.cfg.FloodStreams); err != nil {
			return
		}
		if err := f.burst(ctx, h, h.cfg.FloodStreams); err != nil {
			if ctx.Err() == nil {
				h.tally.error(KindFlood, err)
			}
			return
		}
	}
}

// floodConnState is one raw HTTP/2 client connection.
type floodConnState struct {
	c      net.Conn
	w      *bufio.Writer
	fr     *http2.Framer
	hbuf   bytes.Buffer
	henc   *hpack.Encoder
	host   string
	nextID uint32
	// goaway: the server said it takes no more streams.
	goaway bool
}

func newFloodConn(c net.Conn, host string) (*floodConnState, error) {
	f := &floodConnState{c: c, w: bufio.NewWriterSize(c, 64<<10), host: host, nextID: 1}
	f.fr = http2.NewFramer(f.w, c)
	f.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	f.fr.MaxHeaderListSize = 64 << 10
	f.henc = hpack.NewEncoder(&f.hbuf)
	if _, err := f.w.WriteString(http2.ClientPreface); err != nil {
		return nil, fmt.Errorf("hostile: writing the preface: %w", err)
	}
	if err := f.fr.WriteSettings(); err != nil {
		return nil, fmt.Errorf("hostile: writing settings: %w", err)
	}
	if err := f.w.Flush(); err != nil {
		return nil, fmt.Errorf("hostile: writing settings: %w", err)
	}
	return f, nil
}

// streamState is what a burst knows about one of its streams.
type streamState struct {
	status string // :status of the response headers
}

// burst opens n streams at once, each an unknown-id heartbeat, and reads
// until every one is answered or reset, or the request timeout passes.
func (f *floodConnState) burst(ctx context.Context, h *hostile, n int) error {
	open := make(map[uint32]*streamState, n)
	for range n {
		id := f.nextID
		f.nextID += 2
		f.hbuf.Reset()
		for _, hf := range [][2]string{
			{":method", "POST"}, {":scheme", "https"}, {":path", heartbeatPath}, {":authority", f.host},
			{"content-type", grpcPlain}, {"te", "trailers"},
		} {
			if err := f.henc.WriteField(hpack.HeaderField{Name: hf[0], Value: hf[1]}); err != nil {
				return fmt.Errorf("hostile: encoding headers: %w", err)
			}
		}
		if err := f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: f.hbuf.Bytes(), EndHeaders: true}); err != nil {
			return fmt.Errorf("hostile: writing headers: %w", err)
		}
		if err := f.fr.WriteData(id, true, frame(mustMarshal(fullRequest(uuid.NewString())))); err != nil {
			return fmt.Errorf("hostile: writing data: %w", err)
		}
		open[id] = &streamState{}
	}
	h.tally.sent(KindFlood, n)
	if err := f.w.Flush(); err != nil {
		return fmt.Errorf("hostile: writing a burst: %w", err)
	}
	if err := f.c.SetReadDeadline(time.Now().Add(h.cfg.RequestTimeout)); err != nil {
		return fmt.Errorf("hostile: setting a deadline: %w", err)
	}
	for len(open) > 0 {
		fr, err := f.fr.ReadFrame()
		if err != nil {
			if ctx.Err() == nil {
				for range open {
					h.tally.error(KindFlood, err)
				}
			}
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return fmt.Errorf("hostile: %d streams unanswered: %w", len(open), err)
			}
			return fmt.Errorf("hostile: reading: %w", err)
		}
		switch fr := fr.(type) {
		case *http2.MetaHeadersFrame:
			st := open[fr.StreamID]
			if st == nil {
				continue
			}
			if s := fr.PseudoValue("status"); s != "" {
				st.status = s
			}
			if !fr.StreamEnded() {
				continue
			}
			delete(open, fr.StreamID)
			h.tally.answer(KindFlood, "", answerCode(st.status, fr.Fields))
		case *http2.DataFrame:
			if n := len(fr.Data()); n > 0 {
				// Give the window back, so that a server that answers with
				// data (an OK) is heard.
				_ = f.fr.WriteWindowUpdate(0, uint32(n))
				_ = f.fr.WriteWindowUpdate(fr.StreamID, uint32(n))
			}
			if st := open[fr.StreamID]; st != nil && fr.StreamEnded() {
				delete(open, fr.StreamID)
				h.tally.answer(KindFlood, "", answerCode(st.status, nil))
			}
		case *http2.RSTStreamFrame:
			if open[fr.StreamID] != nil {
				delete(open, fr.StreamID)
				h.tally.answer(KindFlood, "", "rst_"+fr.ErrCode.String())
			}
		case *http2.SettingsFrame:
			if !fr.IsAck() {
				_ = f.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !fr.IsAck() {
				_ = f.fr.WritePing(true, fr.Data)
			}
		case *http2.GoAwayFrame:
			f.goaway = true
			h.tally.answer(KindFlood, "", "goaway_"+fr.ErrCode.String())
			for id := range open {
				if id > fr.LastStreamID {
					delete(open, id)
					h.tally.error(KindFlood, errGoAway)
				}
			}
		}
		if err := f.w.Flush(); err != nil {
			return fmt.Errorf("hostile: writing: %w", err)
		}
	}
	return nil
}

// errGoAway: the server dropped a stream with its GOAWAY.
var errGoAway = errors.New("hostile: stream dropped by GOAWAY")

// answerCode names an answer from its :status and (trailer) fields.
func answerCode(status string, fields []hpack.HeaderField) string {
	if status != "" && status != "200" {
		return "http_" + status
	}
	for _, hf := range fields {
		if strings.EqualFold(hf.Name, "grpc-status") {
			return grpcCode(hf.Value)
		}
	}
	return "no_status"
}

// holdConnections opens a connection, holds it for the hold time, and
// opens the next, until ctx ends.
func (h *hostile) holdConnections(ctx context.Context) {
	for ctx.Err() == nil {
		if err := h.limiter.Wait(ctx); err != nil {
			return
		}
		h.tally.sent(KindConnFlood, 1)
		c, err := h.dial(ctx, h.connTLS, h.connFrom)
		if err == nil {
			err = h.hold(ctx, c)
		}
		switch {
		case err == nil, ctx.Err() != nil:
			continue
		case isTimeout(err):
			h.tally.error(KindConnFlood, err)
		default:
			// Closed before or during the handshake, or before the
			// server's settings: over a limit.
			h.tally.refused()
		}
		// Retry no faster than a held connection would.
		if !h.wait(ctx, h.cfg.HoldTime) {
			return
		}
	}
}

// hold checks that the server serves c, holds it for the hold time or until
// ctx ends, and closes it. It returns an error if the server did not serve
// c.
func (h *hostile) hold(ctx context.Context, c net.Conn) error {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		return fmt.Errorf("hostile: writing the preface: %w", err)
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		return fmt.Errorf("hostile: writing settings: %w", err)
	}
	if err := c.SetReadDeadline(time.Now().Add(h.cfg.RequestTimeout)); err != nil {
		return fmt.Errorf("hostile: setting a deadline: %w", err)
	}
	// The server's SETTINGS: it serves the connection.
	if _, err := fr.ReadFrame(); err != nil {
		return fmt.Errorf("hostile: reading the server's settings: %w", err)
	}
	h.tally.answer(KindConnFlood, "", "conn_held")
	h.wait(ctx, h.cfg.HoldTime)
	return nil
}

// wait waits for d or until ctx ends, and reports whether ctx is still
// live.
func (h *hostile) wait(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}
