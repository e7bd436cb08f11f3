package main

import (
	"context"
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
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
	h.metrics.streams.Inc()
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
	h.metrics.streams.Dec()
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

// sseMetrics is what the event streams add to /metrics.
type sseMetrics struct {
	streams prometheus.Gauge
	dropped prometheus.Counter
	sendLag prometheus.Histogram
}

func newSSEMetrics(r prometheus.Registerer) *sseMetrics {
	f := promauto.With(r)
	return &sseMetrics{
		streams: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "sse_streams", Help: "Open event streams on this instance.",
		}),
		dropped: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "sse_slow_streams_closed_total", Help: "Event streams closed because the client fell too far behind.",
		}),
		sendLag: f.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricNamespace, Name: "sse_send_lag_seconds",
			Help:    "From writing an event to handing it to a stream's connection, for the oldest event of each write: how far the fan-out runs behind.",
			Buckets: []float64{.001, .0025, .005, .01, .02, .05, .1, .25, .5, 1, 5, 30},
		}),
	}
}
