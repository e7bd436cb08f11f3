package main

import (
	"context"
	"maps"
	"net/http"
	"syscall"
	"testing"
	"time"
)

// An Idempotency-Key whose holder died is free again within the marker's
// lease (issue 32: a SIGKILLed instance left its markers for 5 minutes, and
// their retries were 409s without Retry-After). Instance A takes the key and
// is held inside its INSERT by a table lock the test keeps; the test sees
// A's marker in Redis and A's backend waiting on the lock, SIGKILLs A,
// lifts the lock and retries on instance B: 409s with Retry-After while the
// lease runs out, then 201 with one order for the key.
func TestIdempotencyKeyOfAKilledHolderIsFreeWithinTheLease(t *testing.T) {
	t.Parallel()
	env := fastEnv(t)
	// A's request must outlive the moment of the kill: a long budget.
	envA := maps.Clone(env)
	envA["KUMIKO_INSTANCE_ID"] = "holder"
	envA["KUMIKO_HTTP_DEPENDENCY_TIMEOUT"] = "60s"
	envA["KUMIKO_DB_LOCK_TIMEOUT"] = "60s"
	a := startProc(t, envA)
	_, apiA := a.waitReady()
	envB := maps.Clone(env)
	envB["KUMIKO_INSTANCE_ID"] = "retrier"
	b := startProc(t, envB)
	_, apiB := b.waitReady()

	db := sharedPool(t, env)
	rdb := redisClient(t, env["REDIS_URL"])
	ctx := context.Background()
	lock, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx)
	// Reads go on (A's lookup by key), inserts wait.
	if _, err := lock.Exec(ctx, `LOCK TABLE orders IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}

	const key = "killed-holder"
	held := make(chan answer, 1)
	go func() { held <- postOrder(&http.Client{Timeout: 30 * time.Second}, apiA, key) }()
	waitFor(t, 10*time.Second, "A's marker in Redis and A's INSERT waiting on the lock", func() bool {
		n, _ := rdb.Exists(ctx, idempotencyKeyPrefix+key).Result()
		var waiting bool
		db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO orders%')`).Scan(&waiting)
		return n == 1 && waiting
	})

	// While A lives, its request is in flight: 409 with Retry-After.
	client := &http.Client{Timeout: 10 * time.Second}
	if got := postOrder(client, apiB, key); got.status != http.StatusConflict || got.retryAfter == "" {
		t.Fatalf("retry while the holder lives: %s, want 409 with Retry-After", got)
	}

	a.signal(syscall.SIGKILL)
	a.wait(10 * time.Second)
	killed := time.Now()
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := <-held; got.err == nil {
		t.Fatalf("the killed holder answered %s", got)
	}

	var conflicts int
	// A client that retries every 50 ms, faster than Retry-After, to
	// measure the lease.
	var served answer
	pace(context.Background(), 50*time.Millisecond, func() bool {
		served = postOrder(client, apiB, key)
		if served.status != http.StatusConflict {
			return false
		}
		conflicts++
		if served.retryAfter == "" {
			t.Fatalf("409 without Retry-After: %s", served)
		}
		if time.Since(killed) > 10*time.Second {
			t.Fatalf("the key is still held %s after its holder was killed", time.Since(killed))
		}
		return true
	})
	freed := time.Since(killed)
	t.Logf("holder SIGKILLed: retry served %s after the kill (%d × 409 before), answer %s", freed.Round(time.Millisecond), conflicts, served)
	if served.status != http.StatusCreated || served.orderID() == "" {
		t.Fatalf("retry after the holder died: %s, want 201", served)
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM orders WHERE idempotency_key = $1`, key).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d orders for the key (%v), want 1", n, err)
	}
	if again := postOrder(client, apiB, key); again.status != http.StatusCreated || again.orderID() != served.orderID() {
		t.Fatalf("a second retry answered %s, order %q; want the same order %q", again, again.orderID(), served.orderID())
	}
}
