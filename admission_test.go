package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// limiterClock drives a concurrencyLimiter through windows without a clock:
// each window admits busy requests at once and ends them all with the same
// latency, admissionWindow after the last one.
type limiterClock struct {
	t   *testing.T
	l   *concurrencyLimiter
	now time.Time
}

func newLimiterClock(t *testing.T, cfg admissionConfig) *limiterClock {
	start := time.Date(2026, 12, 5, 8, 0, 0, 0, time.UTC)
	return &limiterClock{t: t, l: newConcurrencyLimiter(cfg, start), now: start}
}

// window runs one window: busy requests at once (as many as the limit
// admits), then one at a time until the window has its samples, all taking
// latency except outliers of the first ones, which take slow. The last ends
// admissionWindow after the window began. It returns the limit after it.
func (c *limiterClock) window(busy int, latency time.Duration, outliers int, slow time.Duration) int {
	c.t.Helper()
	var took []time.Duration
	for range busy {
		if !c.l.acquire() {
			break
		}
		d := latency
		if len(took) < outliers {
			d = slow
		}
		took = append(took, d)
	}
	for len(took) < admissionMinSamples {
		took = append(took, latency) // acquired one at a time below
	}
	admitted := len(took)
	if busy < admitted {
		admitted = busy
	}
	during := c.now.Add(admissionWindow / 2)
	for i, d := range took {
		at := during
		if i == len(took)-1 {
			at = c.now.Add(admissionWindow)
		}
		if i >= admitted && !c.l.acquire() {
			c.t.Fatalf("nothing in flight and still shedding (limit %.1f)", c.l.limit)
		}
		closed := c.l.release(d, at)
		if closed != (i == len(took)-1) {
			c.t.Fatalf("the window closed at sample %d of %d", i+1, len(took))
		}
	}
	c.now = c.now.Add(admissionWindow)
	limit, inFlight, _ := c.l.state()
	if inFlight != 0 {
		c.t.Fatalf("%d still in flight after the window", inFlight)
	}
	return limit
}

func TestConcurrencyLimiterShedsPastTheLimit(t *testing.T) {
	l := newConcurrencyLimiter(admissionConfig{min: 3, max: 10, tolerance: 1.5}, time.Now())
	for i := range 3 {
		if !l.acquire() {
			t.Fatalf("request %d of 3 shed with a limit of 3", i+1)
		}
	}
	if l.acquire() {
		t.Fatal("a fourth request admitted with a limit of 3")
	}
	l.release(time.Millisecond, time.Now())
	if !l.acquire() {
		t.Fatal("a request shed after one of the three ended")
	}
}

// While the median latency stays at its baseline and the limit is in use,
// the limit grows up to the maximum; once it doubles, the limit shrinks, in
// steps, down to where the latency was acceptable, and never below the minimum.
func TestConcurrencyLimiterFollowsLatency(t *testing.T) {
	c := newLimiterClock(t, admissionConfig{min: 16, max: 200, tolerance: 1.5})
	limits := []int{c.window(16, 10*time.Millisecond, 0, 0)}
	for range 60 {
		limits = append(limits, c.window(1000, 10*time.Millisecond, 0, 0))
	}
	for i := 1; i < len(limits); i++ {
		if limits[i] < limits[i-1] {
			t.Fatalf("the limit went down at a steady latency: %v", limits)
		}
	}
	if got := limits[len(limits)-1]; got != 200 {
		t.Fatalf("limit %d after 60 busy windows at a steady latency, want the maximum 200: %v", got, limits)
	}
	_, _, baseline := c.l.state()
	if baseline != 10*time.Millisecond {
		t.Fatalf("baseline %s, want the steady 10ms", baseline)
	}

	// Twice as slow: beyond the tolerance (1.5), the limit shrinks, window
	// by window, at most by half each time.
	prev := 200
	var shrinking []int
	for range 10 {
		got := c.window(1000, 20*time.Millisecond, 0, 0)
		shrinking = append(shrinking, got)
		if got >= prev || got < prev/2 {
			t.Fatalf("limits while twice as slow: %v (from 200): want each lower, by at most half", shrinking)
		}
		prev = got
	}
	// Very slow for long: the minimum holds.
	for range 50 {
		prev = c.window(1000, time.Second, 0, 0)
	}
	if prev != 16 {
		t.Fatalf("limit %d after 50 windows at 100× the baseline, want the minimum 16", prev)
	}
}

