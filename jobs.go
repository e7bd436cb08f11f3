package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/meilisearch/meilisearch-go"
	"github.com/minio/minio-go/v7"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/trace"
)

// Job kinds. Each is a River job: durable in Postgres, retried with backoff,
// rescued and run again when the worker running it crashed.
const (
	jobIndexOrder   = "indexOrder"   // order.created → the order in Meilisearch
	jobWriteReceipt = "writeReceipt" // order.created → a sealed receipt object in S3
	jobReport       = "report"       // cron (leader only) or manual → a report object in S3
	jobSleep        = "sleep"        // manual: takes ms milliseconds, to watch a job survive a drain or a crash
	jobPurgeOutbox  = "purgeOutbox"  // cron (leader only) or manual → delivered outbox events past the retention deleted
)

type indexOrderArgs struct {
	OrderID int64 `json:"orderId"`
}

func (indexOrderArgs) Kind() string { return jobIndexOrder }

type writeReceiptArgs struct {
	OrderID int64 `json:"orderId"`
}

func (writeReceiptArgs) Kind() string { return jobWriteReceipt }

// reportArgs is one report. ScheduledAt is unique: two leaders (or a leader
// and its stale predecessor) can never enqueue the same cron tick twice.
type reportArgs struct {
	ScheduledAt  time.Time `json:"scheduledAt" river:"unique"`
	FencingToken int64     `json:"fencingToken,omitempty"`
	Manual       bool      `json:"manual,omitempty"`
}

func (reportArgs) Kind() string { return jobReport }

// purgeOutboxArgs is one run of the outbox retention; unique per tick like the report.
type purgeOutboxArgs struct {
	ScheduledAt  time.Time `json:"scheduledAt" river:"unique"`
	FencingToken int64     `json:"fencingToken,omitempty"`
	Manual       bool      `json:"manual,omitempty"`
}

func (purgeOutboxArgs) Kind() string { return jobPurgeOutbox }

func (purgeOutboxArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}
}

type sleepArgs struct {
	Ms int `json:"ms"`
}

func (sleepArgs) Kind() string { return jobSleep }

func (reportArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}
}

// jobs is the River client and what the rest of the process asks of it:
// the jobs an event triggers, and the jobs an operator may run by hand.
type jobs struct {
	client      *river.Client[pgx.Tx]
	stopping    atomic.Bool         // Stop has begun: a job cancelled now was interrupted, not failed
	subscribers map[string][]string // event type → job kinds, from the feature graph
	tracer      trace.Tracer
	log         *logrus.Entry
}

// jobDeps is what the workers use; search and storage may be nil (not configured).
type jobDeps struct {
	db        *pgxpool.Pool
	search    meilisearch.ServiceManager
	storage   *minio.Client
	bucket    string
	masterKey *masterKey
	log       *logrus.Entry
	// outboxRetention is how long delivered outbox events are kept.
	outboxRetention time.Duration
}

// newJobs creates the River client without starting it: the outbox poller
// (phase 13) inserts jobs before the worker starts (phase 14). softStop is
// how long a stop lets running jobs finish before River cancels them.
func newJobs(d jobDeps, cfg jobsConfig, softStop time.Duration, instanceID string, features []feature, tracer trace.Tracer, m *metrics) (*jobs, error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(d.indexOrder))
	river.AddWorker(workers, river.WorkFunc(d.writeReceipt))
	river.AddWorker(workers, river.WorkFunc(d.writeReport))
	river.AddWorker(workers, river.WorkFunc(sleepJob))
	river.AddWorker(workers, river.WorkFunc(d.purgeOutbox))
	j := &jobs{tracer: tracer, log: d.log}
	client, err := river.NewClient(riverpgxv5.New(d.db), &river.Config{
		ID:                   instanceID,
		Queues:               map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: int(cfg.Workers)}},
		Workers:              workers,
		FetchPollInterval:    cfg.PollInterval,
		JobTimeout:           cfg.Timeout,
		RescueStuckJobsAfter: cfg.RescueAfter,
		SoftStopTimeout:      softStop,
		Logger:               riverLogger(d.log),
		Middleware:           []rivertype.Middleware{traceAndCountJobs(tracer, m, j.stopping.Load, d.log)},
	})
	if err != nil {
		return nil, fmt.Errorf("creating the River client: %w", err)
	}
	subscribers := map[string][]string{}
	for _, f := range features {
		for _, s := range f.subscriptions {
			subscribers[s.event] = append(subscribers[s.event], s.job)
		}
	}
	j.client, j.subscribers = client, subscribers
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

