package main

// The crash matrix (issue 32): one instance, the victim, is SIGKILLed at each
// point of its life — inside each of the 16 boot phases, and inside each step
// of the drain from the readiness flip to the last release hook — while a
// second instance, the survivor, serves on the same PostgreSQL, Redis and S3
// and a client posts orders to both. After each kill:
//
//   - the victim's next boot (same id, same config: a restart in place)
//     reaches ready;
//   - schema_migrations is clean, right after the kill and at the latest
//     version after the next boot;
//   - every Idempotency-Key marker the dead victim left expires within its
//     lease, and every request it left unanswered is served by the survivor
//     within a few seconds: no stuck key;
//   - the leader lock, if the victim held it, expires within its TTL;
//   - every outbox event is delivered exactly once per consumer: one
//     order in one indexOrder and one writeReceipt job, the survivor's event
//     stream has every event once in delivery order, and so has a stream
//     that was open on the victim and resumed on the survivor with
//     Last-Event-ID; no cron tick is enqueued twice.
//
// A point is found by the JSON line that announces it: a phase begins when the
// one before it logs its end (phase=<name>), a drain step when the step before
// it logs (step=<name>; the hooks run newest first), the linger when the
// readiness step has logged. The kill follows as soon as the test has read
// the line. Some phases and hooks end before that (config's last line is its
// end line; featureRegister, the hub's and the search client's stop take
// microseconds): those are killed right after their start line, that is just
// after they ended — each subtest logs where its kill landed, and the summary
// counts them. Two points are held open so the kill lands inside them: the
// migrations on a fresh database (the kill waits for the first committed
// version) and the in-flight wait (a request waits on a row lock the test
// holds).
//
// The survivor does not take part in the leader election
// (KUMIKO_LEADER_ENABLED=false), so the victim is the only candidate: each
// drain point waits for it to lead, and every kill before its leaderElection
// hook leaves a lock that must expire by itself.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// crashBootPhases are boot.go's phases in order; the survivor's boot is held to it.
var crashBootPhases = []string{"config", "observability", "secrets", "runtimeChecks", "featureRegister",
	"bootValidation", "dbConnect", "schemaBaseline", "migrationsCheck", "redisConnect", "searchAdapter",
	"fileStorage", "outboxPoller", "jobsWorker", "apiListener", "ready"}

// crashDrainSteps are shutdown.go's drain steps up to the last release hook;
// the hooks run newest first. A clean drain of the victim is held to it.
var crashDrainSteps = []string{"readiness", "linger", "closeListener", "sseClose", "inFlight",
	"readinessChecks", "sseHub", "leaderElection", "jobsBacklog", "jobsHeartbeat", "outboxPoller", "jobsWorker",
	"storage", "search", "heartbeats", "clusterStatus", "redis", "db"}

const (
	crashVictim    = "victim"
	crashSurvivor  = "survivor"
	crashLeaderTTL = time.Second
	// What a loaded machine may add to a deadline the service keeps: the
	// test's own polling and one request, not a second lease.
	crashSlack = 3 * time.Second
)

// killPoint is one moment of the victim's life.
type killPoint struct {
	name     string
	at       string         // the phase or drain step
	drain    bool           // reached by SIGTERM of a ready victim; else by a boot
	fresh    bool           // the boot meets a database nothing has migrated yet
	announce map[string]any // the line that says the point has begun
	ended    map[string]any // the line the point logs when it ends: seen before the kill, the kill came after it
}

