package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/robfig/cron/v3"
	"github.com/sirupsen/logrus"
)

// componentScheduler is the cron scheduler, on the leader.
var componentScheduler = component{name: "scheduler", heartbeat: "scheduler"}

// The cron scheduler: it runs only inside the elector's lead callback
// (leader.go), on the instance that leads.

// scheduler enqueues the cron jobs of the feature graph (the report, the
// outbox purge) at every tick of their schedules while this instance leads.
// Each tick is inserted with a unique key (the tick's time) in a transaction
// that first checks the fencing token against the database, so neither two
// leaders nor a stale one can enqueue a tick twice.
type scheduler struct {
	db      *pgxpool.Pool
	jobs    *jobs
	crons   []scheduledJob
	beat    *heartbeat
	beatInt time.Duration
	skipped *prometheus.CounterVec // kumiko_cron_ticks_skipped_total{job}
	onPanic func(c component, recovered any)
	log     *logrus.Entry
}

// scheduledJob is one feature's cron job with its parsed schedule.
type scheduledJob struct {
	cronJob
	schedule cron.Schedule
}

// cronsOf collects the cron schedules every feature declared; bootValidation
// has already checked each spec (cron.go).
func cronsOf(features []feature) []scheduledJob {
	var crons []scheduledJob
	for _, f := range features {
		for _, c := range f.crons {
			crons = append(crons, scheduledJob{cronJob: c, schedule: mustSchedule(c.spec)})
		}
	}
	return crons
}

// fence is elector.fence: the newest token any leader raised the fence to.
func (s *scheduler) fence(ctx context.Context) (int64, error) {
	var token int64
	if err := s.db.QueryRow(ctx, `SELECT token FROM scheduler_fence`).Scan(&token); err != nil {
		return 0, fmt.Errorf("reading scheduler_fence: %w", err)
	}
	return token, nil
}

// lead is elector.lead. Every schedule keeps its own next tick, computed
// from its last tick, never from "now" at some unrelated wake-up, so neither
// a heartbeat, a renew interval nor another schedule can postpone it; the
// wait for the earliest of them is read from the wall clock (cronLoop), so a
// clock that steps cannot either. The missed-tick rule: the newest missed
// tick runs, once, and the older ones are skipped — a report is about now,
// not a backlog. On taking over, the newest tick of the last interval is
// enqueued (a no-op when the previous leader did), and the ticks between it
// and the newest one any leader enqueued are skipped; a scheduler that wakes
// late enqueues the newest due tick and skips the ones before it. A skip is
// a warning naming the ticks and counts kumiko_cron_ticks_skipped_total{job}.
// A tick refused by the fence ends lead with a *fencedError: the elector
// steps down and acquires a valid token.
func (s *scheduler) lead(ctx context.Context, token int64) error {
	log := s.log.WithField("fencing_token", token)
	// Raise the fence first: from now on a stale leader's inserts are refused.
	if err := raiseFence(ctx, s.db, token); err != nil {
		if fe := (*fencedError)(nil); errors.As(err, &fe) {
			return err
		}
		if ctx.Err() == nil {
			log.WithError(err).Warn("raising the fencing token")
		}
	}
	// The heartbeat beats on a goroutine of its own: a slow Redis costs a
	// beat its call, never a tick its time. (They shared one loop, and under
	// 1.2 s of Redis latency every beat held the ticks back for its 1 s
	// budget, until ticks were skipped.)
	var beating sync.WaitGroup
	defer beating.Wait()
	ctx, stopBeating := context.WithCancel(ctx)
	defer stopBeating()
	beating.Go(func() {
		defer func() {
			if r := recover(); r != nil {
				s.onPanic(componentScheduler, r) // as for every background goroutine (app.go)
			}
		}()
		s.heartbeat(ctx)
		everyTick(ctx, s.beatInt, nil, s.heartbeat)
	})
	now := time.Now()
	next := make([]time.Time, len(s.crons))
	schedules := make([]cron.Schedule, len(s.crons))
	for i, c := range s.crons {
		s.skipped.WithLabelValues(c.kind) // from 0, so that increase() sees a first skip
		if prev, ok := previousTick(c.schedule, now); ok {
			skipped, err := s.missedBefore(ctx, c, prev)
			if err != nil && ctx.Err() == nil {
				log.WithField("job", c.kind).WithError(err).Warn("counting the ticks skipped before the take-over")
			}
			if err := s.enqueue(ctx, log, token, c.cronJob, prev, skipped); err != nil {
				return err
			}
		}
		next[i], schedules[i] = c.schedule.Next(now), c.schedule
	}
	fire := func(i int, tick time.Time, skipped skippedTicks) error {
		return s.enqueue(ctx, log, token, s.crons[i].cronJob, tick, skipped)
	}
	return cronLoop{schedules: schedules}.run(ctx, next, fire)
}

