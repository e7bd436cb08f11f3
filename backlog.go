package main

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/sirupsen/logrus"
)

// componentJobsBacklog is the loop counting the jobs that wait.
var componentJobsBacklog = component{name: "jobsBacklog"}

// backlogConfig is the backlog watch's setting.
type backlogConfig struct{ Max uint }

func (c *backlogConfig) settings() []configSetting {
	return []configSetting{
		{key: "jobs.backlogMax", env: "KUMIKO_JOBS_BACKLOG_MAX", def: "10000", value: uintValue{p: &c.Max, min: 1},
			doc: "jobs waiting to be worked past which the API's answers say Follow-Up-Delayed and the log warns; the service keeps serving (backlog.go)"},
	}
}

// The jobs backlog: the jobs that wait to be worked (River's state
// "available": due, and taken by no worker yet). Work arrives with the
// requests, faster than the workers finish it if the service takes more than
// they can do, and nothing else would tell anyone until the backlog is huge.
//
// What happens at the bound (KUMIKO_JOBS_BACKLOG_MAX): the service says so
// and keeps serving. A backlog is no reason to refuse requests — the jobs are
// durable, and the workers catch up once the load falls — so readiness stays
// 200 and nothing is shed; but the API's answers carry Follow-Up-Delayed:
// jobs (what a request set going will happen later than usual), the log says
// it once when the bound is crossed and once when the backlog is back under
// it, and kumiko_jobs_backlog above kumiko_jobs_backlog_bound pages
// (KumikoJobsBacklog). Every instance counts, once a heartbeat interval and
// at most twice the bound, so a count costs the same whatever the backlog.

// followUpDelayed is the header of an API answer given while the jobs backlog
// is past its bound.
const followUpDelayed = "Follow-Up-Delayed"

type backlogWatch struct {
	*startStop // stopNow: a count in flight is worth nothing after the stop
	db         *pgxpool.Pool
	bound      int64
	interval   time.Duration
	call       time.Duration // one count
	over       atomic.Bool
	metrics    *backlogMetrics
	log        *logrus.Entry
}

type backlogWatchDeps struct {
	db       *pgxpool.Pool
	bound    uint
	interval time.Duration
	call     time.Duration
	metrics  *backlogMetrics
	log      *logrus.Logger
	onPanic  func(c component, recovered any)
}

func newBacklogWatch(d backlogWatchDeps) *backlogWatch {
	d.metrics.bound.Set(float64(d.bound))
	return &backlogWatch{startStop: newStartStop(componentJobsBacklog, stopNow, d.onPanic), db: d.db, bound: int64(d.bound),
		interval: d.interval, call: d.call, metrics: d.metrics, log: componentJobsBacklog.log(d.log)}
}

// Start counts once, so the gauge and the header are true from the first
// request on, then once an interval. A count that fails is a warning, never
// a failed boot: the backlog is information, not a dependency.
func (w *backlogWatch) Start(ctx context.Context) error {
	recount := func(ctx context.Context) {
		if err := w.count(ctx); err != nil && ctx.Err() == nil {
			w.log.WithError(err).Warn("counting the jobs backlog; the last count stands")
		}
	}
	return w.start(ctx, func(ctx context.Context) error {
		recount(ctx)
		return nil
	}, func(ctx context.Context) { everyTick(ctx, w.interval, nil, recount) })
}

// count reads the backlog, at most twice the bound, and says when it crosses
// the bound.
func (w *backlogWatch) count(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, w.call)
	defer cancel()
	var n int64
	if err := w.db.QueryRow(ctx, `SELECT count(*) FROM (SELECT FROM river_job WHERE state = 'available' LIMIT $1) AS backlog`,
		2*w.bound).Scan(&n); err != nil {
		return fmt.Errorf("counting the jobs backlog: %w", err)
	}
	w.metrics.backlog.Set(float64(n))
	over := n > w.bound
	if w.over.Swap(over) == over {
		return nil
	}
	log := w.log.WithFields(logrus.Fields{"backlog": n, "bound": w.bound})
	if over {
		log.Warn("the jobs backlog is past its bound: follow-up work is delayed, the API's answers say Follow-Up-Delayed")
	} else {
		log.Info("the jobs backlog is back under its bound")
	}
	return nil
}

// sayWhenDelayed marks the API's answers while the backlog is past its bound.
func (w *backlogWatch) sayWhenDelayed() echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if w.over.Load() {
				c.Response().Header().Set(followUpDelayed, "jobs")
			}
			return next(c)
		}
	}
}

// backlogMetrics is what the backlog watch adds to /metrics.
type backlogMetrics struct {
	backlog prometheus.Gauge
	bound   prometheus.Gauge
}

func newBacklogMetrics(r prometheus.Registerer) *backlogMetrics {
	f := promauto.With(r)
	return &backlogMetrics{
		backlog: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "jobs_backlog", Help: "Jobs waiting to be worked (available, not yet taken), counted up to twice the bound (backlog.go).",
		}),
		bound: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "jobs_backlog_bound", Help: "KUMIKO_JOBS_BACKLOG_MAX: past it, the API's answers say Follow-Up-Delayed.",
		}),
	}
}