func crashPoints() (boot, drain []killPoint) {
	for i, ph := range crashBootPhases {
		// Phase 1 has no phase before it: its own config line, logged inside it.
		announce := map[string]any{"component": "config", "msg": "config"}
		if i > 0 {
			announce = map[string]any{"msg": "lifecycle", "phase": crashBootPhases[i-1]}
		}
		boot = append(boot, killPoint{name: fmt.Sprintf("boot-%02d-%s", i+1, ph), at: ph, announce: announce,
			ended: map[string]any{"msg": "lifecycle", "phase": ph}})
	}
	for i, step := range crashDrainSteps {
		announce := map[string]any{"component": "lifecycle", "event": "shutdown_requested"}
		if i > 0 {
			announce = map[string]any{"msg": "lifecycle", "step": crashDrainSteps[i-1]}
		}
		kind := "drain"
		if i >= slices.Index(crashDrainSteps, "readinessChecks") {
			kind = "release"
		}
		drain = append(drain, killPoint{name: fmt.Sprintf("%s-%02d-%s", kind, i+1, step), at: step, drain: true, announce: announce,
			ended: map[string]any{"msg": "lifecycle", "step": step}})
	}
	return boot, drain
}

func TestCrashMatrix(t *testing.T) {
	t.Parallel()
	began := time.Now()
	m := newCrashMatrix(t)
	boot, drain := crashPoints()

	// Phase 9 has real work to cut only on a fresh database, so it goes
	// first, before the survivor has migrated anything; it runs again in
	// its place below, on an up-to-date schema.
	fresh := boot[slices.Index(crashBootPhases, "migrationsCheck")]
	fresh.name, fresh.fresh = fresh.name+"-fresh-database", true
	// Each point starts from what the one before it left: past a failure
	// there is nothing more to learn.
	if !t.Run(fresh.name, func(t *testing.T) { m.run(t, fresh) }) {
		return
	}
	for _, kp := range append(boot, drain...) {
		if !t.Run(kp.name, func(t *testing.T) { m.run(t, kp) }) {
			break
		}
	}
	m.load.halt()
	t.Run("final", func(t *testing.T) { m.checkSettled(t, nil) })

	count := func(s string) (n int) {
		for _, l := range m.landed {
			if strings.Contains(l, s) {
				n++
			}
		}
		return n
	}
	t.Logf("crash matrix: %d kill points in %s: %d killed inside their point, %d right after it ended, %d exited before the kill; %d orders, %d requests served by the survivor after the victim left them:\n%s",
		len(m.landed), time.Since(began).Round(time.Millisecond), count("inside"), count("after its end"), count("before the kill"),
		len(m.load.created), m.orphansServed, strings.Join(m.landed, "\n"))
}

// crashMatrix is what the kill points share: the servers, the survivor and
// its event stream, the client's load, and the ready victim a drain point
// starts from.
type crashMatrix struct {
	top      *testing.T
	env      map[string]string // the victim's
	dbURL    string
	pool     *pgxpool.Pool
	rdb      *redis.Client
	latest   int
	survivor *proc
	apiB     string
	watcher  *sseClient // on the survivor, from the first event on
	load     *crashLoad
	victim   *proc // ready: the previous point's next boot, or nil

	landed        []string // per point, where its kill landed
	orphansServed int
}

func newCrashMatrix(t *testing.T) *crashMatrix {
	env := fastEnv(t,
		"MEILI_URL="+newMeiliDouble(t, "available").srv.URL, // order.created → indexOrder
	)
	s3 := testS3(t) // order.created → writeReceipt
	env["S3_ENDPOINT"], env["S3_ACCESS_KEY"], env["S3_SECRET_KEY"], env["S3_BUCKET"] = s3.Endpoint, s3.AccessKey, s3.SecretKey, "receipts"
	env["KUMIKO_LEADER_LOCK_TTL"], env["KUMIKO_LEADER_RENEW_INTERVAL"] = crashLeaderTTL.String(), "250ms"
	// The next boot takes over the dead victim's entry among the pollers
	// (same id) at once. The TTL is also the age at which a poller's
	// heartbeat fails the boot's readiness: it beats between batches, and a
	// batch on a starved machine took over a second.
	env["KUMIKO_HEARTBEAT_TTL"], env["KUMIKO_HEARTBEAT_INTERVAL"] = "3s", "500ms"
	env["KUMIKO_OUTBOX_PURGE_CRON"] = "@every 1s" // a cron tick a second while the victim leads
	env["KUMIKO_JOBS_POLL_INTERVAL"] = "100ms"
	env["KUMIKO_INSTANCE_ID"] = crashVictim
	// The request held at the in-flight point must outlive the moment of
	// the kill (the default budget would answer it 503 in 500 ms).
	env["KUMIKO_HTTP_DEPENDENCY_TIMEOUT"] = "30s"
	m := &crashMatrix{top: t, env: env, dbURL: env["DATABASE_URL"], pool: sharedPool(t, env),
		rdb: redisClient(t, env["REDIS_URL"]), latest: shippedLatest(t)}
	return m
}

