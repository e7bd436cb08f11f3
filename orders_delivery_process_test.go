package main

// Partitioned delivery across processes (docs/delivery.md). Orders give the
// exactly-once check its witness: an order.created delivery inserts one
// indexOrder job, in the delivery's transaction.

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// partitionEnv is the environment of instances that share one database and
// one Redis, with short heartbeats so a dead poller's share moves quickly.
func partitionEnv(t *testing.T, ttl time.Duration) map[string]string {
	env := fastEnv(t,
		"MEILI_URL="+newMeiliDouble(t, "available").srv.URL, // order.created → indexOrder
		"KUMIKO_HEARTBEAT_TTL="+ttl.String(),
		"KUMIKO_HEARTBEAT_INTERVAL="+(ttl/4).String(),
		"KUMIKO_OUTBOX_BATCH_SIZE=20",
	)
	return env
}

func startInstance(t *testing.T, shared map[string]string, id string) *proc {
	t.Helper()
	env := maps.Clone(shared)
	env["KUMIKO_INSTANCE_ID"] = id
	return startProc(t, env)
}

// writeOrderEvents creates n orders, then rounds events per order: each
// round is one transaction with one order.created per order, so every batch
// mixes aggregates and every aggregate has rounds events in id order.
func writeOrderEvents(pool *pgxpool.Pool, orders, rounds int) (total int, err error) {
	ctx := context.Background()
	var ids []int64
	rows, err := pool.Query(ctx, `INSERT INTO orders (customer, items, total_cents)
		SELECT 'partition test', '[{"sku":"tea","qty":1,"priceCents":250}]', 250 FROM generate_series(1, $1) RETURNING id`, orders)
	if err == nil {
		ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	}
	if err != nil {
		return 0, fmt.Errorf("creating orders: %w", err)
	}
	for r := range rounds {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for _, id := range ids {
				if _, err := writeOutboxEvent(ctx, tx, "order", itoa(id), eventOrderCreated, map[string]any{"id": id, "round": r}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return 0, fmt.Errorf("writing round %d: %w", r, err)
		}
	}
	return orders * rounds, nil
}

func mustWriteOrderEvents(t *testing.T, pool *pgxpool.Pool, orders, rounds int) int {
	t.Helper()
	n, err := writeOrderEvents(pool, orders, rounds)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func countNumbered(pool *pgxpool.Pool) (numbered, total int) {
	pool.QueryRow(context.Background(), `SELECT count(delivery_seq), count(*) FROM outbox_events WHERE event_type = $1`,
		eventOrderCreated).Scan(&numbered, &total)
	return numbered, total
}

// assertAggregateOrderAndOnce checks, per order, that its events were
// numbered in the order they were written and that each was delivered once:
// as many indexOrder jobs naming the order as events.
func assertAggregateOrderAndOnce(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	rows, err := pool.Query(context.Background(), `WITH jobs AS (SELECT order_id, count(*) AS n FROM river_job,
			jsonb_array_elements_text(args->'orderIds') AS order_id WHERE kind = 'indexOrder' GROUP BY order_id)
		SELECT e.aggregate_id, array_agg(e.id ORDER BY e.delivery_seq), count(*),
			coalesce((SELECT n FROM jobs WHERE order_id = e.aggregate_id), 0)
		FROM outbox_events e WHERE e.event_type = $1 GROUP BY e.aggregate_id ORDER BY e.aggregate_id`, eventOrderCreated)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	aggregates := 0
	for rows.Next() {
		var agg string
		var ids []int64
		var events, jobs int64
		if err := rows.Scan(&agg, &ids, &events, &jobs); err != nil {
			t.Fatal(err)
		}
		aggregates++
		if !slices.IsSorted(ids) {
			t.Errorf("order %s: events in delivery order %v, want them in the order written", agg, ids)
		}
		if jobs != events {
			t.Errorf("order %s: %d events, %d indexOrder jobs: want each delivered once", agg, events, jobs)
		}
	}
	if err := rows.Err(); err != nil || aggregates == 0 {
		t.Fatalf("no aggregates read: %v", err)
	}
}

// 1. Four instances deliver one backlog while instances are SIGKILLed at
// random and replaced under new ids: every event is delivered once, each
// order's events in the order they were written, and nothing stays behind.
func TestProcessPartitionedDeliveryUnderKills(t *testing.T) {
	t.Parallel()
	env := partitionEnv(t, time.Second)
	pool := sharedPool(t, env)
	live := map[string]*proc{}
	for i := range 4 {
		id := fmt.Sprint("p", i)
		live[id] = startInstance(t, env, id)
	}
	for _, p := range live {
		p.waitReady()
	}
	// The writer keeps about five rounds ahead of the numbering, so every
	// kill below lands while the instances have a backlog in hand.
	const aggregates, rounds = 60, 100
	total := aggregates * rounds
	written := make(chan error, 1)
	go func() {
		for r := range rounds {
			var n int
			if !poll(60*time.Second, 5*time.Millisecond, func() bool {
				n, _ = countNumbered(pool)
				return n >= (r-5)*aggregates
			}) {
				written <- fmt.Errorf("round %d: %d events numbered after 60s, want %d", r, n, (r-5)*aggregates)
				return
			}
			if _, err := writeOrderEvents(pool, aggregates, 1); err != nil {
				written <- err
				return
			}
		}
		written <- nil
	}()

	const kills = 4
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 24))
	var seen []string
	for k := range kills {
		waitFor(t, 60*time.Second, fmt.Sprintf("delivery to go on before kill %d", k+1), func() bool {
			n, _ := countNumbered(pool)
			return n >= total*(k+1)/(kills+2)
		})
		ids := slices.Sorted(maps.Keys(live))
		victim := ids[rng.IntN(len(ids))]
		var numbered, pending int
		pool.QueryRow(context.Background(), `SELECT count(delivery_seq), count(*) FILTER (WHERE delivered_at IS NULL) FROM outbox_events`).Scan(&numbered, &pending)
		seen = append(seen, fmt.Sprintf("kill %s at %d numbered, %d pending", victim, numbered, pending))
		live[victim].cmd.Process.Kill()
		live[victim].wait(5 * time.Second)
		delete(live, victim)
		id := fmt.Sprint("r", k)
		live[id] = startInstance(t, env, id) // not waited for: the next kill may come while it boots
	}
	if err := <-written; err != nil {
		t.Fatal(err)
	}
	var n int
	if !poll(60*time.Second, 10*time.Millisecond, func() bool {
		n, _ = countNumbered(pool)
		return n >= total
	}) {
		var pending, unnumbered int
		pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE delivered_at IS NULL), count(*) FILTER (WHERE delivered_at IS NOT NULL AND delivery_seq IS NULL) FROM outbox_events`).Scan(&pending, &unnumbered)
		t.Fatalf("%d of %d events numbered after 60s (%d pending, %d delivered unnumbered); %v", n, total, pending, unnumbered, seen)
	}
	t.Logf("%v", seen)
	assertAggregateOrderAndOnce(t, pool)
}

// 2. Events written concurrently while two instances deliver: a stream on
// each instance, and one that moves from b to a with Last-Event-ID halfway,
// see every event once, in delivery_seq order, which is strictly increasing.
func TestProcessStreamsFollowPartitionedDelivery(t *testing.T) {
	t.Parallel()
	env := partitionEnv(t, 2*time.Second)
	pool := sharedPool(t, env)
	a, b := startInstance(t, env, "a"), startInstance(t, env, "b")
	_, apiA := a.waitReady()
	_, apiB := b.waitReady()
	onA, onB, moving := openSSE(t, apiA, 0), openSSE(t, apiB, 0), openSSE(t, apiB, 0)

	// Writers commit out of id order, across many aggregates.
	const writers, perWriter = 4, 25
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			if _, err := writeOrderEvents(pool, 20, perWriter); err != nil {
				t.Error(err)
			}
		})
	}
	total := writers * 20 * perWriter
	moving.waitFor(60*time.Second, "half the events", func(f []sseFrame) bool { return len(orderCreatedIDs(f)) >= total/2 })
	moving.cancel()
	<-moving.ended
	first := orderCreatedIDs(moving.events(eventOrderCreated))
	resumed := openSSE(t, apiA, first[len(first)-1])
	wg.Wait()

	all := func(f []sseFrame) bool { return len(orderCreatedIDs(f)) >= total }
	onA.waitFor(60*time.Second, "every event on a", all)
	onB.waitFor(60*time.Second, "every event on b", all)
	resumed.waitFor(60*time.Second, "every event after the resume", func(f []sseFrame) bool {
		return len(first)+len(orderCreatedIDs(f)) >= total
	})

	// The table's order: every numbered event by delivery_seq.
	rows, err := pool.Query(context.Background(), `SELECT id, delivery_seq FROM outbox_events WHERE event_type = $1 ORDER BY delivery_seq`, eventOrderCreated)
	if err != nil {
		t.Fatal(err)
	}
	type numbered struct{ ID, Seq int64 }
	table, err := pgx.CollectRows(rows, pgx.RowToStructByPos[numbered])
	if err != nil {
		t.Fatal(err)
	}
	var want []int64
	seqOf := map[int64]int64{}
	for _, e := range table {
		want = append(want, e.ID)
		seqOf[e.ID] = e.Seq
	}
	streams := map[string][]int64{
		"on a":                          orderCreatedIDs(onA.events(eventOrderCreated)),
		"on b":                          orderCreatedIDs(onB.events(eventOrderCreated)),
		"b, then a after Last-Event-ID": append(slices.Clone(first), orderCreatedIDs(resumed.events(eventOrderCreated))...),
	}
	for name, got := range streams {
		if !slices.Equal(got, want) {
			t.Errorf("stream %s: %d events, want the table's %d in delivery_seq order\n got: %v\nwant: %v", name, len(got), len(want), got, want)
			continue
		}
		for i := 1; i < len(got); i++ {
			if seqOf[got[i]] <= seqOf[got[i-1]] {
				t.Errorf("stream %s: event %d (seq %d) after %d (seq %d)", name, got[i], seqOf[got[i]], got[i-1], seqOf[got[i-1]])
			}
		}
	}
	assertAggregateOrderAndOnce(t, pool)
}

// 3. A partition owner SIGKILLed while it holds a batch: another instance
// delivers those events once, after the dead poller's entry expires (one
// heartbeat TTL) and not before; a poller that drains hands its share over
// at once.
func TestProcessPartitionOwnerKilledMidBatch(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Second
	env := partitionEnv(t, ttl)
	pool := sharedPool(t, env)
	a, b := startInstance(t, env, "a"), startInstance(t, env, "b")
	a.waitReady()
	b.waitReady()

	// Block job inserts: both pollers claim their batches, then wait on the lock.
	blocker, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(context.Background())
	if _, err := blocker.Exec(context.Background(), `LOCK TABLE river_job IN SHARE ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	total := mustWriteOrderEvents(t, pool, 40, 1)
	waitFor(t, 10*time.Second, "a to hold a batch", func() bool {
		var holding int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'kumiko-lifecycle-demo/a' AND wait_event_type = 'Lock' AND query LIKE '%river_job%'`).Scan(&holding)
		return holding > 0
	})
	a.cmd.Process.Kill()
	killed := time.Now()
	a.wait(5 * time.Second)
	blocker.Rollback(context.Background())

	// Of the pollers a and b, a owns the even partitions, b the odd ones.
	// b delivers its share at once; a's waits for a's entry to expire.
	shares := func() (aPending, aTotal, bPending, unnumbered int) {
		pool.QueryRow(context.Background(), `SELECT
				count(*) FILTER (WHERE p % 2 = 0 AND delivered_at IS NULL), count(*) FILTER (WHERE p % 2 = 0),
				count(*) FILTER (WHERE p % 2 = 1 AND delivered_at IS NULL),
				count(*) FILTER (WHERE delivered_at IS NOT NULL AND delivery_seq IS NULL)
			FROM (SELECT *, `+outboxPartitionExpr+` AS p FROM outbox_events WHERE event_type = $1) e`,
			eventOrderCreated).Scan(&aPending, &aTotal, &bPending, &unnumbered)
		return
	}
	waitFor(t, 10*time.Second, "b to deliver its own share", func() bool {
		_, _, bPending, unnumbered := shares()
		return bPending == 0 && unnumbered == 0
	})
	aPending, aTotal, _, _ := shares()
	if since := time.Since(killed); since < ttl/2 && (aPending != aTotal || aTotal == 0) {
		t.Fatalf("%s after the kill, %d of a's %d events pending: want all of them, until a's entry expires", since, aPending, aTotal)
	}
	waitFor(t, ttl+5*time.Second, "another poller to take over a's share", func() bool {
		n, _ := countNumbered(pool)
		return n == total
	})
	took := time.Since(killed)
	t.Logf("a's %d events delivered by b %s after the kill (heartbeat TTL %s)", aTotal, took.Round(time.Millisecond), ttl)
	if took < ttl/2 || took > ttl+2*time.Second {
		t.Errorf("a's share moved %s after the kill: want after its entry expired, within the TTL (%s) and a poll or two", took, ttl)
	}
	assertAggregateOrderAndOnce(t, pool)

	// Drain: c joins and takes a share; SIGTERM hands it back to b at once,
	// not after c's entry would have expired (30s).
	cEnv := maps.Clone(env)
	cEnv["KUMIKO_HEARTBEAT_TTL"], cEnv["KUMIKO_HEARTBEAT_INTERVAL"] = "30s", "5s"
	c := startInstance(t, cEnv, "c")
	c.waitReady()
	waitFor(t, 10*time.Second, "c to join the pollers", func() bool {
		return len(c.logsMatching(map[string]any{"msg": "outbox share", "pollers": float64(2)})) > 0
	})
	blocker, err = pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(context.Background())
	if _, err := blocker.Exec(context.Background(), `LOCK TABLE river_job IN SHARE ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	total += mustWriteOrderEvents(t, pool, 40, 2)
	waitFor(t, 10*time.Second, "c to hold a batch", func() bool {
		var holding int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'kumiko-lifecycle-demo/c' AND wait_event_type = 'Lock' AND query LIKE '%river_job%'`).Scan(&holding)
		return holding > 0
	})
	c.signal(syscall.SIGTERM)
	drained := time.Now()
	blocker.Rollback(context.Background())
	if code := c.wait(10 * time.Second); code != 0 {
		t.Fatalf("c exited %d after SIGTERM", code)
	}
	waitFor(t, 10*time.Second, "b to deliver what c left", func() bool {
		n, _ := countNumbered(pool)
		return n == total
	})
	t.Logf("after c drained, everything delivered %s after SIGTERM", time.Since(drained).Round(time.Millisecond))
	assertAggregateOrderAndOnce(t, pool)
}
