package main

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func readyLifecycle(t testing.TB) *Lifecycle {
	t.Helper()
	lc := newTestLifecycle()
	lc.moveTo(StateReady)
	return lc
}

// A storm of probes runs the dependency checks once per cache TTL, not once per request.
func TestReadinessStormRunsOneProbePerTTL(t *testing.T) {
	lc := readyLifecycle(t)
	rd := newReadiness(lc, newMetrics(), time.Second, 200*time.Millisecond)
	var pings atomic.Int64
	rd.RegisterReadinessCheck("db", true, func(context.Context) checkResult {
		pings.Add(1)
		time.Sleep(30 * time.Millisecond) // a slow DB: concurrent probes pile up behind one
		return okResult(nil)
	})

	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			if _, ok := rd.report(context.Background()); !ok {
				t.Error("not ready")
			}
		})
	}
	wg.Wait()
	if n := pings.Load(); n != 1 {
		t.Fatalf("200 concurrent probes ran the DB check %d times, want 1", n)
	}
	time.Sleep(250 * time.Millisecond)
	rd.report(context.Background())
	if n := pings.Load(); n != 2 {
		t.Fatalf("after the TTL the check ran %d times in all, want 2", n)
	}
}

// Draining answers 503 at once: no dependency probe is needed to say so.
func TestReadinessWhileDrainingNeedsNoProbe(t *testing.T) {
	lc := readyLifecycle(t)
	rd := newReadiness(lc, newMetrics(), time.Hour, time.Millisecond)
	rd.RegisterReadinessCheck("db", true, func(ctx context.Context) checkResult {
		<-ctx.Done()
		return failedResult(ctx.Err(), nil)
	})
	lc.moveTo(StateDraining)
	start := time.Now()
	rep, ok := rd.report(context.Background())
	if ok || rep.State != "draining" || rep.Status != "not_ready" {
		t.Fatalf("report %+v ok=%v", rep, ok)
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Fatalf("draining readiness took %s", took)
	}
}

// Each check is bounded; optional checks (search, storage) never fail readiness.
func TestReadinessChecksAreBoundedAndOptionalOnesDoNotGate(t *testing.T) {
	lc := readyLifecycle(t)
	rd := newReadiness(lc, newMetrics(), 50*time.Millisecond, time.Millisecond)
	rd.RegisterReadinessCheck("search", false, func(context.Context) checkResult { return failedResult(errors.New("down"), nil) })
	rd.RegisterReadinessCheck("redis", true, func(ctx context.Context) checkResult {
		return timedCheck(ctx, func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() })
	})
	start := time.Now()
	rep, ok := rd.report(context.Background())
	if ok {
		t.Fatal("ready with a hanging redis")
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("probe took %s with a 50ms check timeout", took)
	}
	if rep.Checks["redis"].OK || rep.Checks["search"].OK {
		t.Fatalf("checks %+v", rep.Checks)
	}

	rd2 := newReadiness(lc, newMetrics(), time.Second, time.Millisecond)
	rd2.RegisterReadinessCheck("search", false, func(context.Context) checkResult { return failedResult(errors.New("down"), nil) })
	rd2.RegisterReadinessCheck("storage", false, func(context.Context) checkResult { return failedResult(errors.New("down"), nil) })
	if _, ok := rd2.report(context.Background()); !ok {
		t.Fatal("search and storage being down made the instance not ready")
	}
}