// startSurvivor boots the survivor, holds its boot to crashBootPhases and
// opens its event stream from the first event, and starts the load.
func (m *crashMatrix) startSurvivor(t *testing.T) {
	env := maps.Clone(m.env)
	env["KUMIKO_INSTANCE_ID"] = crashSurvivor
	env["KUMIKO_LEADER_ENABLED"] = "false"
	delete(env, "KUMIKO_HTTP_DEPENDENCY_TIMEOUT")
	m.survivor = startProc(m.top, env)
	m.survivor.t = t
	_, m.apiB = m.survivor.waitReady()
	var phases []string
	for _, l := range m.survivor.logsMatching(map[string]any{"msg": "lifecycle"}) {
		if ph, ok := l["phase"].(string); ok {
			phases = append(phases, ph)
		}
	}
	if !slices.Equal(phases, crashBootPhases) {
		t.Fatalf("the survivor booted through %v; the matrix kills in %v (boot.go changed: update crashBootPhases)", phases, crashBootPhases)
	}
	m.watcher = openSSEHeader(m.top, http.DefaultClient, m.apiB, "0")
	m.load = startCrashLoad(m.top, m.apiB)
}

// run brings the victim to kp, kills it there and checks what it left.
func (m *crashMatrix) run(t *testing.T, kp killPoint) {
	var v *proc
	var moved *resumed
	var held *heldRequest
	if kp.drain {
		if m.victim == nil {
			m.victim = m.nextBoot(t)
		}
		// The victim was started by the matrix, so that it outlived the
		// point that booted it; its failures go to the point that uses it.
		v, m.victim = m.victim, nil
		v.t = t
		// It is the only candidate: it leads, or will once the lock of the
		// victim before it has expired.
		v.waitLog(10*time.Second, map[string]any{"component": "leaderElection", "msg": "became leader"})
		moved = &resumed{head: m.headEvent(t)}
		moved.browser = openSSEHeader(t, http.DefaultClient, v.addr("api"), fmt.Sprint(moved.head))
		if kp.at == "inFlight" {
			held = m.holdRequest(t, v)
		}
		v.signal(syscall.SIGTERM)
	} else {
		m.retireVictim(t)
		v = startProc(t, m.env)
	}
	v.waitLog(30*time.Second, kp.announce)
	if kp.fresh {
		// The kill waits for the first committed version, so it cuts the
		// apply rather than the wait for its lock.
		waitFor(t, 30*time.Second, "the first migration to commit", func() bool {
			var version int64
			err := m.pool.QueryRow(context.Background(), `SELECT version FROM schema_migrations`).Scan(&version)
			return err == nil && version > 0
		})
	}
	// The last hooks may all end, and the process exit, before the kill
	// arrives: that is a clean exit, and it is said so.
	if err := v.cmd.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Fatal(err)
	}
	if m.load != nil {
		m.load.setVictim("")
	}
	code := v.wait(10 * time.Second)
	killed := time.Now()

	// Where the kill landed: a point whose end line is there had ended.
	where := "killed inside"
	switch {
	case code != -1:
		where = fmt.Sprintf("exited %d before the kill", code)
		if code != 0 || !kp.drain {
			t.Errorf("the victim exited %d by itself before the kill", code)
		}
	case len(v.logsMatching(kp.ended)) > 0:
		where = "killed after its end line"
	}
	version, dirty := schemaVersion(t, m.dbURL)
	if dirty {
		t.Errorf("schema_migrations is dirty at version %d right after the kill", version)
	}
	if kp.fresh {
		where += fmt.Sprintf(" (the schema at version %d of %d)", version, m.latest)
	}
	if kp.drain {
		steps := drainSteps(v)
		i := slices.Index(crashDrainSteps, kp.at)
		if n := min(len(steps), len(crashDrainSteps)); n < i || !slices.Equal(steps[:n], crashDrainSteps[:n]) {
			t.Errorf("the drain logged the steps %v before the kill; want %v first", steps, crashDrainSteps[:i])
		}
		lock, _ := m.rdb.Get(context.Background(), leaderKey).Result()
		if slices.Contains(steps, "leaderElection") && strings.HasPrefix(lock, crashVictim+":") {
			t.Errorf("the leaderElection hook logged its end, yet the victim's lock %q is still there", lock)
		}
	}
	m.landed = append(m.landed, fmt.Sprintf("  %-42s %s", kp.name, where))
	t.Logf("SIGKILL: %s", where)

	if m.survivor == nil {
		m.startSurvivor(t)
	}
	if held != nil {
		held.release(t, m.pool)
		m.load.addOrphan(held.key)
	}
	m.afterKill(t, killed)
	m.checkSettled(t, moved)
}

