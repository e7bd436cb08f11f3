package main

// The drain beyond its anchors, at the process level: the adaptive linger
// ends when the load balancer has visibly stopped sending (ended=quiet), not
// before one probe period, and never after KUMIKO_LINGER (ended=max); past
// it, new clients are refused or told to retry (KUMIKO_DRAIN_REJECT); a job
// the drain interrupts spends no attempt.

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

// lingerEnded waits for the drain's linger line and returns it.
func lingerEnded(t *testing.T, p *proc) map[string]any {
	t.Helper()
	return p.waitLog(20*time.Second, map[string]any{"event": "linger_ended"})
}

// Nobody sends anything: the linger lasts one probe period, not KUMIKO_LINGER.
func TestLingerWithoutTrafficEndsAfterOneProbePeriod(t *testing.T) {
	t.Parallel()
	env := fastEnv(t, "KUMIKO_LINGER=5s", "KUMIKO_READINESS_PROBE_PERIOD=300ms", "KUMIKO_SHUTDOWN_TIMEOUT=20s")
	p := startProc(t, env)
	p.waitReady()
	sent := time.Now()
	p.signal(syscall.SIGTERM)
	line := lingerEnded(t, p)
	code := p.wait(20 * time.Second)
	t.Logf("no traffic: linger %v ms (%v), SIGTERM → exit %d in %s", line["duration_ms"], line["ended"], code, time.Since(sent).Round(time.Millisecond))
	if line["ended"] != "quiet" || code != 0 {
		t.Errorf("linger ended=%v, exit %d: want quiet and 0", line["ended"], code)
	}
	if ms, _ := line["duration_ms"].(float64); ms < 300 {
		t.Errorf("the linger took %.0f ms: it must last at least the probe period (300 ms)", ms)
	}
}

// KUMIKO_LINGER_QUIET = KUMIKO_LINGER is a fixed linger, also on an instance
// nobody ever sent anything: the quiet counts from the stop request, not
// from the last client before it.
func TestFixedLingerLastsWithoutTraffic(t *testing.T) {
	t.Parallel()
	env := fastEnv(t, "KUMIKO_LINGER=1s", "KUMIKO_LINGER_QUIET=1s", "KUMIKO_READINESS_PROBE_PERIOD=100ms", "KUMIKO_SHUTDOWN_TIMEOUT=20s")
	p := startProc(t, env)
	p.waitReady()
	p.signal(syscall.SIGTERM)
	line := lingerEnded(t, p)
	code := p.wait(20 * time.Second)
	t.Logf("fixed linger, no traffic: linger %v ms (%v), exit %d", line["duration_ms"], line["ended"], code)
	if ms, _ := line["duration_ms"].(float64); line["ended"] != "max" || ms < 1000 || code != 0 {
		t.Errorf("linger %.0f ms ended=%v, exit %d: want at least 1000 ms, max, and 0", ms, line["ended"], code)
	}
}

// A client that keeps sending keeps the instance lingering until
// KUMIKO_LINGER; once it stops, the linger ends a quiet period later.
func TestLingerLastsWhileRequestsComeAndEndsWhenTheyStop(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		sendAnswered int64 // requests answered after the drain began; 0: until the listener closes
		linger       string
		wantEndedBy  string
	}{
		{"traffic until the end", 0, "1s", "max"},
		{"traffic that stops", 50, "10s", "quiet"}, // at the client's pace, 500 ms of traffic or more
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := fastEnv(t, "KUMIKO_LINGER="+tc.linger, "KUMIKO_READINESS_PROBE_PERIOD=100ms", "KUMIKO_LINGER_QUIET=900ms", "KUMIKO_SHUTDOWN_TIMEOUT=20s")
			p := startProc(t, env)
			_, api := p.waitReady()
			client := &http.Client{Timeout: 5 * time.Second}
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			var answered atomic.Int64
			done := make(chan struct{})
			go func() { // a request every 10 ms until stopped or refused
				defer close(done)
				pace(ctx, 10*time.Millisecond, func() bool {
					resp, err := client.Get(api + "/api/slow?ms=0")
					if err != nil {
						return false
					}
					resp.Body.Close()
					answered.Add(1)
					return true
				})
			}()
			p.signal(syscall.SIGTERM)
			if tc.sendAnswered > 0 {
				p.waitLog(10*time.Second, map[string]any{"event": "state_changed", "to": "draining"})
				from := answered.Load()
				waitFor(t, 20*time.Second, fmt.Sprintf("%d requests answered in the drain", tc.sendAnswered), func() bool {
					select {
					case <-done: // refused: the checks below say why
						return true
					default:
						return answered.Load()-from >= tc.sendAnswered
					}
				})
				stop()
			}
			line := lingerEnded(t, p)
			stop()
			<-done
			n := answered.Load()
			t.Logf("%s: %d requests; linger %v ms, ended by %v", tc.name, n, line["duration_ms"], line["ended"])
			if line["ended"] != tc.wantEndedBy {
				t.Errorf("linger ended by %v, want %s", line["ended"], tc.wantEndedBy)
			}
			if code := p.wait(20 * time.Second); code != 0 {
				t.Errorf("exit code %d", code)
			}
		})
	}
}

