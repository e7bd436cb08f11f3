package main

// No reconnect storm, at the process level: the drain's goodbyes to the event
// streams carry retry hints that differ, spread over a window that grows with
// the streams, and go out over its first half, inside the drain budget; the
// clients, coming back on the other instance with Last-Event-ID, miss and
// repeat nothing.

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
	"syscall"
	"testing"
	"time"
)

// drainHandover is what the clients of a drained instance saw.
type drainHandover struct {
	spread  time.Duration   // the window the sseClose line reports
	step    time.Duration   // how long the sseClose step took
	exit    time.Duration   // SIGTERM → exit
	goodbye []time.Time     // when each client got its goodbye, in arrival order
	hints   []time.Duration // each goodbye's retry hint
	back    []time.Time     // when each client came back (its goodbye plus its hint), in order
}

func (h drainHandover) String() string {
	var at []string
	for _, g := range h.goodbye {
		at = append(at, fmt.Sprint(g.Sub(h.goodbye[0]).Milliseconds()))
	}
	var back []string
	for _, b := range h.back {
		back = append(back, fmt.Sprint(b.Sub(h.goodbye[0]).Milliseconds()))
	}
	return fmt.Sprintf("spread %s, sseClose %s, SIGTERM → exit %s; goodbyes at +%v ms; retry hints %v; back at +%v ms",
		h.spread, h.step, h.exit, at, h.hints, back)
}

