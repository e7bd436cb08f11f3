package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
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

// testReadiness is a readiness whose background loops fail the test if they panic.
func testReadiness(t testing.TB, lc *Lifecycle, m *metrics, probeTimeout, interval time.Duration) *readiness {
	t.Helper()
	rd := newReadiness(lc, m, probeTimeout, interval, 2*interval+probeTimeout, func(c component, r any) { t.Errorf("%s panicked: %v", c, r) })
	t.Cleanup(func() { rd.Stop(context.Background()) })
	return rd
}

// hangs is a probe that waits for its deadline, like a dependency that
// accepts and never answers.
func hangs(ctx context.Context) checkResult {
	return timedCheck(ctx, func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() })
}

// The probe reads the latest results and never waits: with every check
// hanging, a storm of probes answers, and runs no check of its own.
func TestReadinessAnswersWithoutWaitingForChecks(t *testing.T) {
	rd := testReadiness(t, readyLifecycle(t), newMetrics(), time.Hour, time.Hour)
	var runs, running, overlap atomic.Int64
	gate := make(chan struct{})
	rd.RegisterReadinessCheck("db", true, func(ctx context.Context) checkResult {
		runs.Add(1)
		if running.Add(1) > 1 {
			overlap.Add(1)
		}
		defer running.Add(-1)
		if runs.Load() == 1 {
			return okResult(nil)
		}
		<-gate // from the second run on: the database hangs
		return okResult(nil)
	})
	rd.RegisterReadinessCheck("storage", false, hangs)
	if err := rd.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-rd.checks[0].first // db's first run; storage hangs for the probe timeout
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			if rep, ok := rd.report(); !ok {
				t.Errorf("not ready: %+v", rep)
			}
		})
	}
	wg.Wait()
	if n := runs.Load(); n != 1 {
		t.Errorf("200 probes ran the db check %d times in all, want only the loop's first run", n)
	}
	close(gate)
	if overlap.Load() > 0 {
		t.Error("two runs of one check overlapped")
	}
}

// Readiness gates on the core path (PostgreSQL, this instance's workers);
// a shared dependency's trouble is listed as degraded and keeps it ready.
func TestReadinessGatesOnlyOnTheCorePath(t *testing.T) {
	for _, tc := range []struct {
		name         string
		failing      string
		ready        bool
		wantDegraded string
	}{
		{name: "redis down", failing: "redis", ready: true, wantDegraded: "redis"},
		{name: "search down", failing: "search", ready: true, wantDegraded: "search"},
		{name: "storage down", failing: "storage", ready: true, wantDegraded: "storage"},
		{name: "heartbeats not reaching redis", failing: "outboxPoller/shared", ready: true, wantDegraded: "outboxPoller"},
		{name: "worker stuck", failing: "outboxPoller", ready: false},
		{name: "db down", failing: "db", ready: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rd := testReadiness(t, readyLifecycle(t), newMetrics(), time.Second, time.Hour)
			for _, c := range []struct {
				name  string
				gates bool
			}{{"db", true}, {"outboxPoller", true}, {"redis", false}, {"search", false}, {"storage", false}} {
				rd.RegisterReadinessCheck(c.name, c.gates, func(context.Context) checkResult {
					switch tc.failing {
					case c.name:
						return failedResult(errors.New("down"), nil)
					case c.name + "/shared":
						res := failedResult(errors.New("redis does not hear it"), nil)
						res.Shared = true
						return res
					}
					return okResult(nil)
				})
			}
			rd.refresh(context.Background())
			rep, ok := rd.report()
			if ok != tc.ready {
				t.Fatalf("ready=%v, want %v: %+v", ok, tc.ready, rep)
			}
			if got := strings.Join(rep.Degraded, ","); got != tc.wantDegraded {
				t.Errorf("degraded %q, want %q", got, tc.wantDegraded)
			}
		})
	}
}

