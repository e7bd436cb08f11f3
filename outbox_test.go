package main

import (
	"context"
	"encoding/json"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// outboxFixture is a migrated database, a Redis server and what a poller needs.
type outboxFixture struct {
	db    *pgxpool.Pool
	redis *testRedisServer
	rdb   *redis.Client
	cfg   outboxConfig
}

func newOutboxFixture(t testing.TB) *outboxFixture {
	t.Helper()
	db := testPool(t)
	mg, err := newMigrator(db)
	if err != nil {
		t.Fatal(err)
	}
	if err := mg.up(context.Background()); err != nil {
		t.Fatal(err)
	}
	mg.Close()
	srv := testRedis(t)
	opts, _ := redis.ParseURL(srv.URL)
	opts.MaxRetries = -1 // fail fast while the test stops the server
	opts.ContextTimeoutEnabled = true
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { rdb.Close() })
	return &outboxFixture{db: db, redis: srv, rdb: rdb,
		cfg: outboxConfig{BatchSize: 50, PollInterval: 50 * time.Millisecond, Listen: true, MaxAttempts: 10, RetryBase: 20 * time.Millisecond, RetryMax: time.Second}}
}

func (f *outboxFixture) poller(t testing.TB, name string) *outboxPoller {
	t.Helper()
	m := newMetrics()
	rd := newReadiness(readyLifecycle(t), m, time.Second, time.Millisecond)
	beat := newHeartbeats(f.rdb, name, 10*time.Second, m, rd).RegisterHeartbeat("outbox", "outboxPoller")
	p := newOutboxPoller(f.db, f.rdb, f.cfg, beat, time.Second, nil, newLogger(io.Discard, "json"), m,
		func(r any) { t.Errorf("poller panicked: %v", r) })
	t.Cleanup(func() { p.Stop(context.Background()) })
	return p
}