// The median decides: a few requests that take long (a slow client's body)
// do not shrink everyone's limit.
func TestConcurrencyLimiterIgnoresAFewSlowRequests(t *testing.T) {
	c := newLimiterClock(t, admissionConfig{min: 16, max: 200, tolerance: 1.5})
	c.window(16, 10*time.Millisecond, 0, 0)
	before := c.window(16, 10*time.Millisecond, 0, 0)
	after := c.window(1000, 10*time.Millisecond, 7, 15*time.Second)
	if after < before {
		t.Fatalf("7 of %d requests taking 15s shrank the limit from %d to %d", before, before, after)
	}
}

// At idle the limit is not in use: its latency teaches nothing, so neither
// the baseline nor the limit moves.
func TestConcurrencyLimiterLearnsNothingAtIdle(t *testing.T) {
	c := newLimiterClock(t, admissionConfig{min: 16, max: 200, tolerance: 1.5})
	for range 20 {
		if got := c.window(1, 100*time.Microsecond, 0, 0); got != 16 {
			t.Fatalf("limit %d after an idle window, want it unchanged at 16", got)
		}
	}
	if _, _, baseline := c.l.state(); baseline != 0 {
		t.Fatalf("baseline %s learned at idle, want none", baseline)
	}
	// The first busy window is the first baseline.
	c.window(16, 8*time.Millisecond, 0, 0)
	if _, _, baseline := c.l.state(); baseline != 8*time.Millisecond {
		t.Fatalf("baseline %s after the first busy window, want its 8ms", baseline)
	}
}

// A sustained overload does not quickly teach the baseline that slow is
// normal, and once it ends the limit grows again at once; after a long and
// heavy one the baseline is back near where it was within a few windows.
func TestConcurrencyLimiterBaselineRisesSlowlyAndRecovers(t *testing.T) {
	c := newLimiterClock(t, admissionConfig{min: 16, max: 200, tolerance: 1.5})
	c.window(16, 10*time.Millisecond, 0, 0)
	for range 100 { // 10 s of windows three times slower
		c.window(1000, 30*time.Millisecond, 0, 0)
	}
	_, _, baseline := c.l.state()
	if baseline > 15*time.Millisecond {
		t.Fatalf("baseline %s after 100 windows at 30ms from 10ms: it followed the overload too fast", baseline)
	}
	prev := c.window(1000, 10*time.Millisecond, 0, 0)
	for range 10 {
		got := c.window(1000, 10*time.Millisecond, 0, 0)
		if got <= prev && got < 200 {
			t.Fatalf("limit %d after %d: not growing again once the overload ended", got, prev)
		}
		prev = got
	}

	for range 100 { // ten times slower
		c.window(1000, 100*time.Millisecond, 0, 0)
	}
	_, _, high := c.l.state()
	for range 10 {
		c.window(1000, 10*time.Millisecond, 0, 0)
	}
	if _, _, after := c.l.state(); after > 17*time.Millisecond {
		t.Fatalf("baseline %s (from %s) after 10 windows back at 10ms: it came down too slowly", after, high)
	}
}

// A window in which the limit refused requests measures the overload, not
// the instance: the baseline does not rise from it, however long the
// overload lasts; at the limit with nobody refused it rises, slowly.
func TestConcurrencyLimiterBaselineDoesNotLearnFromRefusals(t *testing.T) {
	c := newLimiterClock(t, admissionConfig{min: 16, max: 200, tolerance: 1.5})
	c.window(16, 10*time.Millisecond, 0, 0)
	for range 300 { // 30 s of windows three times slower, each refusing some
		c.window(1000, 30*time.Millisecond, 0, 0)
	}
	if _, _, baseline := c.l.state(); baseline != 10*time.Millisecond {
		t.Fatalf("baseline %s after 300 windows that refused requests, want the 10ms it had", baseline)
	}
	for range 100 { // as slow, but exactly the limit arrives: nobody refused
		limit, _, _ := c.l.state()
		c.window(limit, 30*time.Millisecond, 0, 0)
	}
	if _, _, baseline := c.l.state(); baseline <= 11*time.Millisecond || baseline > 15*time.Millisecond {
		t.Fatalf("baseline %s after 100 windows at 30ms refusing nobody, want it risen slowly from 10ms (11–15ms)", baseline)
	}
}

