package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/robfig/cron/v3"
	"github.com/sirupsen/logrus"
)

// renewScript extends the lock only if this instance still holds it: a plain
// SET XX would extend the lock of whoever holds it now.
var renewScript = redis.NewScript(`
if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
return 0`)

// drawScript draws a fencing token that is larger than the fence the
// database holds (ARGV[1]): a Redis that lost its data (FLUSHALL, a restart
// without persistence, a failover to a replica that missed the last INCR)
// would otherwise hand out tokens the fence refuses forever. It returns the
// token and 1 when the counter had to be raised.
var drawScript = redis.NewScript(`
local floor = tonumber(ARGV[1])
local cur = tonumber(redis.call("GET", KEYS[1]) or "0")
local raised = 0
if cur < floor then
	redis.call("SET", KEYS[1], floor)
	raised = 1
end
return {redis.call("INCR", KEYS[1]), raised}`)

// elector keeps one leader among all instances with a Redis TTL lock. While
// this instance leads, lead runs with a context that ends the moment it stops
// leading — lost lock, missed renew deadline or shutdown. Nothing else can ask
// "am I leader": exclusive work lives inside lead. When lead returns a
// *fencedError (the database knows a newer token) the elector steps down,
// releases the lock and acquires again with a token drawn above the fence.
//
// Its Stop (from startStop, stopSoft) ends leadership — lead returns, the lock
// is deleted with a compare-and-DEL, followers are told at once — and waits.
type elector struct {
	*startStop
	rdb        *redis.Client
	instanceID string
	ttl, renew time.Duration
	lead       func(ctx context.Context, token int64) error
	fence      func(ctx context.Context) (int64, error) // the token the database holds now
	call       time.Duration                            // one Redis or database call of the election
	retry      time.Duration                            // leaderRenewRetry: after a failed renewal
	release    time.Duration                            // the release of the lock on shutdown
	log        *logrus.Entry
	metrics    *metrics

	mu          sync.Mutex
	releaseErr  error // the shutdown's release failed: the lock expires by itself
	leading     bool
	fenced      bool      // fenced and not yet leading again with a valid token
	lastFenced  time.Time // for the readiness body
	fencedTotal int
}

// electorDeps is what newElector builds an elector from.
type electorDeps struct {
	redis      *redis.Client
	instanceID string
	ttl, renew time.Duration // the lock's TTL and how often it is renewed
	timeouts   timeouts
	lead       func(ctx context.Context, token int64) error
	fence      func(ctx context.Context) (int64, error)
	log        *logrus.Logger
	metrics    *metrics
	onPanic    func(c component, recovered any)
}

func newElector(d electorDeps) *elector {
	return &elector{startStop: newStartStop(componentLeaderElection, stopSoft, d.onPanic),
		rdb: d.redis, instanceID: d.instanceID, ttl: d.ttl, renew: d.renew, lead: d.lead, fence: d.fence,
		call: d.timeouts.backgroundCall, retry: d.timeouts.leaderRenewRetry, release: d.timeouts.redisRelease,
		log: componentLeaderElection.log(d.log), metrics: d.metrics}
}

// Stop ends leadership and waits (startStop); a lock it could not release is
// a best-effort failure: followers take over when it expires.
func (e *elector) Stop(ctx context.Context) error {
	if err := e.startStop.Stop(ctx); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.releaseErr != nil {
		return &bestEffortError{err: e.releaseErr}
	}
	return nil
}

// Start checks Redis synchronously, then starts the election loop.
func (e *elector) Start(ctx context.Context) error {
	return e.start(ctx, func(ctx context.Context) error {
		if err := e.rdb.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("leader election needs Redis: %w", err)
		}
		return nil
	}, e.run)
}

// run tries to lead until the elector stops.
func (e *elector) run(ctx context.Context) {
	// Followers hear a release at once instead of at their next try.
	released := e.rdb.Subscribe(ctx, leaderReleased)
	defer released.Close()
	wake := released.Channel()

	// An acquisition or renewal in flight ends when the stop begins: a stop
	// must not wait for a slow Redis. The lock is released right after (a
	// SETNX cut short is undone in acquire).
	stopping := e.stopping()
	calls, cancelCalls := context.WithCancel(ctx)
	defer cancelCalls()
	watch := e.goOwned(ctx, func(ctx context.Context) {
		select {
		case <-stopping:
			cancelCalls()
		case <-ctx.Done():
		}
	})
	defer watch.stop()

	tick := time.NewTicker(e.renew)
	defer tick.Stop()
	for {
		token, value, sent, ok := e.acquire(calls)
		if ok {
			e.serve(ctx, calls, stopping, token, value, sent)
		}
		select {
		case <-stopping: // first: a tick that is also due must not start another acquisition
			return
		default:
		}
		select {
		case <-stopping:
			return
		case <-wake:
		case <-tick.C:
		}
	}
}

