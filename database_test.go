package main

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A transaction left open between its statements — an instance frozen or
// cut off after it took a row lock — is ended by the server after
// KUMIKO_DB_IDLE_IN_TRANSACTION_TIMEOUT, and the lock with it: the statement
// that waits for the row goes on, instead of failing at lock_timeout or
// waiting for the frozen instance to wake.
func TestIdleTransactionIsEndedAndItsLockFreed(t *testing.T) {
	env := fastEnv(t,
		"KUMIKO_DB_IDLE_IN_TRANSACTION_TIMEOUT=300ms",
		"KUMIKO_DB_LOCK_TIMEOUT=30s", // the wait below ends by the idle timeout, not by this
	)
	s := startInProcess(t, env)
	defer s.stop(t)
	ctx := context.Background()

	frozen, err := s.app.db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer frozen.Rollback(ctx)
	if _, err := frozen.Exec(ctx, `UPDATE scheduler_fence SET token = token`); err != nil {
		t.Fatal(err)
	}
	// frozen sends nothing more, as a stopped process would.
	waited := time.Now()
	wait, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := s.app.db.Exec(wait, `UPDATE scheduler_fence SET token = token`); err != nil {
		t.Fatalf("the row stayed locked by a transaction idle for %s: %v", time.Since(waited), err)
	}
	t.Logf("the lock was freed after %s", time.Since(waited).Round(time.Millisecond))
	if err := frozen.Commit(ctx); err == nil {
		t.Error("the idle transaction committed after the server should have ended it")
	}
}

// One ping of the database past its deadline, after one that answered, shows
// the database degraded and keeps the instance ready: on a busy shared server
// every instance's ping fails at once. The second in a row takes the instance
// out; an answer brings it back. A probe that never answered gates at once.
func TestDatabaseProbeGatesOnFailuresInARow(t *testing.T) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testPostgres(t))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	probe := &dbProbe{config: cfg.ConnConfig, pool: pool}
	defer probe.close()
	var late atomic.Bool // the next pings miss their deadline
	rd := testReadiness(t, readyLifecycle(t), newMetrics(), 5*time.Second, time.Hour)
	rd.RegisterReadinessCheck("db", true, func(ctx context.Context) checkResult {
		if late.Load() {
			past, cancel := context.WithDeadline(ctx, time.Now())
			defer cancel()
			return probe.check(past)
		}
		return probe.check(ctx)
	})
	step := func(what string, wantReady bool, wantDegraded string) {
		t.Helper()
		rd.refresh(ctx)
		rep, ok := rd.report()
		if ok != wantReady || strings.Join(rep.Degraded, ",") != wantDegraded {
			t.Fatalf("%s: ready=%v degraded=%v, want ready=%v degraded=%q; db: %+v", what, ok, rep.Degraded, wantReady, wantDegraded, rep.Checks["db"])
		}
	}

	late.Store(true)
	step("a probe that never answered, failing", false, "")
	late.Store(false)
	step("its first answer", true, "")
	late.Store(true)
	step("one ping past its deadline", true, "db")
	step("the second in a row", false, "")
	late.Store(false)
	step("an answer again", true, "")
	late.Store(true)
	step("one ping past its deadline after that", true, "db")
}