// handOver opens n streams on a, posts orders to b all along, sends a
// SIGTERM and moves every client to b once its goodbye's retry hint has
// passed, resuming with Last-Event-ID. Every client must then hold every
// order event exactly once, in delivery order, across its two streams.
func handOver(t *testing.T, n int, tweak func(env map[string]string)) drainHandover {
	t.Helper()
	a, b, env := twoInstances(t, func(env map[string]string) {
		env["KUMIKO_SSE_MAX_STREAMS_PER_IP"] = "0" // every client is 127.0.0.1
		env["KUMIKO_LINGER"] = "0"
		tweak(env)
	})
	opsA, apiA := a.waitReady()
	opsB, apiB := b.waitReady()
	clients := make([]*sseClient, n)
	for i := range clients {
		clients[i] = openSSE(t, apiA, 0)
	}
	waitStreams(t, opsA, n)

	ctx, stop := context.WithCancel(context.Background())
	var posting sync.WaitGroup
	stopPosting := sync.OnceFunc(func() { stop(); posting.Wait() })
	defer stopPosting()
	posting.Go(func() {
		pace(ctx, 10*time.Millisecond, func() bool {
			postQuiet(apiB+"/api/orders", validOrder) // the survivor takes the orders all along
			return true
		})
	})
	pool := sharedPool(t, env)
	waitFor(t, 10*time.Second, "the first orders on a's streams", func() bool {
		return len(clients[0].events(eventOrderCreated)) >= 3
	})

	sent := time.Now()
	a.signal(syscall.SIGTERM)
	var h drainHandover
	closed := a.waitLog(20*time.Second, map[string]any{"component": "sseHub", "msg": "event streams closed"})
	if closed["streams"] != float64(n) || closed["forced"] != float64(0) {
		t.Fatalf("sseClose: %v; want %d streams asked, none forced", closed, n)
	}
	h.spread = time.Duration(closed["spread_ms"].(float64)) * time.Millisecond
	step := a.waitLog(5*time.Second, map[string]any{"component": "lifecycle", "step": "sseClose"})
	h.step = time.Duration(step["duration_ms"].(float64)) * time.Millisecond

	// Each client comes back when its hint says, as an EventSource does.
	type back struct {
		at     time.Time
		client *sseClient
	}
	var backs []back
	for i, c := range clients {
		select {
		case <-c.ended:
		case <-time.After(10 * time.Second):
			t.Fatalf("client %d: its stream on a did not end; it saw %d frames", i, len(c.events(eventOrderCreated)))
		}
		bye := c.events("shutdown")
		if len(bye) != 1 {
			t.Fatalf("client %d got %d goodbyes, want 1", i, len(bye))
		}
		h.goodbye = append(h.goodbye, bye[0].At)
		h.hints = append(h.hints, time.Duration(bye[0].Retry)*time.Millisecond)
		backs = append(backs, back{bye[0].At.Add(time.Duration(bye[0].Retry) * time.Millisecond), c})
	}
	slices.SortFunc(h.goodbye, func(x, y time.Time) int { return x.Compare(y) })
	sort.Slice(backs, func(i, j int) bool { return backs[i].at.Before(backs[j].at) })
	resumed := map[*sseClient]*sseClient{}
	for _, r := range backs {
		h.back = append(h.back, r.at)
		<-time.After(time.Until(r.at)) // the retry hint: the client's own wait
		resumed[r.client] = openSSE(t, apiB, r.client.lastID())
	}
	if code := a.wait(20 * time.Second); code != 0 {
		t.Fatalf("a exited %d; %s", code, h)
	}
	h.exit = time.Since(sent)
	waitStreams(t, opsB, n)
	at := len(deliveryOrder(t, pool))
	waitFor(t, 10*time.Second, "orders delivered after every client moved", func() bool { return len(deliveryOrder(t, pool)) >= at+3 })
	stopPosting()

	var want []int64
	waitFor(t, 10*time.Second, "every order on every client", func() bool {
		// Every posted order numbered first: one still on its way would
		// reach the clients after want was read.
		var unnumbered int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events
			WHERE event_type = 'order.created' AND delivery_seq IS NULL`).Scan(&unnumbered)
		if unnumbered > 0 {
			return false
		}
		want = deliveryOrder(t, pool)
		for _, c := range clients {
			if len(c.events(eventOrderCreated))+len(resumed[c].events(eventOrderCreated)) < len(want) {
				return false
			}
		}
		return true
	})
	for i, c := range clients {
		got := append(orderCreatedIDs(c.events(eventOrderCreated)), orderCreatedIDs(resumed[c].events(eventOrderCreated))...)
		if !slices.Equal(got, want) {
			t.Errorf("client %d, across the handover, got\n%v\nwant every order event once, in delivery order\n%v", i, got, want)
		}
	}
	t.Logf("%d streams: %s", n, h)
	return h
}

// Many streams: the goodbyes' retry hints differ and lie within the window,
// the streams close over its first half, the drain stays inside its budget,
// and no client misses or repeats an event.
func TestProcessDrainSpreadsReconnects(t *testing.T) {
	t.Parallel()
	const n = 40
	const retry, step, drain = 300 * time.Millisecond, 25 * time.Millisecond, 5 * time.Second
	h := handOver(t, n, func(env map[string]string) {
		env["KUMIKO_SSE_RETRY"] = retry.String()
		env["KUMIKO_SSE_RECONNECT_SPREAD_PER_STREAM"] = step.String()
		env["KUMIKO_DRAIN_TIMEOUT"] = drain.String()
	})
	if want := n * step; h.spread != want {
		t.Errorf("the window is %s, want %d streams × %s = %s; %s", h.spread, n, step, want, h)
	}
	distinct := map[time.Duration]bool{}
	for _, hint := range h.hints {
		distinct[hint] = true
		if hint < retry || hint > retry+h.spread/2 {
			t.Errorf("a retry hint of %s, outside [%s, %s]; %s", hint, retry, retry+h.spread/2, h)
		}
	}
	if len(distinct) < n/2 {
		t.Errorf("%d distinct retry hints among %d goodbyes: not jittered; %s", len(distinct), n, h)
	}
	// The goodbyes go out over the first half of the window, not in one instant.
	span := h.goodbye[n-1].Sub(h.goodbye[0])
	if span < h.spread/4 || h.step > h.spread/2+time.Second {
		t.Errorf("goodbyes over %s, sseClose took %s; want them spread over about %s; %s", span, h.step, h.spread/2, h)
	}
	// What the other instances see is the clients coming back: no half of
	// them within 50 ms. (Counted on the comebacks, not the goodbyes: a
	// stall of the drained process on a busy machine delivers the goodbyes
	// due meanwhile at once, 26 of 40 in one run; their hints still differ.)
	for i := range h.back {
		j := i
		for j < n && h.back[j].Sub(h.back[i]) < 50*time.Millisecond {
			j++
		}
		if j-i > n/2 {
			t.Errorf("%d of %d clients came back within 50 ms: not spread; %s", j-i, n, h)
			break
		}
	}
	if h.exit >= drain {
		t.Errorf("SIGTERM → exit took %s, the whole drain budget %s; %s", h.exit, drain, h)
	}
}

// The comparison, and the small cases: with the spread off every goodbye
// carries the base hint at once; one stream waits no more than the base
// hint; a window the drain budget cannot hold is cut to what it can.
func TestProcessDrainSpreadBounds(t *testing.T) {
	t.Parallel()
	const retry = 300 * time.Millisecond
	t.Run("off", func(t *testing.T) {
		t.Parallel()
		h := handOver(t, 20, func(env map[string]string) {
			env["KUMIKO_SSE_RETRY"] = retry.String()
			env["KUMIKO_SSE_RECONNECT_SPREAD"] = "0"
		})
		for _, hint := range h.hints {
			if hint != retry || h.spread != 0 {
				t.Fatalf("with the spread off: a hint of %s, window %s; want %s and 0; %s", hint, h.spread, retry, h)
			}
		}
	})
	t.Run("one stream", func(t *testing.T) {
		t.Parallel()
		h := handOver(t, 1, func(env map[string]string) { env["KUMIKO_SSE_RETRY"] = retry.String() })
		if h.spread > 2*time.Millisecond || h.hints[0] > retry+time.Millisecond || h.step > 100*time.Millisecond {
			t.Errorf("one stream: window %s, hint %s, sseClose %s; want ≤ 2 ms, ≤ %s and no added wait; %s",
				h.spread, h.hints[0], h.step, retry+time.Millisecond, h)
		}
	})
	t.Run("within the drain budget", func(t *testing.T) {
		t.Parallel()
		const drain = 1500 * time.Millisecond
		h := handOver(t, 20, func(env map[string]string) {
			env["KUMIKO_SSE_RETRY"] = retry.String()
			env["KUMIKO_SSE_RECONNECT_SPREAD_PER_STREAM"] = "1s" // 20 s asked for
			env["KUMIKO_DRAIN_TIMEOUT"] = drain.String()
			env["KUMIKO_SHUTDOWN_TIMEOUT"] = "5s"
		})
		if h.spread > drain || h.spread < drain/2 || h.step > drain {
			t.Errorf("window %s, sseClose %s; want the window cut to what is left of the %s drain budget; %s", h.spread, h.step, drain, h)
		}
	})
}
