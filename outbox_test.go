package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
)

// outboxFixture is a migrated database, a Redis server and what a poller needs.
type outboxFixture struct {
	db    *pgxpool.Pool
	redis *testRedisServer
	rdb   *redis.Client
	cfg   outboxConfig
	// alsoInTx stands in for the jobs insert of the delivery transaction.
	alsoInTx func(context.Context, pgx.Tx, []outboxEvent) error
	// beatEvery is the pollers' heartbeat interval (1 s unless set).
	beatEvery time.Duration
}

func newOutboxFixture(t testing.TB) *outboxFixture {
	t.Helper()
	db := testPool(t)
	mg, err := newMigrator(db, time.Minute)
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
	return f.pollerOn(t, name, f.db)
}

// instance is a poller with a pool of its own, as another instance has.
func (f *outboxFixture) instance(t testing.TB, name string) *outboxPoller {
	t.Helper()
	return f.instanceAt(t, name, f.db.Config().ConnString())
}

// instanceAt is an instance that reaches Postgres at conn (a proxy, say).
func (f *outboxFixture) instanceAt(t testing.TB, name, conn string) *outboxPoller {
	t.Helper()
	db, err := pgxpool.New(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return f.pollerOn(t, name, db)
}

func (f *outboxFixture) pollerOn(t testing.TB, name string, db *pgxpool.Pool) *outboxPoller {
	t.Helper()
	m := newMetrics()
	rd := testReadiness(t, readyLifecycle(t), m, time.Second, time.Hour)
	beat := newHeartbeats(f.rdb, name, 10*time.Second, time.Second, newHeartbeatMetrics(m.registry, blockComponents()), rd).RegisterHeartbeat(componentOutboxPoller)
	p := newOutboxPoller(outboxPollerDeps{db: db, redis: f.rdb, cfg: f.cfg, beat: beat, beatEvery: cmp.Or(f.beatEvery, time.Second),
		instanceID: name, memberTTL: 10 * time.Second, redisCall: time.Second,
		insertJobs: f.alsoInTx, log: newLogger(io.Discard, "json"), metrics: newOutboxMetrics(m.registry),
		onPanic: func(_ component, r any) { t.Errorf("poller panicked: %v", r) }})
	t.Cleanup(func() { p.Stop(context.Background()) })
	return p
}

// countJobInserts makes the delivery transaction count, per event, how often
// it inserted the event's jobs — also in transactions that later rolled back,
// which is stricter than counting commits. It returns a reader of the counts.
func (f *outboxFixture) countJobInserts() func() map[int64]int {
	var mu sync.Mutex
	counts := map[int64]int{}
	f.alsoInTx = func(_ context.Context, _ pgx.Tx, events []outboxEvent) error {
		mu.Lock()
		defer mu.Unlock()
		for _, e := range events {
			counts[e.ID]++
		}
		return nil
	}
	return func() map[int64]int {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(counts)
	}
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

// waitDelivered waits until want events are numbered, as the streams see
// them. Counting them reads every numbered row, which with a large backlog
// costs Postgres more than delivering does: it counts only once nothing is
// left to deliver or number (two probes of the small partial indexes), or
// once a second while events retry.
func (f *outboxFixture) waitDelivered(t testing.TB, want int, timeout time.Duration) {
	t.Helper()
	ctx := context.Background()
	var lastCount time.Time
	n := -1
	if !poll(timeout, 10*time.Millisecond, func() bool {
		var outstanding bool
		f.db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL)
			OR EXISTS (SELECT 1 FROM outbox_events WHERE delivery_seq IS NULL AND delivered_at IS NOT NULL)`).Scan(&outstanding)
		if !outstanding || time.Since(lastCount) > time.Second {
			f.db.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE delivery_seq IS NOT NULL`).Scan(&n)
			lastCount = time.Now()
		}
		return n == want
	}) {
		t.Fatalf("%d of %d events delivered after %s", n, want, timeout)
	}
}

