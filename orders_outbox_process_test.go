package main

import (
	"context"
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
)

// twoInstances starts instances a and b on one database and one Redis.
func twoInstances(t *testing.T, tweak func(env map[string]string)) (a, b *proc, shared map[string]string) {
	t.Helper()
	shared = fastEnv(t)
	if tweak != nil {
		tweak(shared)
	}
	start := func(id string) *proc {
		env := maps.Clone(shared)
		env["KUMIKO_INSTANCE_ID"] = id
		return startProc(t, env)
	}
	return start("a"), start("b"), shared
}

func orderCreatedIDs(frames []sseFrame) []int64 {
	var ids []int64
	for _, f := range frames {
		if f.Event == eventOrderCreated {
			ids = append(ids, f.ID)
		}
	}
	return ids
}

// deliveryOrder is every order.created event id in the order it was delivered.
func deliveryOrder(t *testing.T, pool *pgxpool.Pool) []int64 {
	t.Helper()
	rows, _ := pool.Query(context.Background(), `SELECT id FROM outbox_events WHERE event_type = 'order.created' AND delivery_seq IS NOT NULL ORDER BY delivery_seq`)
	var ids []int64
	for rows.Next() {
		var id int64
		rows.Scan(&id)
		ids = append(ids, id)
	}
	return ids
}

// 1. Orders posted alternately to two instances: every order.created reaches
// the SSE clients of both, each id exactly once, in delivery order.
func TestProcessTwoInstancesFanOut(t *testing.T) {
	a, b, env := twoInstances(t, nil)
	_, apiA := a.waitReady()
	_, apiB := b.waitReady()
	// Both streams are registered with their hub: openSSE returns with the
	// response's headers, which the handler writes once its hub has it.
	clientA, clientB := openSSE(t, apiA, 0), openSSE(t, apiB, 0)

	// Order i costs i+1 cents: the public event carries no order id, and the
	// total tells each order's event apart.
	const n = 40
	var totals []float64
	for i := range n {
		api := []string{apiA, apiB}[i%2]
		code, _, body := post(t, api+"/api/orders", fmt.Sprintf(`{"customer":"Ada","items":[{"sku":"tea","qty":1,"priceCents":%d}]}`, i+1), nil)
		if code != 201 {
			t.Fatalf("POST to %s: %d %v", api, code, body)
		}
		totals = append(totals, body["totalCents"].(float64))
	}
	want := func(frames []sseFrame) bool { return len(orderCreatedIDs(frames)) >= n }
	clientA.waitFor(5*time.Second, "every order on A", want)
	clientB.waitFor(5*time.Second, "every order on B", want)

	order := deliveryOrder(t, sharedPool(t, env))
	for name, c := range map[string]*sseClient{"A": clientA, "B": clientB} {
		got := orderCreatedIDs(c.events(eventOrderCreated))
		if !slices.Equal(got, order) {
			t.Errorf("client on %s got %v, want each event once in delivery order %v", name, got, order)
		}
		seenOrders := map[float64]bool{}
		for _, f := range c.events(eventOrderCreated) {
			payload, _ := f.Data["payload"].(map[string]any)
			total, _ := payload["totalCents"].(float64)
			seenOrders[total] = true
			for _, internal := range []string{"aggregateId", "seq"} {
				if _, ok := f.Data[internal]; ok {
					t.Errorf("client on %s: a public frame carries the internal %s: %v", name, internal, f.Data)
				}
			}
		}
		for _, total := range totals {
			if !seenOrders[total] {
				t.Errorf("client on %s never saw the order of %v cents", name, total)
			}
		}
	}
}

