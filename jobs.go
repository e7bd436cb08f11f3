package main

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/trace"
)

// The jobs block's components: the River client working jobs, and the loop
// beating for it (River's loops are River's).
var (
	componentJobsWorker    = component{name: "jobsWorker", heartbeat: "jobs", gates: true, connects: true}
	componentJobsHeartbeat = component{name: "jobsHeartbeat"}
)

// jobsConfig is the jobs block's settings.
type jobsConfig struct {
	Workers      uint
	PollInterval time.Duration
	Timeout      time.Duration
}

func (c *jobsConfig) settings() []configSetting {
	return []configSetting{
		{key: "jobs.workers", env: "KUMIKO_JOBS_WORKERS", def: "100", value: uintValue{p: &c.Workers, min: 1},
			doc: "jobs of one kind worked at once by this instance (each kind has its queue); River fetches at most this many every 100 ms, so short jobs need many"},
		{key: "jobs.pollInterval", env: "KUMIKO_JOBS_POLL_INTERVAL", def: "1s", value: durationValue{p: &c.PollInterval},
			doc: "River's fetch poll, the fallback to its LISTEN", old: "jobs.pollIntervalSec"},
		{key: "jobs.timeout", env: "KUMIKO_JOBS_TIMEOUT", def: "30s", value: durationValue{p: &c.Timeout},
			doc: "a job running longer is cancelled and retried; a job whose worker died (or whose fetch's answer was lost) is run again once it has been running this + 10 s, by River's rescuer, which looks every 30 s", old: "jobs.timeoutSec"},
	}
}

// jobs is the River client and what the rest of the process asks of it:
// the jobs an event triggers, and the jobs an operator may run by hand. Each
// is a River job: durable in Postgres, retried with backoff, rescued and run
// again when the worker running it crashed. The features declare them
// (features.go).
type jobs struct {
	client      *river.Client[pgx.Tx]
	pool        *pgxpool.Pool             // River's own (newJobs); Stop closes it
	stopping    atomic.Bool               // Stop has begun: a job cancelled now was interrupted, not failed
	subscribers map[string][]subscription // event type → the jobs it triggers
	manual      map[string]manualJob      // kind → a job an operator may run
	tracer      trace.Tracer
	log         *logrus.Entry
}

// jobsDeps is what newJobs builds the River client from.
type jobsDeps struct {
	cfg        jobsConfig
	newPool    func(maxConns int32) (*pgxpool.Pool, error) // River's own pool, lazy
	rescue     time.Duration                               // River runs a job again once it has been running this long: it was stranded
	instanceID string
	features   []feature
	work       workDeps
	tracer     trace.Tracer
	metrics    *jobsMetrics
	log        *logrus.Entry
}

// newJobs creates the River client without starting it: the outbox poller
// (phase 13) inserts jobs before the worker starts (phase 14).
func newJobs(d jobsDeps) (*jobs, error) {
	workers := river.NewWorkers()
	j := &jobs{tracer: d.tracer, log: d.log, subscribers: map[string][]subscription{}, manual: map[string]manualJob{}}
	for _, f := range d.features {
		for _, w := range f.workers {
			w.register(workers, d.work.usedBy(f))
		}
		for _, s := range f.subscriptions {
			j.subscribers[s.event] = append(j.subscribers[s.event], s)
		}
		for _, m := range f.manualJobs {
			j.manual[m.kind] = m
		}
	}
	// River works on a pool of its own: a connection listens, and every
	// queue's producer fetches on each poll. On the request path's pool,
	// those fetches held its few connections whenever PostgreSQL slowed
	// down, and requests and the lifecycle's own records waited behind them.
	// Each queue a connection, one to listen, one to complete and maintain.
	queues := queuesByKind(workerKinds(d.features), int(d.cfg.Workers))
	pool, err := d.newPool(int32(len(queues) + 2))
	if err != nil {
		return nil, err
	}
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		ID:                   d.instanceID,
		Queues:               queues,
		Workers:              workers,
		FetchPollInterval:    d.cfg.PollInterval,
		JobTimeout:           d.cfg.Timeout,
		RescueStuckJobsAfter: d.rescue,
		Logger:               riverLogger(d.log),
		Middleware: []rivertype.Middleware{traceAndCountJobs(d.tracer, d.metrics, j.stopping.Load, d.log),
			river.JobInsertMiddlewareFunc(insertIntoKindQueue)},
	})
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("creating the River client: %w", err)
	}
	j.client, j.pool = client, pool
	return j, nil
}

// riverLogger routes River's own warnings and errors (it logs with slog)
// through the process logger, so they get its format, its instance field and
// its secret scrubbing, like every other line.
func riverLogger(log *logrus.Entry) *slog.Logger {
	return slog.New(logrusHandler{log: log.WithField("component", "river"), level: slog.LevelWarn})
}

// logrusHandler is a slog.Handler writing to a logrus entry.
type logrusHandler struct {
	log   *logrus.Entry
	level slog.Level
	group string // prefix of attribute keys, from WithGroup
}

func (h logrusHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= h.level }

func (h logrusHandler) Handle(_ context.Context, r slog.Record) error {
	fields := logrus.Fields{}
	r.Attrs(func(a slog.Attr) bool {
		fields[h.group+a.Key] = a.Value.Resolve().Any()
		return true
	})
	e := h.log.WithFields(fields)
	switch {
	case r.Level >= slog.LevelError:
		e.Error(r.Message)
	case r.Level >= slog.LevelWarn:
		e.Warn(r.Message)
	case r.Level >= slog.LevelInfo:
		e.Info(r.Message)
	default:
		e.Debug(r.Message)
	}
	return nil
}