// deliveredInOrder reads the delivered events' ids in delivery order.
func (f *outboxFixture) deliveredInOrder(t testing.TB) (ids, seqs []int64) {
	t.Helper()
	rows, err := f.db.Query(context.Background(), `SELECT id, delivery_seq FROM outbox_events WHERE delivered_at IS NOT NULL ORDER BY delivery_seq`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, seq int64
		rows.Scan(&id, &seq)
		ids, seqs = append(ids, id), append(seqs, seq)
	}
	return ids, seqs
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

	got, seqs := f.deliveredInOrder(t)
	for i := range got {
		if got[i] != ids[i] || (i > 0 && seqs[i] != seqs[i-1]+1) {
			t.Fatalf("event %d: id %d seq %d, want id %d in sequence", i, got[i], seqs[i], ids[i])
		}
	}
	// The hubs were woken with the newest delivered event, whole.
	waitFor(t, 2*time.Second, "a wake-up carrying the last event", func() bool {
		w := published()
		if len(w) == 0 {
			return false
		}
		last := w[len(w)-1]
		return last.ID == ids[len(ids)-1] && last.Seq == seqs[len(seqs)-1] && last.Type == "test.happened" &&
			last.AggregateID == itoa(int64(len(ids)-1)) && string(last.Payload) == fmt.Sprintf(`{"n":%d}`, len(ids)-1)
	})
	// A NOTIFY wakes the idle poller: a new event is delivered well before the poll.
	f.cfg.PollInterval = time.Hour
	q := f.poller(t, "b")
	p.Stop(context.Background())
	listeners := func() (pids []int32) {
		rows, err := f.db.Query(context.Background(), `SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'idle' AND query ILIKE 'listen %'`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var pid int32
			rows.Scan(&pid)
			pids = append(pids, pid)
		}
		return pids
	}
	old := listeners() // the stopped poller's, if its session has not ended yet
	if err := q.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the new poller's LISTEN", func() bool {
		return slices.ContainsFunc(listeners(), func(pid int32) bool { return !slices.Contains(old, pid) })
	})
	f.writeEvents(t, 1)
	f.waitDelivered(t, len(ids)+1, 2*time.Second)
}

// Redis is a wake-up, not a gate: with Redis down, events are delivered (with
// their delivery_seq and their jobs, once each), and no attempt is spent.
func TestOutboxDeliversWhileRedisIsDown(t *testing.T) {
	f := newOutboxFixture(t)
	jobInserts := f.countJobInserts()
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.redis.Stop()
	ids := f.writeEvents(t, 30)
	f.waitDelivered(t, len(ids), 5*time.Second)
	var attempts, noSeq int
	f.db.QueryRow(context.Background(), `SELECT coalesce(sum(attempts), 0), count(*) FILTER (WHERE delivery_seq IS NULL) FROM outbox_events`).Scan(&attempts, &noSeq)
	if attempts != 0 || noSeq != 0 {
		t.Errorf("with Redis down: %d attempts spent, %d delivered events without a delivery_seq", attempts, noSeq)
	}
	f.redis.Start()
	f.writeEvents(t, 1)
	f.waitDelivered(t, len(ids)+1, 5*time.Second)
	jobs := jobInserts()
	for _, id := range ids {
		if jobs[id] != 1 {
			t.Errorf("event %d: jobs inserted %d times", id, jobs[id])
		}
	}
}

