package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"
)

// One stream's write path: every byte a stream sends goes through write and
// flush below, each write with its deadline. See sse_feed.go for the whole stream.

// sendChunk and sendBuffer make the write timeout a progress floor: a stream
// is dropped when fewer than about sendChunk bytes reach its client within
// KUMIKO_SSE_WRITE_TIMEOUT (1.6 KB/s at the default 10 s), not when one write
// waited that long. Two things made a single write wait far longer than its
// bytes need at a steady slow reader: a write of everything pending at once
// (up to streamBuffer frames, about 1 MB), and the kernel, which wakes a
// writer blocked on a full send buffer only when a third of it is free again
// — of a buffer autotuned up to tcp_wmem's 4 MB, that was 1.3 MB, so every
// reader below ~130 KB/s was cut after the timeout. So writes go out in
// chunks of sendChunk, each with its own deadline, and a stream's socket
// keeps a fixed send buffer of sendBuffer (the kernel doubles it; a blocked
// write wakes once about 5 KB of it drained). The price: a stream moves at
// most about 16 KB per round trip (320 KB/s at 50 ms), plenty for events.
const (
	sendChunk  = 16 << 10
	sendBuffer = 8 << 10
)

// sseStream is one client's stream as the hub sees it.
type sseStream struct {
	ip      string
	next    int64         // the next feed frame this stream reads (only its handler touches it)
	closed  chan struct{} // closed by the hub: the drain
	retry   time.Duration // the goodbye's retry hint, set by the drain before it closes closed
	ctx     context.Context
	cancel  context.CancelFunc
	rc      *http.ResponseController
	timeout time.Duration

	mu     sync.Mutex
	forced bool // the drain gave up on this stream: no more writes
}

// errStreamForced ends a stream the drain force-closed.
var errStreamForced = errors.New("event stream force-closed by the drain")

// arm gives the next write its deadline. The stream's lock serializes it with
// forceClose, so a handler cannot push back a deadline the drain pulled in.
func (s *sseStream) arm() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.forced {
		return errStreamForced
	}
	if err := s.rc.SetWriteDeadline(time.Now().Add(s.timeout)); err != nil {
		return fmt.Errorf("setting the write deadline: %w", err)
	}
	return nil
}

// forceClose makes a write in progress fail now and every later one at once,
// and cancels what the handler waits for: it returns without a hijack.
func (s *sseStream) forceClose() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forced = true
	_ = s.rc.SetWriteDeadline(time.Now()) // fails only when the connection is gone already
	s.cancel()
}

// write hands frames to net/http's buffer, which may write to the client,
// sendChunk bytes at a time, each within the write timeout: a stream is
// judged by its progress, not by how long one large write waited.
func (s *sseStream) write(w http.ResponseWriter, frames []byte) error {
	for len(frames) > 0 {
		n := min(len(frames), sendChunk)
		if err := s.arm(); err != nil {
			return err
		}
		if _, err := w.Write(frames[:n]); err != nil {
			return fmt.Errorf("writing to the event stream: %w", err)
		}
		frames = frames[n:]
	}
	return nil
}

// flush sends what is buffered to the client within the write timeout.
func (s *sseStream) flush() error {
	if err := s.arm(); err != nil {
		return err
	}
	if err := s.rc.Flush(); err != nil {
		return fmt.Errorf("flushing the event stream: %w", err)
	}
	return nil
}

// sendFrames sends the feed frames after *cursor; *cursor moves to the last one. The frames are
// gathered into chunks of sendChunk: net/http's buffers are 2 and 4 KB, and
// frames written one by one would leave in a system call per 4 KB, a call
// that costs the same for 300 bytes or 16 KB. The oldest frame's age is the
// stream's send lag.
func (h *sseHub) sendFrames(s *sseStream, w http.ResponseWriter, frames []feedFrame, cursor *int64) error {
	buf, _ := h.sendBuffers.Get().(*[]byte)
	if buf == nil {
		buf = new([]byte)
	}
	defer h.sendBuffers.Put(buf)
	out := (*buf)[:0]
	var oldest time.Time
	for _, f := range frames {
		if f.seq <= *cursor {
			continue // already sent by the replay
		}
		if len(out) == 0 {
			oldest = f.written
		}
		out = append(out, f.frame...)
		*cursor = f.seq
	}
	*buf = out
	if len(out) == 0 {
		return nil
	}
	if err := s.send(w, out); err != nil {
		return err
	}
	h.metrics.sendLag.Observe(time.Since(oldest).Seconds())
	return nil
}

// limitSendBuffer gives a stream's socket a fixed send buffer of sendBuffer,
// so a blocked write wakes after a few KB reached the client instead of a
// third of a buffer the kernel may have grown to megabytes (see sendChunk).
func limitSendBuffer(ctx context.Context) {
	// A *net.TCPConn, or the API listener's cappedConn around one.
	if tc, ok := ctx.Value(connKey{}).(interface{ SetWriteBuffer(bytes int) error }); ok {
		_ = tc.SetWriteBuffer(sendBuffer) // best effort: the chunked writes still bound each wait
	}
}

// send writes frames and flushes them.
func (s *sseStream) send(w http.ResponseWriter, frames []byte) error {
	if err := s.write(w, frames); err != nil {
		return err
	}
	return s.flush()
}