// 2. kill -9 an instance while its poller holds a batch: the other instance's
// poller delivers those rows; none is lost. The batch is held by a lock on
// river_job, where the delivery inserts the indexOrder jobs.
func TestProcessCrashedPollerBatchIsRedelivered(t *testing.T) {
	env := fastEnv(t,
		"MEILI_URL="+newMeiliDouble(t, "available").srv.URL, // order.created → indexOrder
		"KUMIKO_INSTANCE_ID=crashy",
	)
	// The survivor takes crashy's share once crashy's entry among the pollers expires.
	env["KUMIKO_HEARTBEAT_TTL"], env["KUMIKO_HEARTBEAT_INTERVAL"] = "1s", "250ms"
	// The lock below holds every River fetch too, each on a pooled connection:
	// a pool with room for them leaves the orders theirs (the default, 4 on
	// 2 cores, would be the jobs worker's alone, and this test is not about that).
	env["DATABASE_URL"] += "&pool_max_conns=16"
	crashy := startProc(t, env)
	_, api := crashy.waitReady()
	pool := sharedPool(t, env)

	// Block job inserts: the poller claims the batch, then waits on the lock.
	blocker, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(context.Background())
	if _, err := blocker.Exec(context.Background(), `LOCK TABLE river_job IN SHARE ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	const n = 5
	for range n {
		createOrder(t, api)
	}
	waitFor(t, 5*time.Second, "the poller to hold its batch", func() bool {
		var holding int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'kumiko-lifecycle-demo/crashy' AND wait_event_type = 'Lock' AND query LIKE '%river_job%'`).Scan(&holding)
		return holding > 0
	})
	crashy.cmd.Process.Kill()
	crashy.wait(5 * time.Second)
	blocker.Rollback(context.Background())

	var claimed int
	pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE aggregate_type = 'order' AND delivered_at IS NULL AND attempts = 0`).Scan(&claimed)
	if claimed != n {
		t.Fatalf("%d of %d events pending and untouched after the crash", claimed, n)
	}

	env["KUMIKO_INSTANCE_ID"] = "survivor"
	survivor := startProc(t, env)
	survivor.waitReady()
	waitFor(t, 5*time.Second, "the survivor to deliver the crashed batch", func() bool {
		var pending int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL`).Scan(&pending)
		return pending == 0
	})
	assertOneJobPerOrder(t, pool)
}

// assertOneJobPerOrder checks that every order is in exactly one indexOrder job.
func assertOneJobPerOrder(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT o.id, count(j.order_id) FROM orders o
		LEFT JOIN (SELECT jsonb_array_elements_text(args->'orderIds')::bigint AS order_id FROM river_job WHERE kind = 'indexOrder') j
		ON j.order_id = o.id GROUP BY o.id ORDER BY o.id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	orders := 0
	for rows.Next() {
		var id, jobs int64
		rows.Scan(&id, &jobs)
		orders++
		if jobs != 1 {
			t.Errorf("order %d has %d indexOrder jobs, want exactly 1", id, jobs)
		}
	}
	if orders == 0 {
		t.Fatal("no orders")
	}
}

// redisOutage is how long the Redis-down tests keep Redis down
// (KUMIKO_TEST_REDIS_OUTAGE, default 3s; the scenario is 30s).
func redisOutage(t *testing.T) time.Duration {
	if v := os.Getenv("KUMIKO_TEST_REDIS_OUTAGE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("KUMIKO_TEST_REDIS_OUTAGE: %v", err)
		}
		return d
	}
	return 3 * time.Second
}

// 4. Redis killed while orders are delivered, with a subscriber job: events
// are delivered from Postgres all the same, and after Redis is back every
// order has exactly one indexOrder job (no job inserted again per attempt).
func TestProcessRedisDownDeliversEachJobOnce(t *testing.T) {
	env := fastEnv(t)
	redisServer := testRedis(t)
	env["REDIS_URL"] = redisServer.URL
	env["MEILI_URL"] = newMeiliDouble(t, "available").srv.URL
	p := startProc(t, env)
	_, api := p.waitReady()
	pool := sharedPool(t, env)

	redisServer.Stop()
	for range 5 {
		createOrder(t, api)
	}
	waitFor(t, 5*time.Second, "delivery with Redis down", func() bool {
		var pending int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE event_type = 'order.created' AND delivery_seq IS NULL`).Scan(&pending)
		return pending == 0
	})
	redisServer.Start()
	createOrder(t, api)
	waitFor(t, 5*time.Second, "the order after the outage to be delivered", func() bool {
		var pending int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL`).Scan(&pending)
		return pending == 0
	})
	var attempts int
	pool.QueryRow(context.Background(), `SELECT coalesce(sum(attempts), 0) FROM outbox_events`).Scan(&attempts)
	if attempts != 0 {
		t.Errorf("%d delivery attempts spent on a Redis outage", attempts)
	}
	assertOneJobPerOrder(t, pool)
}

