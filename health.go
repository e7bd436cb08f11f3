package main

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
)

// Readiness means "a request sent here now will most likely succeed", and
// nothing else. It therefore gates on this instance's own state and on what
// its core path cannot work without (PostgreSQL, and its own workers being
// alive); a dependency that every instance shares and the core path can do
// without (Redis, search, storage) is listed as degraded but never fails
// readiness. Gating on a shared dependency fails every instance at the same
// moment: the load balancer is left with no server although each instance
// could serve, and a partial outage becomes a total one.
//
// The probe never waits for a dependency either. Each check runs in the
// background, in its own loop and on its own deadline (so at most one probe
// of a dependency is in flight), and /health/ready reads the latest results
// with their age: a hung S3 or a frozen Redis cannot make a load balancer's
// check time out.

// checkResult is one entry of the readiness body's "checks": "ok" plus whatever
// the check wants an operator to see (latencyMs, provider, heartbeatAgoSec, ...).
type checkResult struct {
	OK bool
	// Shared marks a failure whose cause every instance shares (the
	// heartbeats of a worker that runs, but cannot reach Redis; one failed
	// ping of the database): shown as degraded, it never fails readiness,
	// even under a gating check.
	Shared bool
	Detail map[string]any
}

func (r checkResult) MarshalJSON() ([]byte, error) {
	out := make(map[string]any, len(r.Detail)+1)
	maps.Copy(out, r.Detail)
	out["ok"] = r.OK
	return json.Marshal(out)
}

func okResult(detail map[string]any) checkResult { return checkResult{OK: true, Detail: detail} }

func failedResult(err error, detail map[string]any) checkResult {
	if detail == nil {
		detail = map[string]any{}
	}
	detail["error"] = err.Error()
	return checkResult{OK: false, Detail: detail}
}

// readinessCheck probes one dependency. gates says whether a failure makes
// the instance not ready; the rule above decides which checks do.
type readinessCheck struct {
	name  string
	gates bool
	probe func(ctx context.Context) checkResult
}

// check is a registered check and its latest result.
type check struct {
	readinessCheck
	result checkResult   // guarded by readiness.mu
	at     time.Time     // when result was taken; zero before the first
	first  chan struct{} // closed when the first result is in
}

// readinessReport is the body of GET /health/ready.
type readinessReport struct {
	Status    string                 `json:"status"`
	State     string                 `json:"state"`
	Phase     string                 `json:"phase,omitempty"`
	UptimeSec int64                  `json:"uptimeSec"`
	Degraded  []string               `json:"degraded,omitempty"` // failing checks that do not gate
	Checks    map[string]checkResult `json:"checks"`
}

// readiness runs the checks in the background (Start, Stop: startStop, one
// loop per check) and answers /health/ready from their latest results.
type readiness struct {
	*startStop
	lc           *Lifecycle
	metrics      *metrics
	probeTimeout time.Duration // one run of one check
	interval     time.Duration // how often each check runs
	staleAfter   time.Duration // readinessStale (timeouts.go): an older result counts as failed

	mu      sync.Mutex
	checks  []*check
	started time.Time // when the loops began: a check with no result is stale from here
}

func newReadiness(lc *Lifecycle, m *metrics, probeTimeout, interval, staleAfter time.Duration, onPanic func(component, any)) *readiness {
	return &readiness{startStop: newStartStop(componentReadinessChecks, stopNow, onPanic), lc: lc, metrics: m,
		probeTimeout: probeTimeout, interval: interval, staleAfter: staleAfter}
}

// RegisterReadinessCheck adds a check; phases call it right after the
// component they check is up, before Start (phase 16).
func (rd *readiness) RegisterReadinessCheck(name string, gates bool, probe func(context.Context) checkResult) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	rd.checks = append(rd.checks, &check{readinessCheck: readinessCheck{name: name, gates: gates, probe: probe}, first: make(chan struct{})})
}