// resumed is a stream that was open on the victim when it died: its client
// resumes on the survivor with the last id it saw.
type resumed struct {
	browser *sseClient
	head    int64 // the stream asked for everything after this event
}

// afterKill checks what the dead victim left in Redis while its next boot
// runs: its leader lock expires within the TTL, its idempotency markers
// within the lease, and the survivor serves every request it left
// unanswered.
func (m *crashMatrix) afterKill(t *testing.T, killed time.Time) {
	ctx := context.Background()
	lock, _ := m.rdb.Get(ctx, leaderKey).Result()
	lockTTL, _ := m.rdb.PTTL(ctx, leaderKey).Result()
	victimsLock := strings.HasPrefix(lock, crashVictim+":")
	if victimsLock && (lockTTL < 0 || lockTTL > crashLeaderTTL) {
		t.Errorf("the dead victim's leader lock %q has a TTL of %s; want at most %s", lock, lockTTL, crashLeaderTTL)
	}
	// Every marker is a lease: none may outlive it, whoever set it.
	markers, _ := m.rdb.Keys(ctx, idempotencyKeyPrefix+"*").Result()
	var leases []string
	for _, key := range markers {
		ttl, err := m.rdb.PTTL(ctx, key).Result()
		if err == nil && ttl != -2 {
			leases = append(leases, fmt.Sprintf("%s %s", strings.TrimPrefix(key, idempotencyKeyPrefix), ttl.Round(time.Millisecond)))
		}
		if err == nil && (ttl == -1 || ttl > idempotencyLease) {
			t.Errorf("the idempotency marker %s has a TTL of %s; want at most the lease (%s)", key, ttl, idempotencyLease)
		}
	}
	if len(leases) > 0 {
		t.Logf("idempotency markers at the kill: %s", strings.Join(leases, ", "))
	}
	orphans := m.load.takeOrphans()

	var wg sync.WaitGroup
	var lockErr error
	var lockGone time.Duration
	if victimsLock {
		wg.Go(func() {
			_, lockErr = until(killed.Add(lockTTL+crashSlack), func() bool {
				v, _ := m.rdb.Get(ctx, leaderKey).Result()
				return v != lock
			})
			lockGone = time.Since(killed)
		})
	}
	var served []string
	var slowest time.Duration
	if len(orphans) > 0 {
		wg.Go(func() { served, slowest = m.serveOrphans(orphans, killed) })
	}
	m.victim = m.nextBoot(t)
	wg.Wait()

	if lockErr != nil {
		t.Errorf("the dead victim's leader lock %q (TTL %s at the kill) was still there %s after the kill", lock, lockTTL, lockGone.Round(time.Millisecond))
	} else if victimsLock {
		t.Logf("the dead victim's leader lock (TTL %s at the kill) gone %s after the kill", lockTTL, lockGone.Round(time.Millisecond))
	}
	for _, s := range served {
		if !strings.HasPrefix(s, "ok ") {
			t.Error(s)
		}
	}
	if len(orphans) > 0 {
		m.orphansServed += len(orphans)
		t.Logf("%d requests the victim left unanswered, each served by the survivor, the last %s after the kill", len(orphans), slowest.Round(time.Millisecond))
	}
}

