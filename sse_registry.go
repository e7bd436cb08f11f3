package main

import (
	"context"
	"fmt"
	"net/http"
)

// The streams the hub knows, and the caps on them (KUMIKO_SSE_MAX_STREAMS,
// KUMIKO_SSE_MAX_STREAMS_PER_IP). See sse_feed.go for the whole stream.

// open registers a stream for a client at ip, writing through rc; it returns
// the hub's position at that moment. The stream counts against
// KUMIKO_SSE_MAX_STREAMS and KUMIKO_SSE_MAX_STREAMS_PER_IP until release.
func (h *sseHub) open(ctx context.Context, ip string, rc *http.ResponseController) (*sseStream, int64, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closing {
		return nil, 0, apiError(http.StatusServiceUnavailable, "unavailable", "instance is draining")
	}
	if uint(len(h.handlers)) >= h.cfg.MaxStreams {
		return nil, 0, apiError(http.StatusServiceUnavailable, "too_many_streams", "this instance serves its maximum of event streams; retry")
	}
	if h.cfg.MaxStreamsPerIP > 0 && h.perIP[ip] >= h.cfg.MaxStreamsPerIP {
		return nil, 0, apiError(http.StatusTooManyRequests, "too_many_streams_from_ip",
			fmt.Sprintf("at most %d event streams per client address; close one first", h.cfg.MaxStreamsPerIP))
	}
	s := &sseStream{ip: ip, closed: make(chan struct{}), rc: rc, timeout: h.cfg.WriteTimeout}
	s.ctx, s.cancel = context.WithCancel(ctx)
	h.handlers[s] = struct{}{}
	h.subscribed[s] = struct{}{}
	h.perIP[ip]++
	h.active.Add(1)
	h.metrics.sseStreams.Inc()
	h.streamsNow.Add(1)
	// The stream reads the feed from here on: every event after cursor.
	h.feedMu.RLock()
	defer h.feedMu.RUnlock()
	s.next = h.written
	return s, h.cursor, nil
}

// release is the last thing a stream handler does: only now is its slot free.
func (h *sseHub) release(s *sseStream) {
	s.cancel()
	h.mu.Lock()
	if _, ok := h.subscribed[s]; ok {
		delete(h.subscribed, s)
		close(s.closed)
	}
	delete(h.handlers, s)
	if h.perIP[s.ip]--; h.perIP[s.ip] == 0 {
		delete(h.perIP, s.ip)
	}
	h.metrics.sseStreams.Dec()
	h.streamsNow.Add(-1)
	h.mu.Unlock()
	h.active.Done()
}

// openStreams is the number of stream handlers that have not returned, the
// value of kumiko_sse_streams (both change under h.mu).
func (h *sseHub) openStreams() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.handlers)
}