// RegisterSkipped shows a component that is not configured (or not part of
// this build) in the body, with the reason, so an operator sees it is off on
// purpose. It never fails readiness.
func (rd *readiness) RegisterSkipped(name, reason string) {
	result := okResult(map[string]any{"skipped": reason})
	rd.RegisterReadinessCheck(name, false, func(context.Context) checkResult { return result })
}

// Start runs every check at once and then every interval, each in its own
// loop. WaitFirstResults tells when the checks have a first result.
func (rd *readiness) Start(ctx context.Context) error {
	rd.mu.Lock()
	rd.started = time.Now()
	rd.mu.Unlock()
	return rd.start(ctx, nil, func(ctx context.Context) {
		rd.mu.Lock()
		checks := slices.Clone(rd.checks)
		rd.mu.Unlock()
		for _, c := range checks {
			rd.goOwned(ctx, func(ctx context.Context) { rd.loop(ctx, c) })
		}
		<-ctx.Done()
	})
}

// loop runs one check until the readiness stops. A run that hangs past its
// deadline holds back only this check's next run, and its result turns
// stale meanwhile.
func (rd *readiness) loop(ctx context.Context, c *check) {
	tick := time.NewTicker(rd.interval)
	defer tick.Stop()
	for {
		rd.run(ctx, c)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// run probes one check, bounded by probeTimeout, and keeps its result.
func (rd *readiness) run(ctx context.Context, c *check) {
	cctx, cancel := context.WithTimeout(ctx, rd.probeTimeout)
	res := c.probe(cctx)
	cancel()
	if ctx.Err() != nil {
		return // stopped: a cancelled probe says nothing about the dependency
	}
	rd.metrics.readinessProbes.WithLabelValues(c.name).Inc()
	rd.metrics.readinessOK.WithLabelValues(c.name).Set(boolGauge(res.OK))
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if c.at.IsZero() {
		close(c.first)
	}
	c.result, c.at = res, time.Now()
}

// WaitFirstResults returns once every check has a first result, or when ctx
// ends. Phase 16 waits for it: the first 200 must be backed by a real probe
// of what gates, and its body shows every check. An optional check is waited
// for one probe timeout at most (its run's own deadline), so an optional
// dependency that hangs holds no boot.
func (rd *readiness) WaitFirstResults(ctx context.Context) error {
	rd.mu.Lock()
	checks := slices.Clone(rd.checks)
	rd.mu.Unlock()
	optional := time.NewTimer(rd.probeTimeout)
	defer optional.Stop()
	waitOptional := optional.C
	for _, c := range checks {
		if !c.gates {
			select {
			case <-c.first:
			case <-waitOptional:
				waitOptional = nil // spent: the other optional ones are not waited for
			case <-ctx.Done():
			}
			continue
		}
		select {
		case <-c.first:
		case <-ctx.Done():
			return fmt.Errorf("waiting for the first result of readiness check %s: %w", c.name, context.Cause(ctx))
		}
	}
	return ctx.Err()
}

// WaitGatesPass waits until no gating check fails, reading the latest
// results every interval, or until ctx (the phase's) ends, then names the
// checks still failing. A gate that fails once at the start is not a failed
// boot: on a machine with both cores busy, a worker's loop was once not
// scheduled within its 1 s heartbeat TTL, and the boot ended for it.
func (rd *readiness) WaitGatesPass(ctx context.Context, interval time.Duration) error {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		failing := rd.failingGates(rd.results())
		if len(failing) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("readiness checks failing: %s: %w", strings.Join(failing, "; "), context.Cause(ctx))
		case <-tick.C:
		}
	}
}

