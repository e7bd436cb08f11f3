package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The jobs that wait are counted, at most twice the bound; past the bound the
// API's answers say Follow-Up-Delayed and the log says so once, and once
// again when the backlog is back under it. Nothing is refused.
func TestJobsBacklogPastItsBoundIsSaidNotShed(t *testing.T) {
	ctx := context.Background()
	f := newOutboxFixture(t) // a migrated database
	m := newBacklogMetrics(prometheus.NewRegistry())
	var logs bytes.Buffer
	w := newBacklogWatch(backlogWatchDeps{db: f.db, bound: 3, interval: time.Hour, call: time.Second, metrics: m,
		log: newLogger(&logs, "json"), onPanic: func(_ component, r any) { t.Errorf("the backlog watch panicked: %v", r) }})
	wait := func(n int) {
		t.Helper()
		if _, err := f.db.Exec(ctx, `INSERT INTO river_job (args, kind, max_attempts, queue)
			SELECT '{}', 'waiting', 1, 'waiting' FROM generate_series(1, $1)`, n); err != nil {
			t.Fatal(err)
		}
	}
	e := echo.New()
	e.GET("/api/x", func(c echo.Context) error { return c.NoContent(http.StatusNoContent) }, w.sayWhenDelayed())
	answer := func() (int, string) {
		rec := httptest.NewRecorder()
		e.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/x", nil))
		return rec.Code, rec.Header().Get(followUpDelayed)
	}
	check := func(when string, backlog float64, header string) {
		t.Helper()
		if got := testutil.ToFloat64(m.backlog); got != backlog {
			t.Errorf("%s: kumiko_jobs_backlog %v, want %v", when, got, backlog)
		}
		if code, got := answer(); code != http.StatusNoContent || got != header {
			t.Errorf("%s: the answer was %d with %s %q, want 204 with %q", when, code, followUpDelayed, got, header)
		}
	}

	wait(3)
	if err := w.Start(ctx); err != nil { // counts once before it returns
		t.Fatal(err)
	}
	defer w.Stop(ctx)
	check("3 jobs waiting, bound 3", 3, "")
	if bound := testutil.ToFloat64(m.bound); bound != 3 {
		t.Errorf("kumiko_jobs_backlog_bound %v, want 3", bound)
	}

	wait(10)
	for range 2 {
		if err := w.count(ctx); err != nil {
			t.Fatal(err)
		}
	}
	check("13 jobs waiting, bound 3", 6, "jobs") // counted up to twice the bound
	if n := strings.Count(logs.String(), "the jobs backlog is past its bound"); n != 1 {
		t.Errorf("%d lines say the backlog is past its bound after two counts, want 1:\n%s", n, logs.String())
	}

	if _, err := f.db.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE kind = 'waiting'`); err != nil {
		t.Fatal(err)
	}
	if err := w.count(ctx); err != nil {
		t.Fatal(err)
	}
	check("every job worked", 0, "")
	if n := strings.Count(logs.String(), "the jobs backlog is back under its bound"); n != 1 {
		t.Errorf("%d lines say the backlog is back under its bound, want 1:\n%s", n, logs.String())
	}
}