// checkSettled is what holds once the victim is back: the schema is
// current, every event is delivered once per consumer, no tick came twice,
// and the client got no answer it should not have.
func (m *crashMatrix) checkSettled(t *testing.T, moved *resumed) {
	select {
	case <-m.survivor.exited:
		t.Fatalf("the survivor exited (code %d)", m.survivor.code)
	default:
	}
	if version, dirty := schemaVersion(t, m.dbURL); dirty || version != m.latest {
		t.Errorf("after the next boot the schema is at version %d, dirty %t; want %d, clean", version, dirty, m.latest)
	}
	m.checkDelivery(t, moved)
	assertNoDuplicateTicks(t, m.pool)
	if wrong := m.load.takeWrong(); len(wrong) > 0 {
		t.Errorf("the client got answers no client should get:\n%s", strings.Join(wrong, "\n"))
	}
}

// checkDelivery waits for every event written so far to be delivered, then
// holds each consumer to exactly once: the jobs, the survivor's stream, and
// the stream that moved from the victim to the survivor.
func (m *crashMatrix) checkDelivery(t *testing.T, moved *resumed) {
	ctx := context.Background()
	var upTo int64
	if err := m.pool.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM outbox_events`).Scan(&upTo); err != nil {
		t.Fatal(err)
	}
	var seen string
	if _, err := until(time.Now().Add(30*time.Second), func() bool {
		var pending, unnumbered, dead int
		m.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE delivered_at IS NULL AND dead_at IS NULL),
				count(*) FILTER (WHERE delivered_at IS NOT NULL AND delivery_seq IS NULL), count(*) FILTER (WHERE dead_at IS NOT NULL)
			FROM outbox_events WHERE id <= $1`, upTo).Scan(&pending, &unnumbered, &dead)
		seen = fmt.Sprintf("%d pending, %d delivered but not numbered, %d dead", pending, unnumbered, dead)
		return pending == 0 && unnumbered == 0
	}); err != nil {
		t.Fatalf("events up to id %d not all delivered within 30s: %s", upTo, seen)
	}
	var dead int
	m.pool.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE dead_at IS NOT NULL`).Scan(&dead)
	if dead > 0 {
		t.Errorf("%d events dead", dead)
	}

	// The jobs: one of each kind per order.created. Counted in two scans
	// and compared here: a join of the two fresh, unanalysed tables may be
	// planned as a nested loop, quadratic in the orders.
	rows, err := m.pool.Query(ctx, `SELECT order_id, kind, count(*) FROM river_job, jsonb_array_elements_text(args->'orderIds') AS order_id
		WHERE kind IN ('indexOrder', 'writeReceipt') GROUP BY 1, 2`)
	if err != nil {
		t.Fatal(err)
	}
	jobs := map[[2]string]int{} // order id, kind → jobs
	var order, kind string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&order, &kind, &n}, func() error { jobs[[2]string{order, kind}] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	rows, err = m.pool.Query(ctx, `SELECT id, aggregate_id FROM outbox_events WHERE event_type = $1 AND id <= $2 ORDER BY id`, eventOrderCreated, upTo)
	if err != nil {
		t.Fatal(err)
	}
	var event int64
	bad := 0
	if _, err := pgx.ForEachRow(rows, []any{&event, &order}, func() error {
		index, receipt := jobs[[2]string{order, "indexOrder"}], jobs[[2]string{order, "writeReceipt"}]
		if index != 1 || receipt != 1 {
			if bad++; bad <= 20 {
				t.Errorf("event %d (order %s): %d indexOrder and %d writeReceipt jobs; want one of each", event, order, index, receipt)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	// The table's delivery order, up to the last of these events.
	var seqMax int64
	m.pool.QueryRow(ctx, `SELECT coalesce(max(delivery_seq), 0) FROM outbox_events WHERE id <= $1`, upTo).Scan(&seqMax)
	delivered := func(afterID int64) []int64 {
		rows, _ := m.pool.Query(ctx, `SELECT id FROM outbox_events WHERE delivery_seq <= $1
			AND delivery_seq > coalesce((SELECT delivery_seq FROM outbox_events WHERE id = $2), 0) ORDER BY delivery_seq`, seqMax, afterID)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	if m.watcher != nil {
		want := delivered(0)
		holdStream(t, "the survivor's stream", want, func() []int64 { return frameIDs(m.watcher) })
	}
	if moved != nil && moved.browser != nil {
		onVictim := frameIDs(moved.browser)
		from := moved.head
		if len(onVictim) > 0 {
			from = onVictim[len(onVictim)-1]
		}
		again := openSSEHeader(t, http.DefaultClient, m.apiB, fmt.Sprint(from))
		want := delivered(moved.head)
		holdStream(t, fmt.Sprintf("the stream opened on the victim (%d events there, then resumed on the survivor)", len(onVictim)), want,
			func() []int64 { return append(slices.Clone(onVictim), frameIDs(again)...) })
		again.cancel()
	}
}

// holdStream waits until a stream has as many events as want, then holds it
// to want: the same ids, in delivery order, each once.
func holdStream(t *testing.T, name string, want []int64, got func() []int64) {
	t.Helper()
	if _, err := until(time.Now().Add(15*time.Second), func() bool { return len(got()) >= len(want) }); err != nil {
		ids := got()
		t.Errorf("%s has %d events after 15s, want %d\n got: %v\nwant: %v", name, len(ids), len(want), tail(ids), tail(want))
		return
	}
	if ids := got()[:len(want)]; !slices.Equal(ids, want) {
		t.Errorf("%s: want every delivered event once, in delivery order\n got: %v\nwant: %v", name, ids, want)
	}
}

func tail(ids []int64) []int64 { return ids[max(0, len(ids)-30):] }

// frameIDs is the ids of the events a stream received, in order.
func frameIDs(c *sseClient) []int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var ids []int64
	for _, f := range c.frames {
		if f.ID != 0 {
			ids = append(ids, f.ID)
		}
	}
	return ids
}

// headEvent is the event delivered last so far (0: none yet).
func (m *crashMatrix) headEvent(t *testing.T) int64 {
	var id int64
	err := m.pool.QueryRow(context.Background(), `SELECT id FROM outbox_events WHERE delivery_seq IS NOT NULL ORDER BY delivery_seq DESC LIMIT 1`).Scan(&id)
	if err != nil && err != pgx.ErrNoRows {
		t.Fatal(err)
	}
	return id
}

// nextBoot starts the victim again and waits for it to be ready. It belongs
// to the whole matrix: a drain point starts from it.
func (m *crashMatrix) nextBoot(t *testing.T) *proc {
	t.Helper()
	v := startProc(m.top, m.env)
	v.t = t
	_, api := v.waitReady()
	if m.load != nil {
		m.load.setVictim(api)
	}
	return v
}

// retireVictim stops the ready victim with SIGTERM before a boot point: a
// clean drain, held to crashDrainSteps, that leaves no leader lock behind.
func (m *crashMatrix) retireVictim(t *testing.T) {
	v := m.victim
	if v == nil {
		return
	}
	m.victim = nil
	v.t = t // see run
	m.load.setVictim("")
	v.signal(syscall.SIGTERM)
	if code := v.wait(20 * time.Second); code != 0 {
		t.Fatalf("the victim's clean drain exited %d", code)
	}
	steps := drainSteps(v)
	if len(steps) < len(crashDrainSteps) || !slices.Equal(steps[:len(crashDrainSteps)], crashDrainSteps) {
		t.Fatalf("the victim drained through %v; the matrix kills in %v (shutdown.go or the hooks changed: update crashDrainSteps)", steps, crashDrainSteps)
	}
	if lock, _ := m.rdb.Get(context.Background(), leaderKey).Result(); strings.HasPrefix(lock, crashVictim+":") {
		t.Errorf("after a clean drain the victim's leader lock %q is still there", lock)
	}
}

// drainSteps is the drain steps p logged, in order.
func drainSteps(p *proc) []string {
	var steps []string
	for _, l := range p.logsMatching(map[string]any{"msg": "lifecycle"}) {
		if s, ok := l["step"].(string); ok {
			steps = append(steps, s)
		}
	}
	return steps
}

// heldRequest is an order with an Idempotency-Key that the victim has taken
// and cannot finish: its INSERT waits on the row of the same key, which the
// test inserted and has not committed.
type heldRequest struct {
	key    string
	tx     pgx.Tx
	answer chan answer
}

func (m *crashMatrix) holdRequest(t *testing.T, v *proc) *heldRequest {
	ctx := context.Background()
	h := &heldRequest{key: "crash-held", answer: make(chan answer, 1)}
	tx, err := m.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	h.tx = tx
	t.Cleanup(func() { tx.Rollback(ctx) })
	if _, err := tx.Exec(ctx, `INSERT INTO orders (customer, items, total_cents, idempotency_key, request_hash)
		VALUES ('the test', '[]', 0, $1, 'held by the test')`, h.key); err != nil {
		t.Fatal(err)
	}
	api := v.addr("api")
	go func() { h.answer <- postOrder(&http.Client{Timeout: 60 * time.Second}, api, h.key) }()
	waitFor(t, 15*time.Second, "the victim's INSERT to wait on the held key, its marker in Redis", func() bool {
		var waiting bool
		m.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = $1
			AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO orders%')`, serviceName+"/"+crashVictim).Scan(&waiting)
		n, _ := m.rdb.Exists(ctx, idempotencyKeyPrefix+h.key).Result()
		return waiting && n == 1
	})
	return h
}