// A shed request is answered at once with 503, Retry-After and the API's
// JSON error, its handler never called, and counted; the admitted one is
// served. Health and the event stream are never shed: the full limit of a
// real API listener still answers them.
func TestAdmissionShedsWith503AndRetryAfter(t *testing.T) {
	m := newMetrics()
	l := newConcurrencyLimiter(admissionConfig{min: 1, max: 1, tolerance: 1.5}, time.Now())
	e := newEcho(newLogger(io.Discard, "json"), m, componentAPI)
	called := 0
	e.POST("/api/notes", func(c echo.Context) error { called++; return c.NoContent(http.StatusCreated) }, admitWithinLimit(l, m))

	if !l.acquire() { // the one slot, taken by a request in flight
		t.Fatal("the first request was shed")
	}
	rec := httptest.NewRecorder()
	e.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/api/notes", strings.NewReader(`{}`)))
	var body struct{ Error errorBody }
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != http.StatusServiceUnavailable ||
		rec.Header().Get("Retry-After") != "1" || body.Error.Code != "overloaded" || called != 0 {
		t.Fatalf("over the limit: %d, Retry-After %q, body %s (%v), handler called %d times; want 503, 1, code overloaded, never",
			rec.Code, rec.Header().Get("Retry-After"), rec.Body, err, called)
	}
	if got := testutil.ToFloat64(m.admissionShed); got != 1 {
		t.Fatalf("%v shed counted, want 1", got)
	}

	l.release(time.Millisecond, time.Now())
	rec = httptest.NewRecorder()
	e.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/api/notes", strings.NewReader(`{}`)))
	if rec.Code != http.StatusCreated || called != 1 {
		t.Fatalf("within the limit: %d, handler called %d times; want 201, once", rec.Code, called)
	}
}

// On a real API listener with a limit of one, taken by a request in flight,
// the next API request is shed, while health, readiness, the page, the
// event stream, /api/slow and the ops port still answer. Once the slot is
// free the API request is served.
func TestAdmissionNeverShedsHealthStreamsOrTheOpsPort(t *testing.T) {
	s := startInProcess(t, fastEnv(t, "KUMIKO_API_CONCURRENCY_MIN=1", "KUMIKO_API_CONCURRENCY_MAX=1"))
	get := func(url string) *http.Response {
		t.Helper()
		res, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		return res
	}
	if !s.app.admission.acquire() { // the one place, as a request in flight holds it
		t.Fatal("an idle instance shed a request")
	}
	if res := get(apiURL(s) + "/api/instance"); res.StatusCode != http.StatusServiceUnavailable || res.Header.Get("Retry-After") != "1" {
		t.Fatalf("an API request over the limit: %d, Retry-After %q; want 503, 1", res.StatusCode, res.Header.Get("Retry-After"))
	}
	for _, url := range []string{apiURL(s) + "/health", apiURL(s) + "/health/ready", apiURL(s) + "/", apiURL(s) + "/api/slow?ms=0",
		opsURL(s) + "/health", opsURL(s) + "/health/ready", opsURL(s) + "/metrics"} {
		if res := get(url); res.StatusCode != http.StatusOK {
			t.Errorf("GET %s at the limit: %d, want 200", url, res.StatusCode)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, apiURL(s)+"/api/events", nil)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != http.StatusOK || !strings.HasPrefix(res.Header.Get("Content-Type"), "text/event-stream") {
		t.Errorf("GET /api/events at the limit: %d %q, want a stream", res.StatusCode, res.Header.Get("Content-Type"))
	}
	cancel()
	res.Body.Close()
	if got := testutil.ToFloat64(s.app.metrics.admissionShed); got != 1 {
		t.Errorf("%v requests counted as shed, want the one API request", got)
	}

	s.app.admission.release(time.Millisecond, time.Now())
	if res := get(apiURL(s) + "/api/instance"); res.StatusCode != http.StatusOK {
		t.Fatalf("the API request with the place free: %d, want 200", res.StatusCode)
	}
}
