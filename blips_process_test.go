package main

// Dependency blips at the process level: a PostgreSQL that restarts or
// hangs, a Redis that hangs or sits behind a black hole (Toxiproxy). The
// service runs as a child process against real servers; what is asserted is
// what a client and an operator see — statuses, Retry-After, exit codes, log
// lines, rows. Durations are asserted only with a wide margin (a hung
// dependency used to cost 10 s or forever).
// The figures come from BenchmarkDependencyBlips (orders_bench_test.go). demo:begin (this line) demo:end

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/golang-migrate/migrate/v4/database"
	"github.com/jackc/pgx/v5"
)

// answer is what one request got.
type answer struct {
	status     int
	retryAfter string
	body       []byte
	took       time.Duration
	err        error // no answer at all
}

func (a answer) String() string {
	if a.err != nil {
		return fmt.Sprintf("error after %s: %v", a.took.Round(time.Millisecond), a.err)
	}
	return fmt.Sprintf("%d (Retry-After %q) after %s", a.status, a.retryAfter, a.took.Round(time.Millisecond))
}

func do(client *http.Client, req *http.Request) answer {
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return answer{err: err, took: time.Since(start)}
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), body: body, took: time.Since(start)}
}

// concurrently runs n calls of fn at once and returns their answers.
func concurrently(n int, fn func(i int) answer) []answer {
	answers := make([]answer, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { answers[i] = fn(i) })
	}
	wg.Wait()
	return answers
}

// waitReadiness polls the ops readiness until it answers want, and returns
// how long that took.
func waitReadiness(t *testing.T, ops string, want int, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	client := &http.Client{Timeout: 2 * time.Second}
	var last string
	if !poll(within, 20*time.Millisecond, func() bool {
		resp, err := client.Get(ops + "/health/ready")
		if err != nil {
			last = err.Error()
			return false
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		last = fmt.Sprintf("%d %s", resp.StatusCode, raw)
		return resp.StatusCode == want
	}) {
		t.Fatalf("readiness did not answer %d within %s; last answer: %s", want, within, last)
	}
	return time.Since(start)
}

// SIGTERM while the boot waits for the migration lock another process holds:
// the migrator waits on a connection of its own, so the pool closes at once
// and the process exits 0 well within its budget, with the lock still held
// elsewhere.
func TestSigtermWhileWaitingForTheMigrationLockExitsPromptly(t *testing.T) {
	t.Parallel()
	env := fastEnv(t)
	holder, err := pgx.Connect(context.Background(), env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close(context.Background())
	var dbName string
	holder.QueryRow(context.Background(), `SELECT current_database()`).Scan(&dbName)
	lockID, err := database.GenerateAdvisoryLockId(dbName, "public", "schema_migrations")
	if err != nil {
		t.Fatal(err)
	}
	id, _ := strconv.ParseInt(lockID, 10, 64)
	if _, err := holder.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, id); err != nil {
		t.Fatal(err)
	}

	p := startProc(t, env)
	// The event: the service's session waits for that lock.
	waitFor(t, 20*time.Second, "the service to wait for the migration lock", func() bool {
		var waiting bool
		holder.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)`).Scan(&waiting)
		return waiting
	})
	sent := time.Now()
	p.signal(syscall.SIGTERM)
	code := p.wait(10 * time.Second)
	t.Logf("SIGTERM while waiting for the migration lock → exit %d in %s", code, time.Since(sent).Round(time.Millisecond))
	if code != 0 {
		t.Errorf("exit code %d, want 0: asked to stop while starting", code)
	}
	if time.Since(sent) > 5*time.Second {
		t.Errorf("exit took %s: the drain waited for the abandoned migration", time.Since(sent))
	}
}

// resumingStream is GET /api/events resuming after event 1.
func resumingStream(api string) *http.Request {
	req := must(http.NewRequest(http.MethodGet, api+"/api/events", nil))
	req.Header.Set("Last-Event-ID", "1")
	return req
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