// missedBefore is the ticks of c that no leader enqueued before tick: those
// after the newest one River still holds (it deletes finished jobs after a
// day). None when it holds none (a new deployment, or a day without a leader).
func (s *scheduler) missedBefore(ctx context.Context, c scheduledJob, tick time.Time) (skippedTicks, error) {
	var last *time.Time
	err := s.db.QueryRow(ctx, `SELECT max((args->>'scheduledAt')::timestamptz) FROM river_job
		WHERE kind = $1 AND NOT coalesce((args->>'manual')::boolean, false)`, c.kind).Scan(&last)
	if err != nil {
		return skippedTicks{}, fmt.Errorf("reading the newest tick of %s: %w", c.kind, err)
	}
	if last == nil {
		return skippedTicks{}, nil
	}
	return missedTicks(c.schedule, c.schedule.Next(*last), tick), nil
}

// raiseFence sets the fence to token unless a newer leader raised it
// higher; then it returns a *fencedError.
func raiseFence(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, token int64) error {
	var fence int64
	err := q.QueryRow(ctx, `WITH up AS (UPDATE scheduler_fence SET token = $1 WHERE token <= $1 RETURNING token)
		SELECT coalesce((SELECT token FROM up), (SELECT token FROM scheduler_fence))`, token).Scan(&fence)
	if err != nil {
		return fmt.Errorf("raising the fence: %w", err)
	}
	if fence > token {
		return &fencedError{token: token, fence: fence}
	}
	return nil
}

func (s *scheduler) heartbeat(ctx context.Context) {
	if err := s.beat.beat(ctx); err != nil && ctx.Err() == nil {
		s.log.WithError(err).Warn("scheduler heartbeat")
	}
}

// enqueue inserts the job of one tick, in a transaction that first checks
// the fencing token against the database, and reports the ticks skipped to
// get to it once it is in: the leader that enqueues a tick is the one that
// counts the ticks passed over before it, so no skip is counted twice. Only
// a fence is returned as an error (the leader must step down); other
// failures are logged and the next tick tries again.
func (s *scheduler) enqueue(ctx context.Context, log *logrus.Entry, token int64, job cronJob, tick time.Time, skipped skippedTicks) error {
	tick = tick.UTC()
	log = log.WithField("job", job.kind)
	err := pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if err := raiseFence(ctx, tx, token); err != nil {
			return err
		}
		res, err := s.jobs.client.InsertTx(ctx, tx, job.args(tick, token), nil)
		if err == nil && res.UniqueSkippedAsDuplicate {
			log.WithField("tick", tick).Debug("tick already enqueued")
		}
		return err
	})
	if fe := (*fencedError)(nil); errors.As(err, &fe) {
		log.WithField("tick", tick).WithError(err).Warn("refusing to enqueue: a newer leader exists")
		return err
	}
	if err != nil {
		if ctx.Err() == nil {
			log.WithField("tick", tick).WithError(err).Warn("enqueueing a cron job")
		}
		return nil
	}
	if skipped.count > 0 {
		s.skipped.WithLabelValues(job.kind).Add(float64(skipped.count))
		log.WithFields(logrus.Fields{"tick": tick, "skipped": skipped.count, "first": skipped.first.UTC(), "last": skipped.last.UTC()}).
			Warn("cron ticks skipped")
	}
	return nil
}

// cronMetrics is what the cron scheduler adds to /metrics.
type cronMetrics struct {
	ticksSkipped *prometheus.CounterVec
}

func newCronMetrics(r prometheus.Registerer) *cronMetrics {
	f := promauto.With(r)
	return &cronMetrics{
		ticksSkipped: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "cron_ticks_skipped_total", Help: "Cron ticks this instance passed over while it led, by job: a leader that took over late or woke late runs the newest missed tick, once, and skips the older ones.",
		}, []string{"job"}),
	}
}