// acquire tries to take the lock. The fencing token is drawn first, above
// the fence the database holds, so every acquisition carries a larger token
// than any leader before it, even after Redis lost its counter. Each call is
// bounded by e.call: go-redis ends a call at its deadline, not when its
// context is cancelled, so this bound is also what a stop waits for at
// most. (A Redis slower than that elects no new leader; the one that leads
// keeps leading, its renewals may take until its renew deadline.) sent is
// when the SETNX was sent: the lock's TTL runs from no earlier.
func (e *elector) acquire(ctx context.Context) (token int64, value string, sent time.Time, ok bool) {
	stopped := ctx
	call := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, e.call) }
	fctx, cancel := call()
	floor, err := e.fence(fctx)
	cancel()
	if stopped.Err() != nil {
		return 0, "", time.Time{}, false
	}
	if err != nil {
		// Without the fence a token may be stale; the scheduler cannot work
		// without the database anyway.
		e.log.WithError(err).Warn("reading the fencing token from the database")
		return 0, "", time.Time{}, false
	}
	dctx, cancel := call()
	res, err := drawScript.Run(dctx, e.rdb, []string{leaderTokenKey}, floor).Int64Slice()
	cancel()
	if stopped.Err() != nil {
		return 0, "", time.Time{}, false
	}
	if err != nil || len(res) != 2 {
		e.log.WithError(err).Warn("drawing a fencing token")
		return 0, "", time.Time{}, false
	}
	token = res[0]
	if res[1] == 1 {
		e.markFenced(floor, "the Redis token counter was behind the database fence (Redis lost its data): raised it")
	}
	value = e.instanceID + ":" + strconv.FormatInt(token, 10)
	sent = time.Now()
	sctx, cancel := call()
	defer cancel()
	ok, err = e.rdb.SetNX(sctx, leaderKey, value, e.ttl).Result()
	switch {
	case err != nil:
		if stopped.Err() == nil {
			e.log.WithError(err).Warn("trying the leader lock")
		}
		// A SETNX that timed out or was cut short may still have been
		// applied: this instance would hold a lock it does not know of. Only
		// its own value is deleted.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.release)
		defer cancel()
		compareAndDelete.Run(rctx, e.rdb, []string{leaderKey}, value)
	case !ok:
		e.setFenced(false) // another instance leads; nothing to fix here
	}
	return token, value, sent, ok
}

// markFenced records that this instance met a fence newer than its token:
// one log line, the metrics and the readiness body say so.
func (e *elector) markFenced(fence int64, reason string) {
	e.mu.Lock()
	e.lastFenced = time.Now()
	e.fencedTotal++
	e.mu.Unlock()
	e.setFenced(true)
	e.metrics.leaderFencedTotal.Inc()
	e.log.WithFields(logrus.Fields{"event": "fenced", "fence": fence, "reason": reason}).Warn("fenced")
}

// setFenced sets kumiko_leader_fenced: 1 from a fencing until this instance
// leads again with a token drawn above the fence, or sees another instance lead.
func (e *elector) setFenced(fenced bool) {
	e.mu.Lock()
	e.fenced = fenced
	e.mu.Unlock()
	e.metrics.leaderFenced.Set(boolGauge(fenced))
}

// serve leads until the lock is lost, the renew deadline passes or the
// elector stops. As in client-go's leaderelection: the lock lives lockTtl
// from the last renewal sent (acquired: the SETNX); the leader renews every
// renewInterval and, after a renewal failed, retries four times as often;
// its renew deadline is one renewInterval before the lock can expire, and
// past it this instance stops acting, before anyone else can take over. A
// renewal may take until that deadline, so a slow Redis keeps its leader.
// Config validation keeps renewInterval ≤ lockTtl/3: at least two renewals
// fit before the deadline. Renewals run on calls, which the stop ends.
func (e *elector) serve(ctx, calls context.Context, stopping <-chan struct{}, token int64, value string, acquired time.Time) {
	log := e.log.WithField("fencing_token", token)
	e.setLeading(true)
	// The token was drawn above the fence: leading with it ends a fencing
	// (a newer fence met later sets it again).
	e.setFenced(false)
	log.Info("became leader")
	var leadErr error // written by lead's goroutine, read after it returned
	leading := e.goOwned(ctx, func(ctx context.Context) { leadErr = e.lead(ctx, token) })

	deadline := acquired.Add(e.ttl - e.renew)
	stepDown := time.NewTimer(time.Until(deadline))
	defer stepDown.Stop()
	renew := time.NewTimer(e.renew)
	defer renew.Stop()
	reason := ""
	for reason == "" {
		select {
		case <-stopping:
			reason = "shutdown"
		case <-leading.done: // lead gave up on its own: only a fence makes it
			reason = "fenced"
		case <-stepDown.C:
			reason = "renew deadline passed"
		case <-renew.C:
			sent := time.Now()
			if sent.After(deadline) { // woke late (e.g. the process was paused)
				reason = "renew deadline passed"
				break
			}
			// Bounded by the step-down deadline, so a renewal in flight can
			// never keep this instance leading past it.
			rctx, cancel := context.WithDeadline(calls, deadline)
			n, err := renewScript.Run(rctx, e.rdb, []string{leaderKey}, value, e.ttl.Milliseconds()).Int()
			cancel()
			switch {
			case calls.Err() != nil: // stopping: the next select says so
			case err != nil:
				log.WithError(err).Warn("renewing the leader lock")
				renew.Reset(e.retry)
			case n == 0:
				reason = "lock lost"
			default:
				deadline = sent.Add(e.ttl - e.renew)
				stepDown.Reset(time.Until(deadline))
				renew.Reset(e.renew)
			}
		}
	}

	leading.stop()
	e.setLeading(false)
	log.WithField("reason", reason).Info("stopped leading")
	if fe := (*fencedError)(nil); errors.As(leadErr, &fe) {
		e.markFenced(fe.fence, "a newer leader's token is in the database: stepped down to acquire a new one")
	}
	// After a shutdown or a fence the lock is released at once, so the next
	// leader (this instance again, after a fence) need not wait for the TTL.
	if reason == "shutdown" || reason == "fenced" {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.release)
		defer cancel()
		n, err := compareAndDelete.Run(rctx, e.rdb, []string{leaderKey}, value).Int()
		if err == nil && n == 1 {
			err = e.rdb.Publish(rctx, leaderReleased, e.instanceID).Err()
		}
		if err != nil && reason == "shutdown" {
			e.mu.Lock()
			e.releaseErr = fmt.Errorf("releasing the leader lock: %w", err)
			e.mu.Unlock()
		}
	}
}