// results are the latest results with their age; a stale one is a failure
// that says so.
func (rd *readiness) results() map[string]checkResult {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	now := time.Now()
	out := make(map[string]checkResult, len(rd.checks))
	for _, c := range rd.checks {
		res, age := c.result, now.Sub(c.at)
		if c.at.IsZero() { // its first run has not returned yet
			if rd.started.IsZero() || now.Sub(rd.started) <= rd.staleAfter {
				continue
			}
			age = now.Sub(rd.started)
		}
		res.Detail = maps.Clone(res.Detail)
		if res.Detail == nil {
			res.Detail = map[string]any{}
		}
		res.Detail["ageMs"] = age.Milliseconds()
		if age > rd.staleAfter {
			res.OK, res.Shared = false, false
			res.Detail["error"] = fmt.Sprintf("no result for %s: the check hangs past its %s deadline", age.Round(time.Millisecond), rd.probeTimeout)
		}
		out[c.name] = res
	}
	return out
}

// report builds the readiness body from the latest results; it never waits.
// Only a ready process can be ready; starting and draining say so whatever
// the checks found.
func (rd *readiness) report() (readinessReport, bool) {
	state := rd.lc.State()
	rep := readinessReport{Status: "not_ready", State: state.String(), UptimeSec: int64(rd.lc.Uptime().Seconds()), Checks: rd.results()}
	if state == StateStarting {
		rep.Phase = rd.lc.Phase()
	}
	for name, res := range rep.Checks {
		if !res.OK && !rd.gatesOn(name, res) {
			rep.Degraded = append(rep.Degraded, name)
		}
	}
	slices.Sort(rep.Degraded)
	if state == StateReady && len(rd.failingGates(rep.Checks)) == 0 {
		rep.Status = "ready"
		return rep, true
	}
	return rep, false
}

// failingGates lists, sorted, the failed checks that decide readiness, each
// with its error.
func (rd *readiness) failingGates(results map[string]checkResult) []string {
	var failing []string
	for name, res := range results {
		if !res.OK && rd.gatesOn(name, res) {
			failing = append(failing, fmt.Sprintf("%s: %v", name, res.Detail["error"]))
		}
	}
	slices.Sort(failing)
	return failing
}

// gatesOn says whether the named check's failure res decides readiness.
func (rd *readiness) gatesOn(name string, res checkResult) bool {
	if res.Shared {
		return false
	}
	rd.mu.Lock()
	defer rd.mu.Unlock()
	for _, c := range rd.checks {
		if c.name == name {
			return c.gates
		}
	}
	return false
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// timedCheck runs fn and reports its latency, the common shape of a ping check.
func timedCheck(ctx context.Context, fn func(context.Context) error) checkResult {
	start := time.Now()
	err := fn(ctx)
	detail := map[string]any{"latencyMs": time.Since(start).Milliseconds()}
	if err != nil {
		return failedResult(err, detail)
	}
	return okResult(detail)
}

// handleLive is GET /health: 200 for as long as the process lives.
func handleLive() echo.HandlerFunc {
	body := map[string]string{"status": "alive"}
	return func(c echo.Context) error {
		return c.JSON(http.StatusOK, body)
	}
}

// handleReady is GET /health/ready: 200 only when ready and every gating
// check passes. detailed is the ops port's body (error text, latency,
// provider, notes); the public API port gets status only: the state and each
// check's ok, since error text names users, databases and addresses.
func handleReady(rd *readiness, detailed bool) echo.HandlerFunc {
	return func(c echo.Context) error {
		rep, ok := rd.report()
		c.Response().Header().Set("Cache-Control", "no-store")
		if !detailed {
			rep = rep.statusOnly()
		}
		status := http.StatusOK
		if !ok {
			status = http.StatusServiceUnavailable
		}
		return c.JSON(status, rep)
	}
}

// statusOnly drops every check's details and keeps whether it is ok.
func (r readinessReport) statusOnly() readinessReport {
	checks := make(map[string]checkResult, len(r.Checks))
	for name, res := range r.Checks {
		checks[name] = checkResult{OK: res.OK}
	}
	r.Checks = checks
	return r
}
