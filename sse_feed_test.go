package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// The hub's feed: every stream reads the same encoded frames in delivery
// order; publishing never waits for a stream; a stream that falls more than
// streamBuffer frames behind is told so instead of holding the hub up.
func TestSSEFeedSharesFramesAndDropsLaggards(t *testing.T) {
	env := fastEnv(t)
	pool, err := pgxpool.New(context.Background(), env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	h := newSSEHub(sseHubDeps{db: pool, cfg: defaultConfig().SSE, poll: time.Second, log: newLogger(io.Discard, "json"),
		metrics: newSSEMetrics(prometheus.NewRegistry()), onPanic: func(component, any) {}})
	open := func() *sseStream {
		s, _, err := h.open(context.Background(), "127.0.0.1", nil)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	frame := func(seq int64) feedFrame {
		return feedFrame{seq: seq, frame: appendEvent(nil, &outboxEvent{ID: seq, Seq: seq, Type: "t", Payload: []byte(`{}`)})}
	}
	fast, slow := open(), open()

	_, wake, _ := h.pending(fast, nil)
	h.publish([]feedFrame{frame(1), frame(2), frame(2)}) // a repeat of the newest is ignored
	select {
	case <-wake:
	default:
		t.Fatal("publishing did not wake a waiting stream")
	}
	a, _, behindA := h.pending(fast, nil)
	b, _, behindB := h.pending(slow, nil)
	if behindA || behindB || len(a) != 2 || len(b) != 2 || a[0].seq != 1 || a[1].seq != 2 || &a[1].frame[0] != &b[1].frame[0] {
		t.Fatalf("streams read %v / %v (behind %v %v): want frames 1 and 2, one shared copy", a, b, behindA, behindB)
	}

	// The slow stream stops reading; the fast one keeps up with far more than
	// the feed holds.
	for seq := int64(3); seq < 3+2*streamBuffer; seq++ {
		h.publish([]feedFrame{frame(seq)})
		got, _, behind := h.pending(fast, nil)
		if behind || len(got) != 1 || got[0].seq != seq {
			t.Fatalf("the fast stream read %v (behind %v) after publishing %d", got, behind, seq)
		}
	}
	if _, _, behind := h.pending(slow, nil); !behind {
		t.Fatal("a stream 2048 frames behind was not told it fell behind")
	}
	if got := h.position(); got != 2+2*streamBuffer {
		t.Fatalf("the hub's position is %d, want %d", got, 2+2*streamBuffer)
	}
	// A stream opened now starts at the feed's end.
	late := open()
	if got, _, behind := h.pending(late, nil); behind || len(got) != 0 {
		t.Fatalf("a new stream read %v (behind %v), want nothing yet", got, behind)
	}

	// With many streams open, wakes are spaced out, never lost: a frame
	// published right after a wake still wakes its readers, a gap later.
	h.streamsNow.Add(1_000_000) // as if a million streams: the longest gap
	h.publish([]feedFrame{frame(5000)})
	_, throttled, _ := h.pending(late, nil)
	h.publish([]feedFrame{frame(5001)})
	select {
	case <-throttled:
	case <-time.After(5 * time.Second):
		t.Fatal("a throttled wake never came")
	}
	if got, _, _ := h.pending(late, nil); len(got) != 1 || got[0].seq != 5001 {
		t.Fatalf("after the throttled wake the stream read %v, want frame 5001", got)
	}
	h.streamsNow.Add(-1_000_000)
	for _, s := range []*sseStream{fast, slow, late} {
		h.release(s)
	}
}

// With no stream open the hub reads no event: a wake-up or a tick only moves
// its cursor to where delivery stands. A stream opened then starts there, and
// the hub reads the events after it for that stream.
func TestSSEHubReadsNoEventWithNoStreamOpen(t *testing.T) {
	f := newOutboxFixture(t)
	f.writeEvents(t, 3)
	p := f.poller(t, "p")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer p.Stop(context.Background())
	f.waitDelivered(t, 3, 10*time.Second) // delivered and numbered
	_, seqs := f.deliveredInOrder(t)

	h := newSSEHub(sseHubDeps{db: f.db, cfg: defaultConfig().SSE, poll: time.Second, log: newLogger(io.Discard, "json"),
		metrics: newSSEMetrics(prometheus.NewRegistry()), onPanic: func(component, any) {}})
	h.catchUp(context.Background(), seqs[0]) // a poller's wake-up
	if h.position() != seqs[0] || h.written != 0 {
		t.Fatalf("after a wake-up with no stream: cursor %d, %d events read; want %d and none", h.position(), h.written, seqs[0])
	}
	h.catchUp(context.Background(), 0) // the tick
	if h.position() != seqs[2] || h.written != 0 {
		t.Fatalf("after a tick with no stream: cursor %d, %d events read; want %d and none", h.position(), h.written, seqs[2])
	}

	s, from, err := h.open(context.Background(), "127.0.0.1", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer h.release(s)
	if from != seqs[2] {
		t.Fatalf("a stream opened at %d, want where delivery stands (%d)", from, seqs[2])
	}
	f.writeEvents(t, 2)
	f.waitDelivered(t, 5, 10*time.Second)
	_, seqs = f.deliveredInOrder(t)
	h.catchUp(context.Background(), seqs[4])
	if got, _, _ := h.pending(s, nil); len(got) != 2 || got[0].seq != seqs[3] || got[1].seq != seqs[4] {
		t.Fatalf("the open stream read %v, want the events numbered %v", got, seqs[3:])
	}
}