func (e *elector) setLeading(leading bool) {
	e.mu.Lock()
	changed := e.leading != leading
	e.leading = leading
	e.mu.Unlock()
	if changed {
		e.metrics.leader.Set(boolGauge(leading))
		e.metrics.leaderTransitions.Inc()
	}
}

// readinessCheck is the schedulerLeader check: who leads, whether this
// instance does, and whether it was fenced (and when last).
func (e *elector) readinessCheck(ctx context.Context) checkResult {
	e.mu.Lock()
	detail := map[string]any{"isLeader": e.leading, "fenced": e.fenced, "fencedTotal": e.fencedTotal}
	if !e.lastFenced.IsZero() {
		detail["lastFencedAt"] = e.lastFenced.UTC().Format(time.RFC3339)
	}
	e.mu.Unlock()
	leader, err := currentLeader(ctx, e.rdb)
	if err != nil {
		return failedResult(err, detail)
	}
	detail["leader"] = leader
	return okResult(detail)
}

// currentLeader reads who holds the lock (for the readiness body and /admin/workers).
func currentLeader(ctx context.Context, rdb *redis.Client) (string, error) {
	v, err := rdb.Get(ctx, leaderKey).Result()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	id, _, _ := strings.Cut(v, ":")
	return id, err
}

// ---------------------------------------------------------------------------
// The cron scheduler: it runs only inside elector.lead.

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

// fencedError means a newer leader's token is in the database: this leader
// must not act, and steps down to acquire a new token.
type fencedError struct{ token, fence int64 }

func (e *fencedError) Error() string {
	return fmt.Sprintf("fenced: token %d is older than the fence %d of a newer leader", e.token, e.fence)
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
// clock that steps cannot either. Policy for missed ticks: on taking over,
// the newest tick of the last interval is enqueued (a no-op when the
// previous leader did), and a scheduler that wakes late enqueues the newest
// due tick; older missed ticks are not — a report is about now, not a
// backlog. A tick refused by the fence ends lead with a *fencedError:
// the elector steps down and acquires a valid token.
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
	beat := time.NewTicker(s.beatInt)
	defer beat.Stop()
	s.heartbeat(ctx)
	now := time.Now()
	next := make([]time.Time, len(s.crons))
	schedules := make([]cron.Schedule, len(s.crons))
	for i, c := range s.crons {
		if prev, ok := previousTick(c.schedule, now); ok {
			if err := s.enqueue(ctx, log, token, c.cronJob, prev); err != nil {
				return err
			}
		}
		next[i], schedules[i] = c.schedule.Next(now), c.schedule
	}
	fire := func(i int, tick time.Time) error { return s.enqueue(ctx, log, token, s.crons[i].cronJob, tick) }
	return cronLoop{schedules: schedules}.run(ctx, next, fire, beat.C, func() { s.heartbeat(ctx) })
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
// the fencing token against the database. Only a fence is returned as an
// error (the leader must step down); other failures are logged and the next
// tick tries again.
func (s *scheduler) enqueue(ctx context.Context, log *logrus.Entry, token int64, job cronJob, tick time.Time) error {
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
	if err != nil && ctx.Err() == nil {
		log.WithField("tick", tick).WithError(err).Warn("enqueueing a cron job")
	}
	return nil
}