// 5. A poison event (an order.created whose aggregate id is no order id, so
// its indexOrder job cannot be built) goes dead with its last_error after the
// maximum attempts; the event committed with it and the ones behind it are
// delivered.
func TestProcessPoisonEventGoesDeadAlone(t *testing.T) {
	env := fastEnv(t, "MEILI_URL="+newMeiliDouble(t, "available").srv.URL, "KUMIKO_OUTBOX_MAX_ATTEMPTS=3")
	p := startProc(t, env)
	_, api := p.waitReady()
	pool := sharedPool(t, env)

	var poison, good int64
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(context.Background(), `INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
			VALUES ('order', 'not-an-order', 'order.created', '{}') RETURNING id`).Scan(&poison); err != nil {
			return err
		}
		return tx.QueryRow(context.Background(), `INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
			VALUES ('order', '424242', 'order.created', '{}') RETURNING id`).Scan(&good)
	})
	if err != nil {
		t.Fatal(err)
	}
	p.waitLog(10*time.Second, map[string]any{"component": "outboxPoller", "event_id": poison, "level": "error"})
	var attempts int
	var lastErr string
	var dead, goodDelivered bool
	pool.QueryRow(context.Background(), `SELECT attempts, coalesce(last_error, ''), dead_at IS NOT NULL FROM outbox_events WHERE id = $1`, poison).Scan(&attempts, &lastErr, &dead)
	pool.QueryRow(context.Background(), `SELECT delivered_at IS NOT NULL FROM outbox_events WHERE id = $1`, good).Scan(&goodDelivered)
	if !dead || attempts != 3 || !strings.Contains(lastErr, "not an order id") {
		t.Errorf("poison event: dead %v after %d attempts, last_error %q; want dead after 3 with the cause", dead, attempts, lastErr)
	}
	if !goodDelivered {
		t.Error("the event committed with the poison one was not delivered")
	}
	createOrder(t, api)
	waitFor(t, 5*time.Second, "the order behind the dead event to be delivered", func() bool {
		var pending int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL`).Scan(&pending)
		return pending == 0
	})
	if v, _ := scrapeMetric(p.addr("ops"), "kumiko_outbox_dead_total"); v != 1 {
		t.Errorf("kumiko_outbox_dead_total = %v, want 1", v)
	}
}

// 6. Redis down for a while (redisOutage): SSE clients on both instances
// still receive every new order, from Postgres, on the hubs' poll tick.
func TestProcessSSEFromPostgresWhileRedisIsDown(t *testing.T) {
	t.Parallel()
	redisServer := testRedis(t)
	a, b, env := twoInstances(t, func(env map[string]string) { env["REDIS_URL"] = redisServer.URL })
	_, apiA := a.waitReady()
	_, apiB := b.waitReady()
	clientA, clientB := openSSE(t, apiA, 0), openSSE(t, apiB, 0)
	pool := sharedPool(t, env)

	redisServer.Stop()
	posted := 0
	outage, endOutage := context.WithTimeout(context.Background(), redisOutage(t))
	defer endOutage()
	pace(outage, 100*time.Millisecond, func() bool {
		api := []string{apiA, apiB}[posted%2]
		createOrder(t, api)
		posted++
		return true
	})
	var want []int64
	waitFor(t, 5*time.Second, "every order to be delivered", func() bool {
		want = deliveryOrder(t, pool)
		return len(want) == posted
	})
	// Still during the outage: each hub reads Postgres on its own poll.
	for name, c := range map[string]*sseClient{"A": clientA, "B": clientB} {
		c.waitFor(5*time.Second, "every order on "+name+" with Redis down", func(frames []sseFrame) bool {
			return len(orderCreatedIDs(frames)) >= posted
		})
		if got := orderCreatedIDs(c.events(eventOrderCreated)); !slices.Equal(got, want) {
			t.Errorf("client on %s got %v, want %v", name, got, want)
		}
	}
	redisServer.Start()
}

// 3. An SSE client on a draining instance gets event: shutdown, reconnects to
// the other one with Last-Event-ID, and misses nothing while orders keep coming.
func TestProcessSSEHandoverDuringDrain(t *testing.T) {
	a, b, env := twoInstances(t, func(env map[string]string) { env["KUMIKO_LINGER"] = "300ms" })
	_, apiA := a.waitReady()
	_, apiB := b.waitReady()
	first := openSSE(t, apiA, 0) // registered with A's hub once it returns

	// Keep posting, to A while it accepts, else to B, like a load balancer.
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var posted sync.WaitGroup
	posted.Go(func() {
		i := 0
		pace(ctx, 5*time.Millisecond, func() bool {
			target := apiB
			if i%2 == 0 {
				target = apiA
			}
			if code, _ := postQuiet(target+"/api/orders", validOrder); code != 201 && target == apiA {
				postQuiet(apiB+"/api/orders", validOrder)
			}
			i++
			return true
		})
	})

	// Orders flow to the stream on A before the drain begins.
	first.waitFor(10*time.Second, "five orders on A before the drain", func(frames []sseFrame) bool {
		return len(orderCreatedIDs(frames)) >= 5
	})
	a.signal(syscall.SIGTERM)
	first.waitFor(5*time.Second, "event: shutdown", func(frames []sseFrame) bool {
		return len(frames) > 0 && frames[len(frames)-1].Event == "shutdown"
	})
	shutdown := first.events("shutdown")[0]
	if shutdown.Retry <= 0 {
		t.Errorf("the shutdown frame carries no retry hint: %+v", shutdown)
	}
	pool := sharedPool(t, env)
	second := openSSE(t, apiB, first.lastID())
	// Orders keep coming during and after the drain: five delivered after the
	// resumed stream opened reach it.
	before := deliveryOrder(t, pool)
	second.waitFor(10*time.Second, "five orders delivered after the resume, on the resumed stream", func(frames []sseFrame) bool {
		n := 0
		for _, id := range orderCreatedIDs(frames) {
			if !slices.Contains(before, id) {
				n++
			}
		}
		return n >= 5
	})
	stop()
	posted.Wait()
	if code := a.wait(10 * time.Second); code != 0 {
		t.Fatalf("A exited %d", code)
	}

	var want []int64
	waitFor(t, 5*time.Second, "every event on the second stream", func() bool {
		want = deliveryOrder(t, pool)
		got := append(orderCreatedIDs(first.events(eventOrderCreated)), orderCreatedIDs(second.events(eventOrderCreated))...)
		return len(got) >= len(want) && len(want) > 0
	})
	got := append(orderCreatedIDs(first.events(eventOrderCreated)), orderCreatedIDs(second.events(eventOrderCreated))...)
	if !slices.Equal(got, want) {
		t.Fatalf("across the handover the client got\n%v\nwant every event once, in delivery order\n%v", got, want)
	}
	// The instance's own drain is an event too (instance.state_changed).
	sawDraining := false
	for _, f := range append(first.events(eventInstanceStateChanged), second.events(eventInstanceStateChanged)...) {
		payload, _ := f.Data["payload"].(map[string]any)
		sawDraining = sawDraining || (payload["instanceId"] == "a" && payload["to"] == "draining")
	}
	if !sawDraining {
		t.Error("no instance.state_changed event for a → draining reached the client")
	}
	if len(first.events(eventOrderCreated)) == 0 || len(second.events(eventOrderCreated)) == 0 {
		t.Fatalf("want events on both sides of the handover: %d before, %d after",
			len(first.events(eventOrderCreated)), len(second.events(eventOrderCreated)))
	}
}

func postQuiet(url, body string) (int, error) {
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}
