package main

import (
	"context"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

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

func sharedPool(t testing.TB, env map[string]string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
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
	clientA, clientB := openSSE(t, apiA, 0), openSSE(t, apiB, 0)
	time.Sleep(50 * time.Millisecond) // both streams registered with their hub

	const n = 40
	var orderIDs []string
	for i := range n {
		api := []string{apiA, apiB}[i%2]
		code, _, body := post(t, api+"/api/orders", validOrder, nil)
		if code != 201 {
			t.Fatalf("POST to %s: %d %v", api, code, body)
		}
		orderIDs = append(orderIDs, body["id"].(string))
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
		seenOrders := map[string]bool{}
		for _, f := range c.events(eventOrderCreated) {
			payload, _ := f.Data["payload"].(map[string]any)
			id, _ := payload["id"].(string)
			seenOrders[id] = true
		}
		for _, id := range orderIDs {
			if !seenOrders[id] {
				t.Errorf("client on %s never saw order %v", name, id)
			}
		}
	}
}

// 2. kill -9 an instance while its poller holds a batch: the other instance's
// poller delivers those rows; none is lost.
func TestProcessCrashedPollerBatchIsRedelivered(t *testing.T) {
	env := fastEnv(t)
	redisServer := testRedis(t) // our own handle, to freeze it
	env["REDIS_URL"] = redisServer.URL
	env["KUMIKO_INSTANCE_ID"] = "crashy"
	crashy := startProc(t, env)
	_, api := crashy.waitReady()
	pool := sharedPool(t, env)

	// Freeze Redis: the poller claims the batch, then hangs publishing it.
	redisServer.Pause()
	const n = 5
	for range n {
		if code, _, body := post(t, api+"/api/orders", validOrder, nil); code != 201 {
			t.Fatalf("POST: %d %v", code, body)
		}
	}
	waitFor(t, 5*time.Second, "the poller to hold its batch", func() bool {
		var holding int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'kumiko-lifecycle-demo/crashy' AND state = 'idle in transaction'`).Scan(&holding)
		return holding > 0
	})
	crashy.cmd.Process.Kill()
	crashy.wait(5 * time.Second)
	redisServer.Resume()

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
}

// 3. An SSE client on a draining instance gets event: shutdown, reconnects to
// the other one with Last-Event-ID, and misses nothing while orders keep coming.
func TestProcessSSEHandoverDuringDrain(t *testing.T) {
	a, b, env := twoInstances(t, func(env map[string]string) { env["KUMIKO_LINGER"] = "300ms" })
	_, apiA := a.waitReady()
	_, apiB := b.waitReady()
	first := openSSE(t, apiA, 0)
	time.Sleep(50 * time.Millisecond)

	// Keep posting, to A while it accepts, else to B, like a load balancer.
	stop := make(chan struct{})
	var posted sync.WaitGroup
	posted.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			target := apiB
			if i%2 == 0 {
				target = apiA
			}
			if code, _ := postQuiet(target+"/api/orders", validOrder); code != 201 && target == apiA {
				postQuiet(apiB+"/api/orders", validOrder)
			}
			time.Sleep(5 * time.Millisecond)
		}
	})

	time.Sleep(200 * time.Millisecond)
	a.signal(syscall.SIGTERM)
	first.waitFor(5*time.Second, "event: shutdown", func(frames []sseFrame) bool {
		return len(frames) > 0 && frames[len(frames)-1].Event == "shutdown"
	})
	shutdown := first.events("shutdown")[0]
	if shutdown.Retry <= 0 {
		t.Errorf("the shutdown frame carries no retry hint: %+v", shutdown)
	}
	second := openSSE(t, apiB, first.lastID())
	time.Sleep(300 * time.Millisecond) // orders keep coming during and after the drain
	close(stop)
	posted.Wait()
	if code := a.wait(10 * time.Second); code != 0 {
		t.Fatalf("A exited %d", code)
	}

	pool := sharedPool(t, env)
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

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
	}
}
