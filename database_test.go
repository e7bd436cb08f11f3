package main

import (
	"context"
	"testing"
	"time"
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