// insertForEvents inserts the jobs the delivered events trigger, in the
// delivery's transaction: an event is marked delivered exactly when its jobs exist.
func (j *jobs) insertForEvents(ctx context.Context, tx pgx.Tx, events []outboxEvent) error {
	var params []river.InsertManyParams
	for _, ev := range events {
		kinds := j.subscribers[ev.Type]
		if len(kinds) == 0 {
			continue
		}
		meta := deliverySpan(ctx, j.tracer, ev)
		for _, kind := range kinds {
			args, err := jobForEvent(kind, ev)
			if err != nil {
				return err
			}
			params = append(params, river.InsertManyParams{Args: args, InsertOpts: &river.InsertOpts{Metadata: meta}})
		}
	}
	if len(params) == 0 {
		return nil
	}
	if _, err := j.client.InsertManyTx(ctx, tx, params); err != nil {
		return fmt.Errorf("inserting %d jobs: %w", len(params), err)
	}
	return nil
}

func jobForEvent(kind string, ev outboxEvent) (river.JobArgs, error) {
	id, err := strconv.ParseInt(ev.AggregateID, 10, 64)
	if err != nil {
		return nil, fmt.Errorf("event %d: aggregate id %q is not an order id", ev.ID, ev.AggregateID)
	}
	switch kind {
	case jobIndexOrder:
		return indexOrderArgs{OrderID: id}, nil
	case jobWriteReceipt:
		return writeReceiptArgs{OrderID: id}, nil
	}
	return nil, fmt.Errorf("job %s cannot be triggered by event %s", kind, ev.Type)
}

// Start starts working jobs (phase 14). River keeps running until the
// context given to Start ends; the phase's context ends with the phase, so
// River gets a detached one and lives until Stop.
func (j *jobs) Start(ctx context.Context) error { return j.client.Start(context.WithoutCancel(ctx)) }

// Stop is River's own soft stop: running jobs may finish for the
// SoftStopTimeout given to newJobs, then River cancels them. A job cut off
// this way is interrupted, not failed: River puts it back as available
// without spending an attempt (River 0.44's interrupted state), it runs again
// at once here or on another instance, and it is counted
// kumiko_jobs_total{result="interrupted"} — like a force-closed request, a
// warning, not a failed shutdown. Only when ctx, the hook's slice of the shutdown budget, ends
// first are the jobs cancelled here. Stop of an unstarted client returns at
// once.
func (j *jobs) Stop(ctx context.Context) error {
	j.stopping.Store(true)
	err := j.client.Stop(ctx)
	if err == nil || ctx.Err() == nil {
		return err
	}
	hard, cancel := context.WithTimeout(context.WithoutCancel(ctx), abandonGrace)
	defer cancel()
	if err := j.client.StopAndCancel(hard); err != nil {
		return fmt.Errorf("hard stop of the jobs worker: %w", err)
	}
	j.log.Warn("the shutdown budget ended before the soft stop did: running jobs were cancelled; River will run them again")
	return nil
}

// handleRunJob is POST /admin/jobs/:name/run: run a job by hand, now, on
// whichever instance's worker picks it up.
func handleRunJob(j *jobs) echo.HandlerFunc {
	return func(c echo.Context) error {
		var args river.JobArgs
		switch c.Param("name") {
		case jobReport:
			args = reportArgs{ScheduledAt: time.Now().UTC(), Manual: true}
		case jobPurgeOutbox:
			args = purgeOutboxArgs{ScheduledAt: time.Now().UTC(), Manual: true}
		case jobSleep:
			ms, err := strconv.Atoi(c.QueryParam("ms"))
			if err != nil || ms < 0 || ms > int(maxSlowRequest.Milliseconds()) {
				return apiError(http.StatusBadRequest, "invalid_ms", fmt.Sprintf("ms must be an integer from 0 to %d", maxSlowRequest.Milliseconds()))
			}
			args = sleepArgs{Ms: ms}
		default:
			return apiError(http.StatusNotFound, "unknown_job", "jobs that can be run by hand: "+jobReport+", "+jobPurgeOutbox+", "+jobSleep)
		}
		res, err := j.client.Insert(c.Request().Context(), args, nil)
		if err != nil {
			return fmt.Errorf("inserting job %s: %w", args.Kind(), err)
		}
		return c.JSON(http.StatusAccepted, map[string]any{"job": args.Kind(), "id": res.Job.ID})
	}
}

// ---------------------------------------------------------------------------
// Workers. Each must be idempotent: River runs a job again after a crash.