// writeEvents commits n events, as n business transactions would.
func (f *outboxFixture) writeEvents(t testing.TB, n int) []int64 {
	t.Helper()
	var ids []int64
	err := pgx.BeginFunc(context.Background(), f.db, func(tx pgx.Tx) error {
		for i := range n {
			id, err := writeOutboxEvent(context.Background(), tx, "test", itoa(int64(i)), "test.happened", map[string]int{"n": i})
			if err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// subscribe collects the events published on Redis.
func (f *outboxFixture) subscribe(t *testing.T) func() []outboxEvent {
	t.Helper()
	sub := f.rdb.Subscribe(context.Background(), eventsChannel)
	if _, err := sub.Receive(context.Background()); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []outboxEvent
	go func() {
		for msg := range sub.Channel() {
			var e outboxEvent
			json.Unmarshal([]byte(msg.Payload), &e)
			mu.Lock()
			got = append(got, e)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() { sub.Close() })
	return func() []outboxEvent {
		mu.Lock()
		defer mu.Unlock()
		return append([]outboxEvent(nil), got...)
	}
}

func (f *outboxFixture) waitDelivered(t testing.TB, want int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var n int
		f.db.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE delivered_at IS NOT NULL`).Scan(&n)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events delivered after %s", n, want, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestOutboxDeliversInOrderOnce(t *testing.T) {
	f := newOutboxFixture(t)
	published := f.subscribe(t)
	ids := f.writeEvents(t, 120) // more than two batches
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.waitDelivered(t, len(ids), 5*time.Second)

	got := published()
	if len(got) != len(ids) {
		t.Fatalf("published %d events, want %d", len(got), len(ids))
	}
	for i, e := range got {
		if e.ID != ids[i] || (i > 0 && e.Seq != got[i-1].Seq+1) {
			t.Fatalf("event %d: id %d seq %d, want id %d in sequence", i, e.ID, e.Seq, ids[i])
		}
	}
	// A NOTIFY wakes the idle poller: a new event is delivered well before the poll.
	f.cfg.PollInterval = time.Hour
	q := f.poller(t, "b")
	p.Stop(context.Background())
	if err := q.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // let the listener connect
	f.writeEvents(t, 1)
	f.waitDelivered(t, len(ids)+1, 2*time.Second)
}

// Redis down during delivery: the row is retried with growing backoff, never
// lost, and delivered once Redis is back.
func TestOutboxRetriesWhileRedisIsDown(t *testing.T) {
	f := newOutboxFixture(t)
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.redis.Stop()
	f.writeEvents(t, 1)

	// Record the retry schedule: each attempt waits longer than the one before.
	var gaps []time.Duration
	deadline := time.Now().Add(10 * time.Second)
	for len(gaps) < 4 && time.Now().Before(deadline) {
		var attempts int
		var lastErr string
		var gap time.Duration
		f.db.QueryRow(context.Background(), `SELECT attempts, coalesce(last_error, ''), next_attempt_at - now() FROM outbox_events`).Scan(&attempts, &lastErr, &gap)
		if attempts > len(gaps) && lastErr != "" {
			gaps = append(gaps, gap)
		}
		time.Sleep(2 * time.Millisecond)
	}
	if len(gaps) < 4 {
		t.Fatalf("only %d delivery attempts while Redis was down", len(gaps))
	}
	for i := 1; i < len(gaps); i++ {
		if gaps[i] <= gaps[i-1] {
			t.Errorf("backoff did not grow: %v", gaps)
		}
	}

	f.redis.Start()
	f.waitDelivered(t, 1, 5*time.Second)
}

func TestOutboxGivesUpAfterMaxAttempts(t *testing.T) {
	f := newOutboxFixture(t)
	f.cfg.MaxAttempts = 2
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.redis.Stop()
	f.writeEvents(t, 1)
	deadline := time.Now().Add(5 * time.Second)
	for {
		var attempts int
		var dead bool
		f.db.QueryRow(context.Background(), `SELECT attempts, dead_at IS NOT NULL FROM outbox_events`).Scan(&attempts, &dead)
		if dead {
			if attempts != 2 {
				t.Fatalf("dead after %d attempts, want 2", attempts)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("event never marked dead")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Several pollers (several instances) deliver every event exactly once, and
// the delivery sequence has no duplicates.
func TestOutboxConcurrentPollersDeliverEachEventOnce(t *testing.T) {
	f := newOutboxFixture(t)
	published := f.subscribe(t)
	for _, name := range []string{"a", "b", "c"} {
		if err := f.poller(t, name).Start(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() { f.writeEvents(t, 50) })
	}
	wg.Wait()
	f.waitDelivered(t, 500, 10*time.Second)
	time.Sleep(50 * time.Millisecond)
	seen, seqs := map[int64]int{}, map[int64]bool{}
	for _, e := range published() {
		seen[e.ID]++
		if seqs[e.Seq] {
			t.Fatalf("delivery_seq %d used twice", e.Seq)
		}
		seqs[e.Seq] = true
	}
	for id, n := range seen {
		if n != 1 {
			t.Errorf("event %d published %d times", id, n)
		}
	}
	if len(seen) != 500 {
		t.Fatalf("%d distinct events published, want 500", len(seen))
	}
}

func TestOutboxPollerStartStop(t *testing.T) {
	f := newOutboxFixture(t)
	p := f.poller(t, "a")
	if err := p.Stop(context.Background()); err != nil {
		t.Fatalf("stop without start: %v", err)
	}
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := p.Start(context.Background()); err == nil {
		t.Fatal("second start succeeded")
	}
	f.writeEvents(t, 500) // stop under load
	if err := p.Stop(context.Background()); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := p.Stop(context.Background()); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	// Whatever the stopped poller did not deliver is still pending, not lost.
	var delivered, pending int
	f.db.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE delivered_at IS NOT NULL), count(*) FILTER (WHERE delivered_at IS NULL AND dead_at IS NULL) FROM outbox_events`).Scan(&delivered, &pending)
	if delivered+pending != 500 {
		t.Fatalf("%d delivered + %d pending of 500", delivered, pending)
	}
}

// A hard stop (its budget over, Redis hanging mid-batch) rolls the batch back:
// the events stay pending for the next poller.
func TestOutboxHardStopKeepsTheBatchDurable(t *testing.T) {
	f := newOutboxFixture(t)
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.redis.Pause()
	defer f.redis.Resume()
	f.writeEvents(t, 10)
	time.Sleep(100 * time.Millisecond) // the poller is now blocked publishing
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := p.Stop(ctx); err == nil {
		t.Fatal("a stop past its budget reported success")
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("Stop with a 100ms budget took %s", took)
	}
	var pending int
	f.db.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL AND attempts = 0`).Scan(&pending)
	if pending != 10 {
		t.Fatalf("%d of 10 events still pending untouched after a hard stop", pending)
	}
}