func (h logrusHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	fields := logrus.Fields{}
	for _, a := range attrs {
		fields[h.group+a.Key] = a.Value.Resolve().Any()
	}
	h.log = h.log.WithFields(fields)
	return h
}

func (h logrusHandler) WithGroup(name string) slog.Handler {
	if name != "" {
		h.group += name + "."
	}
	return h
}

// Each job kind has a queue of its own, with its own workers: a dependency
// that hangs (S3 under a kind that writes files) stalls only the kind that
// needs it, while the other kinds (one that indexes in Meilisearch) keep
// being worked. The default
// queue stays, with the same workers, for jobs inserted without a kind's
// queue (by an older version, or by hand in SQL).
func queuesByKind(kinds []string, workers int) map[string]river.QueueConfig {
	queues := map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: workers}}
	for _, kind := range kinds {
		queues[queueOf(kind)] = river.QueueConfig{MaxWorkers: workers}
	}
	return queues
}

// queueOf names a kind's queue in River's spelling: purgeOutbox → purge_outbox.
func queueOf(kind string) string {
	var b strings.Builder
	for i, r := range kind {
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}

// insertIntoKindQueue is River's insert middleware that puts every job in
// its kind's queue, whoever inserts it (a delivery, the scheduler, an
// operator), unless the insert names a queue itself.
func insertIntoKindQueue(ctx context.Context, params []*rivertype.JobInsertParams,
	doInner func(context.Context) ([]*rivertype.JobInsertResult, error)) ([]*rivertype.JobInsertResult, error) {
	for _, p := range params {
		if p.Queue == river.QueueDefault {
			p.Queue = queueOf(p.Kind)
		}
	}
	return doInner(ctx)
}

// Start starts working jobs (phase 14). River keeps running until the
// context given to Start ends; the phase's context ends with the phase, so
// River gets a detached one and lives until Stop.
func (j *jobs) Start(ctx context.Context) error { return j.client.Start(context.WithoutCancel(ctx)) }

// Stop stops River softly: running jobs may finish for half of what is left
// of ctx's deadline; then River cancels them, and the other half is the hard
// stop's (the cancelled jobs return, River writes each one's state and stops
// its services: round trips to the database, which a slow one, 600 ms each,
// made take more than a second). A job cut off this way is interrupted, not failed:
// River puts it back as available without spending an attempt (River 0.44's
// interrupted state), it runs again at once here or on another instance, and
// it is counted kumiko_jobs_total{result="interrupted"} — like a
// force-closed request, a warning, not a failed shutdown.
//
// The soft stop ends by the hook's own deadline, not after a time fixed at
// boot: the steps before this one may have spent much of the budget (a busy
// machine, a slow database), and a soft stop fixed at boot then outlasted the
// hook's slice, which made a clean drain exit 1. Stop of an unstarted client
// returns at once. A stopped client has given back every connection: River's
// pool closes with it.
func (j *jobs) Stop(ctx context.Context) error {
	j.stopping.Store(true)
	err := j.stopClient(ctx)
	if err == nil {
		j.pool.Close()
	}
	return err
}

func (j *jobs) stopClient(ctx context.Context) error {
	soft := ctx
	if deadline, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		soft, cancel = context.WithDeadline(ctx, deadline.Add(-time.Until(deadline)/2))
		defer cancel()
	}
	err := j.client.Stop(soft)
	if err == nil || soft.Err() == nil {
		return err
	}
	// The soft stop is over: cancel the running jobs. If the hook's whole
	// slice is gone too (a second signal), they still get abandonGrace.
	hard := ctx
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		hard, cancel = context.WithTimeout(context.WithoutCancel(ctx), abandonGrace)
		defer cancel()
	}
	if err := j.client.StopAndCancel(hard); err != nil {
		return fmt.Errorf("cancelling the running jobs: %w", err)
	}
	j.log.Warn(jobsCancelledAtStop)
	return nil
}

const jobsCancelledAtStop = "the soft stop ended with jobs running: they were cancelled and River runs them again, no attempt spent"

// jobsFeature is POST /admin/jobs/:name/run, the operator's way to run a job now.
func jobsFeature() feature {
	return feature{name: "jobs", uses: []dependency{usesJobs}, routes: []route{
		{method: http.MethodPost, path: "/admin/jobs/:name/run", admin: true, handler: func(d routeDeps) echo.HandlerFunc { return handleRunJob(d.jobs) }},
	}}
}

// handleRunJob is POST /admin/jobs/:name/run: run a job by hand, now, on
// whichever instance's worker picks it up.
func handleRunJob(j *jobs) echo.HandlerFunc {
	return func(c echo.Context) error {
		m, ok := j.manual[c.Param("name")]
		if !ok {
			return apiError(http.StatusNotFound, "unknown_job", "jobs that can be run by hand: "+strings.Join(slices.Sorted(maps.Keys(j.manual)), ", "))
		}
		args, err := m.args(c)
		if err != nil {
			return err
		}
		res, err := j.client.Insert(c.Request().Context(), args, nil)
		if err != nil {
			return fmt.Errorf("inserting job %s: %w", args.Kind(), err)
		}
		return c.JSON(http.StatusAccepted, map[string]any{"job": args.Kind(), "id": res.Job.ID})
	}
}