// indexOrder puts the order into the Meilisearch index (replacing any earlier copy).
func (d jobDeps) indexOrder(ctx context.Context, job *river.Job[indexOrderArgs]) error {
	if d.search == nil {
		return nil // search not configured: nothing to index into
	}
	o, err := loadOrder(ctx, d.db, job.Args.OrderID)
	if err != nil {
		return err
	}
	pk := "id"
	if _, err := d.search.Index(ordersIndex).AddDocuments(ctx, []order{o}, &meilisearch.DocumentOptions{PrimaryKey: &pk}); err != nil {
		return fmt.Errorf("indexing order %d: %w", o.ID, err)
	}
	return nil
}

// writeReceipt stores the order's receipt in S3, sealed with the master key:
// the object store never sees a customer's order in the clear.
func (d jobDeps) writeReceipt(ctx context.Context, job *river.Job[writeReceiptArgs]) error {
	if d.storage == nil {
		return nil
	}
	o, err := loadOrder(ctx, d.db, job.Args.OrderID)
	if err != nil {
		return err
	}
	plain, _ := json.Marshal(o)
	name := fmt.Sprintf("receipts/%d.sealed", o.ID)
	sealed := d.masterKey.seal(plain, []byte(name))
	_, err = d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(sealed), int64(len(sealed)),
		minio.PutObjectOptions{ContentType: "application/octet-stream", UserMetadata: map[string]string{"Key-Id": d.masterKey.id}})
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// writeReport counts the orders so far and stores the count as
// reports/<scheduled time>.json (the same tick always writes the same object).
func (d jobDeps) writeReport(ctx context.Context, job *river.Job[reportArgs]) error {
	var orders, pending int64
	err := d.db.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders),
		(SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL)`).Scan(&orders, &pending)
	if err != nil {
		return fmt.Errorf("counting for the report: %w", err)
	}
	report, _ := json.Marshal(map[string]any{"scheduledAt": job.Args.ScheduledAt, "manual": job.Args.Manual,
		"orders": orders, "pendingEvents": pending, "fencingToken": job.Args.FencingToken})
	if d.storage == nil {
		d.log.WithField("report", string(report)).Info("report (no S3 configured)")
		return nil
	}
	name := "reports/" + job.Args.ScheduledAt.UTC().Format(time.RFC3339Nano) + ".json"
	_, err = d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(report), int64(len(report)),
		minio.PutObjectOptions{ContentType: "application/json"})
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// outboxPurgeBatch bounds one DELETE of the retention job: each batch is its
// own short transaction, so a large backlog never locks the table for long.
const outboxPurgeBatch = 1000

// purgeOutbox deletes delivered outbox events older than the retention, in
// batches. Pending events are never touched (delivered_at is null); dead
// events are kept too, for an operator to look at (and delete by hand).
func (d jobDeps) purgeOutbox(ctx context.Context, job *river.Job[purgeOutboxArgs]) error {
	var deleted int64
	for {
		// Only delivered events have a delivery_seq, and its unique index
		// yields them oldest first: each batch reads a short prefix of it.
		tag, err := d.db.Exec(ctx, `DELETE FROM outbox_events WHERE id IN (
			SELECT id FROM outbox_events
			WHERE delivery_seq IS NOT NULL AND delivered_at < now() - make_interval(secs => $1) AND dead_at IS NULL
			ORDER BY delivery_seq LIMIT $2 FOR UPDATE SKIP LOCKED)`, d.outboxRetention.Seconds(), outboxPurgeBatch)
		if err != nil {
			return fmt.Errorf("deleting delivered outbox events older than %s (%d deleted so far): %w", d.outboxRetention, deleted, err)
		}
		deleted += tag.RowsAffected()
		if tag.RowsAffected() < outboxPurgeBatch {
			break
		}
	}
	d.log.WithFields(logrus.Fields{"job": jobPurgeOutbox, "deleted": deleted, "retention": d.outboxRetention.String()}).Info("outbox purged")
	return nil
}

// sleepJob takes its time, honouring cancellation: a hard stop cancels it and
// River runs it again later, here or elsewhere.
func sleepJob(ctx context.Context, job *river.Job[sleepArgs]) error {
	return sleepCtx(ctx, time.Duration(job.Args.Ms)*time.Millisecond)
}

func loadOrder(ctx context.Context, db *pgxpool.Pool, id int64) (order, error) {
	o, err := scanOrder(db.QueryRow(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = $1`, id))
	if err != nil {
		return order{}, fmt.Errorf("loading order %d: %w", id, err)
	}
	return o, nil
}
