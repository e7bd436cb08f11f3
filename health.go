package main

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
)

// checkResult is one entry of the readiness body's "checks": "ok" plus whatever
// the check wants an operator to see (latencyMs, provider, heartbeatAgoSec, ...).
type checkResult struct {
	OK     bool
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

// readinessCheck probes one dependency. gates says whether a failure makes the
// instance not ready: search and storage are shown but degrade features instead.
type readinessCheck struct {
	name  string
	gates bool
	probe func(ctx context.Context) checkResult
}

// readinessReport is the body of GET /health/ready.
type readinessReport struct {
	Status    string                 `json:"status"`
	State     string                 `json:"state"`
	Phase     string                 `json:"phase,omitempty"`
	UptimeSec int64                  `json:"uptimeSec"`
	Checks    map[string]checkResult `json:"checks"`
}

// readiness answers /health/ready. Dependency probes are cached: at most one
// probe runs at a time, each check is bounded, and its result is reused for a
// short TTL, so a storm of probes from load balancers does not become a storm
// of DB pings.
type readiness struct {
	lc           *Lifecycle
	metrics      *metrics
	probeTimeout time.Duration
	cacheTTL     time.Duration

	mu       sync.Mutex
	checks   []readinessCheck
	last     map[string]checkResult
	lastAt   time.Time
	inflight chan struct{} // closed when the running probe ends; nil when none runs
}

func newReadiness(lc *Lifecycle, m *metrics, probeTimeout, cacheTTL time.Duration) *readiness {
	return &readiness{lc: lc, metrics: m, probeTimeout: probeTimeout, cacheTTL: cacheTTL}
}

// RegisterReadinessCheck adds a check; phases call it right after the component
// they check is up.
func (rd *readiness) RegisterReadinessCheck(name string, gates bool, probe func(context.Context) checkResult) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	rd.checks = append(rd.checks, readinessCheck{name: name, gates: gates, probe: probe})
	rd.lastAt = time.Time{} // the cached result lacks the new check
}

// RegisterSkipped shows a component that is not configured (or not part of
// this build) in the body, with the reason, so an operator sees it is off on
// purpose. It never fails readiness.
func (rd *readiness) RegisterSkipped(name, reason string) {
	result := okResult(map[string]any{"skipped": reason})
	rd.RegisterReadinessCheck(name, false, func(context.Context) checkResult { return result })
}

// report builds the readiness body. Only a ready process probes its
// dependencies; starting and draining answer at once from what they know.
func (rd *readiness) report(ctx context.Context) (readinessReport, bool) {
	state := rd.lc.State()
	rep := readinessReport{Status: "not_ready", State: state.String(), UptimeSec: int64(rd.lc.Uptime().Seconds())}
	if state == StateStarting {
		rep.Phase = rd.lc.Phase()
	}
	if state != StateReady {
		rep.Checks = rd.cached()
		return rep, false
	}

	rep.Checks = rd.probe(ctx)
	ready := len(rd.failingGates(rep.Checks)) == 0
	// The state may have changed while the probe ran: a draining instance must
	// never answer 200.
	if ready && rd.lc.State() == StateReady {
		rep.Status = "ready"
		return rep, true
	}
	rep.State = rd.lc.State().String()
	return rep, false
}

// failingGates lists, sorted, the failed checks that decide readiness, each
// with its error.
func (rd *readiness) failingGates(results map[string]checkResult) []string {
	var failing []string
	for name, res := range results {
		if !res.OK && rd.gates(name) {
			failing = append(failing, fmt.Sprintf("%s: %v", name, res.Detail["error"]))
		}
	}
	slices.Sort(failing)
	return failing
}

// gates says whether the named check decides readiness.
func (rd *readiness) gates(name string) bool {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	for _, c := range rd.checks {
		if c.name == name {
			return c.gates
		}
	}
	return false
}

func (rd *readiness) cached() map[string]checkResult {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	return maps.Clone(rd.last)
}

// probe returns fresh-enough results: from the cache within its TTL, from the
// probe already running if there is one, or by running one.
func (rd *readiness) probe(ctx context.Context) map[string]checkResult {
	for {
		rd.mu.Lock()
		if !rd.lastAt.IsZero() && time.Since(rd.lastAt) < rd.cacheTTL {
			res := maps.Clone(rd.last)
			rd.mu.Unlock()
			return res
		}
		if wait := rd.inflight; wait != nil {
			rd.mu.Unlock()
			select {
			case <-wait:
				continue // its result is in the cache now
			case <-ctx.Done():
				return rd.cached()
			}
		}
		done := make(chan struct{})
		rd.inflight = done
		checks := append([]readinessCheck(nil), rd.checks...)
		rd.mu.Unlock()

		// The probe belongs to every waiter, not to the request that started it:
		// a client hanging up must not fail everyone else's answer.
		results := rd.runChecks(context.WithoutCancel(ctx), checks)

		rd.mu.Lock()
		rd.last, rd.lastAt, rd.inflight = results, time.Now(), nil
		rd.mu.Unlock()
		close(done)
		return maps.Clone(results)
	}
}

// runChecks probes every check concurrently, each bounded by probeTimeout.
func (rd *readiness) runChecks(ctx context.Context, checks []readinessCheck) map[string]checkResult {
	results := make(map[string]checkResult, len(checks))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, c := range checks {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, rd.probeTimeout)
			defer cancel()
			res := c.probe(cctx)
			rd.metrics.readinessProbes.WithLabelValues(c.name).Inc()
			rd.metrics.readinessOK.WithLabelValues(c.name).Set(boolGauge(res.OK))
			mu.Lock()
			results[c.name] = res
			mu.Unlock()
		})
	}
	wg.Wait()
	return results
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
		rep, ok := rd.report(c.Request().Context())
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