// A poison event (its jobs cannot be inserted) is retried with a growing
// backoff, then dead with its last_error; the events beside it and behind it
// are delivered meanwhile.
func TestOutboxPoisonEventDiesAlone(t *testing.T) {
	f := newOutboxFixture(t)
	f.cfg.MaxAttempts = 4
	f.alsoInTx = func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error {
		for _, e := range events {
			if e.AggregateID == "3" {
				// A real statement error, so the savepoint has something to undo.
				_, err := tx.Exec(ctx, `SELECT 1/0`)
				return err
			}
		}
		return nil
	}
	ids := f.writeEvents(t, 10) // aggregate ids 0..9: the fourth is poison
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.waitDelivered(t, 9, 5*time.Second)
	waitFor(t, 5*time.Second, "the poison event to die", func() bool {
		var dead bool
		f.db.QueryRow(context.Background(), `SELECT dead_at IS NOT NULL FROM outbox_events WHERE id = $1`, ids[3]).Scan(&dead)
		return dead
	})
	var attempts int
	var lastErr string
	var seq *int64
	f.db.QueryRow(context.Background(), `SELECT attempts, coalesce(last_error, ''), delivery_seq FROM outbox_events WHERE id = $1`, ids[3]).Scan(&attempts, &lastErr, &seq)
	if attempts != 4 || !strings.Contains(lastErr, "division by zero") || seq != nil {
		t.Errorf("poison event: %d attempts, last_error %q, delivery_seq %v; want 4, the cause, none", attempts, lastErr, seq)
	}
	more := f.writeEvents(t, 2) // behind a dead event, delivery goes on
	f.waitDelivered(t, 11, 5*time.Second)
	got, _ := f.deliveredInOrder(t)
	if got[len(got)-1] != more[1] {
		t.Errorf("delivered %v, want the later events too", got)
	}
}

