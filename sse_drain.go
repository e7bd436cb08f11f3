package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/sirupsen/logrus"
)

// Drain step 4 for the event streams: a goodbye each, spread over a window so
// the clients' reconnects do not land on the other instances at once. See
// sse_feed.go for the whole stream.

// goodbyes is the hub's part of drain step sseClose, registered with
// Lifecycle.OnCloseStreams in phase 15: every stream gets `event: shutdown`
// and a retry hint (closeStreams), spread over a window that grows with the
// streams (KUMIKO_SSE_RECONNECT_SPREAD), so their clients do not all
// reconnect to the other instances in the same instant. A client that
// stopped reading cannot take its goodbye, so what is left when drain ends
// is force-closed (its write deadline pulled to now), and the release hooks
// keep their share of the budget; a force-close leaves diagnostics.
func (h *sseHub) goodbyes(t timeouts, diag *diagnostics, log *logrus.Logger) func(drain, ctx context.Context) error {
	return func(drain, ctx context.Context) error {
		stopWatch := watchGoroutines(ctx) // the streams a force-close ends are gone when it returns
		r, err := h.closeStreams(drain, ctx, t.sseSpread, t.sseSpreadStep)
		stuck := stopWatch()
		// streams_open is kumiko_sse_streams now: 0 unless a handler outlived its force-close.
		entry := componentSSEHub.log(log).WithFields(logrus.Fields{"streams": r.asked, "forced": r.forced,
			"streams_open": h.openStreams(), "spread_ms": r.window.Milliseconds()})
		if r.forced == 0 {
			entry.Info("event streams closed")
			return err
		}
		entry.WithField("drain_timeout_ms", t.drain.Milliseconds()).Warn("drain timeout: force-closed event streams that did not end")
		reason := fmt.Sprintf("sseClose: %s force-closed at KUMIKO_DRAIN_TIMEOUT=%s", count(int64(r.forced), "event stream"), t.drain)
		if where := stuck.blocked(labelRoute, ""); where != "" {
			reason += ", " + where
		}
		diag.record(ctx, "sseClose", reason, stuck)
		return err
	}
}

// closeStreams is drain step 4: every stream is asked to end with `event:
// shutdown` and a retry hint, and no new one opens. http.Server.Shutdown never
// ends a streaming response by itself, so without this the drain would always
// wait for its timeout. The goodbyes are spread (spreadGoodbyes) over a window
// of step per stream, at most spread and at most what is left of the drain
// budget, so the instances the clients move to are not hit by all of them in
// the same instant. The handlers get until drain ends (the drain budget) to
// say goodbye; a reader that stopped reading cannot take the goodbye, so what
// is left then is force-closed and waited for until hard ends.
func (h *sseHub) closeStreams(drain, hard context.Context, spread, step time.Duration) (streamsClosed, error) {
	start := time.Now()
	h.mu.Lock()
	h.closing = true
	r := streamsClosed{asked: len(h.handlers)}
	streams := make([]*sseStream, 0, len(h.subscribed))
	for s := range h.subscribed {
		streams = append(streams, s)
	}
	h.mu.Unlock()

	left := spread
	if deadline, ok := drain.Deadline(); ok {
		left = time.Until(deadline)
	}
	r.window = spreadWindow(len(streams), spread, step, left)
	// Who goes first is random, not the map's order, nor the order the streams opened in.
	rand.Shuffle(len(streams), func(i, j int) { streams[i], streams[j] = streams[j], streams[i] })
	plan := spreadGoodbyes(len(streams), h.cfg.RetryHint, r.window)
	for i := 0; i < len(plan); {
		if wait := plan[i].at - time.Since(start); wait > 0 && sleepCtx(drain, wait) != nil {
			break // the budget is spent: the rest are force-closed below
		}
		h.mu.Lock()
		for elapsed := time.Since(start); i < len(plan) && plan[i].at <= elapsed; i++ {
			// A goodbye that goes out late (a busy CPU, a timer that fired
			// late) gets a shorter hint, so its client still comes back at
			// the moment it was aimed at, not in a bunch with the others.
			late := elapsed - plan[i].at
			h.sayGoodbye(streams[i], max(h.cfg.RetryHint, plan[i].retry-late))
		}
		h.mu.Unlock()
	}

	ended := make(chan struct{})
	go func() { h.active.Wait(); close(ended) }()
	select {
	case <-ended:
		return r, nil
	case <-drain.Done():
	}

	h.mu.Lock()
	r.forced = len(h.handlers)
	for s := range h.handlers {
		s.forceClose()
	}
	h.mu.Unlock()
	select {
	case <-ended:
		return r, nil
	case <-hard.Done():
		return r, fmt.Errorf("event stream handlers still running after being force-closed: %w", context.Cause(hard))
	}
}

// streamsClosed is what closeStreams did.
type streamsClosed struct {
	asked  int           // streams open when the step began
	forced int           // of those, force-closed at the end of the drain budget
	window time.Duration // their reconnects were spread over this; the goodbyes over its first half
}

// sayGoodbye ends s's stream with the retry hint retry. h.mu is held.
func (h *sseHub) sayGoodbye(s *sseStream, retry time.Duration) {
	if _, ok := h.subscribed[s]; !ok {
		return // its client left, or it fell behind, while it waited for its turn
	}
	s.retry = retry // before the close: the handler reads it once closed is
	delete(h.subscribed, s)
	close(s.closed)
}

// spreadWindow is the window the reconnects of n streams are spread over:
// step per stream, at most spread and at most left (of the drain budget). It
// grows with the streams because a few clients coming back at once are no
// storm, and a window they do not need would only keep them waiting.
func spreadWindow(n int, spread, step, left time.Duration) time.Duration {
	w := spread
	if step > 0 && time.Duration(n) < spread/step { // n*step < spread, without overflowing
		w = time.Duration(n) * step
	}
	return max(0, min(w, left))
}

// goodbye is when the drain closes one stream, after the step began, and the
// retry hint it gives that stream's client.
type goodbye struct {
	at, retry time.Duration
}

// spreadGoodbyes plans the goodbyes of n streams so that their clients come
// back evenly over window, after the base retry hint (KUMIKO_SSE_RETRY). The
// k-th client is aimed at a random moment of the k-th of n equal slots of the
// window; half of the way there is spent before its goodbye, half in its
// retry hint. Clients that honour the hint arrive evenly over the whole
// window; clients that ignore it (reconnect at once) still arrive spread over
// its first half, and the streams are closed in that half, well inside the
// drain budget. A window of 0 is the old way: every goodbye at once with the
// base hint. The plan is in the order of its goodbyes.
func spreadGoodbyes(n int, base, window time.Duration) []goodbye {
	plan := make([]goodbye, n)
	for k := range plan {
		aim := time.Duration((float64(k) + rand.Float64()) / float64(n) * float64(window))
		plan[k] = goodbye{at: aim / 2, retry: base + aim - aim/2}
	}
	return plan
}