// A check that hangs past its own deadline (it ignores its context) turns
// stale, and a stale gating check fails readiness; each result has its age.
func TestReadinessStaleCheckFails(t *testing.T) {
	rd := testReadiness(t, readyLifecycle(t), newMetrics(), 10*time.Millisecond, 10*time.Millisecond)
	release := make(chan struct{})
	defer close(release)
	var runs atomic.Int64
	rd.RegisterReadinessCheck("db", true, func(context.Context) checkResult {
		if runs.Add(1) > 1 {
			<-release // ignores its deadline
		}
		return okResult(nil)
	})
	if err := rd.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := rd.WaitFirstResults(context.Background()); err != nil {
		t.Fatal(err)
	}
	if rep, ok := rd.report(); !ok || rep.Checks["db"].Detail["ageMs"] == nil {
		t.Fatalf("after the first run: ready=%v %+v", ok, rep.Checks)
	}
	var rep readinessReport
	waitFor(t, 5*time.Second, "the hung check to turn stale", func() bool {
		var ok bool
		rep, ok = rd.report()
		return !ok
	})
	if msg, _ := rep.Checks["db"].Detail["error"].(string); !strings.Contains(msg, "hangs") {
		t.Fatalf("stale check %+v", rep.Checks["db"])
	}
}

// Draining answers 503 whatever the checks say.
func TestReadinessWhileDrainingIsNotReady(t *testing.T) {
	lc := readyLifecycle(t)
	rd := testReadiness(t, lc, newMetrics(), time.Second, time.Hour)
	rd.RegisterReadinessCheck("db", true, func(context.Context) checkResult { return okResult(nil) })
	rd.refresh(context.Background())
	lc.moveTo(StateDraining)
	rep, ok := rd.report()
	if ok || rep.State != "draining" || rep.Status != "not_ready" {
		t.Fatalf("report %+v ok=%v", rep, ok)
	}
}

// Phase 16 waits for a first result of every check, so its first 200 shows
// them all; an optional check for one probe timeout at most, so a probe
// that ignores its deadline holds no boot. Its missing result then shows as
// failed once it is stale, and only degrades.
func TestFirstResultsWaitOneProbeTimeoutForOptionalChecks(t *testing.T) {
	rd := testReadiness(t, readyLifecycle(t), newMetrics(), 20*time.Millisecond, 20*time.Millisecond)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) }) // before the Stop that testReadiness registered
	rd.RegisterReadinessCheck("db", true, func(context.Context) checkResult { return okResult(nil) })
	rd.RegisterReadinessCheck("search", false, func(context.Context) checkResult { <-release; return okResult(nil) })
	rd.RegisterReadinessCheck("storage", false, hangs)
	if err := rd.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := rd.WaitFirstResults(context.Background()); err != nil {
		t.Fatal(err)
	}
	if res, seen := rd.results()["storage"]; !seen || res.OK {
		t.Fatalf("storage hangs until its deadline: want its failed first result, got %+v (seen %v)", res, seen)
	}
	waitFor(t, 10*time.Second, "search to show as failed with no result", func() bool {
		res, seen := rd.results()["search"]
		return seen && !res.OK && strings.Contains(fmt.Sprint(res.Detail["error"]), "no result")
	})
	if rep, ok := rd.report(); !ok || !slices.Contains(rep.Degraded, "search") {
		t.Fatalf("a hung optional check: ready=%v, degraded %v; want ready with search degraded", ok, rep.Degraded)
	}
}

// refresh runs every check once now, concurrently, and keeps the results:
// a test reads a report without waiting for the loops.
func (rd *readiness) refresh(ctx context.Context) {
	rd.mu.Lock()
	checks := slices.Clone(rd.checks)
	rd.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range checks {
		wg.Go(func() { rd.run(ctx, c) })
	}
	wg.Wait()
}

// Phase 16 waits for the gating checks to pass: one that fails at first (a
// worker not yet scheduled on a busy machine) is waited out, and one that
// never passes is named when the phase's time is up.
func TestReadinessWaitGatesPass(t *testing.T) {
	rd := testReadiness(t, readyLifecycle(t), newMetrics(), 10*time.Millisecond, 10*time.Millisecond)
	var runs atomic.Int64
	rd.RegisterReadinessCheck("outboxPoller", true, func(context.Context) checkResult {
		if runs.Add(1) <= 3 {
			return failedResult(errors.New("heartbeat is stale"), nil)
		}
		return okResult(nil)
	})
	rd.RegisterReadinessCheck("worker", true, func(context.Context) checkResult {
		return failedResult(errors.New("never beat"), nil)
	})
	if err := rd.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := rd.WaitFirstResults(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	err := rd.WaitGatesPass(ctx, 10*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "worker: never beat") || strings.Contains(err.Error(), "outboxPoller") {
		t.Fatalf("WaitGatesPass = %v; want only the check that never passes named", err)
	}
	if runs.Load() <= 3 {
		t.Errorf("the check that failed at first ran %d times; it was not waited out", runs.Load())
	}
}