// After the linger a new client either finds the port closed (the default,
// refuse) or, with KUMIKO_DRAIN_REJECT=retry-after, is answered 503 with
// Retry-After and Connection: close while a request in flight finishes.
func TestDrainRejectModes(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"refuse", "retry-after"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			env := fastEnv(t, "KUMIKO_DRAIN_REJECT="+mode)
			p := startProc(t, env)
			ops, api := p.waitReady()
			slow := make(chan answer, 1)
			go func() {
				slow <- do(&http.Client{Timeout: 10 * time.Second}, must(http.NewRequest(http.MethodGet, api+"/api/slow?ms=1500", nil)))
			}()
			waitFor(t, 5*time.Second, "the slow request to be served", func() bool {
				n, _ := scrapeMetric(ops, "kumiko_http_requests_in_flight")
				return n >= 1
			})
			p.signal(syscall.SIGTERM)
			p.waitLog(5*time.Second, map[string]any{"msg": "lifecycle", "step": "closeListener"})
			fresh := do(&http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}},
				must(http.NewRequest(http.MethodGet, api+"/api/slow?ms=0", nil)))
			switch mode {
			case "refuse":
				if fresh.err == nil {
					t.Errorf("a new connection after the linger: %s, want refused", fresh)
				}
			case "retry-after":
				if fresh.status != http.StatusServiceUnavailable || fresh.retryAfter == "" {
					t.Errorf("a new request after the linger: %s, want 503 with Retry-After", fresh)
				}
			}
			if a := <-slow; a.status != http.StatusOK {
				t.Errorf("the request in flight: %s, want 200", a)
			}
			if code := p.wait(10 * time.Second); code != 0 {
				t.Errorf("exit code %d", code)
			}
		})
	}
}

// A job the drain cuts off is interrupted, not failed: River puts it back
// without spending an attempt, so a one-attempt job runs again on the other
// instance and completes, and the drain says so (event=job_interrupted).
// The budget is the behaviour's, not a speed: 10 s leave the jobs worker
// about 5 s, half of them the soft stop, which the 8 s job outlasts; the
// hard stop's half must hold River's cancel and its writes, which a 1.5 s
// budget (0.3 s for them) did not with both cores busy.
func TestProcessInterruptedJobSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	env := leaderEnv(t, "KUMIKO_LINGER=0", "KUMIKO_DRAIN_TIMEOUT=200ms", "KUMIKO_SHUTDOWN_TIMEOUT=10s")
	a := startAs(t, env, "a")
	a.waitReady()
	pool := sharedPool(t, env)
	inserter, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := inserter.Insert(context.Background(), sleepArgs{Ms: 8000}, &river.InsertOpts{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Job.ID
	waitFor(t, 10*time.Second, "the one-attempt job running on a", func() bool { return jobState(t, pool, id) == "running" })
	a.signal(syscall.SIGTERM)
	if code := a.wait(15 * time.Second); code != 0 {
		t.Errorf("exit code %d", code)
	}
	a.waitLog(time.Second, map[string]any{"event": "job_interrupted", "job_id": id})
	var state string
	var attempt, failures int
	if err := pool.QueryRow(context.Background(), `SELECT state, attempt, coalesce(array_length(errors, 1), 0) FROM river_job WHERE id = $1`, id).
		Scan(&state, &attempt, &failures); err != nil {
		t.Fatal(err)
	}
	t.Logf("after the drain: state %s, attempt %d, errors %d", state, attempt, failures)
	if state != "available" || attempt != 0 || failures != 0 {
		t.Errorf("the interrupted job is %s at attempt %d with %d errors; want available, 0, 0", state, attempt, failures)
	}
	b := startAs(t, env, "b")
	b.waitReady()
	waitFor(t, 30*time.Second, "the interrupted job to complete on b", func() bool { return jobState(t, pool, id) == "completed" })
}