// Several pollers (several instances) deliver every event exactly once, and
// the delivery sequence has no duplicates.
func TestOutboxConcurrentPollersDeliverEachEventOnce(t *testing.T) {
	f := newOutboxFixture(t)
	jobInserts := f.countJobInserts()
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
	jobs := jobInserts()
	for id, n := range jobs {
		if n != 1 {
			t.Errorf("event %d: jobs inserted %d times", id, n)
		}
	}
	if len(jobs) != 500 {
		t.Fatalf("jobs inserted for %d distinct events, want 500", len(jobs))
	}
	_, seqs := f.deliveredInOrder(t)
	for i := 1; i < len(seqs); i++ {
		if seqs[i] == seqs[i-1] {
			t.Fatalf("delivery_seq %d used twice", seqs[i])
		}
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
	if err := p.Start(context.Background()); err != nil {
		t.Fatalf("second start: %v", err) // a no-op while it runs
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

// A hard stop (its budget over, the jobs insert hanging mid-batch) rolls the
// batch back: the events stay pending, no attempt spent, for the next poller.
func TestOutboxHardStopKeepsTheBatchDurable(t *testing.T) {
	f := newOutboxFixture(t)
	hanging := make(chan struct{}, 1)
	f.alsoInTx = func(ctx context.Context, _ pgx.Tx, _ []outboxEvent) error {
		select {
		case hanging <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	}
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.writeEvents(t, 10)
	<-hanging // the poller holds the batch
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

// Any failure counts as an attempt, not only one event's: here the delivery's
// connection dies mid-batch. The attempt is recorded in a transaction of its
// own, and the event is delivered on the next one.
func TestOutboxBrokenTransactionCountsAsAnAttempt(t *testing.T) {
	f := newOutboxFixture(t)
	var once sync.Once
	f.alsoInTx = func(ctx context.Context, tx pgx.Tx, _ []outboxEvent) error {
		var err error
		once.Do(func() { _, err = tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`) })
		return err
	}
	f.writeEvents(t, 1)
	p := f.poller(t, "a")
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.waitDelivered(t, 1, 5*time.Second)
	var attempts int
	var lastErr *string
	f.db.QueryRow(context.Background(), `SELECT attempts, last_error FROM outbox_events`).Scan(&attempts, &lastErr)
	if attempts != 1 || lastErr != nil {
		t.Errorf("delivered after %d attempts (last_error %v), want 1 failed attempt recorded, then cleared", attempts, lastErr)
	}
}

// Every partition has exactly one owner among the members, the shares differ
// by at most one partition, and a poller missing from the list still counts
// itself (it delivers until it stops).
func TestOutboxSharesCoverEveryPartitionOnce(t *testing.T) {
	for _, members := range [][]string{{"a"}, {"b", "a"}, {"c", "a", "b"}, {"d", "b", "a", "c"}} {
		owners := map[int32][]string{}
		sizes := map[int]bool{}
		for _, m := range members {
			share := shareOf(m, members, false)
			sizes[len(share)] = true
			for _, p := range share {
				owners[p] = append(owners[p], m)
			}
		}
		for p := range int32(outboxPartitions) {
			if len(owners[p]) != 1 {
				t.Errorf("members %v: partition %d owned by %v", members, p, owners[p])
			}
		}
		if len(sizes) > 2 {
			t.Errorf("members %v: share sizes %v", members, sizes)
		}
	}
	if got := shareOf("z", []string{"a"}, false); len(got) != outboxPartitions/2 || got[0] != 1 {
		t.Errorf("a poller missing from the list: share %v, want the odd partitions", got)
	}
	if got := shareOf("z", []string{"a", "b"}, true); len(got) != outboxPartitions {
		t.Errorf("every partition when the members are unknown: %v", got)
	}
}

// The claim's partition expression is the one the outbox_partitioned_delivery
// migration indexes (the planner matches it as text) and cuts
// outboxPartitions partitions. The migration is found by its name: a copy
// made without the demo numbers it differently.
// The pending gauge counts at most outboxPendingCountMax events: every
// poller counts once a beat, and a count of a whole backlog would cost what
// the backlog holds.
func TestOutboxPendingCountIsBounded(t *testing.T) {
	f := newOutboxFixture(t)
	p := f.poller(t, "counter")
	f.writeEvents(t, 3)
	if err := p.updatePending(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(p.metrics.pending); got != 3 {
		t.Errorf("3 pending events read %v", got)
	}
	if _, err := f.db.Exec(context.Background(), `INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'test', g::text, 'test.happened', '{}' FROM generate_series(1, $1) AS g`, outboxPendingCountMax); err != nil {
		t.Fatal(err)
	}
	if err := p.updatePending(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(p.metrics.pending); got != outboxPendingCountMax {
		t.Errorf("%d pending events read %v; want the bound, %d", outboxPendingCountMax+3, got, outboxPendingCountMax)
	}
}

func TestOutboxPartitionExpressionIsIndexed(t *testing.T) {
	names, err := fs.Glob(migrationFiles, "migrations/*_outbox_partitioned_delivery.up.sql")
	if err != nil || len(names) != 1 {
		t.Fatalf("the outbox_partitioned_delivery migration: %v, %v", names, err)
	}
	up, err := migrationFiles.ReadFile(names[0])
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(up), "("+outboxPartitionExpr+", id)") {
		t.Errorf("%s does not index %s", names[0], outboxPartitionExpr)
	}
	if !strings.HasSuffix(outboxPartitionExpr, "% "+strconv.Itoa(outboxPartitions)+")") {
		t.Errorf("%s does not cut %d partitions", outboxPartitionExpr, outboxPartitions)
	}
}

// A sequencer step that finds the delivery lock taken numbers nothing and
// waits outside Postgres: a step queued inside Postgres would hold a snapshot
// all the while, and every delivered row's cleanup with it. The sequencer
// retries until the lock is free, for one poll interval at most.
func TestOutboxSequencerStepsAsideWhileTheLockIsTaken(t *testing.T) {
	ctx := context.Background()
	f := newOutboxFixture(t)
	ids := f.writeEvents(t, 3)
	if _, err := f.db.Exec(ctx, `UPDATE outbox_events SET delivered_at = now() WHERE id = ANY ($1)`, ids); err != nil {
		t.Fatal(err)
	}
	holder, err := f.db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, outboxDeliveryLock); err != nil {
		t.Fatal(err)
	}

	n, _, locked, err := sequenceStep(ctx, f.db, sequencerBatch)
	if err != nil || locked || n != 0 {
		t.Fatalf("step while the lock is taken: numbered %d, locked %v, err %v; want 0, false, nil", n, locked, err)
	}
	var waiting int
	f.db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`).Scan(&waiting)
	if waiting != 0 {
		t.Fatalf("%d sessions wait for a lock in Postgres after the step returned", waiting)
	}

	sequence := func(p *outboxPoller) <-chan struct{} {
		done := make(chan struct{})
		go func() { defer close(done); p.sequenceDelivered(ctx) }()
		return done
	}
	// A lock that stays taken: the sequencer gives up after a poll interval
	// and leaves the events to the next poll's step.
	f.cfg.PollInterval = 100 * time.Millisecond
	select {
	case <-sequence(f.poller(t, "short")):
	case <-time.After(10 * time.Second):
		t.Fatal("the sequencer still waits for the lock 10s on, with a 100ms poll interval")
	}
	var numbered int
	f.db.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE delivery_seq IS NOT NULL`).Scan(&numbered)
	if numbered != 0 {
		t.Fatalf("%d events numbered while another step held the lock", numbered)
	}

	// A lock that is freed within the poll interval: the retrying sequencer
	// numbers the events.
	f.cfg.PollInterval = time.Minute
	done := sequence(f.poller(t, "long"))
	select {
	case <-done:
		t.Fatal("the sequencer returned while the lock was taken, within its poll interval")
	case <-time.After(50 * time.Millisecond): // it retries meanwhile; any point is fine to release
	}
	holder.Rollback(ctx)
	<-done
	if got, _ := f.deliveredInOrder(t); !slices.Equal(got, ids) {
		t.Fatalf("numbered after the lock was freed: %v, want %v", got, ids)
	}
}

// A beat that Redis does not answer is the beat's only Redis call: joining
// the pollers too would wait out a second deadline, and a loop that is only
// waiting on a frozen Redis must go on beating often enough not to look
// stuck (the fleet test saw readiness 503 through a frozen Redis when it did).
func TestOutboxBeatWithoutRedisSkipsTheJoin(t *testing.T) {
	f := newOutboxFixture(t)
	p := f.poller(t, "a")
	sent := &scriptCalls{}
	f.rdb.AddHook(sent)

	p.beatNow(context.Background())
	if n := sent.count(joinScript); n != 1 {
		t.Fatalf("with Redis up, a beat joined the pollers %d times, want 1", n)
	}
	f.redis.Pause()
	t.Cleanup(f.redis.Resume)
	p.beatNow(context.Background())
	if n := sent.count(beatScript); n != 2 {
		t.Fatalf("the heartbeat was sent %d times in two beats, want 2", n)
	}
	if n := sent.count(joinScript); n != 1 {
		t.Errorf("a beat that Redis did not answer still joined the pollers (%d joins in two beats, want 1)", n)
	}
}

// scriptCalls is a go-redis hook that counts the scripts sent, by hash.
type scriptCalls struct {
	mu   sync.Mutex
	sent map[string]int
}

func (s *scriptCalls) count(script *redis.Script) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sent[script.Hash()]
}

func (s *scriptCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (s *scriptCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if args := cmd.Args(); len(args) > 1 && (cmd.Name() == "evalsha" || cmd.Name() == "evalsha_ro") {
			s.mu.Lock()
			if s.sent == nil {
				s.sent = map[string]int{}
			}
			s.sent[fmt.Sprint(args[1])]++
			s.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (s *scriptCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A poller goroutine that outlives the hard stop's grace (the machine was
// too busy to schedule it) loses nothing: a delivery commits or rolls back
// whole. The step fails best effort, so the exit code stays 0.
func TestOutboxStopOutlivedIsBestEffort(t *testing.T) {
	p := &outboxPoller{startStop: newStartStop(componentOutboxPoller, stopSoft, nil)}
	release := make(chan struct{})
	if err := p.start(context.Background(), nil, func(context.Context) { <-release }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	err := p.stopLosingNothing(ctx)
	close(release)
	var bestEffort *bestEffortError
	if !errors.As(err, &bestEffort) || !errors.Is(err, errStillRunning) {
		t.Fatalf("the stop of a poller whose goroutine ignores it: %v; want a best-effort error naming what still runs", err)
	}
}