// release lets the key go, once the victim is dead, and hands it to the
// client, which retries it on the survivor. A backend waiting on a lock
// notices that its client died only when it next writes to it: it would
// insert the order after the rollback, and the retry would merely replay it.
// The dead victim's backends are ended first, as they would be with their
// host, so the key has no order and its retry must wait out the marker's lease.
func (h *heldRequest) release(t *testing.T, pool *pgxpool.Pool) {
	ctx := context.Background()
	if got := <-h.answer; got.err == nil {
		t.Errorf("the victim answered the held request after its SIGKILL: %s", got)
	}
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name IN ($1, $1 || '/river')`,
		serviceName+"/"+crashVictim); err != nil {
		t.Fatal(err)
	}
	if err := h.tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
}

// serveOrphans retries each key on the survivor until it is answered 201; a
// 409 must say Retry-After. One line per key: "ok …" or what went wrong.
func (m *crashMatrix) serveOrphans(keys []string, killed time.Time) (lines []string, slowest time.Duration) {
	client := &http.Client{Timeout: 10 * time.Second}
	for _, key := range keys {
		var last answer
		var conflicts int
		_, err := until(killed.Add(idempotencyLease+crashSlack), func() bool {
			last = postOrder(client, m.apiB, key)
			switch {
			case last.status == http.StatusConflict && last.retryAfter == "":
				return true // reported below
			case last.status == http.StatusConflict:
				conflicts++
			}
			return last.status == http.StatusCreated
		})
		took := time.Since(killed)
		slowest = max(slowest, took)
		switch {
		case err != nil:
			lines = append(lines, fmt.Sprintf("key %s not served %s after the victim died (%d × 409): last answer %s", key, took.Round(time.Millisecond), conflicts, last))
		case last.status != http.StatusCreated:
			lines = append(lines, fmt.Sprintf("key %s: %s without Retry-After", key, last))
		default:
			m.load.served(key, last.orderID())
			lines = append(lines, fmt.Sprintf("ok %s after %s (%d × 409)", key, took.Round(time.Millisecond), conflicts))
		}
	}
	return lines, slowest
}

// until polls cond (through poll) until it holds or deadline passes; it
// returns how long that took, and an error at the deadline.
func until(deadline time.Time, cond func() bool) (time.Duration, error) {
	start := time.Now()
	if !poll(time.Until(deadline), 20*time.Millisecond, cond) {
		return time.Since(start), errors.New("deadline passed")
	}
	return time.Since(start), nil
}

// crashLoad is a client that posts an order with a fresh Idempotency-Key
// every 50 ms, alternately to the victim (while it serves) and to the
// survivor. A request the victim left unanswered — cut by the kill, refused
// by a closed port, or a 503 of its drain — is an orphan: the survivor must
// serve its key once the victim is dead.
type crashLoad struct {
	survivor string
	client   *http.Client
	stop     chan struct{}
	done     chan struct{}

	mu      sync.Mutex
	victim  string // the victim's API while it is ready
	orphans []string
	created map[string]string // key → order id, every 201
	wrong   []string
}

func startCrashLoad(t testing.TB, survivor string) *crashLoad {
	l := &crashLoad{survivor: survivor, client: &http.Client{Timeout: 10 * time.Second},
		stop: make(chan struct{}), done: make(chan struct{}), created: map[string]string{}}
	go l.run()
	t.Cleanup(l.halt)
	return l
}

func (l *crashLoad) run() {
	defer close(l.done)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case <-l.stop:
			return
		case <-tick.C:
		}
		l.mu.Lock()
		api, toVictim := l.survivor, false
		if l.victim != "" && i%2 == 0 {
			api, toVictim = l.victim, true
		}
		l.mu.Unlock()
		key := fmt.Sprint("crash-", i)
		got := postOrder(l.client, api, key)

		l.mu.Lock()
		switch {
		case got.status == http.StatusCreated && got.orderID() != "":
			l.created[key] = got.orderID()
		case toVictim && (got.err != nil || got.status == http.StatusServiceUnavailable):
			l.orphans = append(l.orphans, key)
		case !toVictim && got.status == http.StatusServiceUnavailable && got.retryAfter != "":
			l.orphans = append(l.orphans, key) // shed by a loaded survivor: a client retries it
		default:
			l.wrong = append(l.wrong, fmt.Sprintf("%s to %s: %s", key, api, got))
		}
		l.mu.Unlock()
	}
}

// halt stops the load and waits for its last request.
func (l *crashLoad) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	<-l.done
}

func (l *crashLoad) setVictim(api string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.victim = api
}

func (l *crashLoad) served(key, id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.created[key] = id
}

func (l *crashLoad) addOrphan(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.orphans = append(l.orphans, key)
}

func (l *crashLoad) takeOrphans() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	o := l.orphans
	l.orphans = nil
	return o
}

func (l *crashLoad) takeWrong() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.wrong
	l.wrong = nil
	return w
}
